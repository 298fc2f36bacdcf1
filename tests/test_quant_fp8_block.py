"""FP8-block (1x128, FP32 power-of-two scales): worked examples, scale rule, special values, layouts."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusion
from _quant_slow import slow_e4m3, slow_fp8_block_exponent, slow_fp8_block_row
from fusion.quant import (FP8_BLOCK, QuantizationError, QuantizedTensor, fp8_block_dequantize_2d,
                          fp8_block_quantize_2d, fp8_block_scale_exponent, quantize_fp8_block)

NAN = float("nan")
INF = float("inf")


def test_docs_worked_example():
    # K = 130: one full block and a partial block of 2 elements
    x = torch.zeros(1, 130)
    x[0, :6] = torch.tensor([3.0, 1.0, -0.5, 0.001, 2.9, 1.0 / 3.0])
    x[0, 128:] = torch.tensor([1000.0, -0.0])
    q = quantize_fp8_block(x, columnwise=False)
    # block 0: amax 3 = 1.5 * 2^1, f = 0.5 <= 0.75 -> e = 1 - 8 = -7; elements x * 2^7
    # block 1: amax 1000 = 1.953 * 2^9, f > 0.75 -> e = 9 - 8 + 1 = 2; 1000 / 4 = 250 -> 256 (step 16) = 0x78
    assert q.scale.shape == (2, 1) and q.scale.dtype == torch.float32
    assert q.scale[:, 0].tolist() == [2.0 ** -7, 4.0]
    assert q.data[0, :6].tolist() == [0x7C, 0x70, 0xE8, 0x20, 0x7C, 0x63]
    assert q.data[0, 128:].tolist() == [0x78, 0x80]
    d = q.dequantize()
    assert d[0, :6].tolist() == [3.0, 1.0, -0.5, 0.0009765625, 3.0, 0.34375]
    assert d[0, 128].item() == 1024.0 and math.copysign(1.0, d[0, 129].item()) == -1.0
    assert (q.data[0, 6:128] == 0).all()


@pytest.mark.parametrize("amax,e", [
    (0.0, 0),                                  # all-zero block: scale 1
    (448.0, 0), (449.0, 1), (1.0, -8), (896.0, 1),
    (448.0 * 2.0 ** -127, -127),               # smallest scale 2^-127
    (2.0 ** -140, -127),                       # float32 subnormal: clamped
    (float(torch.finfo(torch.float32).max), 120),
])
def test_scale_exponent(amax, e):
    assert fp8_block_scale_exponent(torch.tensor([amax])).item() == e
    assert slow_fp8_block_exponent(amax) == e


def test_scale_rule_never_saturates():
    ks = torch.arange(-100, 110)
    amax = (448.0 * torch.pow(2.0, ks.double())).float()
    assert torch.equal(fp8_block_scale_exponent(amax), ks)              # exactly k, not k + 1
    up = torch.nextafter(amax, torch.tensor(INF))
    assert torch.equal(fp8_block_scale_exponent(up), ks + 1)


def test_special_blocks():
    x = torch.zeros(6, 128)
    x[1] = torch.linspace(-3, 3, 128)
    x[1, 7] = NAN
    x[1, 8] = INF
    x[2] = NAN                                  # all NaN: amax 0 -> scale 1, every code NaN
    x[3, 0] = float(torch.finfo(torch.float32).max)
    x[3, 1] = 1.0                               # far below the block max: flushes to zero
    x[4, 0] = 448.0 * 2.0 ** -127               # the smallest scale, exactly
    x[4, 1] = 2.0 ** -140                       # below it: zero
    x[5, :3] = torch.tensor([-INF, INF, -2.0])
    q = quantize_fp8_block(x, columnwise=False)
    s = q.scale[0]
    assert s[0].item() == 1.0 and (q.data[0] == 0).all()                  # all-zero block
    assert s[1].item() == 2.0 ** -7 and q.data[1, 7].item() == 0x7F and q.data[1, 8].item() == 0x7F
    assert s[2].item() == 1.0 and (q.data[2] == 0x7F).all()
    # float32 max = 255.99998 * 2^120 rounds to 256 (0x78): it dequantizes to 2^128 = inf in float32
    assert s[3].item() == 2.0 ** 120 and q.data[3, 0].item() == 0x78 and q.data[3, 1].item() == 0
    assert s[4].view(torch.int32).item() == 0x00400000                     # 2^-127, a float32 subnormal
    assert q.data[4, 0].item() == 0x7E and q.data[4, 1].item() == 0
    assert s[5].item() == 2.0 ** -7 and q.data[5, :3].tolist() == [0x7F, 0x7F, 0xF8]
    d = q.dequantize()
    assert d[1, 7].isnan() and d[1, 8].isnan() and d[2].isnan().all() and d[5, 2].item() == -2.0
    assert d[4, 0].item() == 448.0 * 2.0 ** -127 and d[3, 0].item() == INF
    assert q.amax.item() == float(torch.finfo(torch.float32).max)          # finite amax


def test_matches_slow_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 300, generator=g) * torch.exp(torch.randn(3, 1, generator=g) * 8)
    x[0, 3] = NAN
    x[1, 200:] = 0.0
    x[2, 130] = -INF
    data, scale = fp8_block_quantize_2d(x)
    for r in range(3):
        d, s = slow_fp8_block_row(x[r].tolist())
        assert data[r].tolist() == d
        assert scale[:, r].tolist() == s


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 300), log_scale=st.floats(-120, 120), seed=st.integers(0, 2 ** 16))
def test_property_matches_slow_reference(k, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=g).double() * 2.0 ** log_scale).float()
    data, scale = fp8_block_quantize_2d(x)
    d, s = slow_fp8_block_row(x[0].tolist())
    assert data[0].tolist() == d and scale[:, 0].tolist() == s
    # round trip: 2^-4 relative in E4M3's normal range, half a subnormal step below it
    back = fp8_block_dequantize_2d(data, scale)
    step = torch.tensor(s).repeat_interleave(128)[:k] * 2.0 ** -10
    assert ((back - x).abs() <= 2.0 ** -4 * x.abs() + step).all()


def test_layouts():
    x = torch.randn(5, 3, 260)
    q = quantize_fp8_block(x)
    assert q.shape == (5, 3, 260) and q.format == "fp8_block" and q.block_size == FP8_BLOCK == 128
    assert q.data.shape == (15, 260) and q.data.dtype == torch.uint8
    assert q.scale.shape == (3, 15) and q.scale.is_contiguous()            # (ceil(K/128), M), k-block-major
    assert q.columnwise_data.shape == (260, 15) and q.columnwise_scale.shape == (1 + 1, 260)
    assert q.columnwise_scale.dtype == torch.float32 and q.columnwise_scale[1].eq(0).all()
    assert q.global_scale is None
    assert torch.equal(q.data.view(torch.float8_e4m3fn).float() * q.scale.t().repeat_interleave(128, 1)[:, :260],
                       q.dequantize(torch.float32).reshape(15, 260))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_input_dtypes(dtype):
    x = (torch.randn(40, 200, generator=torch.Generator().manual_seed(2)) * 5).to(dtype)
    q = quantize_fp8_block(x)
    ref = quantize_fp8_block(x.float())         # bf16/fp16 -> fp32 exact; float64 rounded to float32 first
    assert q.dtype == dtype and q.dequantize().dtype == dtype
    for name in ("_data", "scale", "columnwise_data", "columnwise_scale"):
        assert torch.equal(getattr(q, name), getattr(ref, name))
    assert torch.equal(q.dequantize(), ref.dequantize().to(dtype))


def test_straight_through_gradient_and_requantize():
    x = torch.randn(33, 140, requires_grad=True)
    q = quantize_fp8_block(x)
    (q * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    q2 = quantize_fp8_block(q)                  # a fixed point of its value
    assert torch.equal(q2.dequantize(), q.dequantize())


def test_errors_and_op():
    with pytest.raises(QuantizationError, match="QuantizeFP8Block"):
        quantize_fp8_block(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(QuantizationError, match="0-dim"):
        quantize_fp8_block(torch.tensor(1.0))
    op = fusion.QuantizeFP8Block(columnwise=False)
    assert op.spec.attrs == {"format": "fp8_block", "columnwise": False, "block": 128}
    op.check_input(100)                         # any feature count: the last block may be partial
    q = op(torch.randn(7, 100))
    assert isinstance(q, QuantizedTensor) and q.columnwise_data is None and q.scale.shape == (1, 7)
    assert "QuantizeFP8Block" in fusion.__all__


def test_empty():
    q = quantize_fp8_block(torch.zeros(0, 300))
    assert q.data.shape == (0, 300) and q.scale.shape == (3, 0) and q.columnwise_scale.shape == (1, 300)
    assert q.dequantize().shape == (0, 300) and q.amax.item() == 0.0
    k0 = quantize_fp8_block(torch.zeros(4, 0))
    assert k0.scale.shape == (0, 4) and k0.dequantize().shape == (4, 0)


def test_e4m3_sanity_of_the_slow_reference():
    assert slow_e4m3(250.0) == 0x78 and slow_e4m3(-0.0) == 0x80 and slow_e4m3(NAN) == 0x7F
