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

from .fragment_io import bits_f32, f32_bits

#: fp32 bits of 1.0: FP8-block's scale of an all-zero block
_ONE_BITS = 0x3F800000
#: fp32 bits of 2^-127 (a subnormal): the smallest scale
_MIN_SCALE_BITS = 0x00400000


def finite_abs_bits(y):
    """``(|y| bits, finite?)`` of an fp32 value: the bits feed a block's integer amax (0 where not finite)."""
    bits = f32_bits(y) & 0x7FFFFFFF
    fin = bits < 0x7F800000
    return cutlass.select_(fin, bits, Int32(0)), fin


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
