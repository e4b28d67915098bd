"""The CPU NVFP4 fake quantization (launcher.megatron.cpu_compat): the fast path equals ModelOpt's
NVFP4QTensor quantize/dequantize (``nvfp4_fake_quant_reference``) bit for bit - every rounding tie,
both zeros, subnormals, infinities, bf16/fp16 inputs, with and without a calibrated amax - and the
inputs it leaves to the reference (a NaN, a zero amax, a partial block) give the reference's bits."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

from launcher.megatron.cpu_compat import nvfp4_fake_quant_cpu, nvfp4_fake_quant_reference  # noqa: E402

INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.view(INT_OF[got.dtype]), want.view(INT_OF[want.dtype])
    bad = g != w
    assert not bad.any(), (int(bad.sum()), got[bad][:8], want[bad][:8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16,), (64, 576), (3, 7, 1536)])
def test_equals_modelopts_nvfp4_bit_for_bit(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    for scale in (1e-3, 1.0, 50.0):
        x = (torch.randn(*shape, generator=gen) * scale).to(dtype)
        # the tensor's own amax, a calibrated one above it, and one far below it (saturated blocks)
        for amax in (None, torch.tensor(2.0 * scale), torch.tensor(0.1 * scale), torch.tensor(1e-6 * scale)):
            assert_same_bits(nvfp4_fake_quant_cpu(x, 16, amax), nvfp4_fake_quant_reference(x, 16, amax))


def _edge_blocks() -> "torch.Tensor":
    """Blocks whose scale is exactly 1 (amax 6, global amax 6 * 448), so each value is the scaled
    value itself: every E2M1 rounding tie and its neighbours, both zeros, a subnormal, the binade
    edges 2 and 4, values above 6 (in blocks of their own, scale > 1) and an infinity."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    near = [v for t in ties for v in (torch.nextafter(torch.tensor(t), torch.tensor(0.0)).item(),
                                      torch.nextafter(torch.tensor(t), torch.tensor(9.0)).item())]
    edges = [0.0, -0.0, 1e-40, 2.0, 4.0, 1.9999999, 3.9999998, 0.1]
    values = ties + near + edges
    rows = []
    for sign in (1.0, -1.0):
        v = [sign * x for x in values]
        for i in range(0, len(v), 15):                     # 15 values and 6.0 per block
            chunk = v[i:i + 15]
            rows.append(torch.tensor([chunk + [6.0] * (16 - len(chunk))]))
    rows.append(torch.tensor([[7.0, -6.5, 100.0, 12.0, 5.9, 0.3] + [1.0] * 10]))
    rows.append(torch.tensor([[float("inf"), 1.0, -2.5, 3.0] + [0.5] * 12]))
    return torch.cat(rows)


def test_every_rounding_tie_and_edge_value():
    x = _edge_blocks()
    amax = torch.tensor(6.0 * 448.0)
    got = nvfp4_fake_quant_cpu(x, 16, amax)
    assert_same_bits(got, nvfp4_fake_quant_reference(x, 16, amax))
    # ties go to the even E2M1 value: 0.25->0 0.75->1 1.25->1 1.75->2 2.5->2 3.5->4 5->4
    assert got[0, :7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    (neg,) = (x[:, 0] == -0.25).nonzero()[0].tolist()
    assert got[neg, :7].tolist() == [0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]


def test_a_negative_value_rounded_to_zero_gives_positive_zero():
    x = torch.tensor([[-0.1, -0.25, -0.0] + [6.0] * 13])
    got = nvfp4_fake_quant_cpu(x, 16, torch.tensor(6.0 * 448.0))
    assert got[0, :3].view(torch.int32).tolist() == [0, 0, 0]          # +0.0, as ModelOpt's code table


@pytest.mark.parametrize("case", ["nan", "zeros", "zero_amax", "partial_block"])
def test_inputs_left_to_the_reference_give_its_bits(case):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    amax = torch.tensor(3.0)
    if case == "nan":
        x[1, 5] = float("nan")
    elif case == "zeros":
        x, amax = torch.zeros(4, 64), None
    elif case == "zero_amax":
        amax = torch.tensor(0.0)
    if case == "partial_block":       # ModelOpt pads, then cannot reshape back: the same error both ways
        x = torch.randn(4, 40)
        with pytest.raises(RuntimeError) as want:
            nvfp4_fake_quant_reference(x, 16, amax)
        with pytest.raises(RuntimeError) as got:
            nvfp4_fake_quant_cpu(x, 16, amax)
        assert str(got.value) == str(want.value)
        return
    assert_same_bits(nvfp4_fake_quant_cpu(x, 16, amax), nvfp4_fake_quant_reference(x, 16, amax))
