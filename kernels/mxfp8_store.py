"""Exact MXFP8 quantization of the epilogue's values in registers (rowwise, 32-column blocks).

The rule is docs/quantization.md's, applied to the value rounded to the GEMM dtype (what a high-precision
``Output`` of the same value stores), so ``fusion.quant.mxfp8.mxfp8_quantize_2d(hp.float())`` reproduces
the bytes: block amax over the finite elements only (integer max of the |x| bit patterns), the scale
exponent from the amax bits, elements = RNE_e4m3(x * 2^-e) with 2^-e built from bits (exact), NaN and
+-Inf -> 0x7F.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .fragment_io import bits_f32, f32_bits, store2_rc, store_byte


def store_mxfp8(res, lcols, oks, t, ts, grow, ab_dtype):
    """Trace time.  ``res[c][v]``: fp32 values of logical columns ``lcols[c] + v`` of row ``grow``.
    A 32-column block = 4 consecutive 8-column chunks; each quad of lanes holds its 32 values (2 per chunk
    per lane), so the block amax is a 2-step butterfly over the quad. Writes e4m3 pairs to ``t`` and the
    E8M0 scale byte (lane 0 of the quad) to ``ts``."""
    n_c = len(res)
    assert n_c % 4 == 0
    for b in range(n_c // 4):
        ys = {}
        amax_bits = Int32(0)
        for c in range(4 * b, 4 * b + 4):
            for v in range(2):
                y = Float32(Float32(res[c][v]).to(ab_dtype))       # round to the GEMM dtype and back
                bits = f32_bits(y) & 0x7FFFFFFF
                fin = bits < 0x7F800000
                ys[(c, v)] = (y, fin)
                amax_bits = cutlass.max(amax_bits, cutlass.select_(fin, bits, Int32(0)))
        amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 1))
        amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 2))
        e8, inv_scale = e8m0_scale_bits(amax_bits)
        qnan = bits_f32(Int32(0x7FFFFFFF))
        for c in range(4 * b, 4 * b + 4):
            q = []
            for v in range(2):
                y, fin = ys[(c, v)]
                q.append(Float32(cutlass.select_(fin, y * inv_scale, qnan)))
            store2_rc(t, grow, lcols[c], q[0], q[1], cutlass.Float8E4M3FN, oks[c])
        # lane 0 of the quad writes the scale byte
        first = lcols[4 * b]
        store_byte(ts, grow, first // 32, e8, oks[4 * b] & ((first % 32) == 0))


def e8m0_scale_bits(bits):
    """Exact MXFP8 scale from the amax's fp32 bits: e = ceil(log2(amax / 448)); amax = 1.f * 2^E gives
    e = E - 8 + (f > 0.75); amax == 0 / subnormal -> e = -127; clamped to [-127, 127].
    Returns (E8M0 byte as Int32, 2^-e as fp32)."""
    biased = bits >> 23
    frac = bits & 0x7FFFFF
    e = biased - 135 + cutlass.select_(frac > 0x600000, Int32(1), Int32(0))
    e = cutlass.select_(biased == 0, Int32(-127), e)
    e = cutlass.max(cutlass.min(e, Int32(127)), Int32(-127))
    inv = bits_f32((cutlass.min(127 - e, Int32(254))) << 23)
    return e + 127, inv
