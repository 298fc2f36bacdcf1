"""MXFP8 reference: scale rule, special values, round trips, columnwise, errors, dtypes."""

import math

import numpy as np
import pytest
import torch

from fusion.quant import MXFP8_BLOCK, QuantizationError, quantize_mxfp8
from fusion.quant.formats import decode_e4m3, decode_e8m0
from fusion.quant.mxfp8 import mxfp8_dequantize_2d, mxfp8_quantize_2d, mxfp8_scale_exponent

NAN = float("nan")
INF = float("inf")
E4M3_POS = [(c, float(decode_e4m3(torch.tensor([c], dtype=torch.uint8)))) for c in range(0x7F)]


def slow_e4m3(v: float) -> int:
    """Independent E4M3 RNE by exhaustive nearest search (ties to the even code)."""
    if math.isnan(v) or math.isinf(v):
        return 0x7F
    a = abs(v)
    best = min(E4M3_POS, key=lambda cv: (abs(cv[1] - a), cv[0] & 1))
    assert abs(best[1] - a) <= 16 or a <= 464, "overflow"
    return best[0] | (0x80 if math.copysign(1.0, v) < 0 else 0)


def slow_exponent(amax: float) -> int:
    """Smallest e with amax <= 448 * 2^e (exact in float64), clamped to [-127, 127]."""
    if amax == 0:
        return -127
    e = -200
    while amax > 448.0 * 2.0 ** e:
        e += 1
    return max(-127, min(127, e))


def slow_mxfp8_row(row):
    data, scale = [], []
    for b in range(0, len(row), 32):
        blk = [float(v) for v in row[b:b + 32]]
        amax = max([abs(v) for v in blk if math.isfinite(v)] or [0.0])
        e = slow_exponent(amax)
        scale.append(e + 127)
        data += [slow_e4m3(v * 2.0 ** -e) for v in blk]
    return data, scale


def test_scale_exponent_powers_of_two():
    ks = torch.arange(-100, 110)
    amax = (448.0 * torch.pow(2.0, ks.double())).float()
    assert torch.equal(mxfp8_scale_exponent(amax), ks)                     # exactly k, not k + 1
    up = torch.nextafter(amax, torch.tensor(INF))
    assert torch.equal(mxfp8_scale_exponent(up), ks + 1)
    down = torch.nextafter(amax, torch.tensor(0.0))
    assert torch.equal(mxfp8_scale_exponent(down), ks)


@pytest.mark.parametrize("amax,e", [
    (0.0, -127), (1.0, -8), (256.0, 0), (448.0, 0), (449.0, 1), (511.0, 1), (512.0, 1),
    (896.0, 1), (2.0 ** -130, -127), (448.0 * 2.0 ** -127, -127), (448.0 * 2.0 ** -126, -126),
    (float(torch.finfo(torch.float32).max), 120), (1e-45, -127),
])
def test_scale_exponent_cases(amax, e):
    assert mxfp8_scale_exponent(torch.tensor([amax])).item() == e


def test_scale_exponent_random_vs_exact():
    g = torch.Generator().manual_seed(0)
    amax = torch.exp(torch.empty(5000).uniform_(-80, 80, generator=g)).float()
    expect = torch.tensor([slow_exponent(v) for v in amax.double().tolist()])
    assert torch.equal(mxfp8_scale_exponent(amax), expect)


def test_hand_computed_block():
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([3.0, 1.0, -0.5, 0.001, 2.9, 1.0 / 3.0])
    q = quantize_mxfp8(x, columnwise=False)
    # amax 3 -> e = ceil(log2(3 / 448)) = -7, byte 120; elements x * 2^7
    assert q.scale.tolist() == [[120]]
    # 384 = 1.5*2^8 -> 0x7C; 128 -> 0x70; -64 -> 0xE8; 0.128 -> 0.125 = 2^-3 -> 0x20 (step 2^-6);
    # 371.2 -> 384 (step 32 in [256, 512): 352 or 384, nearer 384) -> 0x7C
    assert q.data[0, :5].tolist() == [0x7C, 0x70, 0xE8, 0x20, 0x7C]
    # 128/3 = 42.67, in [32, 64) step 4: 40 / 44 -> 44 = 1.375*32 -> (5+7)<<3 | 3 = 0x63
    assert q.data[0, 5].item() == 0x63
    assert q.dequantize()[0, :6].tolist() == [3.0, 1.0, -0.5, 0.125 / 128, 3.0, 44.0 / 128]
    assert (q.data[0, 6:] == 0).all()


def test_matches_slow_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 128, generator=g) * torch.exp(torch.randn(4, 1, generator=g) * 6)
    x[0, 3] = 0.0
    x[1, 32:64] = 0.0
    x[2, 5] = NAN
    x[2, 40] = -INF
    x[3, 0] = -0.0
    x[3, 64:96] *= 1e-30
    data, scale = mxfp8_quantize_2d(x)
    for r in range(4):
        d, s = slow_mxfp8_row(x[r].tolist())
        assert data[r].tolist() == d
        assert scale[r].tolist() == s


def test_element_path_matches_torch_cast():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g) * 100
    data, scale = mxfp8_quantize_2d(x)
    e = scale.to(torch.int64) - 127
    scaled = x.reshape(64, 8, 32) * torch.pow(2.0, -e.double()).float().unsqueeze(-1)
    ref = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(64, 256)
    assert torch.equal(data, ref)


def test_zero_and_negative_zero_blocks():
    x = torch.zeros(2, 64)
    x[1, :32] = -0.0
    q = quantize_mxfp8(x, columnwise=False)
    assert q.scale.tolist() == [[0, 0], [0, 0]]        # all-zero block: 2^-127, byte 0
    assert (q.data[0] == 0).all() and (q.data[1, :32] == 0x80).all() and (q.data[1, 32:] == 0).all()
    d = q.dequantize()
    assert (d == 0).all() and torch.signbit(d[1, :32]).all()


def test_nan_and_inf():
    x = torch.ones(1, 96)
    x[0, 0] = NAN
    x[0, 1] = 112.0
    x[0, 32] = INF
    x[0, 33] = -INF
    x[0, 64:] = NAN
    q = quantize_mxfp8(x, columnwise=False)
    assert q.data[0, 0].item() == 0x7F and q.data[0, 32].item() == 0x7F and q.data[0, 33].item() == 0x7F
    # scales ignore the non-finite elements: block 0 amax 112 -> -2; block 1 amax 1 -> -8; block 2 all NaN -> byte 0
    assert q.scale.tolist() == [[125, 119, 0]]
    d = q.dequantize()
    assert d[0, 0].isnan() and d[0, 32].isnan() and d[0, 33].isnan() and d[0, 64:].isnan().all()
    assert d[0, 1].item() == 112.0 and (d[0, 2:32] == 1).all() and (d[0, 34:64] == 1).all()
    assert q.amax.item() == 112.0                          # per-tensor amax over finite values


def test_round_trip_error_bound():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g) * torch.exp(torch.randn(64, 16, 1, generator=g) * 4).repeat(1, 1, 32).reshape(64, 512)
    q = quantize_mxfp8(x, columnwise=False)
    d = q.dequantize()
    s = decode_e8m0(q.scale).repeat_interleave(32, dim=1)
    normal = x.abs() >= 2.0 ** -6 * s                     # elements in E4M3's normal range
    rel = ((d - x).abs() / x.abs())[normal]
    assert rel.max().item() <= 2.0 ** -4
    assert ((d - x).abs()[~normal] <= 2.0 ** -10 * s[~normal]).all()   # half a subnormal step
    # nothing saturates: the block max is always represented within the rounding
    assert d.abs().amax().item() <= x.abs().amax().item() * (1 + 2.0 ** -4)


def test_dequantize_exact_and_idempotent():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=g)
    q = quantize_mxfp8(x)
    d = q.dequantize()
    q2 = quantize_mxfp8(d)
    # the value is a fixed point (buffers may differ: a block max that rounded down onto 448 * 2^(e-1)
    # gets the smaller exponent the second time, with the same values)
    assert torch.equal(q2.dequantize(), d)
    assert torch.equal(q2.dequantize(columnwise=True), quantize_mxfp8(q.dequantize(columnwise=True)).dequantize(columnwise=True))


def test_columnwise_is_rowwise_of_transpose():
    # one group (no group_sizes): the columnwise blocks are the rowwise blocks of x.T; the scales are stored
    # k-block-major (capacity ceil(M/32) + 1, K), the last row of the capacity unused (byte 0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 64, generator=g) * 10
    q = quantize_mxfp8(x)
    t = quantize_mxfp8(x.t().contiguous(), columnwise=False)
    assert q.columnwise_data.shape == (64, 96) and q.columnwise_scale.shape == (3 + 1, 64)
    assert torch.equal(q.columnwise_data, t.data) and torch.equal(q.columnwise_scale[:3], t.scale.t())
    assert (q.columnwise_scale[3] == 0).all()
    assert torch.equal(q.dequantize(columnwise=True), t.dequantize().t())


def test_nd_input_flattens_leading_dims():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 16, 64, generator=g)
    q = quantize_mxfp8(x)
    q2 = quantize_mxfp8(x.reshape(32, 64))
    assert q.shape == (2, 16, 64) and q.data.shape == (32, 64) and q.scale.shape == (32, 2)
    assert q.columnwise_data.shape == (64, 32) and q.columnwise_scale.shape == (2, 64)
    assert torch.equal(q.data, q2.data) and torch.equal(q.columnwise_data, q2.columnwise_data)
    assert torch.equal(q.dequantize(), q2.dequantize().reshape(2, 16, 64))
    one = quantize_mxfp8(torch.ones(64), columnwise=False)  # 1-D: one row
    assert one.data.shape == (1, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 64, generator=g) * 3).to(dtype)
    q = quantize_mxfp8(x)
    ref = quantize_mxfp8(x.float())                       # bf16/fp16 -> fp32 is exact
    assert q.dtype == dtype and q.data.dtype == torch.uint8 and q.scale.dtype == torch.uint8
    assert torch.equal(q.data, ref.data) and torch.equal(q.scale, ref.scale)
    assert torch.equal(q.columnwise_data, ref.columnwise_data)
    assert q.dequantize().dtype == dtype
    assert torch.equal(q.dequantize(), ref.dequantize().to(dtype))
    assert q.amax.dtype == torch.float32 and q.amax.item() == x.float().abs().max().item()


def test_fp16_subnormals_dequantize_exactly():
    c = torch.arange(0, 0x7C00, dtype=torch.int64)        # every finite non-negative fp16
    x = c.to(torch.int16).view(torch.float16)
    x = x[: (x.numel() // 32) * 32].reshape(-1, 32)
    q = quantize_mxfp8(x, columnwise=False)
    d32 = q.dequantize(torch.float32)
    d16 = q.dequantize()
    fin = d16.isfinite()
    assert torch.equal(d16.float()[fin], d32[fin])         # the cast to fp16 is exact ...
    assert (d32[~fin] >= 65520).all()                      # ... except overflow at fp16's max


def test_fp16_max_overflows_on_dequantize_to_fp16():
    # documented edge: 65504 -> e = 8, 65504 / 256 = 255.875 rounds (RNE) to 256 -> 65536 > fp16 max
    x = torch.full((1, 32), 65504.0, dtype=torch.float16)
    q = quantize_mxfp8(x, columnwise=False)
    assert q.scale.item() == 127 + 8
    assert q.dequantize(torch.float32)[0, 0].item() == 65536.0
    assert q.dequantize()[0, 0].item() == INF


def test_error_last_dim():
    with pytest.raises(QuantizationError) as ei:
        quantize_mxfp8(torch.randn(64, 100))
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "QuantizeMXFP8" in msg and "last dim 100" in msg and "block size 32" in msg and "pad" in msg


def test_any_row_count_for_columnwise():
    # 40 rows: one full 32-row block and a partial block of 8 rows whose scale comes from those 8 rows
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(8))
    q = quantize_mxfp8(x)
    assert q.columnwise_data.shape == (64, 40) and q.columnwise_scale.shape == (2 + 1, 64)
    full = quantize_mxfp8(x[:32].t().contiguous(), columnwise=False)
    tail = mxfp8_scale_exponent(x[32:].abs().amax(0)) + 127
    assert torch.equal(q.columnwise_scale[0], full.scale[:, 0])
    assert torch.equal(q.columnwise_scale[1], tail.to(torch.uint8))
    assert (q.columnwise_scale[2] == 0).all()
    assert torch.equal(q.columnwise_data[:, :32], full.data)
    d = q.dequantize(columnwise=True)
    assert d.shape == x.shape and torch.allclose(d, x, rtol=2.0 ** -4, atol=2.0 ** -9 * 2.0 ** -6)
    nd = quantize_mxfp8(torch.randn(3, 10, 64))                  # 30 rows: one partial block
    assert nd.columnwise_scale.shape == (2, 64) and nd.dequantize(columnwise=True).shape == (3, 10, 64)
    q = quantize_mxfp8(x, columnwise=False)               # rowwise only
    assert q.columnwise_data is None and q.columnwise_scale is None


@pytest.mark.parametrize("x", [torch.ones(64, 64, dtype=torch.int32),
                               torch.tensor(1.0)])
def test_error_dtype_and_rank(x):
    with pytest.raises(QuantizationError, match="QuantizeMXFP8"):
        quantize_mxfp8(x)


def test_float64_is_rounded_to_float32_first():
    x = torch.randn(64, 64, dtype=torch.float64)
    q = quantize_mxfp8(x)
    ref = quantize_mxfp8(x.float())
    assert q.dtype == torch.float64 and torch.equal(q.data, ref.data) and torch.equal(q.scale, ref.scale)
    assert torch.equal(q.dequantize(), ref.dequantize().double())


def test_empty_rows():
    q = quantize_mxfp8(torch.zeros(0, 64))
    assert q.data.shape == (0, 64) and q.scale.shape == (0, 2) and q.columnwise_data.shape == (64, 0)
    assert q.amax.item() == 0.0 and q.dequantize().shape == (0, 64)


def test_block_constant():
    assert MXFP8_BLOCK == 32
    np.testing.assert_equal(mxfp8_dequantize_2d(*mxfp8_quantize_2d(torch.ones(1, 32))).numpy(), np.ones((1, 32)))


def test_docs_worked_example():
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([3.0, 1.0, -0.5, 0.001, 2.9, 1.0 / 3.0])
    q = quantize_mxfp8(x, columnwise=False)
    assert q.scale.tolist() == [[120]]
    assert q.data[0, :6].tolist() == [0x7C, 0x70, 0xE8, 0x20, 0x7C, 0x63]
    assert q.dequantize()[0, :6].tolist() == [3.0, 1.0, -0.5, 0.0009765625, 3.0, 0.34375]
