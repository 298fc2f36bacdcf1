"""Slow, independent references for the quantization tests (scalar Python and group-by-group loops)."""

import math

import torch

from fusion.quant.formats import decode_e4m3, pack_fp4, unpack_fp4
from fusion.quant.mxfp8 import mxfp8_quantize_2d
from fusion.quant.nvfp4 import nvfp4_quantize_2d
from fusion.quant.fp8_block import fp8_block_quantize_2d

E4M3_POS = [(c, float(decode_e4m3(torch.tensor([c], dtype=torch.uint8)))) for c in range(0x7F)]
BLOCKS = {"mxfp8": 32, "nvfp4": 16, "fp8_block": 128}


def slow_e4m3(v: float) -> int:
    """E4M3 RNE by exhaustive nearest search (ties to the even code); NaN / Inf -> 0x7F."""
    if math.isnan(v) or math.isinf(v):
        return 0x7F
    a = abs(v)
    best = min(E4M3_POS, key=lambda cv: (abs(cv[1] - a), cv[0] & 1))
    assert abs(best[1] - a) <= 16 or a <= 464, "overflow"
    return best[0] | (0x80 if math.copysign(1.0, v) < 0 else 0)


def slow_exponent(amax: float) -> int:
    """Smallest e with amax <= 448 * 2^e (exact in float64), clamped to [-127, 127]; 0 -> -127."""
    if amax == 0:
        return -127
    e = -200
    while amax > 448.0 * 2.0 ** e:
        e += 1
    return max(-127, min(127, e))


def slow_fp8_block_exponent(amax: float) -> int:
    return 0 if amax == 0 else slow_exponent(amax)


def slow_fp8_block_row(row):
    """(codes, scales) of one row, 1x128 blocks, the last one partial."""
    data, scales = [], []
    for b in range(0, len(row), 128):
        blk = [float(v) for v in row[b:b + 128]]
        amax = max([abs(v) for v in blk if math.isfinite(v)] or [0.0])
        e = slow_fp8_block_exponent(amax)
        scales.append(2.0 ** e)
        data += [slow_e4m3(v * 2.0 ** -e) for v in blk]
    return data, scales


def reference_columnwise(fmt: str, x: torch.Tensor, sizes):
    """The columnwise buffers built group by group, block by block, with the *rowwise* quantizer of each
    block's zero-padded transpose: ``(data, scale)`` in the documented layouts (``data`` ``(K, M)``,
    NVFP4 packed ``(K, ceil(M/2))``; ``scale`` ``(ceil(M/B) + G, K)``, unused capacity zero)."""
    x = x.float()
    M, K = x.shape
    B = BLOCKS[fmt]
    sizes = [M] if sizes is None else [int(s) for s in sizes]
    capacity = -(-M // B) + len(sizes)
    sdtype = torch.float32 if fmt == "fp8_block" else torch.uint8
    scale = torch.zeros(capacity, K, dtype=sdtype)
    codes = torch.zeros(K, M, dtype=torch.uint8)
    amax = torch.where(x.isfinite(), x.abs(), torch.zeros_like(x)).amax() if x.numel() else torch.tensor(0.0)
    from fusion.quant.nvfp4 import nvfp4_global_scale
    g = nvfp4_global_scale(amax)
    start, block = 0, 0
    for n in sizes:
        for r0 in range(start, start + n, B):
            r1 = min(r0 + B, start + n)
            t = torch.zeros(K, B)
            t[:, :r1 - r0] = x[r0:r1].t()
            if fmt == "mxfp8":
                d, s = mxfp8_quantize_2d(t)
                scale[block] = s[:, 0]
            elif fmt == "fp8_block":
                d, s = fp8_block_quantize_2d(t)
                scale[block] = s[0]
            else:
                d, s = nvfp4_quantize_2d(t, g)
                d = unpack_fp4(d)
                scale[block] = s[:, 0]
            codes[:, r0:r1] = d[:, :r1 - r0]
            block += 1
        start += n
    if fmt == "nvfp4":
        if M % 2:
            codes = torch.cat([codes, torch.zeros(K, 1, dtype=torch.uint8)], 1)
        return pack_fp4(codes), scale
    return codes, scale
