"""Which 128x128 weight-scale blocks the columns of an FP8 GEMM n-tile fall in (plain Python, trace time).

The FP8-block recipe scales the weight in 128x128 blocks: ``sb[g, nb, kb]`` covers rows
``[128 nb, 128 nb + 128)`` of ``B[g]`` (an output column of the GEMM is a row of B). An n-tile's accumulator
columns are one or two *segments* of consecutive B rows:

- a plain GEMM: one segment, B rows ``[n_idx tile_n, +tile_n)``;
- a gated GEMM (canonical ``[gate; up]`` weight): the gate rows ``[n_idx h, +h)`` in accumulator columns
  ``[0, h)`` and the up rows ``[N/2 + n_idx h, +h)`` in ``[h, 2h)`` (``h = tile_n / 2``).

A segment that can never straddle a 128-row boundary (its width divides 128 and every start is a multiple
of it) needs one scale per k-tile; any other one at most two (checked for every n-tile here), chosen per
8-column chunk by a run-time boundary. Each needed scale is a *slot*: the producer loads slot ``s`` of every
k-tile into the stage's scale buffer, the consumers read it back.
"""
from __future__ import annotations

from dataclasses import dataclass

SCALE_BLOCK = 128   # rows of B (and elements of K) per weight scale block; K elements per activation scale

# The producer's TMA boxes of scales (1-D views of the float32 tensors). A box must start on a 16-byte boundary
# of its innermost dimension (an unaligned start traps with "illegal instruction"), so a box starts at the
# wanted float rounded down to a multiple of SCALE_ALIGN and the consumers read box_shift(coord) floats in.
SCALE_ALIGN = 4                   # floats per 16 bytes
SB_BOX = SCALE_ALIGN              # floats per box of weight scales: the aligned group holding the wanted one
SB_SLOT_FLOATS = 32               # each slot's smem box starts on a 128-byte boundary

# floats per box of activation scales: a 128-row wave's from an aligned start (a 256-row tile loads one box per
# wave: a TMA box dimension holds at most 256 elements, and a longer box would be split at an unaligned point)
SA_BOX = 128 + SCALE_ALIGN
SA_STAGE_FLOATS = 160             # each wave's box in a stage starts on a 128-byte boundary


def box_start(coord):
    """The aligned start of the box holding float ``coord`` (a non-negative int or DSL integer)."""
    return coord - (coord & (SCALE_ALIGN - 1))


def box_shift(coord):
    """Where float ``coord`` lies in the box that :func:`box_start` starts."""
    return coord & (SCALE_ALIGN - 1)


@dataclass(frozen=True)
class Segment:
    """Accumulator columns ``[col0, col0 + width)`` hold B rows ``row0 + n_idx * width + [0, width)``.
    ``split``: the rows may straddle one 128-row boundary (slots ``slot`` and ``slot + 1``)."""
    col0: int
    width: int
    row0: int
    split: bool
    slot: int

    def first_row(self, n_idx):
        """The segment's first B row in n-tile ``n_idx`` (works on ints and on DSL integers)."""
        return self.row0 + n_idx * self.width


def plan_segments(tile_n: int, N: int, gated: bool) -> tuple:
    """The segments of an n-tile (see the module docstring). Raises ValueError naming the constraint when a
    segment could span three scale blocks or a block boundary could cut an 8-column chunk."""
    if gated:
        half = tile_n // 2
        n_tiles = -(-(N // 2) // half)
        specs = [(0, half, 0), (half, half, N // 2)]
    else:
        n_tiles = -(-N // tile_n)
        specs = [(0, tile_n, 0)]
    segs = []
    slot = 0
    for col0, width, row0 in specs:
        starts = [row0 + n * width for n in range(n_tiles)]
        if any(s % 8 for s in starts):
            raise ValueError(f"B rows {row0} + n*{width}: a scale-block boundary would cut an 8-column chunk "
                             "(a gated GEMM needs N/2 % 8 == 0)")
        if any(s % SCALE_BLOCK + width > 2 * SCALE_BLOCK for s in starts):
            raise ValueError(f"a {width}-column segment would span three 128-row scale blocks: use a tile_n "
                             "whose segments divide 128 or are at most 128 + gcd(tile_n, 128) wide")
        split = any(s // SCALE_BLOCK != (s + width - 1) // SCALE_BLOCK for s in starts)
        segs.append(Segment(col0, width, row0, split, slot))
        slot += 2 if split else 1
    return tuple(segs)


def num_slots(segments) -> int:
    return sum(2 if s.split else 1 for s in segments)


def segment_of(segments, col: int) -> Segment:
    """The segment holding accumulator column ``col``."""
    for s in segments:
        if s.col0 <= col < s.col0 + s.width:
            return s
    raise IndexError(col)
