"""Warp roles of the FP8 block-scaled grouped GEMM: the bf16 kernel's producer plus scale loads, and
wgmma consumers that promote every k-tile's partial sums into an fp32 accumulator with the scales applied.

- producer: :meth:`kernels.mainloop.WarpRoles.produce` (A and B tiles, gated half boxes, both schedulers);
  its per-stage hooks add the scales of the k-tile: the activation scales ``sa[kt, row0 : row0 + tile_m]``
  (one TMA box of the flat 1-D view) and one 16-byte box per weight-scale slot (``sb[g, block, kt]``,
  kernels/fp8_scales.py). Each box starts at its first wanted float rounded down to a 16-byte boundary (TMA
  traps on an unaligned start); the consumers read ``box_shift`` floats into it. They land in the stage's
  scale buffers under the stage's mbarrier, so a consumer that waited for the stage reads them from shared
  memory.
- consumers (warpgroups 1..2, 64 rows of each 128-row wave of the tile: one wave in a 128-row tile, two in a
  256-row one; with two CTAs an SM, GemmConfig.ctas_per_sm = 2, warpgroup 1 alone, a 128-row tile as two 64-row
  waves), per k-tile and wave: wgmma into a scratch fp32 fragment ``part`` (zeroed by the first wgmma:
  ACCUMULATE off), read the row and block scales of the stage while it runs, wait, (after the last wave)
  release the stage, then ``acc[wave] = part * (sa[row] * sb[slot]) + acc[wave]`` (one FFMA per element; the
  slot of an accumulator column is known at trace time, or, for a segment that straddles a 128-row boundary,
  chosen per 8-column chunk against a boundary computed once per tile). The two warpgroups drift apart, so
  one's promotion overlaps the other's wgmma. Then the bf16 kernel's epilogue. The waves of a 256-row tile
  share one scratch fragment, so the tile costs 64 more accumulator registers per thread, not 128: A and B
  cross L2 and shared memory once per 256 x tile_n of output instead of 128 x tile_n. A gated 128 x 256 tile walks
  *n-waves* the same way: per k-tile the gate half's 64 x 128 wgmma (B rows [0, 128) of the stage), promoted into
  the accumulator's first 16 chunks, then the up half's into the next 16 (the layout one 64 x 256 wgmma would
  give, which the gated epilogue reads), so each accumulator row is 128 whole logical columns: the FP8-block
  store's 1x128 block (kernels/fp8_block_store.py).

  With ``GemmConfig.ordered_waves`` the two warpgroups take turns on named barriers (:func:`take_turn`): a wave's
  wgmma are issued only after the other warpgroup's previous wave finished. Measured 1.1-3.0% slower in five FP8 steps
  (session ai): they drift apart as it is, and the turns add a barrier's latency to each wave (off).

  No "overlapped" fold (a second scratch fragment, k-tile t folded while k-tile t + 1's wgmma runs): an earlier
  build had one, and on an H200 it gave wrong results under load (launches on 7 CTAs, 2-26 of 60 wrong against
  0 of 60 for this serial fold, at K = 512) while the serial fold was as fast or faster (0.92-1.01x its time on
  six MoE GEMMs; bench/results/H200-2026-11-26-fp8-overlap.txt). It was removed.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .fp8_scales import SA_BOX, SB_BOX, SCALE_BLOCK, box_shift, box_start, segment_of
from .mainloop import PINGPONG_BARRIER, WarpRoles

#: setmaxnreg split (producer, consumer warpgroup) of a CTA of two CTAs an SM (the FP8 kernels' ``ctas_per_sm = 2``:
#: kernels/fp8_gemm.py, kernels/fp8_wgrad.py): each starts with 256 threads x 128 registers (65536 an SM), and the
#: consumer can take only what the producer's warpgroup gives back (sum <= 256).
TWO_CTA_REGISTER_SPLIT = (32, 224)
#: cudaSharedmemCarveoutMaxShared: the SM's whole unified L1 / shared memory as shared memory (two CTAs an SM).
MAX_SHARED_CARVEOUT = 100
#: Named barriers 8, 9 (the bf16 kernels' pingpong order; the FP8 kernels are cooperative): with ordered waves,
#: consumer warpgroup ``w`` waits on ``WAVE_ORDER_BARRIER + w`` for its turn to issue a wave (GemmConfig.ordered_waves,
#: WgradConfig.ordered_waves).
WAVE_ORDER_BARRIER = PINGPONG_BARRIER


@cute.jit
def take_turn(ordered: cutlass.Constexpr, cwg: Int32):
    """With ``ordered``: consumer warpgroup ``cwg`` (0 or 1) waits for its turn to issue a wave."""
    if const_expr(ordered):
        cute.arch.barrier(barrier_id=WAVE_ORDER_BARRIER + cwg, number_of_threads=256)


@cute.jit
def pass_turn(ordered: cutlass.Constexpr, cwg: Int32):
    """With ``ordered``: the wave's wgmma are done; the other consumer warpgroup's turn (while this one promotes)."""
    if const_expr(ordered):
        cute.arch.barrier_arrive(barrier_id=WAVE_ORDER_BARRIER + 1 - cwg, number_of_threads=256)


@cute.jit
def first_turn(ordered: cutlass.Constexpr, cwg: Int32):
    """With ``ordered``, before the first wave: warpgroup 1 hands warpgroup 0 the first turn."""
    if const_expr(ordered):
        if cwg == 1:
            cute.arch.barrier_arrive(barrier_id=WAVE_ORDER_BARRIER, number_of_threads=256)


@cute.jit
def last_turn(ordered: cutlass.Constexpr, cwg: Int32):
    """With ``ordered``, after the last wave: warpgroup 0 takes warpgroup 1's last turn, so every arrival on the
    order barriers is matched (warpgroup 1's first one too, when there was no wave at all)."""
    if const_expr(ordered):
        if cwg == 0:
            cute.arch.barrier(barrier_id=WAVE_ORDER_BARRIER, number_of_threads=256)


def issue_wave(tiled_mma, frag, tCrA, tCrB, stage):
    """Trace time: issue one wave's k-tile of wgmma (A: that wave's slice of the stage) into ``frag`` (the first
    one overwrites it: ACCUMULATE off), one commit group: the FP8 kernels' scratch fragment, promoted after the wait
    (this kernel's consumers and kernels/fp8_wgrad.py's). Returns the MMA (its ACCUMULATE field is a traced value:
    callers rebind it, so that loops carry it)."""
    warpgroup.fence()
    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
    for kb in range(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, frag, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], frag)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    return tiled_mma


class Fp8WarpRoles(WarpRoles):
    """Producer hooks and the consumer body (``@cute.jit``, inlined into the kernel)."""

    # ------------------------------------------------------------------ producer hooks
    def tile_extra_loads(self, extras, g, row0, n_idx):
        """Per tile: where k-tile 0's scales are in the flat views (:meth:`scale_coords`)."""
        return self.scale_coords(g, row0, n_idx)

    def scale_coords(self, g, row0, n_idx):
        """The flat offsets of ``sa[0, row0]`` and of ``sb[g, block, 0]`` of every slot: k-tile ``kt``'s are
        ``kt * M`` and ``kt`` further (producer and consumers compute the same)."""
        sb_rows = []
        for seg in self.segments:
            blk = seg.first_row(n_idx) // SCALE_BLOCK
            sb_rows.append((g * self.n_blocks + blk) * self.k_tiles)
            if seg.split:
                sb_rows.append((g * self.n_blocks + blk + 1) * self.k_tiles)
        return row0, sb_rows

    def box_start(self, coord):
        return coord if self.debug.scales == "unaligned" else box_start(coord)

    def box_shift(self, coord):
        return 0 if self.debug.scales == "unaligned" else box_shift(coord)

    def stage_extra_loads(self, extras, tile_extra, kt, stage, bar):
        """k-tile ``kt``'s scales into ``stage``: per 128 rows of the tile the box holding ``sa[kt, row0 + 128 w :
        + 128]`` and, per slot, the one holding ``sb[g, block, kt]`` (floats past the tensor read zeros; they
        only reach masked outputs)."""
        if self.debug.scales == "off":
            return
        tma_sa, mSA, tma_sb, mSB, sSA, sSB, M = extras
        row0, sb_rows = tile_extra
        one = cute.make_layout(1)
        for w in range(self.sa_boxes):
            gSA = cute.local_tile(cute.domain_offset((self.box_start(kt * M + row0 + 128 * w),), mSA), (SA_BOX,),
                                  (0,))
            tSAs, tSAg = cpasync.tma_partition(tma_sa, 0, one, cute.group_modes(sSA, 0, 1),
                                               cute.group_modes(gSA, 0, 1))
            cute.copy(tma_sa, tSAg, tSAs[(None, w, stage)], tma_bar_ptr=bar)
        for slot, base in enumerate(sb_rows):
            gSB = cute.local_tile(cute.domain_offset((self.box_start(base + kt),), mSB), (SB_BOX,), (0,))
            tSBs, tSBg = cpasync.tma_partition(tma_sb, 0, one, cute.group_modes(sSB, 0, 1),
                                               cute.group_modes(gSB, 0, 1))
            cute.copy(tma_sb, tSBg, tSBs[(None, slot, stage)], tma_bar_ptr=bar)

    # ------------------------------------------------------------------ consumers
    def split_bounds(self, n_idx):
        """Per split segment (by first slot): the segment column where its second scale block begins."""
        return {seg.slot: SCALE_BLOCK - seg.first_row(n_idx) % SCALE_BLOCK
                for seg in self.segments if seg.split}

    def promote(self, acc, wave, part, row_scales, slot_scales, bounds):
        """``acc[wave] += part * sa[row] * sb[slot of the column]`` over the thread's fragment (trace-time loops).
        ``part`` is one wave's fragment ``((2 columns, 2 row halves, wave_n / 8 chunks), 1, 1)``; ``acc`` the
        tile's: ``(..., waves, 1)`` for m-waves, ``((2, 2, tile_n / 8), 1, 1)`` for n-waves (wave ``w``'s chunk
        ``c`` is the tile's chunk ``c + w * wave_n / 8``, so the gate half's chunks come before the up half's, as
        one 64 x tile_n wgmma would lay them out); chunk ``c`` covers tile columns ``[8c, 8c + 8)``, so its
        segment, hence its slot, is known here."""
        n_v, n_h, n_c = part.shape[0]
        scale = [[ra * sb for sb in slot_scales] for ra in row_scales]
        c_off = wave * n_c if self.n_waves > 1 else 0
        for h in range(n_h):
            for c in range(n_c):
                seg = segment_of(self.segments, 8 * (c + c_off))
                s = scale[h][seg.slot]
                if seg.split:
                    lo_side = Int32(8 * (c + c_off) - seg.col0) < bounds[seg.slot]
                    s = cutlass.select_(lo_side, s, scale[h][seg.slot + 1])
                for v in range(n_v):
                    i = ((v, h, c + c_off), 0, 0) if self.n_waves > 1 else ((v, h, c), wave, 0)
                    acc[i] = part[((v, h, c), 0, 0)] * s + acc[i]   # ptxas fuses this into one FFMA

    def read_scales(self, sSA, sSB, rows, coords, kt, stage, wave):
        """k-tile ``kt``'s scales from ``stage``: the thread's row scales in wave ``wave`` (``rows``: its rows
        of the wave) and every slot's weight scale (1 when the scales are off)."""
        if self.debug.scales == "off":
            return [Float32(1.0) for _ in rows], [Float32(1.0) for _ in range(self.slots)]
        row0, sb_rows, M = coords
        box, first = divmod(wave * self.wave_rows, 128)   # the wave's 128-row scale box, its first row in it
        sa_shift = self.box_shift(kt * M + row0 + 128 * box)
        row_scales = [sSA[(r + first + sa_shift, box, stage)] for r in rows]
        slot_scales = [sSB[(self.box_shift(base + kt), s, stage)] for s, base in enumerate(sb_rows)]
        return row_scales, slot_scales

    @cute.jit
    def consume_fp8(self, tiled_mma: cute.TiledMma, tiled_mma_log: cute.TiledMma, sA: cute.Tensor,
                    sB: cute.Tensor, sSA: cute.Tensor, sSB: cute.Tensor, mOffs: cute.Tensor, epi_tensors: tuple,
                    ab_pipe, sched_pipe, sTile: cute.Tensor, tidx: Int32, bidx: Int32, grid: Int32, M: Int32,
                    rank=0):
        """The consumer warpgroups (``bidx``, ``grid``, ``rank`` as for :meth:`WarpRoles.produce`)."""
        ctid = tidx - 128
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = tiled_mma.get_slice(ctid)
        # per m-wave, the operands over its wave_rows-row slice of the A ring; per n-wave, over its wave_n-row slice of
        # the B ring (both 1024-byte multiples: the swizzle holds)
        tCrB = [tiled_mma.make_fragment_B(thr_mma.partition_B(
            cute.local_tile(sB, (self.wave_n, self.tile_k, self.stages), (w, 0, 0)))) for w in range(self.n_waves)]
        tCrA = [tiled_mma.make_fragment_A(thr_mma.partition_A(
            cute.local_tile(sA, (self.wave_rows, self.tile_k, self.stages), (w, 0, 0)))) for w in range(self.waves)]
        tCcC = tiled_mma_log.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n_log)))
        tCcW = thr_mma.partition_C(cute.make_identity_tensor((self.wave_rows, self.wave_n)))   # one wave
        if const_expr(self.n_waves > 1):
            # the tile's accumulator as one 64 x tile_n wgmma would hold it: the gate chunks, then the up chunks
            n_vw, n_hw, n_cw = tCcW.shape[0]
            acc = cute.make_rmem_tensor(((n_vw, n_hw, n_cw * self.n_waves), 1, 1), self.acc_dtype)
        else:
            tCcP = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            assert cute.size(tCcP.shape[1]) == self.waves and cute.size(tCcP.shape[2]) == 1
            acc = cute.make_rmem_tensor(tCcP.shape, self.acc_dtype)
        part = cute.make_rmem_tensor(tCcW.shape, self.acc_dtype)
        n_h = cute.size(tCcW.shape[0][1])
        assert cute.size(tCcW.shape[1]) == 1 and cute.size(tCcW.shape[2]) == 1, \
            "one wgmma atom per warpgroup and wave: 64 rows x wave_n"
        # the thread's rows of a wave (wave w holds the tile's rows [wave_rows w, wave_rows (w + 1)))
        rows = [tCcW[((0, h, 0), 0, 0)][0] for h in range(n_h)]
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        ordered = self.ordered
        cwg = wg_idx - 1
        first_turn(ordered, cwg)
        if const_expr(self.dynamic):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
            tile_id, sched_state = self.sched.first_dynamic(sched_pipe, sched_state, sTile, 0)
        else:
            tile_id = self.sched.first_static(bidx, grid)
        g, base, cnt = self.sched.start(mOffs, tile_id)
        while g < self.G:
            m_idx, n_idx = self.sched.coords(tile_id, base, cnt, rank)
            row0 = mOffs[g] + m_idx * self.tile_m
            row_end = mOffs[g + 1]
            bounds = self.split_bounds(n_idx)
            tile_row0, sb_rows = self.scale_coords(g, row0, n_idx)
            coords = (tile_row0, sb_rows, M)

            acc.fill(0.0)
            # a short tile (its rows end within the first 64: WarpRoles.short_tile) leaves the second warpgroup
            # no wgmma: it only waits for each stage and releases it. Two loops with run-time trip counts, not a
            # branch: the MMA's ACCUMULATE field is a traced value that loops carry and branches cannot
            mma_tiles = self.k_tiles
            if const_expr(self.short_tiles):
                mma_tiles = cutlass.select_(self.short_tile(row0, row_end, wg_idx), Int32(0), Int32(self.k_tiles))
            for kt in cutlass.range(mma_tiles, unroll=1):
                ab_pipe.consumer_wait(read_state)
                stage = read_state.index
                for w in cutlass.range_constexpr(self.waves * self.n_waves):
                    wa = w if self.waves > 1 else 0      # the A slice (m-waves) and the B slice (n-waves)
                    wb = w if self.n_waves > 1 else 0
                    take_turn(ordered, cwg)
                    tiled_mma = issue_wave(tiled_mma, part, tCrA[wa], tCrB[wb], stage)
                    # the scales' shared-memory loads go out before the wait, their latency under the wgmma's
                    scales = self.read_scales(sSA, sSB, rows, coords, kt, stage, wa)
                    warpgroup.wait_group(0)
                    pass_turn(ordered, cwg)
                    if const_expr(w == self.waves * self.n_waves - 1):
                        ab_pipe.consumer_release(read_state)
                    self.promote(acc, w, part, *scales, bounds)
                read_state.advance()
            for kt in cutlass.range(self.k_tiles - mma_tiles, unroll=1):
                ab_pipe.consumer_wait(read_state)
                for w in cutlass.range_constexpr(self.waves * self.n_waves):
                    # a short tile's idle warpgroup still takes its turns: the order barriers stay matched
                    take_turn(ordered, cwg)
                    pass_turn(ordered, cwg)
                ab_pipe.consumer_release(read_state)
                read_state.advance()

            self.tile_epi.run(acc, tCcC, epi_tensors, row0, row_end, g, n_idx, self.N, None)

            if const_expr(self.dynamic):
                tile_id, sched_state = self.sched.next_dynamic(sched_pipe, sched_state, sTile)
            else:
                tile_id = self.sched.next_static(tile_id, grid)
            g, base, cnt = self.sched.seek(mOffs, tile_id, g, base, cnt)
        last_turn(ordered, cwg)
