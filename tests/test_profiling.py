"""launcher/profiling.py (PTQ_PROFILE): which stages, the files a profiled block writes, and launch's
refusal of an unknown stage before any rank starts.  Torch-free.  The real stage's profile (the
export's 4 ranks) is asserted on the session's tiny run in tests/test_pipeline_local.py."""
import os

import pytest

from launcher import profiling
from launcher.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "tiny", "Qwen3-MoE-tiny", "megatron_lm_ptq.yaml")


def test_stages_named_in_the_environment():
    assert profiling.stages_to_profile({}) == frozenset()
    assert profiling.stages_to_profile({"PTQ_PROFILE": " quantize, export ,"}) == {"quantize", "export"}


def test_unknown_stage_names_the_valid_ones():
    with pytest.raises(ValueError) as e:
        profiling.stages_to_profile({"PTQ_PROFILE": "export,exprot"})
    assert str(e.value) == ("PTQ_PROFILE='export,exprot': unknown stage(s) ['exprot']; "
                            "valid: quantize, mmlu, export, vllm_smoke")


def _busy_profiled_work(n: int) -> int:
    return sum(i * i for i in range(n))


def test_profiled_block_writes_both_files_naming_its_work(tmp_path):
    env = {"PTQ_PROFILE": "export"}
    with profiling.maybe_profile("export", 2, str(tmp_path), env) as on:
        assert on is True
        _busy_profiled_work(20000)
    raw, text = profiling.profile_paths(str(tmp_path), "export", 2)
    assert raw == str(tmp_path / "export" / "profile-rank2.pstats") and os.path.getsize(raw) > 0
    with open(text) as f:
        body = f.read()
    assert body.startswith("==== by cumulative ====") and "_busy_profiled_work" in body


def test_unnamed_stage_is_not_profiled(tmp_path):
    with profiling.maybe_profile("mmlu", 0, str(tmp_path), {"PTQ_PROFILE": "export"}) as on:
        assert on is False
    assert not os.path.exists(tmp_path / "mmlu")


def test_failed_block_still_writes_its_profile(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with profiling.maybe_profile("quantize", 0, str(tmp_path), {"PTQ_PROFILE": "quantize"}):
            _busy_profiled_work(1000)
            raise RuntimeError("boom")
    with open(profiling.profile_paths(str(tmp_path), "quantize", 0)[1]) as f:
        assert "_busy_profiled_work" in f.read()


def test_launch_refuses_an_unknown_stage_before_starting(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PTQ_PROFILE", "exprot")
    code = main([TINY, f"runs_root={tmp_path}", "--no-check-paths"])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("launch: PTQ_PROFILE='exprot': unknown stage(s) ['exprot']; "
                                               "valid: quantize, mmlu, export, vllm_smoke")
    assert os.listdir(tmp_path) == []   # no run directory was made
