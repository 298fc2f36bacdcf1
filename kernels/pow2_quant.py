"""Exact power-of-two-scaled E4M3 quantization of fp32 values in registers (trace time, ``cutlass`` values).

The pieces every E4M3 encoder of ours shares, so that the MXFP8 epilogue store (kernels/mxfp8_store.py) and
the FP8-block quantize kernel (kernels/fp8_quantize.py) apply the one rule of docs/quantization.md, which
``fusion.quant`` (mxfp8.py, fp8_block.py) implements in torch:

* a block's amax is the integer max of the ``|x|`` bit patterns over its *finite* elements
  (:func:`finite_abs_bits`); for non-negative floats the bit order is the value order, so no float max and
  no NaN propagation;
* the scale exponent ``e = ceil(log2(amax / 448))`` comes exactly from the amax bits
  (:func:`e8m0_scale_bits`; FP8-block's zero block has scale 1: :func:`fp8_block_scale_bits`);
* an element is ``E4M3_RNE(x * 2^-e)`` with ``2^-e`` built from bits (the product is exact), converted with
  ``cvt.rn.satfinite.e4m3x2``. That saturates ``±Inf`` to ``±448``, so NaN and ``±Inf`` are replaced by a
  quiet NaN first (:func:`scaled_or_nan`), which converts to E4M3 NaN ``0x7F``.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm

from .fragment_io import bits_f32, f32_bits, unpack2

#: fp32 bits of 1.0: FP8-block's scale of an all-zero block
_ONE_BITS = 0x3F800000
#: fp32 bits of 2^-127 (a subnormal): the smallest scale
_MIN_SCALE_BITS = 0x00400000


def finite_abs_bits(y):
    """``(|y| bits, finite?)`` of an fp32 value: the bits feed a block's integer amax (0 where not finite)."""
    bits = f32_bits(y) & 0x7FFFFFFF
    fin = bits < 0x7F800000
    return cutlass.select_(fin, bits, Int32(0)), fin


def finite_abs2_bf16(word):
    """Two bf16 values packed in a word (fragment_io.pack2) -> ``(magnitudes, clean word)``: the halves' ``|x|`` bits
    with every non-finite half 0 (what :func:`max2_u16` folds into a block's amax, as :func:`finite_abs_bits` for
    one fp32 value), and the word with every non-finite half (±Inf, NaN of either sign) replaced by the quiet NaN
    ``0x7FC0``, so that ``value * 2^-e`` converts to E4M3 NaN ``0x7F`` with no per-value test
    (:func:`scaled_or_nan`'s select). Five integer instructions a pair, where the fp32 tests take about four a
    value: a magnitude plus ``0x80`` carries into its half's top bit exactly where it is ``>= 0x7F80`` (no carry
    crosses into the other half), and ``prmt``'s sign replication spreads that bit over the half."""
    mag = word & 0x7FFF7FFF
    flag = Int32(llvm.inline_asm(Int32.mlir_type, [Int32(mag + 0x00800080).ir_value()],
                                 "prmt.b32 $0, $1, 0, 0xBB99;", "=r,r"))
    keep = flag ^ -1
    return mag & keep, (word & keep) | (flag & 0x7FC07FC0)


def max2_u16(a, b) -> Int32:
    """The halfwise unsigned max of two words (``max.u16x2``, sm_90): a running max of two bf16 magnitudes."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(a).ir_value(), Int32(b).ir_value()],
                                 "max.u16x2 $0, $1, $2;", "=r,r,r"))


def bf16_pair_amax_bits(run):
    """A running :func:`max2_u16` of bf16 magnitudes as the fp32 bits of its larger half (a bf16 value's fp32 bits
    are its 16 bits shifted up), what :func:`fp8_block_scale_bits` takes."""
    return cutlass.max(run & 0xFFFF, (run >> 16) & 0xFFFF) << 16


def clean_bf16_words(words, run=None):
    """:func:`finite_abs2_bf16` over a row's words: ``(run, clean words)``, ``run`` the halfwise :func:`max2_u16` of
    their finite magnitudes (folded into ``run`` when given; :func:`bf16_pair_amax_bits` makes it fp32 amax bits)."""
    run = Int32(0) if run is None else run
    clean = []
    for word in words:
        mag, word = finite_abs2_bf16(word)
        clean.append(word)
        run = max2_u16(run, mag)
    return run, clean


def scaled_clean_pair(word, inv_scale) -> list:
    """A clean word's two bf16 values times ``2^-e``: what converts to their E4M3 codes (its non-finite halves are
    +NaN already, so no per-value test)."""
    return [y * inv_scale for y in unpack2(word, cutlass.BFloat16)]


def scaled_or_nan(y, fin, inv_scale):
    """``y * 2^-e`` for a finite ``y``, a quiet NaN otherwise (E4M3 NaN ``0x7F`` once converted, where the
    saturating conversion would turn ``±Inf`` into ``±448``)."""
    return Float32(cutlass.select_(fin, y * inv_scale, bits_f32(Int32(0x7FFFFFFF))))


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


def fp8_block_scale_bits(bits):
    """FP8-block's scale from the amax's fp32 bits: ``2^e`` as fp32 bits (``e`` as in :func:`e8m0_scale_bits`;
    ``e = -127`` is the subnormal ``0x00400000``) and ``2^-e`` as fp32; an all-zero block (amax bits 0) has
    scale 1.0 (its finite elements are zeros, which any ``2^-e`` keeps, sign included)."""
    e8, inv = e8m0_scale_bits(bits)
    scale = cutlass.select_(e8 == 0, Int32(_MIN_SCALE_BITS), e8 << 23)
    return cutlass.select_(bits == 0, Int32(_ONE_BITS), scale), inv


def pack4_e4m3(v0, v1, v2, v3) -> Int32:
    """Four fp32 values as one word of E4M3 codes (v0 in the low byte): two ``cvt.rn.satfinite.e4m3x2.f32`` (the
    conversion of every encoder here) and one move, where converting a value at a time spends a pair conversion
    and merge instructions on each value."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Float32(v).ir_value() for v in (v0, v1, v2, v3)],
        "{ .reg .b16 l, h; cvt.rn.satfinite.e4m3x2.f32 l, $2, $1; cvt.rn.satfinite.e4m3x2.f32 h, $4, $3; "
        "mov.b32 $0, {l, h}; }", "=r,f,f,f,f"))
