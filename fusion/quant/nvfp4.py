"""NVFP4: E2M1 elements (two per byte), one E4M3 scale per 16 elements, one FP32 global scale.

Rules (float32 arithmetic, IEEE round-to-nearest-even for every operation; every division is a true
division, never a multiplication by a reciprocal; see ``docs/quantization.md``):

1. ``amax`` = max ``|x|`` over the finite elements of the whole tensor (0 if none).
2. ``global_scale g = amax / 2688`` (2688 = 448 * 6); if that is 0 (amax == 0, or underflow),
   ``g = 1``.
3. Per block of 16 consecutive elements of a row: ``block_amax`` over the finite elements;
   ``s = E4M3_RNE_SATFINITE((block_amax / 6) / g)`` (two divisions, left to right), stored as an
   E4M3 byte; ``s_dec = decode_e4m3(s)``.
4. ``denom = s_dec * g``; element code ``E2M1_RNE_SATFINITE(x / denom)``. If ``denom == 0`` (the
   block scale rounded to zero) every element of the block encodes as a signed zero.
5. A block holding any NaN or ±Inf gets the E4M3 NaN scale ``0x7F`` and all-zero element codes:
   its 16 elements dequantize to NaN (E2M1 cannot represent NaN).
6. Dequantize: ``(decode_e2m1(code) * s_dec) * g`` in float32 (the first product is exact), then
   cast to the requested dtype.
7. Columnwise: the same rules on the transpose (blocks of 16 rows), with the same ``g``.
"""

from __future__ import annotations

import torch

from ._common import check_input, finite_amax, to_2d_float32
from .formats import (decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, pack_fp4, unpack_fp4,
                      E4M3_NAN)

__all__ = ["NVFP4_BLOCK", "NVFP4_GLOBAL_DIVISOR", "nvfp4_global_scale", "nvfp4_quantize_2d",
           "nvfp4_dequantize_2d", "quantize_nvfp4"]

NVFP4_BLOCK = 16
NVFP4_GLOBAL_DIVISOR = 448.0 * 6.0  # 2688


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``g = amax / 2688`` in float32 (a true division), or 1 where that is 0."""
    amax = amax.to(torch.float32)
    g = torch.div(amax, torch.full_like(amax, NVFP4_GLOBAL_DIVISOR))
    return torch.where(g == 0, torch.ones_like(g), g)


def nvfp4_quantize_2d(x2d: torch.Tensor, global_scale: torch.Tensor):
    """Rowwise NVFP4 of a 2-D tensor ``(M, K)``, ``K % 16 == 0``, with the given global scale.

    Returns ``(data, scale)``: ``data`` uint8 ``(M, K // 2)`` (two E2M1 codes per byte, element
    ``2j`` in the low nibble), ``scale`` uint8 E4M3 codes ``(M, K // 16)``.
    """
    M, K = x2d.shape
    xb = x2d.to(torch.float32).reshape(M, K // NVFP4_BLOCK, NVFP4_BLOCK)
    g = global_scale.to(device=xb.device, dtype=torch.float32)
    finite = torch.isfinite(xb)
    poisoned = ~finite.all(dim=-1) if xb.numel() else torch.zeros(xb.shape[:-1], dtype=torch.bool,
                                                                   device=xb.device)
    mag = torch.where(finite, xb.abs(), torch.zeros_like(xb))
    if xb.numel():
        block_amax = mag.amax(dim=-1)
    else:
        block_amax = torch.zeros(xb.shape[:-1], dtype=torch.float32, device=xb.device)
    gb = g.expand_as(block_amax)
    s_f32 = torch.div(torch.div(block_amax, torch.full_like(block_amax, 6.0)), gb)
    s_code = encode_e4m3(s_f32, saturate=True)
    s_dec = decode_e4m3(s_code)
    denom = (s_dec * gb).unsqueeze(-1).expand_as(xb)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scaled = torch.where(denom > 0, torch.div(xb, safe), xb * 0.0)
    codes = encode_e2m1(scaled)
    codes = torch.where(poisoned.unsqueeze(-1), torch.zeros_like(codes), codes)
    s_code = torch.where(poisoned, torch.full_like(s_code, E4M3_NAN), s_code)
    return pack_fp4(codes.reshape(M, K)), s_code


def nvfp4_dequantize_2d(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                        dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`nvfp4_quantize_2d`: ``(e2m1 * s_dec) * g`` in float32, cast to ``dtype``."""
    M = data.shape[0]
    K = data.shape[1] * 2
    vals = decode_e2m1(unpack_fp4(data)).reshape(M, K // NVFP4_BLOCK, NVFP4_BLOCK)
    g = global_scale.to(device=vals.device, dtype=torch.float32)
    out = (vals * decode_e4m3(scale).unsqueeze(-1)) * g
    return out.reshape(M, K).to(dtype)


def quantize_nvfp4_buffers(x: torch.Tensor, columnwise: bool = True, op_name: str = "QuantizeNVFP4"):
    """All buffers of the NVFP4 quantization of ``x``: a dict with ``data, scale, amax`` and
    ``columnwise_data, columnwise_scale`` (``None`` unless ``columnwise``)."""
    M, K = check_input(x, op_name, "NVFP4", NVFP4_BLOCK, columnwise)
    x2d = to_2d_float32(x, M, K)
    amax = finite_amax(x2d)
    g = nvfp4_global_scale(amax)
    data, scale = nvfp4_quantize_2d(x2d, g)
    cw_data = cw_scale = None
    if columnwise:
        cw_data, cw_scale = nvfp4_quantize_2d(x2d.t().contiguous(), g)
    return dict(data=data, scale=scale, amax=amax, columnwise_data=cw_data, columnwise_scale=cw_scale)


def quantize_nvfp4(x: torch.Tensor, columnwise: bool = True):
    """Quantize ``x`` to NVFP4; returns a :class:`~fusion.quant.QuantizedTensor` (straight-through
    gradient). Raises :class:`~fusion.quant.QuantizationError` on a bad shape or dtype."""
    from .tensor import quantize

    return quantize(x, "nvfp4", columnwise=columnwise)
