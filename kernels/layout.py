"""Host-side layout helpers for gated (gate/up) GEMMs.

The kernel expects the FC1 weight of a gated activation with gate and up rows interleaved in blocks of
``GATE_BLOCK`` = 8 rows: for W of shape (G, 2f, K) (rows [0, f) = gate, [f, 2f) = up, the canonical
`x.chunk(2, -1)` order), the interleaved weight has, for each block b of 8 features,
rows 16b..16b+7 = gate rows 8b..8b+7 and rows 16b+8..16b+15 = up rows 8b..8b+7.
With wgmma's accumulator layout each thread then holds gate j and up j in the same registers' slots,
and the epilogue's output tile is exactly the accumulator layout of a half-width tile.
Any tensor of width 2f in "paired" form (GroupVector/AuxInput/Output with paired=True) uses the same
interleave along its last dimension.  Requires f % 8 == 0.
"""
import torch

GATE_BLOCK = 8


def interleave_gated_weight(w: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """(…, 2f, K) [gate; up] -> interleaved (…, 2f, K) along ``dim`` (default: the row dim of a weight).

    One permuting copy: view the dim as (2 halves, f/8 blocks, 8) and swap the first two."""
    dim = dim % w.dim()
    two_f = w.shape[dim]
    assert two_f % (2 * GATE_BLOCK) == 0, "2f must be a multiple of 16"
    shp = list(w.shape)
    x = w.reshape(shp[:dim] + [2, two_f // (2 * GATE_BLOCK), GATE_BLOCK] + shp[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shp).contiguous()


def deinterleave_gated(w: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`interleave_gated_weight` (one permuting copy)."""
    dim = dim % w.dim()
    two_f = w.shape[dim]
    shp = list(w.shape)
    x = w.reshape(shp[:dim] + [two_f // (2 * GATE_BLOCK), 2, GATE_BLOCK] + shp[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shp).contiguous()
