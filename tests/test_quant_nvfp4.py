"""NVFP4 reference: global / block scale formulas, E2M1 rounding, special values, layouts, errors."""

import math

import numpy as np
import pytest
import torch

from fusion.quant import NVFP4_BLOCK, QuantizationError, quantize_nvfp4
from fusion.quant.formats import decode_e2m1, decode_e4m3, unpack_fp4
from fusion.quant.nvfp4 import nvfp4_global_scale, nvfp4_quantize_2d

NAN = float("nan")
INF = float("inf")
f32 = np.float32
E4M3_POS = [(c, float(decode_e4m3(torch.tensor([c], dtype=torch.uint8)))) for c in range(0x7F)]
E2M1_POS = list(enumerate([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]))


def nearest(table, a):
    return min(table, key=lambda cv: (abs(cv[1] - a), cv[0] & 1))[0]


def slow_nvfp4(x2d):
    """Independent scalar implementation of the documented rules with numpy float32 arithmetic."""
    rows = x2d.tolist()
    fin = [abs(v) for r in rows for v in r if math.isfinite(v)]
    amax = f32(max(fin or [0.0]))
    g = f32(amax / f32(2688.0))
    if g == 0:
        g = f32(1.0)
    data, scales = [], []
    for r in rows:
        codes, srow = [], []
        for b in range(0, len(r), 16):
            blk = [f32(v) for v in r[b:b + 16]]
            if not all(math.isfinite(v) for v in blk):
                srow.append(0x7F)
                codes += [0] * 16
                continue
            bamax = max(abs(v) for v in blk)
            s = f32(f32(bamax / f32(6.0)) / g)
            sc = nearest(E4M3_POS, min(float(s), 448.0))
            srow.append(sc)
            denom = f32(f32(dict(E4M3_POS)[sc]) * g)
            for v in blk:
                q = f32(v / denom) if denom > 0 else f32(0.0)
                c = nearest(E2M1_POS, min(abs(float(q)), 6.0))
                codes.append(c | (8 if math.copysign(1.0, float(v)) < 0 else 0))
        data.append([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)])
        scales.append(srow)
    return data, scales, float(g)


def test_global_scale():
    a = torch.tensor([2688.0, 0.0, 6.0, 1e-45, 448.0 * 6 * 2 ** 10])
    g = nvfp4_global_scale(a)
    assert g.tolist() == [1.0, 1.0, float(f32(6.0) / f32(2688.0)), 1.0, 1024.0]


def test_hand_computed():
    # amax = 2688 -> g = 1 exactly
    x = torch.zeros(1, 64)
    x[0, :16] = 448.0 * torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -0.25, 0.75, 2.5, 5, 0, 0, 0])
    x[0, 16:32] = torch.tensor([12.0, 1, 1.5, 3, 5, 0.25, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    x[0, 32:48] = 0.001                                   # block scale rounds to 0
    x[0, 48:64] = torch.tensor([6.375] + [1.0] * 15)      # block scale tie 1.0625 -> 1.0; 6.375 saturates
    q = quantize_nvfp4(x, columnwise=False)
    assert q.amax.item() == 2688.0 and q.global_scale.item() == 1.0
    # block 0: s = 448 (0x7E), elements x / 448; block 1: s = 2 (0x40), elements x / 2;
    # block 2: 0.001 / 6 < 2^-10 -> s = 0; block 3: s = e4m3(1.0625) = 1.0 (0x38)
    assert q.scale.tolist() == [[0x7E, 0x40, 0x00, 0x38]]
    codes = unpack_fp4(q.data)[0]
    assert codes[:16].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 15, 8, 2, 4, 6, 0, 0, 0]
    # 6, 0.5, 0.75 (tie -> 1.0), 1.5, 2.5 (tie -> 2), 0.125 -> 0
    assert codes[16:22].tolist() == [7, 1, 2, 3, 4, 0]
    assert (codes[32:48] == 0).all()
    assert codes[48].item() == 7 and (codes[49:64] == 2).all()
    d = q.dequantize()[0]
    assert d[:16].tolist() == (448.0 * torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -0.0, 1, 2, 4, 0, 0, 0])).tolist()
    assert d[16:20].tolist() == [12.0, 1.0, 2.0, 3.0]
    assert (d[32:48] == 0).all() and d[48].item() == 6.0
    # nibble order: byte 0 holds element 0 (low) and element 1 (high)
    assert q.data[0, 0].item() == 0 | (1 << 4) and q.data[0, 4].item() == 15 | (8 << 4)


def test_subnormal_block_scale():
    x = torch.zeros(1, 32)
    x[0, :16] = 2688.0                                    # amax -> g = 1
    x[0, 16] = 6 * 2.0 ** -9                              # s = 2^-9: the smallest E4M3 subnormal
    x[0, 17] = 3 * 2.0 ** -9
    q = quantize_nvfp4(x, columnwise=False)
    assert q.scale[0, 1].item() == 0x01
    assert q.dequantize()[0, 16:18].tolist() == [6 * 2.0 ** -9, 3 * 2.0 ** -9]


def test_matches_slow_reference():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 64, generator=g) * torch.exp(torch.randn(6, 4, 1, generator=g) * 3).repeat(1, 1, 16).reshape(6, 64)
    x[0, :16] = 0.0
    x[1, 3] = NAN
    x[2, 20] = INF
    x[3, 0] = -0.0
    x[4, 32:48] *= 1e-4
    amax = torch.where(x.isfinite(), x.abs(), torch.zeros_like(x)).amax()
    data, scale = nvfp4_quantize_2d(x, nvfp4_global_scale(amax))
    sd, ss, sg = slow_nvfp4(x)
    assert nvfp4_global_scale(amax).item() == sg
    assert scale.tolist() == ss
    assert data.tolist() == sd


def test_all_zero_tensor():
    q = quantize_nvfp4(torch.zeros(32, 32))
    assert q.amax.item() == 0 and q.global_scale.item() == 1.0
    assert (q.data == 0).all() and (q.scale == 0).all() and (q.columnwise_scale == 0).all()
    assert (q.dequantize() == 0).all()
    n = quantize_nvfp4(torch.full((1, 16), -0.0), columnwise=False)
    assert (n.data == 0x88).all() and torch.signbit(n.dequantize()).all()


def test_nan_and_inf_poison_their_block():
    x = torch.ones(1, 48)
    x[0, 2] = NAN
    x[0, 20] = -INF
    x[0, 40] = 5.0
    q = quantize_nvfp4(x, columnwise=False)
    assert q.amax.item() == 5.0                            # finite amax
    assert q.scale[0, 0].item() == 0x7F and q.scale[0, 1].item() == 0x7F and q.scale[0, 2].item() != 0x7F
    assert (q.data[0, :16] == 0).all()                     # codes of a NaN-scale block are zero
    d = q.dequantize()
    assert d[0, :32].isnan().all() and d[0, 32:].isfinite().all()
    assert d[0, 40].item() == pytest.approx(5.0, rel=1e-6)


def test_round_trip_error_bound():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 16, 1, generator=g) * 2).repeat(1, 1, 16).reshape(64, 256)
    q = quantize_nvfp4(x, columnwise=False)
    d = q.dequantize()
    denom = (decode_e4m3(q.scale) * q.global_scale).repeat_interleave(16, dim=1)
    normal = (decode_e4m3(q.scale) >= 2.0 ** -6).repeat_interleave(16, dim=1)
    assert normal.float().mean() > 0.5 and (~normal).any()
    # blocks with a normal E4M3 scale: E2M1 rounding, half a step, i.e. at most 1/4 of
    # max(|x|, denom), saturation included (the scale rounds by at most 2^-4)
    err = (d - x).abs()
    assert (err <= 0.25 * torch.maximum(x.abs(), denom) * (1 + 1e-5))[normal].all()
    # subnormal block scales (block amax < 2^-6 * 6 * g) lose precision: values saturate at 6 * denom
    assert (d.abs() <= 6 * denom * (1 + 1e-6)).all()
    assert q.dequantize().abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)


def test_columnwise_is_rowwise_of_transpose():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(48, 32, generator=g)
    q = quantize_nvfp4(x)
    t = quantize_nvfp4(x.t().contiguous(), columnwise=False)
    assert q.columnwise_data.shape == (32, 24) and q.columnwise_scale.shape == (3 + 1, 32)
    assert torch.equal(q.columnwise_data, t.data) and torch.equal(q.columnwise_scale[:3], t.scale.t())
    assert (q.columnwise_scale[3] == 0).all()
    assert torch.equal(q.dequantize(columnwise=True), t.dequantize().t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_dtypes_and_nd(dtype):
    g = torch.Generator().manual_seed(14)
    x = torch.randn(2, 8, 64, generator=g).to(dtype)
    q = quantize_nvfp4(x)
    ref = quantize_nvfp4(x.float().reshape(16, 64))
    assert q.shape == (2, 8, 64) and q.dtype == dtype
    assert q.data.shape == (16, 32) and q.scale.shape == (16, 4)
    assert q.columnwise_data.shape == (64, 8) and q.columnwise_scale.shape == (1 + 1, 64)
    assert torch.equal(q.data, ref.data) and torch.equal(q.scale, ref.scale)
    assert torch.equal(q.columnwise_data, ref.columnwise_data)
    assert torch.equal(q.dequantize(), ref.dequantize().reshape(2, 8, 64).to(dtype))


def test_errors():
    with pytest.raises(QuantizationError) as ei:
        quantize_nvfp4(torch.randn(32, 40))
    msg = str(ei.value)
    assert "QuantizeNVFP4" in msg and "last dim 40" in msg and "block size 16" in msg and "pad" in msg
    q = quantize_nvfp4(torch.randn(7, 32))                # any row count: one partial block, odd M padded
    assert q.columnwise_data.shape == (32, 4) and q.columnwise_scale.shape == (1 + 1, 32)
    assert (q.columnwise_data[:, 3] >> 4 == 0).all()       # the pad nibble
    assert quantize_nvfp4(torch.randn(8, 32), columnwise=False).data.shape == (8, 16)
    assert NVFP4_BLOCK == 16


def test_docs_worked_example():
    row = [0.3, -1.2, 2.6, 5.0, 0.0, 0.1, 7.9, -3.3, 0.75, 1.0, 1.25, 4.4, -0.2, 0.6, 2.0, 3.0, 100.0] + [0.0] * 15
    q = quantize_nvfp4(torch.tensor([row]), columnwise=False)
    assert q.scale.tolist() == [[0x61, 0x7E]]
    assert q.data[0, :8].tolist() == [0xA0, 0x64, 0x00, 0xC7, 0x11, 0x52, 0x18, 0x43]
    assert q.data[0, 8].item() == 0x07 and (q.data[0, 9:] == 0).all()
    assert q.dequantize()[0, 16].item() == 100.0
