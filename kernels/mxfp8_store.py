"""Exact MXFP8 quantization of the epilogue's values in registers (rowwise, 32-column blocks).

The rule is docs/quantization.md's, applied to the value rounded to the GEMM dtype (what a high-precision
``Output`` of the same value stores), so ``fusion.quant.mxfp8.mxfp8_quantize_2d(hp.float())`` reproduces
the bytes: block amax over the finite elements only (integer max of the |x| bit patterns), the scale
exponent from the amax bits, elements = RNE_e4m3(x * 2^-e) with 2^-e built from bits (exact), NaN and
+-Inf -> 0x7F. bf16 values go a packed pair at a time (``clean``: pow2_quant.finite_abs2_bf16, as the FP8-block
store's since session z), other dtypes a value at a time.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .fp8_block_store import store_chunk_group
from .fragment_io import pack2, store2_rc, store_byte
from .pow2_quant import bf16_pair_amax_bits, clean_bf16_words, e8m0_scale_bits, finite_abs_bits, scaled_clean_pair, \
    scaled_or_nan

__all__ = ["store_mxfp8", "e8m0_scale_bits"]


def store_mxfp8(res, lcols, oks, t, ts, grow, ab_dtype, clean=False, sectors=True):
    """Trace time.  ``res[c][v]``: fp32 values of logical columns ``lcols[c] + v`` of row ``grow``.
    A 32-column block = 4 consecutive 8-column chunks; each quad of lanes holds its 32 values (2 per chunk
    per lane), so the block amax is a 2-step butterfly over the quad. Writes e4m3 pairs to ``t`` and the
    E8M0 scale byte (lane 0 of the quad) to ``ts``. ``clean`` (bf16 only): each chunk's pair rounded and packed
    into one word whose non-finite halves and share of the amax take a few integer instructions, and (``sectors``)
    the block's codes stored as one 32-byte sector, 8 bytes a lane (False: 2 bytes a lane and chunk, the A/B build
    of bench/probes/mxfp8_store_ab.py)."""
    n_c = len(res)
    assert n_c % 4 == 0
    assert not clean or ab_dtype is cutlass.BFloat16, "clean words are bf16 pairs"
    for b in range(n_c // 4):
        chunks = range(4 * b, 4 * b + 4)
        if clean:
            run, words = clean_bf16_words(pack2(res[c][0], res[c][1], ab_dtype) for c in chunks)
            amax_bits = bf16_pair_amax_bits(run)
        else:
            ys = {}
            amax_bits = Int32(0)
            for c in chunks:
                for v in range(2):
                    y = Float32(Float32(res[c][v]).to(ab_dtype))       # round to the GEMM dtype and back
                    bits, fin = finite_abs_bits(y)
                    ys[(c, v)] = (y, fin)
                    amax_bits = cutlass.max(amax_bits, bits)
        amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 1))
        amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 2))
        e8, inv_scale = e8m0_scale_bits(amax_bits)
        if clean and sectors:
            # non-finite values are +NaN already (E4M3 NaN 0x7F); the block's 32 codes leave as one whole sector, the
            # quad's lanes each storing 8 bytes of one chunk (fp8_block_store.store_chunk_group) where 2-byte stores
            # wrote each sector in four pieces
            codes = [scaled_clean_pair(w, inv_scale) for w in words]
            store_chunk_group(t, grow, lcols[4 * b], codes, [oks[c] for c in chunks], cute.arch.lane_idx() & 3)
        elif clean:
            for w, c in zip(words, chunks):
                q = scaled_clean_pair(w, inv_scale)
                store2_rc(t, grow, lcols[c], q[0], q[1], cutlass.Float8E4M3FN, oks[c])
        else:
            for c in chunks:
                q = [scaled_or_nan(y, fin, inv_scale) for y, fin in (ys[(c, 0)], ys[(c, 1)])]
                store2_rc(t, grow, lcols[c], q[0], q[1], cutlass.Float8E4M3FN, oks[c])
        # lane 0 of the quad writes the scale byte
        first = lcols[4 * b]
        store_byte(ts, grow, first // 32, e8, oks[4 * b] & ((first % 32) == 0))
