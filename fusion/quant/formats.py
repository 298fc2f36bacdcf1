"""Exact codecs of the element and scale formats used by MXFP8 and NVFP4.

Pure torch, vectorized, any device, no host synchronisation. Every encoder returns ``torch.uint8``
codes (raw bytes); every decoder returns ``torch.float32`` and is exact (integer arithmetic on the code bits; no
cached table, so everything traces under ``torch.compile(fullgraph=True)``).

Formats
-------
* **E4M3** (OCP FP8, ``torch.float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits. No
  infinities; ``0x7F`` / ``0xFF`` are NaN; max finite 448 (``0x7E``); min normal 2^-6; subnormals
  ``m * 2^-9`` for ``m = 1..7``. Encoding rounds to nearest, ties to even (RNE).
* **E8M0** (OCP MX scale): an unsigned biased exponent, value ``2^(b - 127)`` for ``b = 0..254``;
  ``0xFF`` is NaN. ``b = 0`` is 2^-127 (a float32 subnormal, still exact).
* **E2M1** (FP4): 1 sign, 2 exponent (bias 1), 1 mantissa bit; magnitudes
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` for codes ``0..7``, bit 3 is the sign. No Inf / NaN.
  Two codes per byte: element ``2j`` in the low nibble, element ``2j + 1`` in the high nibble.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX", "E4M3_NAN", "E4M3_MIN_NORMAL", "E4M3_MIN_SUBNORMAL",
    "E2M1_MAX", "E2M1_VALUES",
    "E8M0_BIAS", "E8M0_NAN", "E8M0_MIN_EXP", "E8M0_MAX_EXP",
    "encode_e4m3", "decode_e4m3",
    "encode_e8m0", "decode_e8m0",
    "encode_e2m1", "decode_e2m1",
    "pack_fp4", "unpack_fp4",
    "float32_bits", "pow2_f32",
]

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
E4M3_MIN_NORMAL = 2.0 ** -6
E4M3_MIN_SUBNORMAL = 2.0 ** -9

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127

_F32_EXP_MASK = 0x7F800000
_F32_ABS_MASK = 0x7FFFFFFF


def float32_bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE-754 bit pattern of ``x`` (converted to float32) as a non-negative int64 tensor."""
    x32 = x.to(torch.float32)
    return x32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------
# exact powers of two
# ----------------------------------------------------------------------------------------------

def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """Exact ``2^e`` as float32 for integer tensors ``e`` in ``[-127, 127]``.

    Built from the bit pattern (no ``exp2``, whose accuracy is backend dependent): ``(e + 127) << 23``
    for ``e >= -126``, and the subnormal ``0x00400000`` for ``e = -127``.
    """
    e = e.to(torch.int32)
    bits = torch.where(e == -127, torch.full_like(e, 0x00400000), (e + 127) << 23)
    return bits.view(torch.float32)


# ----------------------------------------------------------------------------------------------
# E4M3
# ----------------------------------------------------------------------------------------------

def encode_e4m3(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """Round ``x`` (float32/bf16/fp16; converted to float32 exactly) to E4M3 codes, RNE.

    * The sign is kept for every non-NaN value, so ``-0.0`` and negative values that round to zero
      give ``0x80``.
    * NaN gives the canonical NaN ``0x7F`` whatever its sign.
    * ``saturate=False`` (default, like a ``torch.float8_e4m3fn`` cast): values whose rounded
      magnitude exceeds 448 (``|x| > 464``) and ``±Inf`` give NaN ``0x7F``.
      ``saturate=True`` (PTX ``.satfinite``): they give ``±448`` (``0x7E`` / ``0xFE``).
    """
    x32 = x.to(torch.float32)
    bits = float32_bits(x32)
    sign = (bits >> 31) & 1
    mag = bits & _F32_ABS_MASK
    a = x32.abs()
    is_nan = mag > _F32_EXP_MASK
    is_inf = mag == _F32_EXP_MASK
    is_sub = a < E4M3_MIN_NORMAL  # False for NaN
    # subnormal range: code = RNE(a * 2^9) in 0..8 (8 is the smallest normal, code 0x08); the
    # power-of-two scaling is exact, torch.round is round-half-to-even.
    a_sub = torch.where(is_sub, a, torch.zeros_like(a))
    code_sub = torch.round(a_sub * 512.0).to(torch.int64)
    # normal range: rebias the exponent (127 -> 7) and round 23 -> 3 mantissa bits with RNE;
    # a mantissa carry propagates into the exponent.
    t = mag - (120 << 23)
    code_norm = (t + 0x7FFFF + ((t >> 20) & 1)) >> 20
    code = torch.where(is_sub, code_sub, code_norm)
    overflow = (~is_sub) & (~is_nan) & ((code > 0x7E) | is_inf)
    if saturate:
        code = torch.where(overflow, torch.full_like(code, 0x7E), code)
        code = code | (sign << 7)
    else:
        code = code | (sign << 7)
        code = torch.where(overflow, torch.full_like(code, E4M3_NAN), code)
    code = torch.where(is_nan, torch.full_like(code, E4M3_NAN), code)
    return code.to(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8, or a ``torch.float8_e4m3fn`` tensor) to float32, exact."""
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    # Decoded by arithmetic, not a cached lookup table: a module-level tensor would be captured as a real
    # tensor by torch.compile ("Please convert all Tensors to FakeTensors"), and this is as fast.
    c = codes.to(torch.int32)
    e = (c >> 3) & 0xF
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).view(torch.float32)  # 1.mmm * 2^(e-7), exact
    sub = m.to(torch.float32) * E4M3_MIN_SUBNORMAL  # 0.mmm * 2^-6 = m * 2^-9, exact
    mag = torch.where(e == 0, sub, normal)
    mag = torch.where((c & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((c & 0x80) != 0, -mag, mag)


# ----------------------------------------------------------------------------------------------
# E8M0
# ----------------------------------------------------------------------------------------------

def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents to E8M0 codes ``exponent + 127``, clamped to ``[-127, 127]`` (0..254)."""
    e = exponent.to(torch.int64).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return (e + E8M0_BIAS).to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes to float32 ``2^(code - 127)`` (``0xFF`` -> NaN), exact."""
    if codes.dtype != torch.uint8 and codes.is_floating_point():
        codes = codes.view(torch.uint8)  # e.g. torch.float8_e8m0fnu
    b = codes.to(torch.int32)
    value = pow2_f32(b - E8M0_BIAS)  # b = 0 is 2^-127, a float32 subnormal
    return torch.where(b == E8M0_NAN, torch.full_like(value, float("nan")), value)


# ----------------------------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------------------------

def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to E2M1 codes (uint8 in ``0..15``), RNE, saturating (PTX ``.satfinite``).

    Ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    ``|x| > 5`` and ``±Inf`` give ``±6``. The sign bit (bit 3) follows the sign of ``x``
    (``-0.0`` and small negatives give ``0x8``). E2M1 has no NaN: NaN gives ``0x0`` (callers must
    handle NaN themselves; NVFP4 marks the block's scale NaN).
    """
    x32 = x.to(torch.float32)
    a = x32.abs()
    # The decision thresholds are the midpoints; ">" sends a tie down, ">=" sends it up, chosen so
    # that every tie lands on the even code.
    idx = ((a > 0.25).to(torch.int64) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = ((float32_bits(x32) >> 31) & 1) << 3
    code = idx | sign
    code = torch.where(torch.isnan(x32), torch.zeros_like(code), code)
    return code.to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits used) to float32, exact."""
    c = codes.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    # e == 0: 0 or 0.5 (subnormal); else (1 + m/2) * 2^(e-1) = (2 + m) * 2^e / 4, all exact
    mag = torch.where(e == 0, m * 0.5, (2.0 + m) * (1 << e).to(torch.float32) * 0.25)
    return torch.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes ``(..., 2n)`` into bytes ``(..., n)``: element ``2j`` in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {codes.shape[-1]} is odd; FP4 packs two elements per byte")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: bytes ``(..., n)`` to codes ``(..., 2n)`` (uint8)."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
