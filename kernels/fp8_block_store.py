"""Exact FP8-block quantization of an epilogue row's values in registers (rowwise: one 128-column block).

The rule is docs/quantization.md's ("FP8-block"), applied to the value rounded to the GEMM dtype (what a
high-precision ``Output`` of the same value stores), so ``fusion.quant.fp8_block_quantize_2d(hp)`` reproduces
the bytes: the block amax over the finite elements only (integer max of the ``|x|`` bit patterns), the power-of-
two scale from the amax bits (an all-zero block: 1.0), elements ``RNE_e4m3(x * 2^-e)`` with ``2^-e`` built from
bits (exact), NaN and ``±Inf`` -> ``0x7F`` (kernels/pow2_quant.py, the pieces the quantize kernel shares).

Where a row's block lies: the logical tile is 128 columns wide (a gated FP8 tile of 128 x 256, walked as two
n-waves, or a plain 128-column one), so one accumulator row of the tile is the whole block, spread over the four
lanes of a quad (2 values per 8-column chunk per lane): the block amax is a 2-step butterfly over the quad.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .fragment_io import bits_f32, store2_rc
from .pow2_quant import finite_abs_bits, fp8_block_scale_bits, scaled_or_nan

__all__ = ["store_fp8_block_row", "store_block_scale", "warp_amax_to"]

FP8 = cutlass.Float8E4M3FN


def store_fp8_block_row(res, lcols, oks, t, grow, ab_dtype):
    """Trace time. ``res[c][v]``: fp32 values of logical columns ``lcols[c] + v`` of row ``grow``, every chunk of
    the row's 128-column block (16 chunks), ``oks[c]`` whether chunk ``c`` is stored (row and columns in range;
    a masked chunk adds nothing to the amax). Writes the e4m3 codes to ``t``; returns ``(scale bits, amax bits)``
    of the block, the same in the four lanes of the quad."""
    ys = []
    amax_bits = Int32(0)
    for c in range(len(res)):
        pair = []
        for v in range(2):
            y = Float32(Float32(res[c][v]).to(ab_dtype))       # round to the GEMM dtype and back
            bits, fin = finite_abs_bits(y)
            pair.append((y, fin))
            amax_bits = cutlass.max(amax_bits, cutlass.select_(oks[c], bits, Int32(0)))
        ys.append(pair)
    amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 1))
    amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 2))
    scale_bits, inv_scale = fp8_block_scale_bits(amax_bits)
    for c in range(len(res)):
        q = [scaled_or_nan(y, fin, inv_scale) for y, fin in ys[c]]
        store2_rc(t, grow, lcols[c], q[0], q[1], FP8, oks[c])
    return scale_bits, amax_bits


@cute.jit
def store_block_scale(ts: cute.Tensor, blk: Int32, row: Int32, scale_bits: Int32, ok: cutlass.Boolean):
    """``ts[blk, row] = 2^e`` (float32, k-block-major scales) where ok (one lane of the quad)."""
    if ok:
        ts[blk, row] = bits_f32(scale_bits)


def warp_amax_to(tamax: cute.Tensor, amax_bits, lane):
    """The warp's max of ``amax_bits`` (finite |x| bits: their integer order is the value order), one atomic max
    into ``tamax`` (an int32 the caller zeroed) by lane 0. Every lane of the warp must call it."""
    for k in range(5):
        amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 1 << k))
    _atomic_max_lane0(tamax, amax_bits, lane)


@cute.jit
def _atomic_max_lane0(tamax: cute.Tensor, amax_bits: Int32, lane: Int32):
    if lane == 0:
        cute.arch.atomic_max(tamax.iterator.llvm_ptr, amax_bits)
