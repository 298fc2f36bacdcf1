"""The gather-A producer of the grouped GEMM: A's rows are read through an index, so an MoE block's
``Gather -> GroupLinear`` never writes the gathered copy of its tokens.

    D[r] = epilogue(A[index[r]] @ B[g].T)      for r in offsets[g] .. offsets[g+1]

A is the token matrix ``(T, K)``, ``index`` an int32 ``(M,)``: routed row ``r`` multiplies token ``index[r]``.
A TMA box can only read consecutive rows, so A is loaded with 16-byte ``cp.async`` instead, by the whole
producer warpgroup (128 threads): each thread owns ``tile_m / 16`` rows of the tile and one 16-byte chunk of
each (the 8 chunks of a 128-byte swizzle row go to 8 neighbouring threads, so a warp reads 4 whole rows),
written through the same swizzled smem layout the wgmma reads. A thread reads its rows' token ids once per
tile and keeps one base address per row in registers, so a k-step costs it ``tile_m / 16`` copies.

Synchronisation (one ``PipelineTmaAsync`` ring, full barriers expecting ``1 + 128`` arrivals):

- warp 0 waits for the stage to be empty, arrives on its full barrier expecting B's bytes only
  (``producer_acquire``) and issues B's TMA boxes (two half boxes when gated, :meth:`WarpRoles.b_tile`);
- warps 1..3 wait for the stage to be empty themselves (``producer_acquire`` would arrive a second time);
- every thread then issues its stage's copies and ``cp.async.mbarrier.arrive.noinc``: its arrival counts
  once all of its copies so far have landed, so the stage is full when B's bytes and all 128 threads' A rows
  are in smem.

Rows of a tile past the group's end are neither read from ``index`` nor loaded (their smem rows keep stale
values, which only reach accumulator rows the epilogue never stores). A padding row (index -1: token rounding's
rows past the routed ones) is zero-filled (``cp.async`` with source size 0), so its product row is zero, as the
reference's gathered copy (zeros there) gives: a dY read through the index then needs no gathered copy with
zeros at padding rows. A ragged last k-tile (``K % tile_k != 0``) zero-fills its chunks past K the same way, as
TMA would: stale smem there would reach every row of the product.

Either schedule. Static: every producer thread walks the CTA's tiles itself (``bidx``, ``bidx + grid``, ...).
Dynamic: warp 0 takes each next tile id from the atomic counter and publishes it to the consumer warpgroups
(:meth:`kernels.scheduler.TileScheduler.publish`'s slots); the producer's 128 threads then meet at a named
barrier (``GATHER_BARRIER``) and read the id from the slot just written. Every producer thread advances the same
scheduler state, so the slot index needs no broadcast; a slot is written again only ``sched_stages`` tiles later,
after further barriers that every reader has passed. Why dynamic: with a static walk the CTAs drift apart and
work on tiles of many experts at once, whose weights then no longer share L2 (measured in
:func:`kernels.tile_policy.for_gather`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .scheduler import multicast_mask

#: Threads of the producer warpgroup, all of which load A.
GATHER_THREADS = 128
#: Named barrier of the producer warpgroup's 128 threads (dynamic schedule: the next tile id is in its slot);
#: 8 and 9 are the pingpong consumers' (kernels/mainloop.py).
GATHER_BARRIER = 10
#: Bytes one cp.async moves: 8 bf16/fp16 elements, the unit of the 128-byte swizzle.
CHUNK_BYTES = 16


class GatherProducer:
    """Mixin of :class:`kernels.grouped_gemm.GroupedGemmKernel` (reads its trace-time attributes: tile shape,
    ``stages``, ``k_tiles``, ``K``, ``sched``, ``ab_dtype``; uses :meth:`WarpRoles.b_tile` / ``load_b``)."""

    def gather_copy(self) -> cute.TiledCopy:
        """The 128 producer threads over a ``tile_m x tile_k`` A stage: 16-byte cp.async chunks, the chunks
        of a row on neighbouring threads (``tile_k`` up to one 128-byte swizzle row per pass)."""
        chunk = CHUNK_BYTES * 8 // self.ab_dtype.width
        per_row = min(self.tile_k // chunk, 8)
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.ab_dtype,
                                   num_bits_per_copy=CHUNK_BYTES * 8)
        threads = cute.make_layout((GATHER_THREADS // per_row, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, chunk)))

    @cute.jit
    def produce_gather(self, mA: cute.Tensor, mIdx: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                       mOffs: cute.Tensor, mCounter: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, ab_pipe,
                       sched_pipe, sTile: cute.Tensor, ptid: Int32, warp_idx: Int32, bidx: Int32, grid: Int32,
                       rank=0, tma_a=None):
        """The producer warpgroup's loop (``ptid`` = thread in the warpgroup, ``warp_idx`` its warp); ``mCounter``,
        ``sched_pipe``, ``sTile``: the dynamic scheduler's counter, tile-id pipeline and slots (unused static).
        With ``cluster_m = 2`` (``bidx`` / ``grid``: the pair's index and count, ``rank``: this CTA's in it) warp 0
        loads its half of each B box and multicasts it to the pair; each CTA gathers its own m-tile's A rows.
        With ``gather_tma`` (``tma_a``: the one-row box's atom, ``mA`` its coordinate tensor) the warps issue one TMA
        box per row instead of cp.async (:meth:`produce_gather_tma`; also as a CTA pair along n)."""
        if const_expr(self.gather_tma):
            self.produce_gather_tma(tma_a, mA, mIdx, tma_b, mB, mOffs, mCounter, sA, sB, ab_pipe, sched_pipe, sTile,
                                    ptid, warp_idx, bidx, grid, rank)
            return
        chunk = CHUNK_BYTES * 8 // self.ab_dtype.width
        tiled_copy = self.gather_copy()
        thr_copy = tiled_copy.get_slice(ptid)
        tAsA = thr_copy.partition_D(sA)                                      # (chunk, rows, chunks, stage)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        rows = cute.size(tAcA, mode=[1])
        chunks = cute.size(tAcA, mode=[2])
        k_tail = const_expr(self.K % self.tile_k != 0)
        b_mask = multicast_mask(self.cluster_m, rank)
        sent = Int32(0)   # tile ids through the pair's mailbox so far
        prod_state, sched_state, tile_id, g, base, cnt = self.first_tile(sched_pipe, sTile, mOffs, warp_idx, bidx)
        while g < self.G:
            m_idx, n_idx = self.sched.coords(tile_id, base, cnt, rank)
            row_end = mOffs[g + 1]
            row0 = mOffs[g] + m_idx * self.tile_m
            # this thread's rows of the tile: their tokens (read once per tile), as rows of A cut into chunks
            # (`live`: inside the group, so copied; `real`: a token, not padding (-1), whose copies are zero-filled)
            live = cute.make_rmem_tensor((rows,), Boolean)
            real = cute.make_rmem_tensor((rows,), Boolean)
            token = cute.make_rmem_tensor((rows,), Int32)
            for m in cutlass.range_constexpr(rows):
                r = row0 + tAcA[0, m, 0][0]
                live[m] = r < row_end
                token[m] = Int32(0)
                if live[m]:
                    token[m] = mIdx[r]
                real[m] = token[m] >= 0
                if not real[m]:
                    token[m] = Int32(0)
            gRows = [cute.tiled_divide(cute.append_ones(mA[token[m], None], up_to_rank=2), (chunk, 1))
                     for m in range(rows)]
            b_parts = self.b_tile(tma_b, mB, sB, g, n_idx, rank)
            for kt in cutlass.range(self.k_tiles, unroll=1):
                stage, bar = self.acquire_stage(ab_pipe, prod_state, warp_idx, tma_b, b_parts, kt, b_mask)
                for c in cutlass.range_constexpr(chunks):
                    col = kt * self.tile_k + tAcA[0, 0, c][1]
                    for m in cutlass.range_constexpr(rows):
                        if live[m]:
                            ok = cute.make_rmem_tensor((1,), Boolean)
                            ok[0] = real[m] & (col < self.K) if const_expr(k_tail) else real[m]
                            cute.copy(tiled_copy, gRows[m][None, col // chunk, 0], tAsA[None, m, c, stage], pred=ok)
                cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                prod_state.advance()
            sched_state, tile_id, sent, g, base, cnt = self.next_tile(sched_pipe, sched_state, sTile, mOffs, mCounter,
                                                                      warp_idx, grid, rank, tile_id, sent, g, base, cnt)
        self.last_tile(ab_pipe, prod_state, sched_pipe, sched_state, sTile, warp_idx, tile_id, rank, sent,
                       cp_async=True)

    @cute.jit
    def produce_gather_tma(self, tma_a: cute.CopyAtom, mA: cute.Tensor, mIdx: cute.Tensor, tma_b: cute.CopyAtom,
                           mB: cute.Tensor, mOffs: cute.Tensor, mCounter: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor,
                           ab_pipe, sched_pipe, sTile: cute.Tensor, ptid: Int32, warp_idx: Int32, bidx: Int32,
                           grid: Int32, rank=0):
        """:meth:`produce_gather` with A's rows by TMA: each producer warp issues one box per row of its share of
        the tile (32 rows; as a CTA pair along n, ``cluster_n = 2``, this CTA's half of the m-tile's rows, 16 per
        warp, each box multicast to both CTAs, which work on neighbouring n-tiles of that m-tile). Lane ``j`` of a
        warp reads the token of its ``j``-th row once per tile (-1 past the group's end, as at a padding row: the
        box then reads out of bounds, which TMA fills with zeros while still counting its bytes;
        bench/probes/tma_row_probe.cu). Per k-step warp 0 arrives on the stage's full barrier expecting the whole
        A tile's and this CTA's B bytes and loads B; every warp waits for the stage to be empty (in a pair, released
        by both CTAs' consumers) and issues its boxes, the token moved to the whole warp by a shuffle (a TMA
        instruction takes uniform coordinates). The barrier completes on bytes alone. A pair's dynamic tile ids go
        from rank 0 to rank 1 through the mailbox, as :meth:`produce_gather`'s."""
        rows_per_warp = self.tile_m // (4 * self.cluster_n)
        first = rank * (self.tile_m // self.cluster_n) + warp_idx * rows_per_warp   # this warp's rows of the tile
        lane = ptid % 32
        a_mask = multicast_mask(self.cluster_n, rank)
        sent = Int32(0)   # tile ids through the pair's mailbox so far
        prod_state, sched_state, tile_id, g, base, cnt = self.first_tile(sched_pipe, sTile, mOffs, warp_idx, bidx)
        while g < self.G:
            m_idx, n_idx = self.sched.coords(tile_id, base, cnt, rank)
            row_end = mOffs[g + 1]
            r = mOffs[g] + m_idx * self.tile_m + first + lane
            token = Int32(-1)
            if (lane < rows_per_warp) & (r < row_end):
                token = mIdx[r]
            b_parts = self.b_tile(tma_b, mB, sB, g, n_idx, 0)
            for kt in cutlass.range(self.k_tiles, unroll=1):
                stage, bar = self.acquire_stage(ab_pipe, prod_state, warp_idx, tma_b, b_parts, kt, None)
                for j in cutlass.range_constexpr(rows_per_warp):
                    row_token = cute.arch.shuffle_sync(token, j)
                    gRow = cute.local_tile(mA, (1, self.tile_k), (row_token, None))        # (1, tile_k, k_tiles)
                    sRow = cute.local_tile(sA, (1, self.tile_k), (first + j, 0, None))    # (1, tile_k, stages)
                    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sRow, 0, 2),
                                                       cute.group_modes(gRow, 0, 2))
                    cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, stage)], tma_bar_ptr=bar, mcast_mask=a_mask)
                prod_state.advance()
            sched_state, tile_id, sent, g, base, cnt = self.next_tile(sched_pipe, sched_state, sTile, mOffs, mCounter,
                                                                      warp_idx, grid, rank, tile_id, sent, g, base, cnt)
        self.last_tile(ab_pipe, prod_state, sched_pipe, sched_state, sTile, warp_idx, tile_id, rank, sent)

    @cute.jit
    def acquire_stage(self, ab_pipe, prod_state, warp_idx: Int32, tma_b: cute.CopyAtom, b_parts, kt, b_mask):
        """Every producer thread, per k-step: (the stage, its full barrier) once the stage is empty; warp 0 waits,
        arrives expecting the stage's TMA bytes (B's, and with gather_tma A's too) and loads k-tile ``kt`` of B
        (multicast with ``b_mask``); warps 1-3 wait on the empty barrier themselves (producer_acquire would arrive
        a second time)."""
        stage = prod_state.index
        bar = ab_pipe.producer_get_barrier(prod_state)
        if warp_idx == 0:
            ab_pipe.producer_acquire(prod_state)
            self.load_b(tma_b, b_parts, kt, stage, bar, b_mask)
        else:
            ab_pipe.sync_object_empty.wait(stage, prod_state.phase)
        return stage, bar

    @cute.jit
    def first_tile(self, sched_pipe, sTile: cute.Tensor, mOffs: cute.Tensor, warp_idx: Int32, bidx: Int32):
        """Every producer thread, before its loop: (the smem ring's producer state, the tile-id pipeline's (None
        static), the first tile id ``bidx``, published to the consumers by the dynamic scheduler, and its group
        ``g``, ``base``, ``cnt``)."""
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        sched_state = None
        if const_expr(self.dynamic):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
            sched_state = self.publish_id(sched_pipe, sched_state, sTile, bidx, warp_idx)
        g, base, cnt = self.sched.start(mOffs, bidx)
        return prod_state, sched_state, bidx, g, base, cnt

    @cute.jit
    def next_tile(self, sched_pipe, sched_state, sTile: cute.Tensor, mOffs: cute.Tensor, mCounter: cute.Tensor,
                  warp_idx: Int32, grid: Int32, rank, tile_id: Int32, sent: Int32, g, base, cnt):
        """Every producer thread, after a tile: the next tile (static: ``grid`` further; dynamic: warp 0 takes it
        and publishes it, in a pair rank 0's sent to rank 1 as message ``sent``, and every thread reads it from the
        slot after the warpgroup's named barrier), with its group: (sched_state, tile_id, sent, g, base, cnt)."""
        if const_expr(self.dynamic):
            slot = sched_state.index
            sched_state = self.publish_id(sched_pipe, sched_state, sTile, tile_id, warp_idx, mCounter, grid, rank,
                                          sent)
            sent = sent + 1
            cute.arch.barrier(barrier_id=GATHER_BARRIER, number_of_threads=GATHER_THREADS)
            tile_id = sTile[slot]
        else:
            tile_id = tile_id + grid
        g, base, cnt = self.sched.seek(mOffs, tile_id, g, base, cnt)
        return sched_state, tile_id, sent, g, base, cnt

    @cute.jit
    def last_tile(self, ab_pipe, prod_state, sched_pipe, sched_state, sTile: cute.Tensor, warp_idx: Int32,
                  tile_id: Int32, rank, sent: Int32, cp_async: cutlass.Constexpr = False):
        """Every producer thread, after its loop: a pingpong pair's second end-of-work entry (as TileScheduler's TMA
        producer publishes); with ``cp_async``, no copy left in flight behind an exiting thread; then warp 0 drains a
        pair's mailbox and waits for the consumers to release the ring."""
        if const_expr(self.dynamic and self.pingpong):
            sched_state = self.publish_id(sched_pipe, sched_state, sTile, tile_id, warp_idx)
        if const_expr(cp_async):
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
        if warp_idx == 0:
            if const_expr(self.dynamic and self.cluster_size > 1):
                self.mailbox.drain(sent, rank)
            ab_pipe.producer_tail(prod_state)

    @cute.jit
    def publish_id(self, sched_pipe, state, sTile: cute.Tensor, tile_id: Int32, warp_idx: Int32, mCounter=None,
                   grid=None, rank=0, sent=0):
        """Every producer thread: warp 0 publishes a tile id to the consumers (dynamic scheduler): ``tile_id``, or
        with ``mCounter`` the next one it takes from the counter (only warp 0 takes one; in a CTA pair rank 0's
        takes it and sends it to rank 1's as message ``sent`` of the pair's mailbox). All advance the same state (each
        thread its copy), so after the next :data:`GATHER_BARRIER` every thread knows the slot."""
        if warp_idx == 0:
            nxt = tile_id
            if const_expr(mCounter is not None):
                mailbox = self.mailbox if const_expr(self.cluster_size > 1) else None
                nxt = self.sched.producer_next(mCounter, tile_id, grid, mailbox, rank, sent)
            self.sched.fill_slot(sched_pipe, state, sTile, nxt)
        state.advance()
        return state
