"""MXFP8: E4M3 elements with one E8M0 (power-of-two) scale per 32 consecutive elements.

Rules (the reference the fused kernels are tested against; see ``docs/quantization.md``):

* Blocks are 32 consecutive elements of a row of the 2-D view ``(M, K)`` of the input (leading dims
  flattened). ``K % 32 == 0`` is required.
* ``block_amax`` = max ``|x|`` over the block's *finite* elements (NaN and ±Inf are ignored; 0 if none).
* Scale exponent ``e = ceil(log2(block_amax / 448))`` computed exactly from the float32 bits of
  ``block_amax`` (no float log2): with ``block_amax = 1.f * 2^E``, ``e = E - 8 + (f > 0.75)``. So
  ``block_amax = 448 * 2^k`` gives exactly ``k``. ``block_amax == 0`` (and float32 subnormals)
  gives the smallest scale 2^-127, E8M0 byte 0. ``e`` is clamped to ``[-127, 127]``.
  (Transformer Engine's rounded-up "no saturation" convention; TE computes ``block_amax * (1/448)``
  in float32 before rounding the exponent up, which can differ from the exact ceil when
  ``block_amax`` is within a float32 ulp of ``448 * 2^k``.)
* Elements: ``E4M3_RNE(x * 2^-e)``; the scaling is exact and ``|x * 2^-e| <= 448`` so nothing
  saturates. NaN and ±Inf elements encode as E4M3 NaN ``0x7F``; they do not affect the scale.
* Dequantize: ``decode_e4m3(code) * 2^e`` in float32 (exact), then cast to the requested dtype.
* Columnwise: the same rules applied to the transpose ``x2d.T`` (``(K, M)``; blocks of 32 rows of
  ``x2d``), requiring ``M % 32 == 0``.
"""

from __future__ import annotations

import torch

from ._common import check_input, to_2d_float32
from .formats import decode_e4m3, decode_e8m0, encode_e4m3, encode_e8m0, float32_bits

__all__ = ["MXFP8_BLOCK", "mxfp8_scale_exponent", "mxfp8_quantize_2d", "mxfp8_dequantize_2d",
           "quantize_mxfp8"]

MXFP8_BLOCK = 32


def mxfp8_scale_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(block_amax / 448))`` clamped to ``[-127, 127]`` (int64); 0 -> -127.

    ``block_amax`` must be finite and non-negative (float32/bf16/fp16).
    """
    bits = float32_bits(block_amax) & 0x7FFFFFFF
    biased = bits >> 23
    frac = bits & 0x7FFFFF
    # block_amax = 1.f * 2^(biased-127); 448 = 1.75 * 2^8; 1.f / 1.75 is in (0.57, 1] iff f <= 0.75
    e = biased - 127 - 8 + (frac > 0x600000).to(torch.int64)
    # zero and float32 subnormals (< 2^-126, so block_amax / 448 < 2^-134): the smallest scale
    e = torch.where(biased == 0, torch.full_like(e, -127), e)
    return e.clamp(-127, 127)


def _pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """Exact 2^e as float64 for integer tensors e in [-1022, 1023]."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def mxfp8_quantize_2d(x2d: torch.Tensor):
    """Rowwise MXFP8 of a 2-D tensor ``(M, K)``, ``K % 32 == 0``.

    Returns ``(data, scale)``: ``data`` uint8 E4M3 codes ``(M, K)``, ``scale`` uint8 E8M0 codes
    ``(M, K // 32)``.
    """
    M, K = x2d.shape
    xb = x2d.to(torch.float32).reshape(M, K // MXFP8_BLOCK, MXFP8_BLOCK)
    finite = torch.isfinite(xb)
    mag = torch.where(finite, xb.abs(), torch.zeros_like(xb))
    if xb.numel():
        block_amax = mag.amax(dim=-1)
    else:
        block_amax = torch.zeros(xb.shape[:-1], dtype=torch.float32, device=xb.device)
    e = mxfp8_scale_exponent(block_amax)
    # exact scaling in float64; the float32 conversion only rounds values below 2^-126, which are
    # far below E4M3's smallest subnormal and encode as (signed) zero either way.
    scaled = (xb.to(torch.float64) * _pow2_f64(-e).unsqueeze(-1)).to(torch.float32)
    data = encode_e4m3(scaled).reshape(M, K)
    return data, encode_e8m0(e)


def mxfp8_dequantize_2d(data: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`mxfp8_quantize_2d`: ``decode_e4m3(data) * decode_e8m0(scale)`` (exact
    in float32), cast to ``dtype``."""
    M, K = data.shape
    vals = decode_e4m3(data).reshape(M, K // MXFP8_BLOCK, MXFP8_BLOCK)
    out = (vals * decode_e8m0(scale).unsqueeze(-1)).reshape(M, K)
    return out.to(dtype)


def quantize_mxfp8_buffers(x: torch.Tensor, columnwise: bool = True, op_name: str = "QuantizeMXFP8"):
    """All buffers of the MXFP8 quantization of ``x``: a dict with ``data, scale, amax`` and
    ``columnwise_data, columnwise_scale`` (``None`` unless ``columnwise``)."""
    from ._common import finite_amax

    M, K = check_input(x, op_name, "MXFP8", MXFP8_BLOCK, columnwise)
    x2d = to_2d_float32(x, M, K)
    data, scale = mxfp8_quantize_2d(x2d)
    cw_data = cw_scale = None
    if columnwise:
        cw_data, cw_scale = mxfp8_quantize_2d(x2d.t().contiguous())
    return dict(data=data, scale=scale, amax=finite_amax(x2d),
                columnwise_data=cw_data, columnwise_scale=cw_scale)


def quantize_mxfp8(x: torch.Tensor, columnwise: bool = True):
    """Quantize ``x`` to MXFP8; returns a :class:`~fusion.quant.QuantizedTensor` (straight-through
    gradient). Raises :class:`~fusion.quant.QuantizationError` on a bad shape or dtype."""
    from .tensor import quantize

    return quantize(x, "mxfp8", columnwise=columnwise)
