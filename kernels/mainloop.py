"""The two warp roles of the grouped GEMM kernel: the TMA producer and the wgmma consumers.

- producer (warp 0 of warpgroup 0): walks its CTA's tiles and fills a ``stages``-deep smem ring with
  the A and B tiles of every k-step (``PipelineTmaAsync``); with the dynamic scheduler it also takes the
  tile ids and publishes them to the consumers. A gated GEMM reads the canonical weight (gate rows
  ``[0, N/2)``, up rows ``[N/2, N)``): each stage's B tile is two ``tile_n/2``-row TMA boxes, the gate rows
  of the n-tile into the tile's first half and the same up rows into its second half (one expect-tx count
  for the whole tile), so the accumulator holds gate in columns ``[0, tile_n/2)`` and up in the rest.
- consumers (warpgroups 1..2): wgmma over the ring into an fp32 accumulator, then the epilogue
  (:class:`kernels.tile_epilogue.TileEpilogue`). Cooperative: both warpgroups work on one tile (64 rows
  each). Pingpong: each warpgroup owns every other tile of the CTA's sequence; a named-barrier pair
  orders their mainloops (warpgroup w starts once the other has issued all of its own), so one's epilogue
  overlaps the other's mainloop, and each skips the other's ``k_tiles`` stages of the ring.

With ``gather_a`` the producer is :class:`kernels.gather_producer.GatherProducer` (A through an index, by the
whole warpgroup); it reuses :meth:`WarpRoles.b_tile` / :meth:`WarpRoles.load_b` for B.

A mixin of :class:`kernels.grouped_gemm.GroupedGemmKernel`: it reads the kernel's trace-time attributes
(tile shape, ``stages``, ``k_tiles``, ``sched``, ``gated``, ``tile_epi``, ...).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .gather_producer import GATHER_THREADS
from .scheduler import PEER_SLOTS, PeerMailbox, multicast_mask

PINGPONG_BARRIER = 8  # named barriers 8, 9: pingpong mainloop order (consumer warpgroup 0, 1)

# setmaxnreg split (producer warpgroup, each consumer warpgroup), multiples of 8, by gather_a (the FP8 kernel
# takes the TMA producer's). The CTA starts with the launch allocation (384 threads x 168 registers);
# setmaxnreg.inc only takes what the producer's .dec gave back, so
# 128 * (168 - producer) >= 256 * (consumer - 168), or the consumers wait forever (a 48/232 split hangs). The TMA
# producer is one warp issuing loads (40); the gather producer's threads hold a tile's row addresses (48, its
# SASS uses 42), so its consumers take 224.
REGISTER_SPLIT = {False: (40, 232), True: (48, 224)}
LAUNCH_REGISTERS = 168
assert all(128 * (LAUNCH_REGISTERS - p) >= 256 * (c - LAUNCH_REGISTERS) for p, c in REGISTER_SPLIT.values())


def consumer_ids(pingpong: bool, tidx, wg_idx):
    """(parity, thread) of a consumer thread at trace time: pingpong, its warpgroup's parity in the CTA's tile
    sequence and its thread in the warpgroup (each warpgroup owns whole tiles); cooperative, parity 0 and its
    thread among the consumer warpgroups (they split one tile)."""
    if pingpong:
        return wg_idx - 1, tidx % 128
    return Int32(0), tidx - 128


def mma_k_step(tiled_mma, acc, tCrA, tCrB, stage, num_k_blocks: int):
    """Trace time: issue one smem stage's wgmma into ``acc`` (every k-block of the stage) and commit them as one
    group."""
    for kb in range(num_k_blocks):   # plain Python: unrolled while tracing (this helper is not preprocessed)
        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc)
    warpgroup.commit_group()


def first_rows(tiled_mma, thr_mma, acc, sA, tile_k: int, stages: int):
    """Trace time, for a pingpong warpgroup (its 128-row tile is two 64-row wgmma atoms along m): the operands of
    the first atom only, (A fragment over the ring's first 64 rows, the accumulator's first m-repeat as a view of
    the same registers), for :func:`mma_k_step_first_rows`."""
    tCrA_first = tiled_mma.make_fragment_A(thr_mma.partition_A(cute.local_tile(sA, (64, tile_k, stages), (0, 0, 0))))
    v_shape, v_stride = acc.layout.shape[0], acc.layout.stride[0]
    acc_first = cute.make_tensor(acc.iterator, cute.make_layout((v_shape, 1, 1), stride=(v_stride, 0, 0)))
    return tCrA_first, acc_first


def mma_k_step_first_rows(tiled_mma, first, tCrB, stage, num_k_blocks: int):
    """Trace time: :func:`mma_k_step` for a short tile, whose rows end within its first 64: with ``first`` (a
    pingpong warpgroup's :func:`first_rows`) the first atom's wgmma only; with None (a cooperative kernel's
    warpgroup of the tile's second 64 rows) none. Commits one group either way, so that the callers'
    wait_group counts hold."""
    if first is not None:
        tCrA_first, acc_first = first
        for kb in range(num_k_blocks):
            cute.gemm(tiled_mma, acc_first, tCrA_first[(None, None, kb, stage)], tCrB[(None, None, kb, stage)],
                      acc_first)
    warpgroup.commit_group()


def end_mainloop(pingpong: bool, cwg):
    """Trace time, after a tile's last wgmma is issued: a pingpong warpgroup hands the tensor cores to the other
    (its order barrier); then wait for every wgmma of the tile to finish (the stages may be released)."""
    if pingpong:
        cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER + 1 - cwg, number_of_threads=256)
    warpgroup.wait_group(0)


class WarpRoles:
    """Producer and consumer bodies (``@cute.jit``, inlined into the kernel)."""

    #: A loaded through an index by the producer warpgroup (kernels/gather_producer.py); the FP8 kernel never is
    gather_a = False
    #: ... by one TMA box per row instead of cp.async (GemmConfig.gather_tma)
    gather_tma = False
    #: CTAs per cluster along n: 2 = a CTA pair works on neighbouring n-tiles of one m-tile, each loading half of
    #: the A tile and multicasting it to both (the bf16 and the FP8 kernel)
    cluster_n = 1
    #: CTAs per cluster along m: 2 = a CTA pair works on neighbouring m-tiles of one group and n-tile, each loading
    #: half of the B tile (the weight's; half of each box when gated) and multicasting it to both (the bf16 kernel)
    cluster_m = 1
    #: a 128-row tile whose rows end within its first 64 issues only their wgmma (:meth:`short_tile`;
    #: GemmConfig.short_tiles: the bf16 kernel here, the FP8 kernel in kernels/fp8_mainloop.py)
    short_tiles = False

    @property
    def cluster_size(self) -> int:
        """CTAs per cluster (a pair along m or n, or a single CTA)."""
        return self.cluster_m * self.cluster_n

    # ------------------------------------------------------------------ shared setup
    def make_smem(self, sA_layout, sB_layout):
        """Trace time, in the kernel's prologue (before its barrier): the kernel's ``shared_storage``, the
        smem ring's pipeline (TMA producer, plus the 128 cp.async producer threads with gather_a; one arrive
        per consumer warp that reads a stage: pingpong, one warpgroup reads each stage; with a CTA pair, the
        peer's warps too, since half of each stage's A came from the peer), the tile-id pipeline of the
        dynamic scheduler (else None), its smem slots, and the ring's A and B tensors. A clustered kernel
        must call :meth:`cluster_sync_barriers` before using the pipeline."""
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        # a full barrier's arrivals: the TMA warp's expect-tx arrive, and with gather_a one cp.async arrive per
        # producer thread (kernels/gather_producer.py)
        producers = 1 + (GATHER_THREADS if self.gather_a and not self.gather_tma else 0)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.cluster_size * self.mma_atoms_m * 4),
            tx_count=self.tx_bytes,
            # a pair's consumers release a stage in both CTAs (either CTA's producer filled half of it)
            cta_layout_vmnk=cute.make_layout((1, self.cluster_size, 1, 1)),
            defer_sync=self.cluster_size > 1,
        )
        sched_pipe = None
        if self.dynamic:
            # the producer warp fetches the next tile id and publishes it to the consumers
            sched_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.sched.data_ptr(),
                num_stages=self.sched_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 128),
            )
        sTile = storage.tile_slot.get_tensor(cute.make_layout((self.sched_stages,)))
        if const_expr(self.dynamic and self.cluster_size > 1):
            # rank 0's producer hands the tile ids it takes to rank 1's (kernels/scheduler.py)
            self.mailbox = PeerMailbox(storage.peer_bar.data_ptr(),
                                       storage.peer_slot.get_tensor(cute.make_layout((PEER_SLOTS,))))
            self.mailbox.init()
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        return storage, ab_pipe, sched_pipe, sTile, sA, sB

    def cluster_sync_barriers(self):
        """Trace time, after :meth:`make_smem`: a clustered kernel waits until every CTA of its cluster has
        initialized its barriers (a peer's multicast or release must not reach an uninitialized one)."""
        if const_expr(self.cluster_size > 1):
            pipeline_init_arrive(cluster_shape_mn=(self.cluster_size, 1), is_relaxed=True)
            pipeline_init_wait(cluster_shape_mn=(self.cluster_size, 1))

    def mma_operands(self, tiled_mma, tiled_mma_log, sA, sB, ctid):
        """A consumer thread's wgmma operand fragments over the smem ring and the (row, logical column)
        coordinates of its accumulator fragment (the epilogue's)."""
        thr_mma = tiled_mma.get_slice(ctid)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCcC = tiled_mma_log.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n_log)))
        return thr_mma, tCrA, tCrB, tCcC

    # ------------------------------------------------------------------ producer
    def tile_extra_loads(self, extras, g, row0, n_idx):
        """Hook (trace time): per-tile setup of loads that ride along with A and B in every stage (the FP8
        kernel's block scales, kernels/fp8_mainloop.py). None here."""
        return None

    def stage_extra_loads(self, extras, tile_extra, kt, stage, bar):
        """Hook (trace time): issue k-tile ``kt``'s extra loads into ``stage`` on the stage's barrier."""

    def b_tile(self, tma_b: cute.CopyAtom, mB: cute.Tensor, sB: cute.Tensor, g, n_idx, rank=0):
        """Trace time, once per tile: the TMA partitions of B's n-tile ``n_idx`` of group ``g`` over the smem
        ring, as (gmem, smem) pairs of TMA boxes, one box (two when gated) per stage; with ``cluster_m = 2``
        this CTA's half of the box (rank ``rank``), multicast to the pair by :meth:`load_b`."""
        if const_expr(self.gated):
            # gate rows [n_idx * tile_n/2, +tile_n/2) -> first half of the B tile, the same rows of the up
            # half (N/2 further) -> second half.  A partial last n-tile: the gate box reads up rows (their
            # results are masked: logical column >= N/2), the up box reads past N (zeros).
            half = self.tile_n // 2
            mBg = mB[None, None, g]
            boxes = (
                (cute.local_tile(mBg, (half, self.tile_k), (n_idx, None)),
                 cute.local_tile(sB, (half, self.tile_k, self.stages), (0, 0, 0))),
                (cute.local_tile(cute.domain_offset((self.N // 2, 0), mBg), (half, self.tile_k), (n_idx, None)),
                 cute.local_tile(sB, (half, self.tile_k, self.stages), (1, 0, 0))),
            )
        else:
            boxes = ((cute.local_tile(mB[None, None, g], (self.tile_n, self.tile_k), (n_idx, None)), sB),)
        parts = []
        for gB, sBb in boxes:
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, rank if const_expr(self.cluster_m > 1) else 0, cute.make_layout(self.cluster_m),
                cute.group_modes(sBb, 0, 2), cute.group_modes(gB, 0, 2)
            )
            parts.append((tBgB, tBsB))
        return parts

    def load_b(self, tma_b: cute.CopyAtom, b_parts, kt, stage, bar, b_mask=None):
        """Trace time: issue k-tile ``kt`` of B (the boxes of :meth:`b_tile`) into ``stage`` on ``bar`` (with
        ``b_mask``: multicast to the CTA pair)."""
        for tBgB, tBsB in b_parts:
            cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, stage)], tma_bar_ptr=bar, mcast_mask=b_mask)

    @cute.jit
    def produce(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                mOffs: cute.Tensor, mCounter: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, ab_pipe,
                sched_pipe, sTile: cute.Tensor, bidx: Int32, grid: Int32, extras=None, rank=0):
        """Warp 0. ``bidx`` / ``grid``: the CTA's (or with clusters the cluster's) index and count; ``rank``: the
        CTA's rank in its cluster (it loads that half of the A tile, or with ``cluster_m`` of the B tile, and
        multicasts it to the pair)."""
        a_mask, b_mask = multicast_mask(self.cluster_n, rank), multicast_mask(self.cluster_m, rank)
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        mailbox = self.mailbox if const_expr(self.dynamic and self.cluster_size > 1) else None
        sent = Int32(0)   # tile ids through the mailbox so far
        if const_expr(self.dynamic):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.sched_stages)
        tile_id = bidx
        g, base, cnt = self.sched.start(mOffs, tile_id)
        if const_expr(self.dynamic):
            sched_state = self.sched.publish(sched_pipe, sched_state, sTile, tile_id)
        while g < self.G:
            m_idx, n_idx = self.sched.coords(tile_id, base, cnt, rank)
            row0 = mOffs[g] + m_idx * self.tile_m
            gA = cute.local_tile(cute.domain_offset((row0, 0), mA), (self.tile_m, self.tile_k), (0, None))
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, rank if const_expr(self.cluster_n > 1) else 0, cute.make_layout(self.cluster_n),
                cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            b_parts = self.b_tile(tma_b, mB, sB, g, n_idx, rank)
            tile_extra = self.tile_extra_loads(extras, g, row0, n_idx)
            for kt in cutlass.range(self.k_tiles, unroll=1):
                ab_pipe.producer_acquire(prod_state)
                bar = ab_pipe.producer_get_barrier(prod_state)
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, prod_state.index)], tma_bar_ptr=bar,
                          mcast_mask=a_mask)
                self.load_b(tma_b, b_parts, kt, prod_state.index, bar, b_mask)
                self.stage_extra_loads(extras, tile_extra, kt, prod_state.index, bar)
                ab_pipe.producer_commit(prod_state)
                prod_state.advance()
            tile_id = self.sched.producer_next(mCounter, tile_id, grid, mailbox, rank, sent)
            sent = sent + 1
            g, base, cnt = self.sched.seek(mOffs, tile_id, g, base, cnt)
            if const_expr(self.dynamic):
                sched_state = self.sched.publish(sched_pipe, sched_state, sTile, tile_id)
        if const_expr(self.dynamic and self.pingpong):
            # pingpong consumers read entries in pairs (the other warpgroup's, then their own): a second
            # end-of-work entry lets the warpgroup that skips the first one stop too
            sched_state = self.sched.publish(sched_pipe, sched_state, sTile, tile_id)
        if const_expr(self.dynamic and self.cluster_size > 1):
            mailbox.drain(sent, rank)
        ab_pipe.producer_tail(prod_state)

    # ------------------------------------------------------------------ consumers
    def short_tile(self, row0, row_end, wg_idx):
        """Trace time: whether the consumer warpgroup ``wg_idx`` (1 or 2, warp-uniform) issues the short-tile wgmma
        of :func:`mma_k_step_first_rows` for the tile at ``row0`` (its group's rows end at ``row_end``): the
        tile's rows end within its first 64 (a group's short last m-tile; the other rows belong to the next group
        or to no group, and the epilogue stores none of them) and, cooperative, the warpgroup is the one of the
        second 64. The tensor cores then do half of the tile's work. Groups of a few hundred rows leave such a tile
        in about every other group (Qwen3-235B-A22B's 256 rows per expert)."""
        second_half = row0 + 64 >= row_end
        if const_expr(self.pingpong):
            return second_half
        return second_half & (wg_idx == 2)

    @cute.jit
    def tile_mainloop(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                      ab_pipe, read_state, rel_state, num_k_blocks: cutlass.Constexpr, cwg,
                      first, short: cutlass.Constexpr):
        """One tile's mainloop over the smem ring: every k-tile's wgmma (one commit group each, one in flight
        while the next stage is awaited), each stage released once its wgmma finished. ``read_state`` and
        ``rel_state`` are the caller's copies (it advances its own by ``k_tiles``). ``short``: the wgmma of
        :func:`mma_k_step_first_rows` (``first``: :func:`first_rows` or None) instead of :func:`mma_k_step`.
        The caller sets the MMA's ACCUMULATE field (a traced value: set inside a branch, it would not reach the
        next tile)."""
        warpgroup.fence()
        ab_pipe.consumer_wait(read_state)
        self.mma_stage(tiled_mma, acc, tCrA, tCrB, read_state.index, num_k_blocks, first, short)
        read_state.advance()
        for kt in cutlass.range(1, self.k_tiles, unroll=1):
            ab_pipe.consumer_wait(read_state)
            self.mma_stage(tiled_mma, acc, tCrA, tCrB, read_state.index, num_k_blocks, first, short)
            warpgroup.wait_group(1)
            ab_pipe.consumer_release(rel_state)
            rel_state.advance()
            read_state.advance()
        end_mainloop(self.pingpong, cwg)
        ab_pipe.consumer_release(rel_state)
        rel_state.advance()

    @cute.jit
    def tile_mainloops(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                       ab_pipe, read_state, rel_state, num_k_blocks: cutlass.Constexpr, cwg, first, row0, row_end,
                       wg_idx):
        """The tile's mainloop: with short tiles, two whole :meth:`tile_mainloop` bodies chosen by
        :meth:`short_tile`, not a branch per k-step (a branch between wgmma issue and wait makes ptxas serialize
        every wgmma: an arrive and a wait around each HGMMA in the SASS); else the one body. Each body advances its
        own copies of the ring's states, made inside its branch (a copy made outside and advanced in both branches
        would be a value defined in one branch and used in the other: invalid IR)."""
        if const_expr(self.short_tiles):
            if self.short_tile(row0, row_end, wg_idx):
                self.tile_mainloop(tiled_mma, acc, tCrA, tCrB, ab_pipe, read_state.clone(), rel_state.clone(),
                                   num_k_blocks, cwg, first, True)
            else:
                self.tile_mainloop(tiled_mma, acc, tCrA, tCrB, ab_pipe, read_state.clone(), rel_state.clone(),
                                   num_k_blocks, cwg, first, False)
        else:
            self.tile_mainloop(tiled_mma, acc, tCrA, tCrB, ab_pipe, read_state.clone(), rel_state.clone(),
                               num_k_blocks, cwg, first, False)

    def mma_stage(self, tiled_mma, acc, tCrA, tCrB, stage, num_k_blocks: int, first, short: bool):
        """Trace time: one smem stage's wgmma and its commit, :func:`mma_k_step` or for a short tile
        :func:`mma_k_step_first_rows`."""
        if short:
            mma_k_step_first_rows(tiled_mma, first, tCrB, stage, num_k_blocks)
        else:
            mma_k_step(tiled_mma, acc, tCrA, tCrB, stage, num_k_blocks)

    @cute.jit
    def consume(self, tiled_mma: cute.TiledMma, tiled_mma_log: cute.TiledMma, sA: cute.Tensor,
                sB: cute.Tensor, mOffs: cute.Tensor, epi_tensors: tuple, ab_pipe, sched_pipe,
                sTile: cute.Tensor, tidx: Int32, wg_idx: Int32, bidx: Int32, grid: Int32, rank=0):
        """The consumer warpgroups (``bidx``, ``grid``, ``rank`` as for :meth:`produce`)."""
        k_tiles = self.k_tiles
        cwg, ctid = consumer_ids(self.pingpong, tidx, wg_idx)
        thr_mma, tCrA, tCrB, tCcC = self.mma_operands(tiled_mma, tiled_mma_log, sA, sB, ctid)
        acc_shape = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))).shape
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        num_k_blocks = cute.size(tCrA, mode=[2])
        first = None   # a short tile's operands (pingpong: the first 64 rows; cooperative: none to issue)
        if const_expr(self.short_tiles and self.pingpong):
            first = first_rows(tiled_mma, thr_mma, acc, sA, self.tile_k, self.stages)
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        rel_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if const_expr(self.pingpong):
            # warpgroup 1 starts after warpgroup 0's first tile in the smem ring
            read_state.advance(cwg * k_tiles)
            rel_state.advance(cwg * k_tiles)
        if const_expr(self.dynamic):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
            tile_id, sched_state = self.sched.first_dynamic(sched_pipe, sched_state, sTile, cwg)
        else:
            tile_id = self.sched.first_static(bidx, grid, cwg)
        g, base, cnt = self.sched.start(mOffs, tile_id)
        if const_expr(self.pingpong):
            if cwg == 0:
                # warpgroup 0 goes first: pre-arrive on its own mainloop barrier
                cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER, number_of_threads=256)
        while g < self.G:
            m_idx, n_idx = self.sched.coords(tile_id, base, cnt, rank)
            row_start = mOffs[g]
            row_end = mOffs[g + 1]
            row0 = row_start + m_idx * self.tile_m

            # ---- epilogue inputs read from global memory, issued now so that the loads complete under
            # the mainloop instead of stalling the epilogue
            pre = None
            if const_expr(self.tile_epi.prefetch_pairs > 0):
                pre = self.tile_epi.prefetch(tCcC, epi_tensors, row0, row_end, n_idx, self.N)

            # ---- mainloop
            if const_expr(self.pingpong):
                # wait for the other warpgroup to have issued its whole mainloop: tensor cores go to one
                # warpgroup at a time, and every smem stage of this tile then has its previous fill
                # consumed (mbarrier parity waits can only tell adjacent phases apart)
                cute.arch.barrier(barrier_id=PINGPONG_BARRIER + cwg, number_of_threads=256)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            # the mainloop advances copies of the ring's states (a @cute.jit callee's changes to its arguments do
            # not reach the caller: the caller advances its own by k_tiles)
            self.tile_mainloops(tiled_mma, acc, tCrA, tCrB, ab_pipe, read_state, rel_state, num_k_blocks, cwg, first,
                                row0, row_end, wg_idx)
            read_state.advance(k_tiles)
            rel_state.advance(k_tiles)

            # ---- epilogue
            self.tile_epi.run(acc, tCcC, epi_tensors, row0, row_end, g, n_idx, self.N, pre)

            # ---- next tile
            if const_expr(self.pingpong):
                # skip the other warpgroup's tile in the smem ring
                read_state.advance(k_tiles)
                rel_state.advance(k_tiles)
            if const_expr(self.dynamic):
                tile_id, sched_state = self.sched.next_dynamic(sched_pipe, sched_state, sTile)
            else:
                tile_id = self.sched.next_static(tile_id, grid)
            g, base, cnt = self.sched.seek(mOffs, tile_id, g, base, cnt)
