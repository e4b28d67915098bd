"""The paired gate (launcher/mmlu/paired.py, gate.decide with a per-question baseline) and the
baseline cache (launcher/mmlu/baseline_cache.py), single process; scipy and torch as oracles."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from launcher.mmlu import baseline_cache as bc
from launcher.mmlu.gate import decide
from launcher.mmlu.paired import clopper_pearson, compare, kl_divergence, mcnemar_exact_p


@pytest.mark.parametrize("x,m", [(0, 1), (0, 9), (3, 10), (9, 9), (50, 120), (400, 1000)])
def test_clopper_pearson_equals_scipy_beta_quantiles(x, m):
    stats = pytest.importorskip("scipy.stats")
    lo, hi = clopper_pearson(x, m)
    want_lo = 0.0 if x == 0 else stats.beta.ppf(0.025, x, m - x + 1)
    want_hi = 1.0 if x == m else stats.beta.ppf(0.975, x + 1, m - x)
    assert lo == pytest.approx(want_lo, abs=1e-10) and hi == pytest.approx(want_hi, abs=1e-10)


@pytest.mark.parametrize("n10,n01", [(10, 3), (0, 0), (5, 5), (0, 7), (40, 21)])
def test_mcnemar_exact_p_equals_scipy_binomtest(n10, n01):
    stats = pytest.importorskip("scipy.stats")
    want = 1.0 if n10 + n01 == 0 else stats.binomtest(n10, n10 + n01, 0.5).pvalue
    assert mcnemar_exact_p(n10, n01) == pytest.approx(want, abs=1e-12)


@pytest.mark.torch
def test_kl_equals_torch():
    torch = pytest.importorskip("torch")
    base, quant = [2.0, -1.0, 0.5, 3.0], [1.5, -0.5, 0.5, 3.5]
    p, logq = torch.softmax(torch.tensor(base, dtype=torch.float64), 0), torch.log_softmax(torch.tensor(quant, dtype=torch.float64), 0)
    want = float(torch.nn.functional.kl_div(logq, p, reduction="sum"))
    assert kl_divergence(base, quant) == pytest.approx(want, abs=1e-12)
    assert kl_divergence(base, base) == 0.0


def _paired(n10, n01, both_right, both_wrong):
    """Answers all 0; baseline/quantized predictions realizing the four cells."""
    b = [0] * n10 + [1] * n01 + [0] * both_right + [2] * both_wrong
    q = [1] * n10 + [0] * n01 + [0] * both_right + [2] * both_wrong
    n = len(b)
    logit = lambda k: [5.0 if i == k else 0.0 for i in range(4)]   # noqa: E731
    return compare([0] * n, q, b, [logit(k) for k in q], [logit(k) for k in b])


def test_compare_counts_discordant_pairs_and_scales_the_interval():
    stats = pytest.importorskip("scipy.stats")
    c = _paired(12, 4, 60, 24)   # n = 100: baseline 72 right, quantized 64
    assert (c.n, c.baseline_correct, c.correct, c.n10, c.n01) == (100, 72, 64, 12, 4)
    assert c.drop == pytest.approx(0.08, abs=1e-15) and c.agreement == 0.84
    lo, hi = stats.beta.ppf(0.025, 12, 5), stats.beta.ppf(0.975, 13, 4)
    assert c.interval == pytest.approx(((2 * lo - 1) * 16 / 100, (2 * hi - 1) * 16 / 100), abs=1e-10)
    assert c.p_value == pytest.approx(stats.binomtest(12, 16, 0.5).pvalue, abs=1e-12)
    # a changed prediction moves a one-hot distribution: KL(onehot5 || other) per changed question
    changed = kl_divergence([5.0, 0, 0, 0], [0, 5.0, 0, 0])
    assert c.mean_kl == pytest.approx(changed * 16 / 100, rel=1e-12) and c.max_kl == pytest.approx(changed)
    assert c.to_dict()["method"] == "mcnemar_exact" and c.to_dict()["interval"] == list(c.interval)
    same = _paired(0, 0, 30, 10)
    assert same.interval == (0.0, 0.0) and same.p_value == 1.0 and same.mean_kl == 0.0


def test_decide_judges_max_drop_on_the_paired_drop_and_warns_when_its_interval_straddles():
    c = _paired(12, 4, 60, 24)             # drop 0.08, interval about [0.001, 0.16]
    d = decide(64, 100, max_drop=0.10, paired=c)
    assert d.passed and d.drop == c.drop and d.baseline_accuracy == 0.72 and d.agreement == 0.84
    assert len(d.warnings) == 1 and d.warnings[0].startswith("paired 95% interval of the drop [")
    assert "(mcnemar_exact; 12 questions lost, 4 gained) straddles max_drop 0.1" in d.warnings[0]
    d = decide(64, 100, max_drop=0.05, paired=c)
    assert not d.passed and d.failures == ["accuracy 0.6400 dropped 0.0800 from baseline 0.7200 > max_drop 0.05"]
    # an interval clear of the bound: no warning (the unpaired Wilson test would have warned)
    c = _paired(3, 3, 600, 394)
    d = decide(603, 1000, max_drop=0.02, paired=c)
    assert d.passed and d.warnings == [] and c.interval[1] < 0.02
    unpaired = decide(603, 1000, max_drop=0.02, baseline_accuracy=0.603)
    assert any("straddles baseline - max_drop" in w for w in unpaired.warnings)
    with pytest.raises(ValueError, match="paired comparison is of 603/1000, not 600/1000"):
        decide(600, 1000, max_drop=0.02, paired=c)


# ------------------------------------------------------------------ baseline cache

def _checkpoint(path):
    os.makedirs(path)
    for name, text in (("config.json", '{"architectures": ["LlamaForCausalLM"]}'), ("model.safetensors", "W" * 64),
                       ("tokenizer.json", "{}"), ("build.json", "{}"), ("notes.txt", "ignored")):
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    return str(path)


def _lookup(cache, ckpt, **over):
    args = dict(prompt_texts=["p0", "p1"], token_ids=[[1, 2], [3]], few_shots=0, add_bos=None, dtype="float32")
    args.update(over)
    return bc.lookup(cache, ckpt, **args)


def test_cache_key_covers_every_field_and_content_not_path(tmp_path):
    ckpt, cache = _checkpoint(tmp_path / "ckpt"), str(tmp_path / "cache")
    base = _lookup(cache, ckpt)
    assert not base.hit and "no cached baseline in" in base.miss_reason and "baseline=evaluate" in base.miss_reason
    keys = {base.key}
    for over in ({"prompt_texts": ["p0", "p1 "]}, {"token_ids": [[1, 2], [4]]}, {"few_shots": 5},
                 {"add_bos": True}, {"dtype": "bfloat16"}):
        keys.add(_lookup(cache, ckpt, **over).key)
    assert len(keys) == 6
    moved = shutil.copytree(ckpt, tmp_path / "elsewhere")
    assert _lookup(cache, str(moved)).key == base.key          # content, not path
    with open(os.path.join(moved, "notes.txt"), "w") as f:   # not read by the evaluation
        f.write("changed")
    assert _lookup(cache, str(moved)).key == base.key
    with open(os.path.join(moved, "model.safetensors"), "w") as f:
        f.write("X" * 64)
    assert _lookup(cache, str(moved)).key != base.key
    assert bc.checkpoint_files(ckpt) == ["config.json", "model.safetensors", "tokenizer.json"]
    memo = json.load(open(os.path.join(cache, bc.FILE_HASHES)))
    assert os.path.realpath(os.path.join(ckpt, "model.safetensors")) in memo


def test_cache_store_then_hit_is_exact_and_a_miss_names_what_differs(tmp_path):
    ckpt, cache = _checkpoint(tmp_path / "ckpt"), str(tmp_path / "cache")
    found = _lookup(cache, ckpt)
    results = {0: (2, [0.1, -1.25, 3.0000001, 1e-7]), 1: (0, [9.5, 1.0, 2.0, 3.0])}
    path = bc.store(found, results, ckpt, 0.5, "tp1 pp1")
    hit = _lookup(cache, ckpt)
    assert hit.hit and hit.path == path and hit.results == results   # floats round-trip exactly
    assert [e["path"] for e in bc.entries_for_model(cache, ckpt)] == [path]
    miss = _lookup(cache, ckpt, few_shots=5)
    assert not miss.hit
    assert f"{os.path.basename(path)} differs in few_shots: cached 0 vs now 5" in miss.miss_reason
    assert "prompts_sha256" not in miss.miss_reason and "checkpoint_sha256" not in miss.miss_reason
    with pytest.raises(ValueError, match="baseline results cover 1 prompts, the key says 2"):
        bc.store(found, {0: results[0]}, ckpt, 0.5, "tp1")


def test_validation_refuses_baseline_cached_without_an_entry(tmp_path, tiny_dir):
    from conftest import TINY_EXAMPLE
    from launcher.config.compose import ConfigError, compose_example
    from launcher.config.validate import validate

    cache = tmp_path / "cache"
    over = ["stages.mmlu.baseline=cached", "stages.mmlu.max_drop=0.05", f"stages.mmlu.baseline_cache_dir={cache}"]
    cfg = compose_example(TINY_EXAMPLE, over)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert (f"stages.mmlu.baseline='cached': no cached baseline for model.path={cfg.model.path} in {cache}; "
            "run once with stages.mmlu.baseline=evaluate") in str(e.value)
    found = bc.lookup(str(cache), cfg.model.path, ["p"], [[1]], 0, None, "float32")
    bc.store(found, {0: (1, [0.0, 1.0, 0.0, 0.0])}, cfg.model.path, 1.0, "tp1")
    validate(cfg)   # an entry for this model exists: the stage checks the exact key
    with pytest.raises(ConfigError, match=r"stages.mmlu.baseline_accuracy=0.5: only used with stages.mmlu.baseline=recorded"):
        validate(compose_example(TINY_EXAMPLE, over + ["stages.mmlu.baseline_accuracy=0.5"]), check_paths=False)
