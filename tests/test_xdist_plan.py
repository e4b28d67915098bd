"""tests/xdist_plan.py: which files share a worker under `make test`'s pytest-xdist workers."""
from types import SimpleNamespace

import pytest

from xdist_plan import file_groups


def item(nodeid: str, marks=(), fixtures=()):
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures),
                           get_closest_marker=lambda name: name if name in marks else None)


def test_a_file_is_its_own_group_unless_it_uses_a_shared_resource():
    groups = file_groups([
        item("tests/test_cli.py::test_a"),
        item("tests/test_pipeline_drive.py::test_local"),
        item("tests/test_pipeline_drive.py::test_on_slurm", marks=("slurm",)),   # the whole file follows
        item("tests/test_slurm_multinode.py::test_x", fixtures=("slurm_multinode",)),
        item("tests/test_suite.py::test_tiny", fixtures=("tiny_dir", "tiny_run")),
        item("tests/test_suite.py::test_plain"),
    ])
    assert groups == {"tests/test_cli.py": "tests/test_cli.py", "tests/test_pipeline_drive.py": "slurm",
                      "tests/test_slurm_multinode.py": "slurm", "tests/test_suite.py": "tiny_run"}


def test_a_file_in_two_shared_groups_is_refused():
    with pytest.raises(ValueError, match="tests/test_x.py is in two shared groups, slurm and tiny_run"):
        file_groups([item("tests/test_x.py::a", marks=("slurm",)), item("tests/test_x.py::b", fixtures=("tiny_run",))])
