"""Per-group columnwise blocks: the row blocks of the transposed copy, which never straddle two groups.

The columnwise copy of ``x2d`` (``(M, K)``) feeds the weight gradient ``dW[g] = dY_g.T @ X_g``, which
reduces over the rows of one group. Its blocks therefore run down the rows *of each group*: group ``g``
(rows ``[start_g, start_g + n_g)``) has ``ceil(n_g / B)`` blocks of ``B`` rows, the last one partial when
``n_g % B != 0`` (its scale comes from the rows present). Without ``group_sizes`` the tensor is one group.

Layout (the one kernels write and read; ``docs/quantization.md``):

* ``capacity = ceil(M / B) + G`` blocks per feature, static (known from shapes alone, no host sync). It
  bounds the blocks used, ``sum_g ceil(n_g / B) <= ceil(M / B) + G - 1``.
* Group ``g``'s blocks are ``block_offset[g] + j`` for ``j < ceil(n_g / B)``, with
  ``block_offset[g] = sum_{h<g} ceil(n_h / B)``: the used blocks are a prefix; the rest is unused capacity.
* Row ``r`` of group ``g`` lies in block ``block_offset[g] + (r - start_g) // B``.

Everything is device tensor arithmetic on ``group_sizes`` (cumsum, searchsorted): no ``.item()``, no
``.tolist()``, traceable by ``torch.compile``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .formats import encode_e4m3, pow2_f32

__all__ = ["columnwise_capacity", "ColumnwiseBlocks", "columnwise_blocks", "block_max",
           "pow2_columnwise_quantize", "unused_block_value"]


def columnwise_capacity(rows: int, block: int, num_groups: int) -> int:
    """``ceil(rows / block) + num_groups``: the static number of columnwise blocks per feature."""
    return -(-rows // block) + num_groups


class ColumnwiseBlocks(NamedTuple):
    """Where each row's columnwise block lives."""

    #: (M,) int64: the block index (into the capacity) of each row
    row_block: torch.Tensor
    #: (capacity,) bool: True for the blocks that hold rows (a prefix of the capacity)
    used: torch.Tensor
    #: ceil(M / block) + G
    capacity: int
    #: (M,) int64: each row's column in the *slot layout* ``(K, block * capacity)``, where block ``b`` holds its
    #: rows at ``[block * b, block * b + block)`` in order and zeros after them (what the FP8 weight-gradient
    #: kernel reads: kernels/fp8_wgrad.py)
    slot: torch.Tensor


def columnwise_blocks(rows: int, block: int, group_sizes, device) -> ColumnwiseBlocks:
    """The per-group block of every row, from ``group_sizes`` on the device (``None``: one group).

    ``group_sizes`` must be non-negative and sum to ``rows`` (not checked here: that would sync). Rows past
    the sum are clamped into the capacity (their values are then meaningless, but nothing reads out of
    bounds).
    """
    if group_sizes is None:
        sizes = torch.full((1,), rows, dtype=torch.int64, device=device)
    else:
        sizes = group_sizes.to(device=device, dtype=torch.int64)
    G = sizes.shape[0]
    capacity = columnwise_capacity(rows, block, G)
    blocks = (sizes + (block - 1)) // block
    block_start = torch.cumsum(blocks, 0) - blocks
    row_end = torch.cumsum(sizes, 0)
    row_start = row_end - sizes
    r = torch.arange(rows, dtype=torch.int64, device=device)
    g = torch.searchsorted(row_end, r, right=True).clamp(0, max(G - 1, 0))
    if G:
        within = r - row_start[g]
        row_block = block_start[g] + within // block
    else:  # no groups: there are no rows either (the sizes sum to rows)
        within = row_block = torch.zeros_like(r)
    row_block = row_block.clamp(0, capacity - 1)
    used = torch.arange(capacity, dtype=torch.int64, device=device) < blocks.sum()
    return ColumnwiseBlocks(row_block, used, capacity, row_block * block + within.remainder(block))


def block_max(values: torch.Tensor, blocks: ColumnwiseBlocks) -> torch.Tensor:
    """Per (block, feature) max of ``values`` (``(M, K)``, float32, every value ``>= 0``): ``(capacity, K)``,
    0 for blocks without rows."""
    M, K = values.shape
    out = torch.zeros(blocks.capacity, K, dtype=values.dtype, device=values.device)
    if M == 0:
        return out
    index = blocks.row_block.unsqueeze(1).expand(M, K)
    return out.scatter_reduce(0, index, values, reduce="amax", include_self=True)


def pow2_columnwise_quantize(x2d: torch.Tensor, block: int, group_sizes, exponent_fn):
    """Columnwise E4M3 quantization with power-of-two scales (MXFP8, FP8-block).

    ``exponent_fn(block_amax) -> e`` (int) is the format's scale rule. Returns ``(data, e, blocks)``:
    ``data`` uint8 ``(K, M)`` E4M3 codes of ``x2d.T``, each element ``E4M3_RNE(x * 2^-e)`` of its block;
    ``e`` int64 ``(capacity, K)`` for every block, used or not; ``blocks`` the :class:`ColumnwiseBlocks`.
    """
    M, K = x2d.shape
    x = x2d.to(torch.float32)
    blocks = columnwise_blocks(M, block, group_sizes, x.device)
    mag = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    e = exponent_fn(block_max(mag, blocks))
    # x * 2^-e in float32 is the correctly rounded exact product (see mxfp8.py), as the kernels compute it
    scaled = x * pow2_f32(-e)[blocks.row_block]
    data = encode_e4m3(scaled).t().contiguous()
    return data, e, blocks


def unused_block_value(scale: torch.Tensor, blocks: ColumnwiseBlocks) -> torch.Tensor:
    """``scale`` (``(capacity, K)``) with the unused capacity set to zero (byte 0 / 0.0)."""
    return torch.where(blocks.used.unsqueeze(1), scale, torch.zeros_like(scale))
