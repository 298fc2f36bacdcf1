"""Exact FP8-block quantization of an epilogue row's values in registers (rowwise: one 128-column block).

The rule is docs/quantization.md's ("FP8-block"), applied to the value rounded to the GEMM dtype (what a
high-precision ``Output`` of the same value stores), so ``fusion.quant.fp8_block_quantize_2d(hp)`` reproduces
the bytes: the block amax over the finite elements only (integer max of the ``|x|`` bit patterns), the power-of-
two scale from the amax bits (an all-zero block: 1.0), elements ``RNE_e4m3(x * 2^-e)`` with ``2^-e`` built from
bits (exact), NaN and ``±Inf`` -> ``0x7F`` (kernels/pow2_quant.py, the pieces the quantize kernel shares).

Where a row's block lies: the logical tile is 128 columns wide (a gated FP8 tile of 128 x 256, walked as two
n-waves, or a plain 128-column one), so one accumulator row of the tile is the whole block, spread over the four
lanes of a quad (2 values per 8-column chunk per lane): the block amax is a 2-step butterfly over the quad. The
codes leave in whole 32-byte sectors: per group of four chunks, two more butterflies give each lane of the quad one
whole chunk, stored as 8 bytes (2-byte stores per chunk measured 12-15% off the kernel's bf16 store on an H100).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm

from .epilogue import FP8BlockOutput
from .fragment_io import bits_f32, f32_bits, pack2, store2, store4_run, unpack2
from .pow2_quant import bf16_pair_amax_bits, clean_bf16_words, finite_abs2_bf16, finite_abs_bits, \
    fp8_block_scale_bits, max2_u16, scaled_clean_pair, scaled_or_nan

__all__ = ["lane_amax", "lane_amax_clean", "clean_words", "rounded", "store_fp8_block_row", "store_fp8_block_halves",
           "store_fp8_block_dequantized_row", "store_block_scale", "warp_amax_to", "decode_e4m3", "round_trip2_e4m3",
           "store_chunk_group"]

FP8 = cutlass.Float8E4M3FN


def _in_gemm_dtype(item, ab_dtype) -> list:
    """A chunk's two values in the GEMM dtype, as float32: an item is a packed word (fragment_io.pack2) or a pair
    already rounded (:func:`rounded`)."""
    return list(item) if isinstance(item, (list, tuple)) else list(unpack2(item, ab_dtype))


def rounded(pairs, ab_dtype) -> list:
    """A row's float32 results (``pairs[c]``: chunk c's two) rounded to the GEMM dtype, once: the items of a caller
    that keeps its row in float32 (FC1's store: packing there cost its kernel 248 more instructions, 3248 against
    3000, the unpacking done twice)."""
    return [[Float32(Float32(v).to(ab_dtype)) for v in pair] for pair in pairs]


def lane_amax(items, oks, ab_dtype, amax_bits=None):
    """The running max of the finite ``|value|`` bits of this lane's stored (``oks``) values: ``items[c]``, chunk c's
    two values in the GEMM dtype (:func:`_in_gemm_dtype`). A caller that has a row's chunks batch by batch folds
    each batch in as it comes (``amax_bits``: the max so far), so the block's reduction needs no second pass over
    the row (a dgrad writing a quantized and a dequantized row spilled with one)."""
    amax_bits = Int32(0) if amax_bits is None else amax_bits
    for c, item in enumerate(items):
        for y in _in_gemm_dtype(item, ab_dtype):
            bits, _ = finite_abs_bits(y)
            amax_bits = cutlass.max(amax_bits, cutlass.select_(oks[c], bits, Int32(0)))
    return amax_bits


def clean_words(ab_dtype) -> bool:
    """Whether a row's pending values wait as *clean* packed words (:func:`lane_amax_clean`): bf16 ones, whose
    non-finite halves and block amax take a few integer instructions a pair (pow2_quant.finite_abs2_bf16)."""
    return ab_dtype is cutlass.BFloat16


def lane_amax_clean(words, oks, run=None):
    """:func:`lane_amax` over bf16 words (fragment_io.pack2), a pair at a time: returns ``(run, clean words)``, the
    running halfwise max of the stored (``oks``) finite magnitudes (pow2_quant.max2_u16; the fp32 amax bits are
    pow2_quant.bf16_pair_amax_bits of it) and the words with their non-finite halves made +NaN, which the row's
    quantization then scales with no per-value test (:func:`_scaled` with ``clean``). A chunk's ``oks`` that are one
    value (the row's, where the columns are exact) mask the batch's max once."""
    run = Int32(0) if run is None else run
    if all(ok is oks[0] for ok in oks):
        batch, out = clean_bf16_words(words)
        return max2_u16(run, cutlass.select_(oks[0], batch, Int32(0))), out
    out, batch = [], Int32(0)
    for word, ok in zip(words, oks):
        mag, clean = finite_abs2_bf16(word)
        out.append(clean)
        batch = max2_u16(batch, cutlass.select_(ok, mag, Int32(0)))
    return max2_u16(run, batch), out


def _block_scale(items, oks, ab_dtype, amax_bits=None, clean=False):
    """``(scale bits, 2^-e, amax bits)`` of the row's block: the amax over the quad's stored finite values, from
    this lane's :func:`lane_amax` (``amax_bits``; None: computed here from ``items``) by a butterfly; ``clean``:
    ``amax_bits`` is :func:`lane_amax_clean`'s run."""
    if clean:
        assert amax_bits is not None, "clean words come with their run"
        amax_bits = bf16_pair_amax_bits(amax_bits)
    amax_bits = lane_amax(items, oks, ab_dtype) if amax_bits is None else amax_bits
    amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 1))
    amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 2))
    scale_bits, inv_scale = fp8_block_scale_bits(amax_bits)
    return scale_bits, inv_scale, amax_bits


def _scaled(item, inv_scale, ab_dtype, clean=False):
    """A chunk's two values times ``2^-e`` (NaN for a non-finite one): what converts to their E4M3 codes. ``clean``:
    the item is a word of :func:`lane_amax_clean`, whose non-finite values are already +NaN (no test needed)."""
    if clean:
        return scaled_clean_pair(item, inv_scale)
    out = []
    for y in _in_gemm_dtype(item, ab_dtype):
        _, fin = finite_abs_bits(y)
        out.append(scaled_or_nan(y, fin, inv_scale))
    return out


def store_fp8_block_row(items, lcols, oks, t, grow, ab_dtype, amax_bits=None, clean=False):
    """Trace time. ``items[c]``: logical columns ``lcols[c]``, ``lcols[c] + 1`` of row ``grow`` in the GEMM dtype
    (packed words, or :func:`rounded` pairs), every chunk of the row's 128-column block (16 chunks), ``oks[c]``
    whether chunk ``c`` is stored (row and columns in range; a masked chunk adds nothing to the amax);
    ``amax_bits``: this lane's :func:`lane_amax` of them where the caller kept it; ``clean``: the items are
    :func:`lane_amax_clean`'s words. Writes the e4m3 codes to ``t``; returns ``(scale bits, amax bits)`` of the block,
    the same in the four lanes of the quad."""
    scale_bits, inv_scale, amax_bits = _block_scale(items, oks, ab_dtype, amax_bits, clean)
    assert len(items) % 4 == 0, "the codes leave in groups of four chunks"
    quad = cute.arch.lane_idx() & 3
    for g in range(len(items) // 4):
        codes = [_scaled(items[c], inv_scale, ab_dtype, clean) for c in range(4 * g, 4 * g + 4)]
        store_chunk_group(t, grow, lcols[4 * g], codes, oks[4 * g: 4 * g + 4], quad)
    return scale_bits, amax_bits


@cute.jit
def store_fp8_block_halves(gate: list, up: list, lcols: list, oks: list, t: cute.Tensor, ts: cute.Tensor,
                           grow: Int32, scale_ok: cutlass.Boolean, n_log: Int32, amax_bits: list, amax_run: Int32,
                           ab_dtype: cutlass.Constexpr, clean: cutlass.Constexpr = False) -> Int32:
    """Trace time. A paired row's two blocks (``gate`` and ``up``: packed words of each half, as for
    :func:`store_fp8_block_row`; the up half ``n_log`` columns further; ``amax_bits``: this lane's :func:`lane_amax`
    of each), one after the other in a loop the compiler does not unroll, so one half's scaled values are live at a
    time (both at once, scheduled together, spilled); each block's scale into the k-block-major ``ts`` where
    ``scale_ok`` (lane 0 of the quad, the row in range); ``clean`` as for :func:`store_fp8_block_row`. Returns
    ``amax_run`` raised by both blocks' amax."""
    for k in cutlass.range(2, unroll=1):
        second = k == 1
        words = [cutlass.select_(second, u, g) for g, u in zip(gate, up)]
        off = cutlass.select_(second, n_log, Int32(0))
        scale_bits, block_amax = store_fp8_block_row(words, [c + off for c in lcols], oks, t, grow, ab_dtype,
                                                     cutlass.select_(second, amax_bits[1], amax_bits[0]), clean)
        store_block_scale(ts, (off + lcols[0]) // FP8BlockOutput.block, grow, scale_bits, scale_ok)
        amax_run = cutlass.max(amax_run, block_amax)
    return amax_run


def store_fp8_block_dequantized_row(words, oks, addr, ab_dtype, amax_bits=None, odd=None, hw_decode=True,
                                    clean=False):
    """Trace time. The row's block (``words`` as for :func:`store_fp8_block_row`) quantized as that function does,
    decoded again and multiplied by its scale (exact in float32, as ``fusion.quant``'s dequantize), stored in the
    GEMM dtype: ``addr`` is the byte address of this lane's pair in chunk 0; chunk ``c`` lies 8 c columns further.
    ``odd`` (the lane's parity in its quad) given: chunk pairs 4 columns per lane and store (fragment_io.store4_run:
    whole 32-byte sectors), the quad neighbours swapping a chunk's values *before* they are decoded, one chunk pair
    at a time (swapped after the decode, as fragment_io.store4_swapped does, this kernel spilled: 24 STL); None: 2
    columns per lane, as an ``Output``'s plain store. ``hw_decode``: with the 4-column stores, each pair converted
    and decoded by the hardware (:func:`round_trip2_e4m3`; Qwen3-30B-A3B's FP8 dgrad 4936 -> 3992 SASS instructions),
    else its codes decoded by integer instructions (:func:`decode_e4m3`: the A/B build); the same values. ``clean``:
    the words are :func:`lane_amax_clean`'s."""
    scale_bits, inv_scale, _ = _block_scale(words, oks, ab_dtype, amax_bits, clean)
    scale = bits_f32(scale_bits)
    eb = ab_dtype.width // 8

    # (beside 2-column stores, not the policy's, the hardware round trip spilled: a 96-byte frame on Qwen3-30B-A3B's
    # B1, tests/test_compile_plans.py; that build keeps the integer decode)
    hw_decode = hw_decode and odd is not None

    def decoded(word):
        scaled = _scaled(word, inv_scale, ab_dtype, clean)
        if hw_decode:
            lo, hi = round_trip2_e4m3(*scaled)
        else:
            code = _pack2_e4m3(*scaled)
            lo, hi = decode_e4m3(code & 0xFF), decode_e4m3((code >> 8) & 0xFF)
        return lo * scale, hi * scale

    paired = 0 if odd is None else len(words) - len(words) % 2
    for c in range(0, paired, 2):
        # the swap before the decode: the even lane takes its neighbour's chunk-c values, the odd lane its chunk-(c+1)
        # ones (the quad shares the row's scale), and each decodes the 4 columns it stores
        got = cute.arch.shuffle_sync_bfly(cutlass.select_(odd, words[c], words[c + 1]), 1)
        first = cutlass.select_(odd, got, words[c])
        second = cutlass.select_(odd, words[c + 1], got)
        store4_run(addr + 8 * c * eb, pack2(*decoded(first), ab_dtype), pack2(*decoded(second), ab_dtype), oks[c],
                   oks[c + 1], odd, eb)
    for c in range(paired, len(words)):
        store2(addr + 8 * c * eb, *decoded(words[c]), ab_dtype, oks[c])


def _pack2_e4m3(v0, v1) -> Int32:
    """Two fp32 values as E4M3 codes in the low 16 bits of a word (v0 in the low byte)."""
    return _pack4(v0, v1, Float32(0.0), Float32(0.0)) & 0xFFFF


def round_trip2_e4m3(v0, v1) -> tuple:
    """Two fp32 values converted to E4M3 (fn) codes as :func:`_pack2_e4m3` converts them (``cvt.rn.satfinite``) and
    decoded again, exact, by the hardware: ``cvt.rn.f16x2.e4m3x2`` (every E4M3 value, subnormals and signed zeros
    included, is an fp16 one; the NaN code gives NaN), each half then widened to fp32. Two conversions and two
    widenings for the pair, where :func:`decode_e4m3` spends about a dozen integer instructions a value."""
    h2 = llvm.inline_asm(Int32.mlir_type, [Float32(v0).ir_value(), Float32(v1).ir_value()],
                         "{ .reg .b16 c; cvt.rn.satfinite.e4m3x2.f32 c, $2, $1; cvt.rn.f16x2.e4m3x2 $0, c; }",
                         "=r,f,f")
    lo = llvm.inline_asm(Float32.mlir_type, [h2], "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, l; }",
                         "=f,r")
    hi = llvm.inline_asm(Float32.mlir_type, [h2], "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, h; }",
                         "=f,r")
    return Float32(lo), Float32(hi)


def decode_e4m3(code):
    """The fp32 value of an E4M3 (fn) code held in an Int32 (0..255), exact: sign, then ``(1 + m/8) 2^(e-7)``
    (e > 0), ``m 2^-9`` (e = 0, signed zero included), NaN for 0x7F / 0xFF (E4M3fn has no infinities)."""
    sign = (code & 0x80) << 24
    e = (code >> 3) & 0xF
    m = code & 0x7
    normal = sign | ((e + 120) << 23) | (m << 20)
    subnormal = sign | f32_bits(Float32(m) * Float32(2.0 ** -9))
    bits = cutlass.select_(e == 0, subnormal, normal)
    return bits_f32(cutlass.select_((code & 0x7F) == 0x7F, Int32(0x7FC00000), bits))


def _pack4(v0, v1, v2, v3) -> Int32:
    """Four fp32 values as one word of E4M3 codes (v0 in the low byte; the conversion is the MXFP8 store's)."""
    frag = cute.make_rmem_tensor((4,), FP8)
    for i, v in enumerate((v0, v1, v2, v3)):
        frag[i] = v.to(FP8)
    return cute.recast_tensor(frag, Int32)[0]


def _lo(w):
    return w & 0xFFFF


def _hi(w):
    return (w >> 16) & 0xFFFF


def store_chunk_group(t, grow, lcol0, codes, oks, quad):
    """The codes of four consecutive 8-column chunks of one row (``codes[j]``: this lane's 2 columns of chunk j,
    ``lcol0`` its first column in chunk 0) moved within the quad by two butterflies so that lane ``q`` holds all
    8 bytes of chunk ``q``, then one 8-byte store per lane: the quad writes the group's 32 bytes, a whole sector,
    where 2-byte stores per chunk would write each sector in four pieces. Every lane of the warp must call it."""
    a = (quad & 1) == 1
    b = (quad & 2) == 2
    w0 = _pack4(codes[0][0], codes[0][1], codes[1][0], codes[1][1])   # chunks 0, 1: this lane's 16-bit pairs
    w1 = _pack4(codes[2][0], codes[2][1], codes[3][0], codes[3][1])   # chunks 2, 3
    # butterfly 1 (lanes q, q ^ 2): lane q keeps the chunk pair 2b, 2b + 1 of its own and of lane q ^ 2; x holds
    # lane (q & 1)'s pair, y lane (q & 1) + 2's
    got = cute.arch.shuffle_sync_bfly(cutlass.select_(b, w0, w1), 2)
    x = cutlass.select_(b, got, w0)
    y = cutlass.select_(b, w1, got)
    # butterfly 2 (lanes q, q ^ 1): lane q keeps chunk 2b + a of x and y and gets the same chunk of its neighbour's
    mine_x = cutlass.select_(a, _hi(x), _lo(x))
    mine_y = cutlass.select_(a, _hi(y), _lo(y))
    send = cutlass.select_(a, _lo(x) | (_lo(y) << 16), _hi(x) | (_hi(y) << 16))
    got = cute.arch.shuffle_sync_bfly(send, 1)
    words = cute.make_rmem_tensor((2,), Int32)   # chunk q's columns 0-3 (lanes 0, 1) and 4-7 (lanes 2, 3)
    words[0] = cutlass.select_(a, _lo(got) | (mine_x << 16), mine_x | (_lo(got) << 16))
    words[1] = cutlass.select_(a, _hi(got) | (mine_y << 16), mine_y | (_hi(got) << 16))
    ok = cutlass.select_(quad == 0, oks[0], cutlass.select_(quad == 1, oks[1],
                                                            cutlass.select_(quad == 2, oks[2], oks[3])))
    # chunk q starts 8 q columns after chunk 0, whose first column is 2 q before this lane's lcol0
    _store8(t, grow, lcol0 + 6 * quad, words, ok)


@cute.jit
def _store8(t: cute.Tensor, row: Int32, col: Int32, words: cute.Tensor, ok: cutlass.Boolean):
    """8 bytes (two words) at ``t[row, col]`` of a row-major one-byte tensor (8-byte aligned), where ok."""
    if ok:
        off = Int64(row) * t.layout.stride[0] + Int64(col)
        p = cute.make_ptr(Int32, t.iterator.toint() + off, cute.AddressSpace.gmem, assumed_align=8)
        cute.autovec_copy(words, cute.make_tensor(p, cute.make_layout((2,))))


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
