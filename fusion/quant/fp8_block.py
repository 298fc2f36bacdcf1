"""FP8-block (Hopper's FP8 training format): E4M3 elements, one FP32 power-of-two scale per 1x128 block.

DeepGEMM's "1d2d" activations and Transformer Engine's Float8BlockScaling. Rules (``docs/quantization.md``):

* Rowwise blocks are 128 consecutive elements of a row of the 2-D view ``(M, K)``; a row's last block is
  partial when ``K % 128 != 0`` (its scale comes from the elements present). Any K.
* ``block_amax`` = max ``|x|`` over the block's *finite* elements (0 if none), as MXFP8.
* Scale ``2^e``, ``e = ceil(log2(block_amax / 448))`` computed exactly from the float32 bits (the MXFP8
  rule, :func:`~fusion.quant.mxfp8.mxfp8_scale_exponent`: no element saturates), clamped to
  ``[-127, 127]``; **an all-zero block (``block_amax == 0``: all zeros, NaN or Inf) has scale 1**
  (``e = 0``, TE's rule). The scale is stored as a float32 (2^-127 is the float32 subnormal 0x00400000).
* Elements ``E4M3_RNE(x * 2^-e)``, exact scaling, never saturating; NaN and ±Inf elements encode as E4M3 NaN
  ``0x7F`` (E4M3 has no Inf) and leave the rest of the block alone.
* Rowwise scales are k-block-major: ``scale`` is a contiguous ``(ceil(K/128), M)`` float32 tensor,
  ``scale[j, i]`` scales ``x2d[i, 128j:128j+128]``, so a GEMM tile reads ``tile_m`` consecutive floats.
* Columnwise: 128-row blocks per group of ``group_sizes`` (``fusion/quant/blocks.py``); data ``(K, M)``;
  scales ``(ceil(M/128) + G, K)`` float32, unused capacity 0.0.
* Dequantize: ``decode_e4m3(code) * scale`` in float32 (exact), then cast.
"""

from __future__ import annotations

import torch

from ._common import check_group_sizes, check_input, finite_amax, to_2d_float32
from .blocks import columnwise_blocks, pow2_columnwise_quantize, unused_block_value
from .formats import decode_e4m3, encode_e4m3, pow2_f32
from .mxfp8 import mxfp8_scale_exponent

__all__ = ["FP8_BLOCK", "fp8_block_scale_exponent", "fp8_block_quantize_2d", "fp8_block_dequantize_2d",
           "fp8_block_quantize_columnwise", "fp8_block_dequantize_columnwise", "fp8_block_columnwise_slots",
           "quantize_fp8_block"]

FP8_BLOCK = 128


def fp8_block_scale_exponent(block_amax: torch.Tensor) -> torch.Tensor:
    """``e`` of the scale ``2^e``: exact ``ceil(log2(block_amax / 448))`` in ``[-127, 127]``; 0 for a zero
    block. ``block_amax`` must be finite and non-negative."""
    e = mxfp8_scale_exponent(block_amax)
    return torch.where(block_amax == 0, torch.zeros_like(e), e)


def _spread_columns(per_block: torch.Tensor, K: int) -> torch.Tensor:
    """``(M, ceil(K/128))`` block values to ``(M, K)``: each value repeated over its (partial) block."""
    M, nkb = per_block.shape
    return per_block.unsqueeze(-1).expand(M, nkb, FP8_BLOCK).reshape(M, nkb * FP8_BLOCK)[:, :K]


def fp8_block_quantize_2d(x2d: torch.Tensor):
    """Rowwise FP8-block of a 2-D tensor ``(M, K)``, any K.

    Returns ``(data, scale)``: ``data`` uint8 E4M3 codes ``(M, K)``; ``scale`` float32 ``(ceil(K/128), M)``,
    contiguous (k-block-major).
    """
    M, K = x2d.shape
    x = x2d.to(torch.float32)
    nkb = -(-K // FP8_BLOCK)
    mag = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    padded = torch.nn.functional.pad(mag, (0, nkb * FP8_BLOCK - K))  # zeros never raise a max of |x|
    block_amax = padded.reshape(M, nkb, FP8_BLOCK).amax(dim=-1)
    e = fp8_block_scale_exponent(block_amax)
    data = encode_e4m3(x * _spread_columns(pow2_f32(-e), K))
    return data, pow2_f32(e).t().contiguous()


def fp8_block_dequantize_2d(data: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp8_block_quantize_2d`: ``decode_e4m3(data) * scale`` (exact in float32)."""
    M, K = data.shape
    return (decode_e4m3(data) * _spread_columns(scale.t(), K)).to(dtype)


def fp8_block_quantize_columnwise(x2d: torch.Tensor, group_sizes=None):
    """Columnwise FP8-block of ``x2d`` (``(M, K)``, any M): 128-row blocks per group of ``group_sizes``.

    Returns ``(data, scale)``: ``data`` uint8 E4M3 codes of ``x2d.T``, ``(K, M)``; ``scale`` float32,
    k-block-major ``(ceil(M/128) + G, K)``: ``scale[b, k]`` scales the rows of block ``b`` in column ``k``;
    unused capacity is 0.0 (a used all-zero block has 1.0).
    """
    data, e, blocks = pow2_columnwise_quantize(x2d, FP8_BLOCK, group_sizes, fp8_block_scale_exponent)
    return data, unused_block_value(pow2_f32(e), blocks)


def fp8_block_dequantize_columnwise(data: torch.Tensor, scale: torch.Tensor, group_sizes=None,
                                    dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp8_block_quantize_columnwise`: the logical ``(M, K)`` tensor."""
    K, M = data.shape
    blocks = columnwise_blocks(M, FP8_BLOCK, group_sizes, data.device)
    return (decode_e4m3(data).t() * scale[blocks.row_block]).to(dtype)


def fp8_block_columnwise_slots(data: torch.Tensor, group_sizes=None) -> torch.Tensor:
    """The columnwise codes ``data`` (``(K, M)``, :func:`fp8_block_quantize_columnwise`'s) in the *slot layout*
    ``(K, 128 * capacity)`` of the FP8 weight-gradient kernel: block ``b``'s rows at columns ``[128 b, 128 b +
    128)``, zeros after them and in unused capacity (fusion/quant/blocks.py). The scales need no change: they are
    already one row per block slot."""
    K, M = data.shape
    blocks = columnwise_blocks(M, FP8_BLOCK, group_sizes, data.device)
    out = torch.zeros(K, FP8_BLOCK * blocks.capacity, dtype=data.dtype, device=data.device)
    return out.index_copy_(1, blocks.slot, data)


def quantize_fp8_block_buffers(x: torch.Tensor, columnwise: bool = True, group_sizes=None,
                               op_name: str = "QuantizeFP8Block"):
    """All buffers of the FP8-block quantization of ``x``: a dict with ``data, scale, amax`` and
    ``columnwise_data, columnwise_scale`` (``None`` unless ``columnwise``)."""
    M, K = check_input(x, op_name, "FP8-block", FP8_BLOCK, whole_blocks=False)
    check_group_sizes(group_sizes, x, op_name)
    x2d = to_2d_float32(x, M, K)
    data, scale = fp8_block_quantize_2d(x2d)
    cw_data = cw_scale = None
    if columnwise:
        cw_data, cw_scale = fp8_block_quantize_columnwise(x2d, group_sizes)
    return dict(data=data, scale=scale, amax=finite_amax(x2d),
                columnwise_data=cw_data, columnwise_scale=cw_scale)


def dequantize_fp8_block_buffers(data, scale, amax, M, K, columnwise, group_sizes):
    """The float32 ``(M, K)`` value of the rowwise or the columnwise buffers."""
    if columnwise:
        return fp8_block_dequantize_columnwise(data, scale, group_sizes)
    return fp8_block_dequantize_2d(data, scale)
