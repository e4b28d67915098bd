"""Shard plans (pure): every batch exactly once, EP peers in lockstep of forward calls."""
import pytest

from launcher.mmlu.sharding import Step, plan_shards, resolve_mode
from launcher.topology import ParallelDims

# 10 batches, lengths descending like batching produces, last one short
SHAPES = [(4, 40), (4, 36), (4, 33), (4, 30), (4, 28), (4, 25), (4, 22), (4, 20), (4, 17), (2, 12)]

LAYOUTS = {
    "ep4": ParallelDims(4, ep=4),
    "ep2_edp2": ParallelDims(4, ep=2),
    "tp2_ep2": ParallelDims(4, tp=2, ep=2),
    "pp2": ParallelDims(4, pp=2),
    "dense_dp4": ParallelDims(4),
    "pp2_ep2": ParallelDims(4, pp=2, ep=2),
    "single": ParallelDims(1),
}


def evaluated_once(plan, dims):
    """Every batch is owned by exactly one last-stage rank that evaluates it."""
    assert sorted(plan.owner) == list(range(len(SHAPES)))
    for b, r in plan.owner.items():
        assert dims.coordinates(r)["pp"] == dims.pp - 1
        assert b in [s.batch for s in plan.steps[r]]
    # each DP shard evaluates each batch at most once, and all batches are covered
    seen = {}
    for r in range(dims.world_size):
        bs = [s.batch for s in plan.steps[r] if s.batch is not None]
        assert len(bs) == len(set(bs))
        seen.setdefault(plan.shard_of_rank[r], set()).update(bs)
    assert set().union(*seen.values()) == set(range(len(SHAPES)))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["balanced", "lockstep", "dense_dp"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_every_batch_once(layout, mode, dispatcher):
    dims = LAYOUTS[layout]
    plan = plan_shards(SHAPES, dims, mode, dispatcher, allow_unsafe=True)
    evaluated_once(plan, dims)
    if mode != "dense_dp":
        for g in dims.groups["ep"]:
            assert len({len(plan.steps[r]) for r in g}) == 1
    # shapes carried by real steps are at least the batch's own
    for steps in plan.steps:
        for s in steps:
            if s.batch is not None:
                assert s.rows >= SHAPES[s.batch][0] and s.padded_len >= SHAPES[s.batch][1]


def test_ep4_balanced_vs_lockstep_vs_dense_dp():
    dims = LAYOUTS["ep4"]
    bal = plan_shards(SHAPES, dims, "auto", "alltoall")
    lock = plan_shards(SHAPES, dims, "lockstep", "alltoall")
    dense = plan_shards(SHAPES, dims, "dense_dp", "alltoall", allow_unsafe=True)
    assert bal.mode == "balanced"
    assert bal.forward_calls() == [3, 3, 3, 3]
    assert lock.forward_calls() == [10, 10, 10, 10]
    assert dense.forward_calls() == [3, 3, 2, 2]          # the seed bug: unequal
    # snake deal: shard0 0,7,8 shard1 1,6,9 shard2 2,5 shard3 3,4 ; dummies fill the tail
    assert [[s.batch for s in st] for st in bal.steps] == [[0, 7, 8], [1, 6, 9], [2, 5, None], [3, 4, None]]
    assert bal.steps[2][2] == Step(None, 12, 1)
    assert bal.dummies() == [0, 0, 1, 1]
    assert bal.owner == {0: 0, 7: 0, 8: 0, 1: 1, 6: 1, 9: 1, 2: 2, 5: 2, 3: 3, 4: 3}
    assert lock.owner == {b: 0 for b in range(10)}


def test_ep4_allgather_equal_shapes_per_step():
    plan = plan_shards(SHAPES, LAYOUTS["ep4"], "balanced", "allgather")
    for i in range(3):
        assert len({(plan.steps[r][i].rows, plan.steps[r][i].padded_len) for r in range(4)}) == 1
    assert [plan.steps[r][0].padded_len for r in range(4)] == [40] * 4
    assert plan.steps[2][2] == Step(None, 17, 4)          # dummy takes the step's agreed shape


def test_ep2_edp2_components_and_tp_peers():
    plan = plan_shards(SHAPES, LAYOUTS["ep2_edp2"], "balanced", "alltoall")
    assert plan.components == [[0, 1], [2, 3]]
    assert plan.forward_calls() == [3, 3, 2, 2]          # each EP group equal, groups independent
    assert plan.dummies() == [0, 0, 0, 0]
    lock = plan_shards(SHAPES, LAYOUTS["ep2_edp2"], "lockstep", "alltoall")
    assert lock.forward_calls() == [5, 5, 5, 5]
    tp = plan_shards(SHAPES, LAYOUTS["tp2_ep2"], "balanced", "alltoall")
    assert tp.steps[0] == tp.steps[1] and tp.steps[2] == tp.steps[3]   # TP peers identical
    assert tp.forward_calls() == [5, 5, 5, 5]
    pp = plan_shards(SHAPES, LAYOUTS["pp2"], "balanced", "alltoall")
    assert pp.steps[0] == pp.steps[2] and pp.steps[1] == pp.steps[3]   # PP stages identical
    assert set(pp.owner.values()) == {2, 3}


def test_dense_dp_refused_at_ep_gt_1():
    with pytest.raises(ValueError) as e:
        resolve_mode("dense_dp", ep=4)
    assert "stages.mmlu.shard_mode='dense_dp': shards batches over the dense data-parallel group, which desyncs the expert all-to-all at ep=4" in str(e.value)
    assert "allow_unsafe_shard_mode=true" in str(e.value)
    assert resolve_mode("dense_dp", ep=1) == "dense_dp"
    with pytest.raises(ValueError, match=r"shard_mode='fast': valid values are \['auto', 'balanced', 'lockstep', 'dense_dp'\]"):
        resolve_mode("fast", ep=1)
    with pytest.raises(ValueError, match=r"moe_dispatcher='flex'"):
        plan_shards(SHAPES, LAYOUTS["ep4"], "auto", "flex")


def test_more_shards_than_batches():
    plan = plan_shards([(1, 5)], LAYOUTS["ep4"], "balanced", "alltoall")
    assert [[s.batch for s in st] for st in plan.steps] == [[0], [None], [None], [None]]
    empty = plan_shards([], LAYOUTS["ep4"], "balanced", "alltoall")
    assert empty.forward_calls() == [0, 0, 0, 0]


def test_summary_keys():
    s = plan_shards(SHAPES, LAYOUTS["ep4"], "auto", "alltoall").summary()
    assert s["forward_calls_per_rank"] == [3, 3, 3, 3]
    assert s["dummies_per_rank"] == [0, 0, 1, 1]
    assert s["real_batches_per_rank"] == [3, 3, 2, 2]


def test_shard_padded_tokens_counts_each_shard_once():
    real = sum(r * n for r, n in SHAPES)
    lock = plan_shards(SHAPES, LAYOUTS["ep4"], "lockstep", "alltoall")
    assert lock.shard_padded_tokens() == real                      # one shard, no dummies
    bal = plan_shards(SHAPES, LAYOUTS["ep4"], "balanced", "alltoall")
    assert bal.shard_padded_tokens() == real + 2 * 12              # two 1x12 dummies
    tp = plan_shards(SHAPES, LAYOUTS["tp2_ep2"], "balanced", "alltoall")
    assert tp.shard_padded_tokens() == real                        # TP peers counted once
