"""launcher/megatron/collectives.py on 3 real gloo ranks (torch.distributed, CPU), and in one process."""
import pytest

from launcher_testing.ranks import run_on_ranks

pytestmark = pytest.mark.torch


def collectives_worker():
    import datetime

    import torch.distributed as dist

    from launcher.megatron import collectives as c

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    out = {
        "broadcast": c.broadcast({"from": rank}),
        "all_gather": c.all_gather(rank * 10),
        "gather": c.gather_to_rank0(f"r{rank}", rank),
        "on_rank0": list(c.on_rank0(lambda: ["done", rank], rank)),
        "on_rank0_long": list(c.on_rank0(lambda: rank + 7, rank, wait_s=120)),
    }

    def fails():
        raise OSError("disk full")

    out["error"] = list(c.on_rank0(fails, rank, wait_s=120))
    out["error_not_caught"] = None
    if rank == 0:   # an error outside ``errors`` propagates on rank 0; the others are not left waiting on it
        try:
            c.on_rank0(fails, rank, errors=(ValueError,))
        except OSError as e:
            out["error_not_caught"] = str(e)
    with c.long_wait_group(30) as group:
        out["group_gather"] = c.all_gather(rank, group)
    dist.destroy_process_group()
    return out


def test_collectives_on_three_gloo_ranks():
    results = run_on_ranks("test_collectives:collectives_worker", nprocs=3, timeout_s=240)
    for rank, r in enumerate(results):
        assert r["broadcast"] == {"from": 0}
        assert r["all_gather"] == [0, 10, 20]
        assert r["gather"] == (["r0", "r1", "r2"] if rank == 0 else None)
        assert r["on_rank0"] == [["done", 0], None]
        assert r["on_rank0_long"] == [7, None]
        assert r["error"] == [None, "OSError: disk full"]
        assert r["group_gather"] == [0, 1, 2]
    assert results[0]["error_not_caught"] == "disk full"


def test_without_a_process_group_each_is_the_identity():
    from launcher.megatron import collectives as c

    assert c.broadcast(3) == 3
    assert c.all_gather("x") == ["x"]
    assert c.gather_to_rank0("x", 0) == ["x"]
    assert c.on_rank0(lambda: 5, 0, wait_s=10) == (5, None)
    assert c.on_rank0(lambda: 1 / 0, 0) == (None, "ZeroDivisionError: division by zero")
    with c.long_wait_group() as group:
        assert group is None
