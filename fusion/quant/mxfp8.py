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
* Columnwise: the same rules on blocks of 32 rows of ``x2d`` *per group* of ``group_sizes`` (a group's
  last block may be partial); data ``(K, M)``, scales k-block-major ``(ceil(M/32) + G, K)``
  (``fusion/quant/blocks.py``). Any row count.
"""

from __future__ import annotations

import torch

from ._common import check_group_sizes, check_input, finite_amax, to_2d_float32
from .blocks import columnwise_blocks, pow2_columnwise_quantize, unused_block_value
from .formats import decode_e4m3, decode_e8m0, encode_e4m3, encode_e8m0, float32_bits, pow2_f32

__all__ = ["MXFP8_BLOCK", "mxfp8_scale_exponent", "mxfp8_quantize_2d", "mxfp8_dequantize_2d",
           "mxfp8_quantize_columnwise", "mxfp8_dequantize_columnwise", "quantize_mxfp8"]

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


def mxfp8_quantize_2d(x2d: torch.Tensor):
    """Rowwise MXFP8 of a 2-D tensor ``(M, K)``, ``K % 32 == 0``.

    Returns ``(data, scale)``: ``data`` uint8 E4M3 codes ``(M, K)``, ``scale`` uint8 E8M0 codes
    ``(M, K // 32)``.
    """
    M, K = x2d.shape
    x = x2d.to(torch.float32)
    mag = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    block_amax = mag.reshape(M, K // MXFP8_BLOCK, MXFP8_BLOCK).amax(dim=-1)
    e = mxfp8_scale_exponent(block_amax)
    # x * 2^-e in float32: 2^-e is exact (e in [-127, 127]) and the product is the correctly rounded exact
    # product; it only rounds when it falls below 2^-126, far below E4M3's smallest subnormal, where it
    # encodes as (signed) zero either way. Each column reads its block's exponent by index (a 3-D
    # (M, K/32, 32) broadcast here trips an inductor CPU loop-split assertion in some fusions, torch 2.13).
    scaled = x * pow2_f32(-e)[:, _block_of_column(K, x.device)]
    return encode_e4m3(scaled), encode_e8m0(e)


def _block_of_column(K: int, device) -> torch.Tensor:
    return torch.arange(K, device=device) // MXFP8_BLOCK


def mxfp8_dequantize_2d(data: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`mxfp8_quantize_2d`: ``decode_e4m3(data) * decode_e8m0(scale)`` (exact
    in float32), cast to ``dtype``."""
    M, K = data.shape
    return (decode_e4m3(data) * decode_e8m0(scale)[:, _block_of_column(K, data.device)]).to(dtype)


def mxfp8_quantize_columnwise(x2d: torch.Tensor, group_sizes=None):
    """Columnwise MXFP8 of ``x2d`` (``(M, K)``, any M): 32-row blocks per group of ``group_sizes``.

    Returns ``(data, scale)``: ``data`` uint8 E4M3 codes of ``x2d.T``, ``(K, M)``; ``scale`` uint8 E8M0
    codes, k-block-major ``(ceil(M/32) + G, K)``: ``scale[b, k]`` scales the rows of block ``b`` in column
    ``k``; unused capacity is byte 0.
    """
    data, e, blocks = pow2_columnwise_quantize(x2d, MXFP8_BLOCK, group_sizes, mxfp8_scale_exponent)
    return data, unused_block_value(encode_e8m0(e), blocks)


def mxfp8_dequantize_columnwise(data: torch.Tensor, scale: torch.Tensor, group_sizes=None,
                                dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`mxfp8_quantize_columnwise`: the logical ``(M, K)`` tensor (exact in float32)."""
    K, M = data.shape
    blocks = columnwise_blocks(M, MXFP8_BLOCK, group_sizes, data.device)
    return (decode_e4m3(data).t() * decode_e8m0(scale)[blocks.row_block]).to(dtype)


def quantize_mxfp8_buffers(x: torch.Tensor, columnwise: bool = True, group_sizes=None,
                           op_name: str = "QuantizeMXFP8"):
    """All buffers of the MXFP8 quantization of ``x``: a dict with ``data, scale, amax`` and
    ``columnwise_data, columnwise_scale`` (``None`` unless ``columnwise``)."""
    M, K = check_input(x, op_name, "MXFP8", MXFP8_BLOCK)
    check_group_sizes(group_sizes, x, op_name)
    x2d = to_2d_float32(x, M, K)
    data, scale = mxfp8_quantize_2d(x2d)
    cw_data = cw_scale = None
    if columnwise:
        cw_data, cw_scale = mxfp8_quantize_columnwise(x2d, group_sizes)
    return dict(data=data, scale=scale, amax=finite_amax(x2d),
                columnwise_data=cw_data, columnwise_scale=cw_scale)


def dequantize_mxfp8_buffers(data, scale, amax, M, K, columnwise, group_sizes):
    """The float32 ``(M, K)`` value of the rowwise or the columnwise buffers."""
    if columnwise:
        return mxfp8_dequantize_columnwise(data, scale, group_sizes)
    return mxfp8_dequantize_2d(data, scale)
