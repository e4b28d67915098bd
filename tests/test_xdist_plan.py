"""tests/xdist_plan.py: which files share a worker under `make test`'s pytest-xdist workers."""
import json
import os
from types import SimpleNamespace

import pytest

from xdist_plan import SHARED_FILES, file_groups, misplaced_files, scope_of


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


def test_the_listed_shared_files_must_match_what_the_files_use():
    groups = {"tests/test_cli.py": "tests/test_cli.py", "tests/test_slurm_new.py": "slurm",
              "tests/test_suite.py": "tiny_run"}
    assert misplaced_files(groups, {"tests/test_suite.py": "tiny_run", "tests/test_slurm_new.py": "slurm"}) == {}
    assert misplaced_files(groups, {"tests/test_suite.py": "tiny_run", "tests/test_cli.py": "slurm"}) == {
        "tests/test_slurm_new.py": "tests/test_slurm_new.py uses the shared resource 'slurm' but SHARED_FILES in "
                                   "tests/xdist_plan.py lists it in no group: list it as 'tests/test_slurm_new.py': "
                                   "'slurm'",
        "tests/test_cli.py": "tests/test_cli.py uses no shared resource but SHARED_FILES in tests/xdist_plan.py "
                             "lists it under 'slurm': remove it from SHARED_FILES"}
    assert misplaced_files({"tests/test_x.py": "slurm"}, {"tests/test_x.py": "tiny_run"}) == {
        "tests/test_x.py": "tests/test_x.py uses the shared resource 'slurm' but SHARED_FILES in tests/xdist_plan.py "
                           "lists it under 'tiny_run': list it as 'tests/test_x.py': 'slurm'"}


def test_the_scheduler_hands_out_a_shared_group_or_a_file():
    assert scope_of("tests/test_slurm_multinode.py::test_x", SHARED_FILES) == "slurm"
    assert scope_of("tests/test_slurm_executor.py::test_y[a::b]", SHARED_FILES) == "slurm"
    assert scope_of("tests/test_cli.py::test_a[1]", SHARED_FILES) == "tests/test_cli.py"


GENERATED_CONFTEST = '''
import sys
sys.path.insert(0, {tests!r})
import pytest
import xdist_plan
pytest_plugins = ["xdist_plan"]
xdist_plan.SHARED_FILES = {shared!r}

def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: uses the Slurm cluster")

@pytest.fixture(scope="session")
def slurm_cluster():
    return "cluster"
'''

GENERATED_TEST = '''
import json, os
{head}
def test_{name}(request{fixture}):
    with open(os.path.join({out!r}, "{name}.json"), "w") as f:
        json.dump({{"nodeid": request.node.nodeid, "worker": os.environ["PYTEST_XDIST_WORKER"]}}, f)
'''


def _run_generated(tmp_path, files: dict, shared: dict):
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "conftest.py").write_text(GENERATED_CONFTEST.format(tests=tests_dir, shared=shared))
    for name, (head, fixture) in files.items():
        (tmp_path / f"test_{name}.py").write_text(GENERATED_TEST.format(head=head, name=name, fixture=fixture,
                                                                        out=str(out)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder",
                           "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    ran = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return proc, ran


def test_two_real_workers_run_a_shared_group_on_one_worker(tmp_path):
    """`pytest -n 2 --dist loadgroup` as `make test` runs it, on generated files: the two files that use
    the Slurm cluster (one by fixture, one by mark) run on the same worker, every time; the plain files
    spread over both workers."""
    files = {"uses_cluster": ("", ", slurm_cluster"), "marked": ("import pytest\npytestmark = pytest.mark.slurm", "")}
    files.update({f"plain{i}": ("", "") for i in range(6)})
    shared = {"test_uses_cluster.py": "slurm", "test_marked.py": "slurm"}
    for attempt in range(3):   # a split would show in some attempt: which worker gets a unit is a race
        proc, ran = _run_generated(tmp_path / str(attempt), files, shared)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert sorted(ran) == sorted(files), ran
        assert ran["uses_cluster"]["worker"] == ran["marked"]["worker"], ran
        assert {r["worker"] for r in ran.values()} == {"gw0", "gw1"}, ran


def test_a_file_using_a_shared_resource_but_not_listed_fails_the_run(tmp_path):
    files = {"uses_cluster": ("", ", slurm_cluster"), "plain": ("", "")}
    proc, ran = _run_generated(tmp_path, files, {})
    assert proc.returncode == 1 and list(ran) == ["plain"], proc.stdout[-3000:]
    assert ("test_uses_cluster.py uses the shared resource 'slurm' but SHARED_FILES in tests/xdist_plan.py lists "
            "it in no group") in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
