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
7. Columnwise: the same rules on blocks of 16 rows *per group* of ``group_sizes`` (a group's last block
   may be partial), with the same ``g``; data: packed E2M1 of ``x2d.T``, ``(K, ceil(M/2))`` (an odd M
   leaves the last high nibble 0); scales k-block-major ``(ceil(M/16) + G, K)``. Any row count.
"""

from __future__ import annotations

import torch

from ._common import check_group_sizes, check_input, finite_amax, to_2d_float32
from .blocks import block_max, columnwise_blocks, unused_block_value
from .formats import (decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, pack_fp4, unpack_fp4,
                      E4M3_NAN)

__all__ = ["NVFP4_BLOCK", "NVFP4_GLOBAL_DIVISOR", "nvfp4_global_scale", "nvfp4_quantize_2d",
           "nvfp4_dequantize_2d", "nvfp4_quantize_columnwise", "nvfp4_dequantize_columnwise",
           "quantize_nvfp4"]

NVFP4_BLOCK = 16
NVFP4_GLOBAL_DIVISOR = 448.0 * 6.0  # 2688


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``g = amax / 2688`` in float32 (a true division), or 1 where that is 0."""
    amax = amax.to(torch.float32)
    g = torch.div(amax, torch.full_like(amax, NVFP4_GLOBAL_DIVISOR))
    return torch.where(g == 0, torch.ones_like(g), g)


def _encode_elements(x: torch.Tensor, s_code: torch.Tensor, g: torch.Tensor, spread) -> torch.Tensor:
    """E2M1 codes of ``x`` given per-block E4M3 scale codes; ``spread`` maps a block tensor to x's shape."""
    s_dec = decode_e4m3(s_code)
    denom = spread(s_dec * g.expand_as(s_dec))
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scaled = torch.where(denom > 0, torch.div(x, safe), x * 0.0)
    return encode_e2m1(scaled)


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
    codes = _encode_elements(xb, s_code, g, lambda b: b.unsqueeze(-1).expand_as(xb))
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


def nvfp4_quantize_columnwise(x2d: torch.Tensor, global_scale: torch.Tensor, group_sizes=None):
    """Columnwise NVFP4 of ``x2d`` (``(M, K)``, any M): 16-row blocks per group of ``group_sizes``.

    Returns ``(data, scale)``: ``data`` uint8 ``(K, ceil(M/2))``, the packed E2M1 codes of ``x2d.T`` (row
    ``k`` holds column ``k`` of ``x2d``, element ``2j`` in the low nibble; an odd M leaves the last high
    nibble 0); ``scale`` uint8 E4M3, k-block-major ``(ceil(M/16) + G, K)``; unused capacity is byte 0.
    """
    M, K = x2d.shape
    x = x2d.to(torch.float32)
    g = global_scale.to(device=x.device, dtype=torch.float32)
    blocks = columnwise_blocks(M, NVFP4_BLOCK, group_sizes, x.device)
    finite = torch.isfinite(x)
    block_amax = block_max(torch.where(finite, x.abs(), torch.zeros_like(x)), blocks)
    poisoned = block_max((~finite).to(torch.float32), blocks) > 0
    gb = g.expand_as(block_amax)
    s_code = encode_e4m3(torch.div(torch.div(block_amax, torch.full_like(block_amax, 6.0)), gb), saturate=True)
    codes = _encode_elements(x, s_code, g, lambda b: b[blocks.row_block])
    codes = torch.where(poisoned[blocks.row_block], torch.zeros_like(codes), codes)
    s_code = torch.where(poisoned, torch.full_like(s_code, E4M3_NAN), s_code)
    codes_t = codes.t()
    if M % 2:
        codes_t = torch.cat([codes_t, torch.zeros_like(codes_t[:, :1])], dim=1)
    return pack_fp4(codes_t).contiguous(), unused_block_value(s_code, blocks)


def nvfp4_dequantize_columnwise(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                                rows: int, group_sizes=None, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`nvfp4_quantize_columnwise`: the logical ``(rows, K)`` tensor."""
    K = data.shape[0]
    blocks = columnwise_blocks(rows, NVFP4_BLOCK, group_sizes, data.device)
    vals = decode_e2m1(unpack_fp4(data)[:, :rows]).t()
    g = global_scale.to(device=vals.device, dtype=torch.float32)
    return ((vals * decode_e4m3(scale)[blocks.row_block]) * g).to(dtype)


def quantize_nvfp4_buffers(x: torch.Tensor, columnwise: bool = True, group_sizes=None,
                           op_name: str = "QuantizeNVFP4"):
    """All buffers of the NVFP4 quantization of ``x``: a dict with ``data, scale, amax`` and
    ``columnwise_data, columnwise_scale`` (``None`` unless ``columnwise``)."""
    M, K = check_input(x, op_name, "NVFP4", NVFP4_BLOCK)
    check_group_sizes(group_sizes, x, op_name)
    x2d = to_2d_float32(x, M, K)
    amax = finite_amax(x2d)
    g = nvfp4_global_scale(amax)
    data, scale = nvfp4_quantize_2d(x2d, g)
    cw_data = cw_scale = None
    if columnwise:
        cw_data, cw_scale = nvfp4_quantize_columnwise(x2d, g, group_sizes)
    return dict(data=data, scale=scale, amax=amax, columnwise_data=cw_data, columnwise_scale=cw_scale)


def dequantize_nvfp4_buffers(data, scale, amax, M, K, columnwise, group_sizes):
    """The float32 ``(M, K)`` value of the rowwise or the columnwise buffers."""
    g = nvfp4_global_scale(amax)
    if columnwise:
        return nvfp4_dequantize_columnwise(data, scale, g, M, group_sizes)
    return nvfp4_dequantize_2d(data, scale, g)
