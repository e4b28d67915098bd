"""launcher.topology equals megatron-core's own RankGenerator for every valid layout <= 16 ranks."""
import itertools

import pytest

from launcher.topology import ParallelDims, minimal_world_size

DENSE_TOKENS = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "dp_cp": "dp-cp", "mp": "tp-pp"}
EXPERT_TOKENS = {"ep": "ep", "etp": "tp", "edp": "dp", "expert_mp": "tp-ep"}


def valid_layouts(max_world=16):
    degrees = [1, 2, 4, 8, 16, 3]
    for world in range(1, max_world + 1):
        for tp, pp, cp, ep, etp in itertools.product(degrees, repeat=5):
            if world % (tp * cp * pp) or world % (etp * ep * pp):
                continue
            yield ParallelDims(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)


@pytest.mark.torch
def test_matches_megatron_rank_generator_for_every_layout_up_to_16_ranks():
    ps = pytest.importorskip("megatron.core.parallel_state")
    order = "tp-cp-ep-dp-pp"
    n = 0
    for d in valid_layouts():
        dense = ps.RankGenerator(tp=d.tp, ep=1, dp=d.dp, pp=d.pp, cp=d.cp, order=order)
        expert = ps.RankGenerator(tp=d.etp, ep=d.ep, dp=d.edp, pp=d.pp, cp=1, order=order)
        for kind, token in DENSE_TOKENS.items():
            assert d.groups[kind] == dense.get_ranks(token), (d, kind)
        for kind, token in EXPERT_TOKENS.items():
            assert d.groups[kind] == expert.get_ranks(token), (d, kind)
        n += 1
    assert n > 300  # the sweep really covered many layouts


def test_nano_layouts():
    q = ParallelDims(world_size=4, ep=4)
    assert (q.dp, q.edp) == (4, 1)
    assert q.groups["ep"] == [[0, 1, 2, 3]]
    assert q.groups["edp"] == [[0], [1], [2], [3]]
    e = ParallelDims(world_size=4, pp=4)
    assert e.groups["pp"] == [[0, 1, 2, 3]] and e.dp == 1
    t = ParallelDims(world_size=4, tp=2, ep=2)
    assert t.groups["tp"] == [[0, 1], [2, 3]]
    assert t.groups["ep"] == [[0, 1], [2, 3]]
    assert t.coordinates(3) == {"tp": 1, "pp": 0, "dp": 1, "cp": 0, "ep": 1, "etp": 0, "edp": 1}


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=4, tp=3), "world_size 4 is not divisible by tp(3) * cp(1) * pp(1) = 3"),
    (dict(world_size=6, ep=4), "world_size 6 is not divisible by etp(1) * ep(4) * pp(1) = 4"),
    (dict(world_size=4, pp=0), "pp must be a positive integer, got 0"),
])
def test_invalid_degrees_name_every_number(kwargs, message):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kwargs)
    assert message in str(e.value)


def test_minimal_world_size():
    assert minimal_world_size(tp=1, pp=1, cp=1, ep=4, etp=1) == 4
    assert minimal_world_size(tp=2, pp=2, cp=1, ep=4, etp=1) == 8
    assert minimal_world_size(tp=1, pp=4, cp=1, ep=1, etp=1) == 4


def test_from_stage_reads_the_stage_degrees_and_defaults_the_world():
    from omegaconf import OmegaConf

    from launcher.schema import enabled_stages

    par = dict(tp=1, pp=2, cp=1, ep=4, etp=1)
    cfg = OmegaConf.create({"stages": {
        "quantize": {"enabled": True, "parallel": {**par, "world_size": None}},
        "mmlu": {"enabled": False, "parallel": {**par, "world_size": 16}},
        "export": {"enabled": True, "parallel": {**par, "ep": 3, "world_size": 8}},
        "vllm_smoke": {"enabled": True}}})
    assert ParallelDims.from_stage(cfg, "quantize") == ParallelDims(world_size=8, pp=2, ep=4)
    assert ParallelDims.from_stage(cfg, "mmlu").edp == 2
    assert ParallelDims.from_stage(cfg, "vllm_smoke") == ParallelDims(world_size=1)
    with pytest.raises(ValueError, match="not divisible by etp"):
        ParallelDims.from_stage(cfg, "export")
    assert enabled_stages(cfg) == ["quantize", "export", "vllm_smoke"]
