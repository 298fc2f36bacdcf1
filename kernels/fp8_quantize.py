"""The FP8-block quantize kernel: a 2-D tensor read once, its rowwise and (optionally) columnwise copies written.

    data[i, k]      = E4M3(x[i, k] * 2^-e)          e from 1x128 blocks of a row (the last one partial)
    scale[kb, i]    = 2^e                            (ceil(K/128), M) float32, k-block-major
    cw_data[k, i]   = E4M3(x[i, k] * 2^-e')         e' from 128-row blocks of each group, per column
    cw_scale[b, k]  = 2^e'                           (ceil(M/128) + G, K) float32, unused capacity 0.0

bit for bit what fusion.quant.fp8_block_quantize_2d / fp8_block_quantize_columnwise compute (the rule is in
kernels/pow2_quant.py). The unfused FP8 path's quantization, where no epilogue pattern covers it.

Tiles. CTA ``(b, kb)`` (256 threads) owns the tile of rows ``[row0, row0 + nrows)`` and columns
``[128 kb, 128 kb + 128)``, where ``(row0, nrows)`` is columnwise block ``b``: the ``j``-th 128-row block of
the group it falls in (per-group blocks, fusion/quant/blocks.py), found by each warp from ``group_sizes`` with
a warp scan (no host sync, no prologue launch); a block past the used ones writes its capacity's zero scales.
Rowwise blocks lie along a row, so the same tiles cover them: every row of x lies in exactly one used block.
Rowwise only, the tiles are plain 128-row blocks.

Thread ``t`` holds chunk ``c = t % CPB`` (16 bytes of a row: 8 bf16/fp16 or 4 fp32 elements; ``CPB`` chunks
per 128 columns) of ``RPT`` consecutive rows ``q * RPT + u`` (``q = t // CPB``): 16-byte loads, and one
instruction reads whole 256- or 512-byte row segments. A row's amax is a butterfly over its ``CPB`` lanes; its
codes go out as one 8- (4-) byte store per thread; its scales through shared memory, one coalesced store.
A column's amax is a max over the thread's rows, then across lanes and warps in shared memory. Its codes (the
thread's ``RPT`` consecutive rows of one column: 8 or 16 bytes) go to a shared ``(128 columns, 128 rows)``
byte tile, slots XOR-swizzled so that stores and reads are free of bank conflicts; each warp then writes 128
rows of one column of ``cw_data`` with 4-byte stores aligned in global memory (``cw_data[k]`` starts wherever
``k * M + row0`` falls): two shared words funnel-shifted, bytes at the edges of the block.

Pipelined builds (slot layout: :data:`PIPELINED`; (K, M) layout: :data:`PIPELINED_COLUMNS`) are persistent: a one-wave grid of CTAs walks the tiles, each
thread's rows of the next tiles loaded by ``cp.async`` into a ring of shared tiles while the current one is encoded
(``pipelined_tiles``). bf16 columnwise builds test their values a packed pair at a time (:data:`COLUMN_PAIRS`).

Launched through TVM-FFI with integer arguments (fusion.kernels.fp8_quantize_api), compiled once per
``(dtype, K, columnwise, G, sizes dtype, amax, slots, rowwise, pairs, min_ctas, pipelined, column_pairs)``
(``compile_fp8_quantize``'s key); ``M`` and ``group_sizes`` are run-time.
"""
from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_ptr
from cutlass.memory import SmemAllocator

from .dtypes import cutlass_dtype
from .fragment_io import bits_f32, unpack2
from .pow2_quant import bf16_pair_amax_bits, clean_bf16_words, finite_abs2_bf16, finite_abs_bits, \
    fp8_block_scale_bits, max2_u16, scaled_clean_pair, scaled_or_nan
from .utility_kernel import UtilityKernel, compile_once

FP8 = cutlass.Float8E4M3FN
#: Threads per CTA (8 warps).
THREADS = 256
#: Rows and columns of a CTA's tile: the FP8 block.
TILE = 128
_CHUNK_BYTES = 16
_LANES = 32
#: CTAs an SM must hold (registers capped at 128 a thread): while one computes, the other's loads are in flight.
#: The fp32 columnwise kernel (64 fp32 values a thread through its rowwise pass) spills under that cap and is
#: built for one (build_kernel).
MIN_CTAS_PER_SM = 2
#: CUDA's default shared-memory carveout, named so that the launch bound above needs no device query at compile
#: time (the DSL asks the driver for the SM's shared memory otherwise, and compiling must work without a GPU).
_CARVEOUT_DEFAULT = -1
#: Most groups a columnwise kernel takes: each warp scans them in registers, 32 per lane.
MAX_GROUPS = 1024
#: Whether a bf16 rowwise-only kernel tests its values a packed pair at a time (pow2_quant.finite_abs2_bf16: the
#: non-finite halves and a halfwise max for the amax, a few integer instructions a pair where the fp32 tests take
#: about four a value; session z) instead of one value at a time. Read when a kernel is built (it is in the key);
#: bench/bench_quantize.py --ab-pairs times the two builds.
PAIRS = True
#: Whether a bf16 columnwise build tests and folds its values a packed pair at a time as the rowwise-only build does
#: (:data:`PAIRS`): a word's two magnitudes fold into two columns' running maxima with one ``max.u16x2``, the row
#: scan parks the cleaned words (non-finite halves a quiet NaN) back in the thread's shared slice, and the column
#: pass then scales each value with no test. FUSION_FP8_QUANTIZE_COLUMN_PAIRS=0: value at a time (read when a
#: kernel is built; it is in the key).
COLUMN_PAIRS = os.environ.get("FUSION_FP8_QUANTIZE_COLUMN_PAIRS", "1") != "0"
#: Whether a slot-layout build is persistent and pipelined (:class:`FP8QuantizeKernel` ``pipelined``): each CTA walks
#: tiles ``bid, bid + grid, ...`` with the next tiles' loads in flight (cp.async into a ring of shared-memory tiles)
#: while it encodes the current one. The one-tile-a-CTA build loads, parks, encodes and stores in turn, so an SM has
#: at most its two CTAs' 32 KiB loads in flight and only while neither computes: the slot builds ran at about 0.6 of
#: a copy's bandwidth where the rowwise-only build (registers only, no barriers) reaches 0.82-0.90. Read when a
#: kernel is built (it is in the key); FUSION_FP8_QUANTIZE_PIPELINED=0 builds the one-tile-a-CTA kernel.
PIPELINED = os.environ.get("FUSION_FP8_QUANTIZE_PIPELINED", "1") != "0"
#: Whether the rowwise-only builds (a training step's x, dY and d(gate, up) for the FP8 GEMMs) are pipelined the same
#: way, their ring the only shared tile. **Off: measured slower** (session ai, H200, bench/probes/quantize_pipelined_ab.py
#: --switch PIPELINED_ROWWISE, bench/results/H200-2026-12-01ai-call1-*): +4.8..+5.6% on four of five tensors (OLMoE's and
#: Qwen3-30B-A3B's FC1 dY, Mixtral's, Llama-3-70B's), -3.0% on Mixtral's 16384 x 4096; the FP8 steps -0.6 / +0.1 / -0.2%
#: (OLMoE / Qwen3-30B-A3B / Mixtral, three rounds of 100). The registers-only build already moves 0.89-0.92 of a copy's
#: bandwidth there, and the ring's barrier per tile costs more than the loads it keeps in flight. Read when a kernel is
#: built (it is in the key); FUSION_FP8_QUANTIZE_PIPELINED_ROWWISE=1 turns it on.
PIPELINED_ROWWISE = os.environ.get("FUSION_FP8_QUANTIZE_PIPELINED_ROWWISE", "0") == "1"
#: Whether the bf16 (K, M) columnwise builds (a user's unfused ``QuantizeFP8Block(columnwise=True)``) are pipelined the
#: same way. Session ah left them one tile a CTA: pipelined then, their byte-masked column stores kept per-lane
#: addresses live across the persistent loop (194 registers at K = 2048, one CTA an SM); with the values tested a pair
#: at a time (:data:`COLUMN_PAIRS`) the pipelined bf16 build fits 128 registers without spilling. On an H200 (session
#: ai, bench/probes/quantize_pipelined_ab.py --switch PIPELINED_COLUMNS, with :data:`BLOCKS_FASTEST`;
#: bench/results/H200-2026-12-01ai-call{2,3}-quant-*) it is 5.4-12.4% faster on five tensors (0.41-0.58 -> 0.43-0.66
#: of a copy's bandwidth). fp16 and fp32 stay one tile a CTA: pipelined they need one CTA an SM (192-213 registers) and
#: fp16 ran 21-25% slower. Read when a kernel is built (it is in the key); FUSION_FP8_QUANTIZE_PIPELINED_COLUMNS=0 builds
#: one tile a CTA.
PIPELINED_COLUMNS = os.environ.get("FUSION_FP8_QUANTIZE_PIPELINED_COLUMNS", "1") != "0"
#: Whether a pipelined (K, M) build's CTAs walk their tiles row blocks fastest (concurrent CTAs then write neighbouring
#: rows of the same columns of ``cw_data``, as the one-tile-a-CTA grid's do) instead of column blocks fastest (they
#: read neighbouring columns of the same rows of x). Session ai (H200, --switch BLOCKS_FASTEST): -15.4% on Mixtral's
#: FC1 dY (16384 x 28672, where columns fastest had been 8.1% slower than one tile a CTA), -0.2..+1.8% on the other
#: four. Read when a kernel is built (it is in the key).
BLOCKS_FASTEST = True
#: Whether a (K, M) column's edge bytes (the up to 3 rows before its first 4-byte-aligned word and the up to 3 after
#: its last whole one) are stored once per tile after the whole words, two threads a column and three predicated byte
#: stores each (:meth:`FP8QuantizeKernel.store_edges`), instead of byte loops in lanes 0 and 31 beside each column's
#: words (up to 4 + 4 predicated stores those lanes issue while the other 30 wait). Session ai's Nsight Compute run of
#: the (K, M) build (bench/results/H200-2026-12-01ai-call5-ncu-quant.log): the same DRAM bytes as the rowwise + slot
#: build but 1.6x its instructions at the same issue rate (0.65 a scheduler a cycle: issue-bound), 4.3x its global
#: stores. Session aj (H200, bench/probes/quantize_pipelined_ab.py --switch EDGE_BYTES_BY_LANES,
#: bench/results/H200-2026-12-01aj-call{1,2}-*): one byte a lane beside each column's words cut the stores 2.6x but
#: not the time (-3.1..+13.5%: the edge arithmetic every lane issued for each column, predicated off); once per tile
#: the column store is 24 SASS instructions a column instead of 63 and the build 8.0-11.9% faster on five bf16
#: tensors (0.43-0.66 -> 0.49-0.72 of a copy's bandwidth), 9.9-11.2% on two fp16 ones; the same bytes. Read when a
#: kernel is built (it is in the key); FUSION_FP8_QUANTIZE_EDGE_BYTES_BY_LANES=0 builds the byte loops.
EDGE_BYTES_BY_LANES = os.environ.get("FUSION_FP8_QUANTIZE_EDGE_BYTES_BY_LANES", "1") != "0"
#: Whether a pipelined columnwise build's CTA skips the work of a tile of unused columnwise capacity (a block past
#: its group's rows, ``nrows`` 0: the launch covers ``ceil(M / 128) + G`` row blocks because the group sizes stay on
#: the device) and writes only what that tile owes: its columns' zero scales and, in the slot layout, its zero codes,
#: straight from registers (:meth:`FP8QuantizeKernel.empty_tile`). The kernel is bound by issuing instructions, and
#: such a tile cost as many as a full one: with 128 ragged groups (a fifth empty) about 12% of the tiles. The loop
#: bound is their warp sum marked warp-uniform (else ptxas wrapped every shuffle of the loop in collective code, and
#: the kernel doubled). Session ak (H200, bench/probes/quantize_pipelined_ab.py --switch SKIP_EMPTY_TILES,
#: bench/results/H200-2026-12-01ak-call1-skip-empty.*): -8.1 / -8.6 / -9.6% on Qwen3-30B-A3B's FC1 input (G=128; the
#: slot, rowwise + slot and (K, M) builds, 0.68 -> 0.74, 0.68 -> 0.74, 0.49 -> 0.54 of a copy's bandwidth), -2.3..-4.3%
#: at G=64 (OLMoE), -0.6..-2.9% at G=8 (Mixtral); the same bytes. Read when a kernel is built (it is in the key);
#: FUSION_FP8_QUANTIZE_SKIP_EMPTY_TILES=0 encodes them like the others.
SKIP_EMPTY_TILES = os.environ.get("FUSION_FP8_QUANTIZE_SKIP_EMPTY_TILES", "1") != "0"
#: Shared memory an SM gives its CTAs (sm_90: 227 KiB), and the most tiles a pipelined CTA keeps in its ring.
_SMEM_PER_SM = 227 * 1024
_MAX_STAGES = 4


def _word(x):
    """A value as 32 raw bits: a Uint32, whose ``>>`` is a logical shift."""
    return cutlass.Uint32(x)


def funnel_word(prev, word, sh, first):
    """Trace time: the aligned word a lane stores when its column starts ``sh`` (0..3) bytes into a word: the
    top ``sh`` bytes of ``prev`` (the previous lane's shared word; 0 for the ``first`` lane), then the low
    ``4 - sh`` of ``word``; and ``word``'s top ``sh`` bytes shifted down (what spills past the last word).
    Every operand is re-typed Uint32: ``cutlass.select_`` returns an untyped value whose ``>>`` is an
    arithmetic shift, which would smear a code byte >= 0x80 (negative, -0.0) over the bytes above it."""
    prev = _word(cutlass.select_(first, _word(0), _word(prev)))
    word = _word(word)
    right = _word(cutlass.select_(sh == 0, _word(0), _word(32 - 8 * sh)))   # never a shift by 32
    joined = _word((prev >> right) | (word << _word(8 * sh)))
    return _word(cutlass.select_(sh == 0, word, joined)), _word(word >> right)


def whole_word_rows(lane, sh, nrows):
    """Trace time: ``(p, whole)``: the first of the four rows lane ``lane``'s aligned word holds when a column of
    ``nrows`` codes starts ``sh`` (0..3) bytes into a word (``p`` = 4 lane - sh), and whether all four are the
    column's (then the lane stores the word whole)."""
    p = lane * 4 - sh
    return p, (p >= 0) & (p + 4 <= nrows)


def edge_byte_row(e, sh, nrows):
    """Trace time: ``(r, edge)``: the row of edge byte ``e`` (0..5; none from 6) of a column of ``nrows`` codes
    starting ``sh`` bytes into a word, and whether the column has it. The whole words of :func:`whole_word_rows`
    hold rows ``rb .. re - 1`` (``rb`` = (4 - sh) & 3 rows before the first aligned word, ``re`` = rb + a multiple
    of 4); edge bytes 0-2 are the head rows ``0 .. min(rb, nrows) - 1``, 3-5 the tail rows ``re .. nrows - 1``
    when the column is longer than its head. Every row of ``[0, nrows)`` is stored exactly once
    (tests/test_fp8_quantize_compile.py checks every ``sh`` and ``nrows``)."""
    rb = (4 - sh) & 3
    re = rb + ((nrows - rb) & Int32(-4))
    r = cutlass.select_(e < 3, e, re + e - 3)
    head = (e < 3) & (r < cutlass.min(rb, nrows))
    tail = (e >= 3) & (e < 6) & (nrows > rb) & (r < nrows)
    return r, head | tail


class FP8QuantizeKernel:
    """Trace-time parameters: the input dtype, the row length ``K`` (a multiple of 16 bytes of elements),
    whether the columnwise copy is written, and for it the groups ``G`` and their sizes' dtype ("int32",
    "int64", or None for one group of all rows); the launch bound ``min_ctas`` (0: MIN_CTAS_PER_SM); ``amax``:
    also the tensor's finite amax, as float32 bits by one atomic max per warp into a zeroed int32 (a
    non-negative float's bits order as integers, so the result is independent of the order); ``slots``: the
    columnwise codes in the slot layout (below) instead of ``(K, M)``; ``rowwise`` False: no rowwise copy (the
    FP8 weight gradient reads only the columnwise one); ``pairs``: a bf16 rowwise-only kernel tests and folds its
    values a packed pair at a time (:data:`PAIRS`); ``pipelined``: the build runs persistent CTAs whose
    next tiles load while the current one is encoded (:data:`PIPELINED`; the (K, M) layout with
    :data:`PIPELINED_COLUMNS`, a rowwise-only build with :data:`PIPELINED_ROWWISE`), launched with a grid of at most
    ``grid_limit`` CTAs (one wave: the SMs times ``min_ctas``); ``column_pairs``: a bf16 columnwise build tests and
    folds its values a packed pair at a time (:data:`COLUMN_PAIRS`).

    The slot layout, ``cw_data[k, 128 b + r]`` of shape ``(K, 128 * (ceil(M/128) + G))``: block ``b``'s rows
    at bytes ``[128 b, 128 b + 128)`` of each column, zeros past the block's rows and in unused capacity, so that
    every 128-byte k-tile of the FP8 varlen-K kernel (kernels/fp8_wgrad.py) is one whole block of one group."""

    def __init__(self, dtype: str, K: int, columnwise: bool, G: int = 1, sizes_dtype: str | None = None,
                 min_ctas: int = 0, amax: bool = False, slots: bool = False, rowwise: bool = True,
                 pairs: bool = True, pipelined: bool = False, column_pairs: bool = False,
                 blocks_fastest: bool = False, edge_lanes: bool = False, skip_empty: bool = False):
        self.dtype = cutlass_dtype(dtype)
        self.vec = _CHUNK_BYTES * 8 // self.dtype.width
        if K <= 0 or K % self.vec:
            raise ValueError(f"FP8 quantize kernel: K={K} must be a positive multiple of {self.vec} ({dtype}: "
                             f"16-byte rows)")
        if columnwise and not 1 <= G <= MAX_GROUPS:
            raise ValueError(f"FP8 quantize kernel: {G} groups; the columnwise kernel takes 1..{MAX_GROUPS}")
        self.K = K
        self.columnwise = columnwise
        self.G = G if columnwise else 1
        self.sizes_dtype = sizes_dtype if columnwise else None
        self.nkb = (K + TILE - 1) // TILE
        self.cpb = TILE // self.vec             # chunks per 128 columns: 16 or 32
        self.rg = THREADS // self.cpb           # row groups: 16 or 8
        self.rpt = TILE // self.rg              # consecutive rows per thread: 8 or 16
        self.slot_words = self.rpt // 4         # a thread's column codes, in 32-bit words
        self.per_lane = (self.G + _LANES - 1) // _LANES
        #: the launch bound: CTAs an SM must hold (0: the default, MIN_CTAS_PER_SM)
        self.min_ctas = min_ctas or MIN_CTAS_PER_SM
        self.amax = amax
        self.slots = slots and columnwise
        self.rowwise = rowwise or not columnwise
        self.pairs = pairs and not columnwise and self.dtype is cutlass.BFloat16
        self.column_pairs = column_pairs and columnwise and self.dtype is cutlass.BFloat16
        #: tiles in a pipelined CTA's ring (0: one tile a CTA): as many as fit the SM's shared memory shared by
        #: ``min_ctas`` CTAs beside the fixed tiles, at most _MAX_STAGES; fewer than two: not pipelined
        #: a pipelined CTA's tiles walk the column blocks' row blocks fastest (tile t = row block t % blocks of column
        #: block t // blocks) instead of the row blocks' column blocks
        self.blocks_fastest = blocks_fastest
        #: a (K, M) tile's edge bytes after its whole words, two threads a column (:data:`EDGE_BYTES_BY_LANES`)
        self.edge_lanes = edge_lanes and columnwise and not self.slots
        self.stages = 0
        #: a pipelined columnwise CTA's tiles of unused capacity take only their zero writes (:data:`SKIP_EMPTY_TILES`)
        self.skip_empty = skip_empty and columnwise
        if pipelined:
            tile_bytes = TILE * TILE * self.dtype.width // 8
            fixed = TILE * 4 + 1024
            if columnwise:
                fixed += TILE * 4 + TILE * THREADS // _LANES * 4 + TILE * TILE
            fit = min(_MAX_STAGES, (_SMEM_PER_SM // self.min_ctas - fixed) // tile_bytes)
            self.stages = fit if fit >= 2 else 0

    @cute.jit
    def __call__(self, pX: cute.Pointer, pData: cute.Pointer, pScale: cute.Pointer, pCwData: cute.Pointer,
                 pCwScale: cute.Pointer, pSizes: cute.Pointer, pAmax: cute.Pointer, M: Int32, grid_limit: Int32,
                 stream):
        chunks = self.K // self.vec
        mX = cute.make_tensor(pX, cute.make_layout((M, chunks, self.vec), stride=(self.K, self.vec, 1)))
        mData = cute.make_tensor(pData, cute.make_layout((M, chunks, self.vec), stride=(self.K, self.vec, 1)))
        mScale = cute.make_tensor(pScale, cute.make_layout((self.nkb, M), stride=(M, 1)))
        blocks = self.row_blocks(M)
        mCwScale = cute.make_tensor(pCwScale, cute.make_layout((blocks, self.K), stride=(self.K, 1)))
        mSizes = cute.make_tensor(pSizes, cute.make_layout((self.G,)))
        mAmax = cute.make_tensor(pAmax, cute.make_layout((1,)))
        tiles = blocks * self.nkb
        grid = (blocks, self.nkb, 1)
        if const_expr(self.stages):
            grid = (cutlass.min(tiles, grid_limit), 1, 1)
        self.kernel(mX, mData, mScale, pCwData, mCwScale, mSizes, mAmax, M, tiles).launch(
            grid=grid, block=(THREADS, 1, 1), min_blocks_per_mp=self.min_ctas,
            preferred_smem_carveout=_CARVEOUT_DEFAULT, stream=stream)

    # ------------------------------------------------------------------ the block's rows
    @cute.jit
    def block_rows(self, mSizes: cute.Tensor, M: Int32, b: Int32, lane: Int32):
        """``(row0, nrows)`` of columnwise block ``b`` (``nrows == 0``: unused capacity). Every warp computes
        it: the sizes (clamped to [0, M], running sums saturating at M, so bad sizes never reach out of
        bounds) are scanned across the warp, and the lane whose group holds block ``b`` reports it."""
        row0 = b * TILE
        nrows = Int32(0)
        if const_expr(self.sizes_dtype is None):
            nrows = cutlass.max(cutlass.min(M - row0, Int32(TILE)), Int32(0))
        else:
            sizes = []
            rows_sum = Int32(0)
            blocks_sum = Int32(0)
            for j in cutlass.range_constexpr(self.per_lane):
                size = self.group_size(mSizes, M, lane * self.per_lane + j)
                sizes.append(size)
                rows_sum = cutlass.min(rows_sum + size, M)
                blocks_sum = blocks_sum + (size + TILE - 1) // TILE
            rows_scan = rows_sum
            blocks_scan = blocks_sum
            for k in cutlass.range_constexpr(5):
                offset = 1 << k
                r_other = cute.arch.shuffle_sync_up(rows_scan, offset)
                b_other = cute.arch.shuffle_sync_up(blocks_scan, offset)
                if lane >= offset:
                    rows_scan = cutlass.min(rows_scan + r_other, M)
                    blocks_scan = blocks_scan + b_other
            row_start = rows_scan - rows_sum
            block_start = blocks_scan - blocks_sum
            found_row0 = Int32(0)
            found_rows = Int32(0)
            for j in cutlass.range_constexpr(self.per_lane):
                n_blocks = (sizes[j] + TILE - 1) // TILE
                if (b >= block_start) & (b < block_start + n_blocks):
                    first = (b - block_start) * TILE
                    found_row0 = cutlass.min(row_start + first, M)
                    found_rows = cutlass.min(sizes[j] - first, Int32(TILE))
                row_start = cutlass.min(row_start + sizes[j], M)
                block_start = block_start + n_blocks
            for k in cutlass.range_constexpr(5):  # one lane found it (blocks of groups are disjoint)
                found_row0 = cutlass.max(found_row0, cute.arch.shuffle_sync_bfly(found_row0, 1 << k))
                found_rows = cutlass.max(found_rows, cute.arch.shuffle_sync_bfly(found_rows, 1 << k))
            row0 = found_row0
            nrows = cutlass.max(cutlass.min(found_rows, M - row0), Int32(0))
        return row0, nrows

    # ------------------------------------------------------------------ rowwise, a bf16 pair at a time
    def row_by_pairs(self, frag, u: int):
        """Trace time (``pairs``): ``(values times 2^-e, scale bits, run)`` of the thread's row ``u`` of bf16 words:
        each word's non-finite halves and magnitudes by pow2_quant.finite_abs2_bf16, the row's amax a halfwise max
        (``run``, this lane's) then the butterfly over its CPB lanes, and the values scaled from the cleaned words
        with no per-value test: what the value-at-a-time pass converts, the same bytes."""
        words = cute.recast_tensor(frag, Int32)
        per_row = self.vec // 2
        run, clean = clean_bf16_words([words[j + per_row * u] for j in range(per_row)])
        return (*self.scaled_row(run, clean), run)

    def scaled_row(self, run, clean):
        """Trace time: ``(values times 2^-e, scale bits)`` of a row from this lane's halfwise magnitude max ``run``
        (the butterfly over the row's CPB lanes makes it the row's amax) and its clean bf16 words ``clean``."""
        amax = bf16_pair_amax_bits(run)
        for k in range(self.cpb.bit_length() - 1):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, 1 << k))
        row_bits, row_inv = fp8_block_scale_bits(amax)
        vals = cute.make_rmem_tensor((self.vec,), Float32)
        for j in range(self.vec // 2):
            vals[2 * j], vals[2 * j + 1] = scaled_clean_pair(clean[j], row_inv)
        return vals, row_bits

    def row_and_columns_by_pairs(self, frag, u: int, col_runs: list, sTile):
        """Trace time (``column_pairs``): the thread's row ``u`` of bf16 words cleaned (pow2_quant.finite_abs2_bf16),
        each word's magnitudes folded into ``col_runs`` (its two columns' running maxima, in place), the clean words
        parked back over the row in ``sTile`` (the column pass reads them), and with ``rowwise`` the row's
        ``(values times 2^-e, scale bits)`` as :meth:`row_by_pairs` computes them (else ``(None, None)``)."""
        words = cute.recast_tensor(frag, Int32)
        per_row = self.vec // 2
        run = Int32(0)
        clean = cute.make_rmem_tensor((per_row,), Int32)
        for j in range(per_row):
            mag, clean[j] = finite_abs2_bf16(words[j + per_row * u])
            col_runs[j] = max2_u16(col_runs[j], mag)
            run = max2_u16(run, mag)
        parked = cute.make_tensor(cute.recast_ptr(sTile[None, u].iterator, dtype=Int32), cute.make_layout((per_row,)))
        cute.autovec_copy(clean, parked)
        if const_expr(not self.rowwise):
            return None, None
        return self.scaled_row(run, clean)

    # ------------------------------------------------------------------ the loaded values
    def row_values(self, frag, u: int):
        """Trace time: the ``vec`` values of the thread's row ``u`` as fp32 (exact; 16-bit values widened from
        their packed words)."""
        if const_expr(self.dtype is Float32):
            return [Float32(frag[i, u]) for i in range(self.vec)]
        words = cute.recast_tensor(frag, Int32)
        ys = []
        for j in range(self.vec // 2):
            ys.extend(unpack2(words[j + self.vec // 2 * u], self.dtype))
        return ys

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, mX: cute.Tensor, mData: cute.Tensor, mScale: cute.Tensor, pCwData: cute.Pointer,
               mCwScale: cute.Tensor, mSizes: cute.Tensor, mAmax: cute.Tensor, M: Int32, tiles: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, kb, _ = cute.arch.block_idx()
        lane = tidx % _LANES

        smem = SmemAllocator()
        sRowScale = smem.allocate_tensor(Float32, cute.make_layout((TILE,)), 16)
        sColInv = sPart = sCodes = sRaw = None
        if const_expr(self.columnwise):
            sColInv = smem.allocate_tensor(Float32, cute.make_layout((TILE,)), 16)
            sPart = smem.allocate_tensor(Int32, cute.make_layout((TILE, THREADS // _LANES)), 16)
            sCodes = smem.allocate_tensor(Int32, cute.make_layout((TILE * TILE // 4,)), 16)
        if const_expr(self.columnwise or self.stages):
            # the loaded tile, parked for the columnwise pass (registers would hold it across the barriers); a
            # thread's row u is the 16 bytes after the other threads' row u: one STS.128 per row, no conflicts.
            # A pipelined build keeps a ring of `stages` tiles (the last mode).
            tile_elems = self.vec * self.rpt * THREADS
            sRaw = smem.allocate_tensor(self.dtype, cute.make_layout(
                (self.vec, self.rpt, THREADS, max(self.stages, 1)),
                stride=(1, THREADS * self.vec, self.vec, tile_elems)), 16)
        shared = (sRowScale, sColInv, sPart, sCodes)

        if const_expr(self.stages):
            self.pipelined_tiles(mX, mData, mScale, pCwData, mCwScale, mSizes, mAmax, M, tiles, sRaw, shared,
                                 bid, tidx)
        else:
            row0, nrows = self.block_rows(mSizes, M, bid, lane)
            # A block past the used ones (columnwise capacity, nrows == 0) runs the same code with every load and
            # store masked, and writes its zero scales: no branch around the shuffles, which stay convergent.
            frag = self.load_rows(mX, row0, nrows, kb, tidx)
            sTile = None
            if const_expr(self.columnwise):
                # parked in shared memory and read back row by row after a barrier (which the compiler cannot
                # move loads across): the loaded registers free up, and the columnwise pass reads the tile again
                sTile = sRaw[None, None, tidx, 0]
                cute.autovec_copy(frag, sTile)
                cute.arch.sync_threads()
                frag = cute.make_rmem_tensor((self.vec, self.rpt), self.dtype)
                cute.autovec_copy(sTile, frag)
            self.encode_tile(frag, sTile, mData, mScale, pCwData, mCwScale, mAmax, shared, M, bid, kb, row0, nrows,
                             tidx)

    @cute.jit
    def load_rows(self, mX: cute.Tensor, row0: Int32, nrows: Int32, kb: Int32, tidx: Int32) -> cute.Tensor:
        """The thread's RPT rows x one 16-byte chunk of tile ``(row0, kb)`` in registers (zeros where masked)."""
        c = tidx % self.cpb
        q = tidx // self.cpb
        chunk = kb * self.cpb + c
        col_ok = chunk * self.vec < self.K
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=_CHUNK_BYTES * 8)
        frag = cute.make_rmem_tensor((self.vec, self.rpt), self.dtype)
        frag.fill(0.0)
        first_row = Int64(row0 + q * self.rpt)       # rows first_row + u: one address plus constant offsets
        for u in cutlass.range_constexpr(self.rpt):
            if col_ok & (q * self.rpt + u < nrows):
                cute.copy(load, mX[first_row + u, chunk, None], frag[None, u])
        return frag

    @cute.jit
    def issue_tile(self, mX: cute.Tensor, mSizes: cute.Tensor, M: Int32, t: Int32, blocks: Int32, sTile: cute.Tensor,
                   tidx: Int32):
        """cp.async of tile ``t`` (of ``blocks`` row blocks)'s rows into the thread's slice ``sTile`` (vec, RPT) of a
        ring stage, rows past the block's and chunks past K zero-filled (source size 0, read from row 0 of the
        tile's column block)."""
        c = tidx % self.cpb
        q = tidx // self.cpb
        b, kb = self.tile_coords(t, blocks)
        row0, nrows = self.block_rows(mSizes, M, b, tidx % _LANES)
        chunk = kb * self.cpb + c
        col_ok = chunk * self.vec < self.K
        safe_chunk = cutlass.min(chunk, Int32(self.K // self.vec - 1))
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                   num_bits_per_copy=_CHUNK_BYTES * 8)
        first_row = Int64(row0 + q * self.rpt)
        for u in cutlass.range_constexpr(self.rpt):
            ok = cute.make_rmem_tensor((1,), cutlass.Boolean)
            ok[0] = col_ok & (q * self.rpt + u < nrows)
            row = cutlass.select_(ok[0], first_row + u, Int64(0))
            # one 16-byte atom: a (V, rest) profile whose V is the whole chunk
            src = cute.make_tensor(mX[row, safe_chunk, None].iterator, cute.make_layout(((self.vec, 1),)))
            dst = cute.make_tensor(sTile[None, u].iterator, cute.make_layout(((self.vec, 1),)))
            cute.copy(atom, src, dst, pred=ok)

    @cute.jit
    def tile_coords(self, t: Int32, blocks: Int32):
        """``(row block b, column block kb)`` of a pipelined CTA's tile ``t`` of ``blocks`` row blocks."""
        b = t // self.nkb
        kb = t - b * self.nkb
        if const_expr(self.blocks_fastest):
            kb = t // blocks
            b = t - kb * blocks
        return b, kb

    def row_blocks(self, M: Int32):
        """Trace time: the row blocks a launch covers: ``ceil(M / 128)``, plus ``G`` columnwise (each group may end
        in a partial block; the sizes stay on the device)."""
        blocks = (M + TILE - 1) // TILE
        if const_expr(self.columnwise):
            blocks = blocks + self.G
        return blocks

    @cute.jit
    def used_blocks(self, mSizes: cute.Tensor, M: Int32, lane: Int32) -> Int32:
        """The row blocks the groups use (the sum of their ``ceil(size / 128)``, as :meth:`block_rows` counts
        them, at most :meth:`row_blocks`): the blocks past them are unused capacity (:data:`SKIP_EMPTY_TILES`).
        Every lane of the warp must call it."""
        used = (M + TILE - 1) // TILE
        if const_expr(self.sizes_dtype is not None):
            part = Int32(0)
            for j in cutlass.range_constexpr(self.per_lane):
                part = part + (self.group_size(mSizes, M, lane * self.per_lane + j) + TILE - 1) // TILE
            for k in cutlass.range_constexpr(5):
                part = part + cute.arch.shuffle_sync_bfly(part, 1 << k)
            used = part
        # every lane holds the same sum: said so, the loops it bounds are not divergent to ptxas (whose collective
        # shuffle wrappers otherwise doubled the kernel)
        return cute.arch.make_warp_uniform(cutlass.min(used, self.row_blocks(M)))

    @cute.jit
    def group_size(self, mSizes: cute.Tensor, M: Int32, i: Int32) -> Int32:
        """Group ``i``'s size clamped to ``[0, M]`` (0 past the last group)."""
        size = Int32(0)
        if i < self.G:
            raw = mSizes[cutlass.min(i, self.G - 1)]
            if const_expr(self.sizes_dtype == "int64"):
                size = Int32(cutlass.max(cutlass.min(Int64(raw), Int64(M)), Int64(0)))
            else:
                size = cutlass.max(cutlass.min(Int32(raw), M), Int32(0))
        return size

    @cute.jit
    def pipelined_tiles(self, mX: cute.Tensor, mData: cute.Tensor, mScale: cute.Tensor, pCwData: cute.Pointer,
                        mCwScale: cute.Tensor, mSizes: cute.Tensor, mAmax: cute.Tensor, M: Int32, tiles: Int32,
                        sRaw: cute.Tensor, shared, bid: Int32, tidx: Int32):
        """The persistent CTA's loop: tiles ``bid, bid + grid, ...`` (tile ``t`` = columnwise block ``t // nkb``,
        column block ``t % nkb``), the loads of the next ``stages - 1`` in flight (one cp.async group each, empty
        past the last tile) while tile ``i`` is encoded from ring stage ``i % stages``. A stage is refilled only
        after the barriers of the tile that read it. With :data:`SKIP_EMPTY_TILES` the loop covers only the row
        blocks the groups use (:meth:`used_blocks`), and the unused capacity's tiles follow as
        :meth:`empty_tile`'s zero writes, again ``bid, bid + grid, ...``."""
        S = self.stages
        grid, _, _ = cute.arch.grid_dim()
        blocks = self.row_blocks(M)
        if const_expr(self.skip_empty):
            blocks = self.used_blocks(mSizes, M, tidx % _LANES)
            tiles = blocks * self.nkb
        for s in cutlass.range_constexpr(S - 1):
            if bid + s * grid < tiles:
                self.issue_tile(mX, mSizes, M, bid + s * grid, blocks, sRaw[None, None, tidx, s], tidx)
            cute.arch.cp_async_commit_group()
        t = bid
        i = Int32(0)
        while t < tiles:
            ahead = t + (S - 1) * grid
            if ahead < tiles:
                self.issue_tile(mX, mSizes, M, ahead, blocks, sRaw[None, None, tidx, (i + S - 1) % S], tidx)
            cute.arch.cp_async_commit_group()
            # tile i's group: the S - 1 after it may stay in flight. No barrier: a thread reads back only its own
            # slice of the stage, and encode_tile's barriers order the shared tiles' reuse between tiles
            cute.arch.cp_async_wait_group(S - 1)
            b, kb = self.tile_coords(t, blocks)
            row0, nrows = self.block_rows(mSizes, M, b, tidx % _LANES)
            sTile = sRaw[None, None, tidx, i % S]
            frag = cute.make_rmem_tensor((self.vec, self.rpt), self.dtype)
            cute.autovec_copy(sTile, frag)
            self.encode_tile(frag, sTile, mData, mScale, pCwData, mCwScale, mAmax, shared, M, b, kb, row0, nrows,
                             tidx)
            t = t + grid
            i = i + 1
        cute.arch.cp_async_wait_group(0)
        if const_expr(self.skip_empty):
            e = bid
            while e < (self.row_blocks(M) - blocks) * self.nkb:
                b = e // self.nkb
                self.empty_tile(pCwData, mCwScale, M, blocks + b, e - b * self.nkb, tidx)
                e = e + grid

    @cute.jit
    def empty_tile(self, pCwData: cute.Pointer, mCwScale: cute.Tensor, M: Int32, b: Int32, kb: Int32, tidx: Int32):
        """What a tile of unused columnwise capacity (row block ``b`` past every group's blocks) writes, the same
        bytes :meth:`encode_tile` writes for it: its columns' scales 0.0 and, in the slot layout, its 128 rows of zero
        codes (the rowwise and (K, M) copies have no rows there; the amax gains nothing). No load, no barrier, no
        shared memory."""
        if tidx < TILE:
            if kb * TILE + tidx < self.K:
                mCwScale[b, kb * TILE + tidx] = Float32(0.0)
        if const_expr(self.slots):
            self.store_slot(None, pCwData, M, b, kb, tidx // _LANES, tidx % _LANES, zero=True)

    @cute.jit
    def encode_tile(self, frag: cute.Tensor, sTile, mData: cute.Tensor, mScale: cute.Tensor, pCwData: cute.Pointer,
                    mCwScale: cute.Tensor, mAmax: cute.Tensor, shared, M: Int32, b: Int32, kb: Int32, row0: Int32,
                    nrows: Int32, tidx: Int32):
        """One tile from the thread's loaded rows ``frag`` (and, columnwise, their parked copy ``sTile``): the
        rowwise codes and scales, the columnwise amax, scales and codes. Ends after a barrier past the last read
        of ``sTile``, so a pipelined CTA may refill that stage; the next tile writes the shared tiles only after
        barriers every thread reaches when done with this one's (a pipelined rowwise-only build ends with one: the
        next tile's row scales would overwrite this one's before every thread stored them)."""
        sRowScale, sColInv, sPart, sCodes = shared
        lane = tidx % _LANES
        warp = tidx // _LANES
        c = tidx % self.cpb
        q = tidx // self.cpb
        chunk = kb * self.cpb + c
        col_ok = chunk * self.vec < self.K
        first_row = Int64(row0 + q * self.rpt)
        # ---- rowwise: amax over the row's CPB lanes, codes, scale to shared memory
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), FP8, num_bits_per_copy=self.vec * 8)
        col_bits = [Int32(0)] * self.vec
        run_all = Int32(0)    # (pairs) the halfwise max of the thread's finite bf16 magnitudes
        col_runs = [Int32(0)] * (self.vec // 2)   # (column_pairs) halfwise maxima: columns 2j, 2j + 1 of word j
        for u in cutlass.range_constexpr(self.rpt):
            if const_expr(self.pairs):
                vals, row_bits, run = self.row_by_pairs(frag, u)
                run_all = max2_u16(run_all, run)
            elif const_expr(self.column_pairs):
                vals, row_bits = self.row_and_columns_by_pairs(frag, u, col_runs, sTile)
            else:
                ys = self.row_values(frag, u)
                mags = []
                for i in cutlass.range_constexpr(self.vec):
                    mags.append(finite_abs_bits(ys[i]))
                for i in cutlass.range_constexpr(self.vec):
                    col_bits[i] = cutlass.max(col_bits[i], mags[i][0])
                if const_expr(self.rowwise):   # (the slot layout's columnwise-only kernel skips the row's work)
                    amax = Int32(0)
                    for i in cutlass.range_constexpr(self.vec):
                        amax = cutlass.max(amax, mags[i][0])
                    for k in cutlass.range_constexpr(self.cpb.bit_length() - 1):
                        amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, 1 << k))
                    row_bits, row_inv = fp8_block_scale_bits(amax)
                    vals = cute.make_rmem_tensor((self.vec,), Float32)
                    for i in cutlass.range_constexpr(self.vec):
                        vals[i] = scaled_or_nan(ys[i], mags[i][1], row_inv)
            if const_expr(self.rowwise):
                codes = cute.make_rmem_tensor((self.vec,), FP8)
                codes.store(vals.load().to(FP8))
                r = q * self.rpt + u
                if col_ok & (r < nrows):
                    cute.copy(store, codes, mData[first_row + u, chunk, None])
                if c == 0:
                    sRowScale[r] = bits_f32(row_bits)
        if const_expr(self.pairs):
            col_bits = [bf16_pair_amax_bits(run_all)]
        if const_expr(self.column_pairs):
            # ---- columnwise amax: the words' halfwise maxima over the lanes of the same chunk, then per column
            for j in cutlass.range_constexpr(self.vec // 2):
                for k in cutlass.range_constexpr((_LANES // self.cpb).bit_length() - 1):
                    col_runs[j] = max2_u16(col_runs[j], cute.arch.shuffle_sync_bfly(col_runs[j], self.cpb << k))
            col_bits = []
            for j in cutlass.range_constexpr(self.vec // 2):
                col_bits.extend([(col_runs[j] & 0xFFFF) << 16, (col_runs[j] >> 16 & 0xFFFF) << 16])
        if const_expr(self.amax):
            # ---- the tensor's finite amax: the thread's columns, the warp, one atomic max per warp
            amax_bits = col_bits[0]
            for i in cutlass.range_constexpr(1, len(col_bits)):
                amax_bits = cutlass.max(amax_bits, col_bits[i])
            for k in cutlass.range_constexpr(_LANES.bit_length() - 1):
                amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 1 << k))
            if lane == 0:
                cute.arch.atomic_max(mAmax.iterator.llvm_ptr, amax_bits)
        if const_expr(self.columnwise):
            # ---- columnwise amax: this thread's rows, the lanes of the same chunk, the warps
            for i in cutlass.range_constexpr(self.vec):
                if const_expr(not self.column_pairs):
                    for k in cutlass.range_constexpr((_LANES // self.cpb).bit_length() - 1):
                        col_bits[i] = cutlass.max(col_bits[i],
                                                  cute.arch.shuffle_sync_bfly(col_bits[i], self.cpb << k))
                if lane < self.cpb:
                    sPart[c * self.vec + i, warp] = col_bits[i]
        cute.arch.sync_threads()
        if tidx < TILE:
            if const_expr(self.rowwise):
                if tidx < nrows:
                    mScale[kb, row0 + tidx] = sRowScale[tidx]
        elif const_expr(self.columnwise):
            t = tidx - TILE
            col_amax = Int32(0)
            for w in cutlass.range_constexpr(THREADS // _LANES):
                col_amax = cutlass.max(col_amax, sPart[t, w])
            scale_bits, inv = fp8_block_scale_bits(col_amax)
            sColInv[t] = inv
            if kb * TILE + t < self.K:
                mCwScale[b, kb * TILE + t] = bits_f32(cutlass.select_(nrows == 0, Int32(0), scale_bits))
        if const_expr(self.columnwise):
            cute.arch.sync_threads()
            parked = cute.make_rmem_tensor((self.vec, self.rpt), self.dtype)
            cute.autovec_copy(sTile, parked)
            if const_expr(self.column_pairs):
                self.columns_to_smem_by_pairs(parked, sColInv, sCodes, c, q)
            else:
                self.columns_to_smem(parked, sColInv, sCodes, c, q)
            cute.arch.sync_threads()
            if const_expr(self.slots):
                self.store_slot(sCodes, pCwData, M, b, kb, warp, lane)
            else:
                self.store_columns(sCodes, pCwData, M, row0, nrows, kb, warp, lane)
        elif const_expr(self.stages):
            cute.arch.sync_threads()

    # ------------------------------------------------------------------ columnwise codes
    @cute.jit
    def code_word(self, sCodes: cute.Tensor, kl: Int32, w: Int32) -> Int32:
        """Codes of rows ``4w .. 4w + 3`` of tile column ``kl`` (little endian) from the swizzled tile."""
        # slot_words, vec and rg are powers of two and kl, w >= 0: shifts and masks, not signed division
        sw, v = self.slot_words.bit_length() - 1, self.vec.bit_length() - 1
        slot = (w >> sw) ^ ((kl >> v) & (self.rg - 1))
        return sCodes[kl * (TILE // 4) + (slot << sw) + (w & (self.slot_words - 1))]

    @cute.jit
    def columns_to_smem(self, frag: cute.Tensor, sColInv: cute.Tensor, sCodes: cute.Tensor, c: Int32, q: Int32):
        """The thread's RPT consecutive rows of each of its columns, encoded with the column's scale, as one
        8- or 16-byte store into the column's slot ``q`` (XOR-swizzled by the chunk: the lanes of one store
        instruction hit distinct banks)."""
        slot = q ^ (c % self.rg)
        ys = [self.row_values(frag, u) for u in range(self.rpt)]
        for i in cutlass.range_constexpr(self.vec):
            self.column_to_smem([y[i] for y in ys], sColInv, sCodes, c * self.vec + i, slot)

    @cute.jit
    def columns_to_smem_by_pairs(self, frag: cute.Tensor, sColInv: cute.Tensor, sCodes: cute.Tensor, c: Int32,
                                 q: Int32):
        """:meth:`columns_to_smem` from the parked clean words (``column_pairs``: their non-finite halves are a quiet
        NaN already), so each value is widened and scaled with no test."""
        slot = q ^ (c % self.rg)
        words = cute.recast_tensor(frag, Int32)
        per_row = self.vec // 2
        for j in cutlass.range_constexpr(per_row):
            inv_lo, inv_hi = sColInv[c * self.vec + 2 * j], sColInv[c * self.vec + 2 * j + 1]
            lo = cute.make_rmem_tensor((self.rpt,), Float32)
            hi = cute.make_rmem_tensor((self.rpt,), Float32)
            for u in cutlass.range_constexpr(self.rpt):
                y_lo, y_hi = unpack2(words[j + per_row * u], self.dtype)
                lo[u] = y_lo * inv_lo
                hi[u] = y_hi * inv_hi
            self.codes_to_smem(lo, sCodes, c * self.vec + 2 * j, slot)
            self.codes_to_smem(hi, sCodes, c * self.vec + 2 * j + 1, slot)

    def codes_to_smem(self, vals, sCodes: cute.Tensor, k: Int32, slot: Int32):
        """Trace time: one column's RPT scaled values as E4M3 codes into the column's slot of the shared tile."""
        codes = cute.make_rmem_tensor((self.rpt,), FP8)
        codes.store(vals.load().to(FP8))
        words = cute.recast_tensor(codes, Int32)
        addr = sCodes.iterator.toint() + (k * (TILE // 4) + slot * self.slot_words) * 4
        dst = cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=self.rpt),
                               cute.make_layout((self.slot_words,)))
        cute.autovec_copy(words, dst)

    def column_to_smem(self, ys, sColInv: cute.Tensor, sCodes: cute.Tensor, k: Int32, slot: Int32):
        """Trace time: one column's RPT values encoded with its scale into the column's slot of the shared tile."""
        inv = sColInv[k]
        vals = cute.make_rmem_tensor((self.rpt,), Float32)
        for u in range(self.rpt):
            y = ys[u]
            _, fin = finite_abs_bits(y)
            vals[u] = scaled_or_nan(y, fin, inv)
        self.codes_to_smem(vals, sCodes, k, slot)

    @cute.jit
    def store_columns(self, sCodes: cute.Tensor, pCwData: cute.Pointer, M: Int32, row0: Int32, nrows: Int32,
                      kb: Int32, warp: Int32, lane: Int32):
        """``cw_data[k, row0 : row0 + nrows]`` for the tile's columns, one column per warp and step. Lane ``w``
        writes the ``w``-th 4-byte-aligned word from the one holding ``k * M + row0``: rows ``4w - sh ..``
        (``sh`` = that start's misalignment), two shared words funnel-shifted; a word the block only partly
        covers is written byte by byte (the neighbouring block writes the rest), and lane 31 writes the
        ``sh`` bytes past word 31. With :data:`EDGE_BYTES_BY_LANES` the lanes store only whole words, and the
        columns' partial words follow as bytes, a few a thread (:meth:`store_edges`)."""
        for it in cutlass.range_constexpr(TILE // (THREADS // _LANES)):
            self.store_column(sCodes, pCwData, M, row0, nrows, kb, it * (THREADS // _LANES) + warp, lane)
        if const_expr(self.edge_lanes):
            self.store_edges(sCodes, pCwData, M, row0, nrows, kb, warp * _LANES + lane)

    @cute.jit
    def store_column(self, sCodes: cute.Tensor, pCwData: cute.Pointer, M: Int32, row0: Int32, nrows: Int32,
                     kb: Int32, kl: Int32, lane: Int32):
        """Column ``kl`` of the tile: this lane's word of ``cw_data[k, row0 : row0 + nrows]`` (:meth:`store_columns`)."""
        k = kb * TILE + kl
        if k < self.K:
            start = Int64(k) * Int64(M) + Int64(row0)
            sh = Int32(start & 3)
            word0 = pCwData.toint() + (start - Int64(sh))
            val, spill = funnel_word(self.code_word(sCodes, kl, cutlass.max(lane - 1, Int32(0))),
                                     self.code_word(sCodes, kl, lane), sh, lane == 0)
            p, whole = whole_word_rows(lane, sh, nrows)
            addr = word0 + Int64(lane * 4)
            if const_expr(self.edge_lanes):
                if whole:
                    cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4),
                                     cute.make_layout((1,)))[0] = Int32(val)
            else:
                if whole:
                    cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4),
                                     cute.make_layout((1,)))[0] = Int32(val)
                else:
                    self.store_bytes(addr, val, p, 4, nrows)
                if (lane == _LANES - 1) & (sh > 0):
                    self.store_bytes(word0 + Int64(TILE), spill, TILE - sh, sh, nrows)

    @cute.jit
    def store_edges(self, sCodes: cute.Tensor, pCwData: cute.Pointer, M: Int32, row0: Int32, nrows: Int32, kb: Int32,
                    tidx: Int32):
        """The bytes of the tile's columns that no whole word holds (:data:`EDGE_BYTES_BY_LANES`), once per tile
        after :meth:`store_column`'s whole words: thread ``tidx`` takes column ``tidx // 2``'s head (even threads:
        edge rows 0-2 of :func:`edge_byte_row`) or tail (odd: edge rows 3-5), three predicated byte stores. A
        column's edge work thus costs a warp a few instructions, not the ~20 every lane issued for each of its 16
        columns when the edge bytes were computed beside the words."""
        kl = tidx >> 1
        k = kb * TILE + kl
        if k < self.K:
            start = Int64(k) * Int64(M) + Int64(row0)
            sh = Int32(start & 3)
            base = pCwData.toint() + start
            for j in cutlass.range_constexpr(3):
                r, edge = edge_byte_row((tidx & 1) * 3 + j, sh, nrows)
                if edge:
                    word = _word(self.code_word(sCodes, kl, r >> 2))
                    cute.make_tensor(cute.make_ptr(Uint8, base + Int64(r), cute.AddressSpace.gmem, assumed_align=1),
                                     cute.make_layout((1,)))[0] = Uint8((word >> _word(8 * (r & 3))) & _word(0xFF))

    @cute.jit
    def store_slot(self, sCodes: cute.Tensor, pCwData: cute.Pointer, M: Int32, b: Int32, kb: Int32, warp: Int32,
                   lane: Int32, zero: cutlass.Constexpr = False):
        """The slot layout: ``cw_data[k, 128 b : 128 b + 128]`` for the tile's columns, one column per warp and
        step, lane ``w`` writing rows ``4w .. 4w + 3`` as one aligned word (rows past the block's are zero codes:
        their values were loaded as zeros; ``zero``: every word zero, ``sCodes`` unread)."""
        length = Int64(self.row_blocks(M)) * Int64(TILE)
        for it in cutlass.range_constexpr(TILE // (THREADS // _LANES)):
            kl = it * (THREADS // _LANES) + warp
            k = kb * TILE + kl
            if k < self.K:
                addr = pCwData.toint() + Int64(k) * length + Int64(b) * Int64(TILE) + Int64(lane * 4)
                word = Int32(0) if const_expr(zero) else self.code_word(sCodes, kl, lane)
                cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4),
                                 cute.make_layout((1,)))[0] = word

    @cute.jit
    def store_bytes(self, addr: Int64, val, p: Int32, count, nrows: Int32):
        """Bytes ``j < count`` of ``val`` (rows ``p + j``) at ``addr + j``, those of rows in ``[0, nrows)``."""
        for j in cutlass.range_constexpr(4):
            if (j < count) & (p + j >= 0) & (p + j < nrows):
                cute.make_tensor(cute.make_ptr(Uint8, addr + Int64(j), cute.AddressSpace.gmem, assumed_align=1),
                                 cute.make_layout((1,)))[0] = Uint8((val >> cutlass.Uint32(8 * j)) & cutlass.Uint32(0xFF))


def compile_fp8_quantize(dtype: str, K: int, columnwise: bool, G: int = 1,
                         sizes_dtype: str | None = None, amax: bool = False, slots: bool = False,
                         rowwise: bool = True, min_ctas: int = 0) -> UtilityKernel:
    """The quantize kernel for rows of ``dtype`` ("bfloat16", "float16", "float32") and length ``K``, compiled
    once per process. ``launch(x, data, scale, cw_data, cw_scale, sizes, amax, M, grid_limit, stream)`` with plain
    integers (pointers; rowwise only, the columnwise ones and ``sizes`` may be 0; without ``amax``, so may its;
    ``grid_limit``: :func:`grid_limit`). ``G``, ``sizes_dtype``: the groups of the columnwise blocks (ignored
    rowwise; None: one group of all rows); ``slots``, ``rowwise``: :class:`FP8QuantizeKernel`'s; ``min_ctas``:
    :func:`build_kernel`'s. The result's ``ctas_per_sm`` is the build's launch bound."""
    if not columnwise:
        G, sizes_dtype, slots, rowwise = 1, None, False, True
    pairs, column_pairs = PAIRS, COLUMN_PAIRS
    pipelined = _pipelined(dtype, columnwise, slots)
    blocks_fastest = BLOCKS_FASTEST and columnwise and not slots
    edge_lanes = EDGE_BYTES_BY_LANES and columnwise and not slots
    skip_empty = SKIP_EMPTY_TILES and columnwise

    def build():
        fn, _, kernel = build_kernel(dtype, K, columnwise, G, sizes_dtype, amax, slots, rowwise, pairs, min_ctas,
                                     pipelined, column_pairs, blocks_fastest, edge_lanes, skip_empty)
        return UtilityKernel(fn, ctas_per_sm=kernel.min_ctas)

    return compile_once(("fp8_quantize", dtype, K, columnwise, G, sizes_dtype, amax, slots, rowwise, pairs, min_ctas,
                         pipelined, column_pairs, blocks_fastest, edge_lanes, skip_empty), build)


def _pipelined(dtype: str, columnwise: bool, slots: bool) -> bool:
    """Whether a build of this layout is pipelined: :data:`PIPELINED` (slot layout), :data:`PIPELINED_COLUMNS`
    ((K, M) layout, bf16 only) or :data:`PIPELINED_ROWWISE` (rowwise only), read when it is built."""
    if not columnwise:
        return PIPELINED_ROWWISE
    return PIPELINED if slots else PIPELINED_COLUMNS and dtype == "bfloat16"


def grid_limit(kernel: UtilityKernel, sms: int) -> int:
    """The most CTAs a pipelined build's launch takes on a GPU of ``sms`` SMs: one wave, its persistent CTAs
    (the one-tile-a-CTA builds ignore it); at least one."""
    return max(1, sms * kernel.ctas_per_sm)


def build_kernel(dtype: str, K: int, columnwise: bool, G: int = 1, sizes_dtype: str | None = None,
                 amax: bool = False, slots: bool = False, rowwise: bool = True, pairs: bool = True,
                 min_ctas: int = 0, pipelined: bool | None = None, column_pairs: bool | None = None,
                 blocks_fastest: bool | None = None, edge_lanes: bool | None = None, skip_empty: bool | None = None):
    """``(compiled function, cubin, kernel)``: built for two CTAs an SM (128 registers a thread), or for one
    where that spills (the fp32 columnwise kernel, and a few shapes where the compiler's schedule needs more),
    as the grouped GEMMs fall back to a tile that does not spill; ``min_ctas`` > 0: built for that many CTAs an SM
    whatever it spills (the bf16 rowwise + slots build needs 138 registers, so the rule above gives it one CTA an SM
    and half the loads in flight); ``pipelined``, ``column_pairs``: :class:`FP8QuantizeKernel`'s (None:
    :func:`_pipelined`'s setting for the layout, :data:`COLUMN_PAIRS`); ``blocks_fastest``, ``edge_lanes``,
    ``skip_empty``: None reads :data:`BLOCKS_FASTEST` (a (K, M) build's), :data:`EDGE_BYTES_BY_LANES` and
    :data:`SKIP_EMPTY_TILES`, as :func:`compile_fp8_quantize` does. What tests read the SASS of: the defaults build what runs. The tile order changes ptxas's allocation: at
    G=1 and K=7168 or 2880 the column-blocks-fastest order spills one register at two CTAs an SM (stop 66's CI
    failure, a test building that order), the row-blocks-fastest order that runs does not (nor on 23 other
    (K, G) of real blocks, session ak)."""
    import shlex
    import tempfile

    from .api import _cubin_nv_info

    pipelined = _pipelined(dtype, columnwise, slots) if pipelined is None else pipelined
    column_pairs = COLUMN_PAIRS if column_pairs is None else column_pairs
    edge_lanes = EDGE_BYTES_BY_LANES if edge_lanes is None else edge_lanes
    if blocks_fastest is None:
        blocks_fastest = BLOCKS_FASTEST and columnwise and not slots
    skip_empty = SKIP_EMPTY_TILES if skip_empty is None else skip_empty
    for min_ctas in ((min_ctas,) if min_ctas else (MIN_CTAS_PER_SM, 1)):
        kernel = FP8QuantizeKernel(dtype, K, columnwise, G, sizes_dtype, min_ctas, amax, slots, rowwise, pairs,
                                   pipelined, column_pairs, blocks_fastest, edge_lanes, skip_empty)
        with tempfile.TemporaryDirectory() as dump:
            fn = compile_kernel(kernel, f"--enable-tvm-ffi --keep-cubin --dump-dir={shlex.quote(dump)}")
            cubin = getattr(fn, "__cubin__", None)
        if min_ctas == 1 or cubin is None or not _cubin_nv_info(cubin).get("frame_size", 0):
            return fn, cubin, kernel
    return fn, cubin, kernel


def compile_kernel(kernel: FP8QuantizeKernel, options: str = "--enable-tvm-ffi"):
    """``cute.compile`` of a kernel instance with placeholder pointers."""
    from cutlass.runtime import make_fake_stream

    x = make_ptr(kernel.dtype, 0, cute.AddressSpace.gmem, assumed_align=16)
    codes = make_ptr(FP8, 0, cute.AddressSpace.gmem, assumed_align=16)
    floats = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16)
    sizes = make_ptr(cutlass_dtype(kernel.sizes_dtype or "int32"), 0, cute.AddressSpace.gmem, assumed_align=4)
    amax = make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
    return cute.compile(kernel, x, codes, floats, codes, floats, sizes, amax, Int32(1), Int32(1), make_fake_stream(),
                        options=options)
