"""Persistent grouped GEMM whose reduction runs over each group's rows (varlen-K), for sm_90a (CuTe DSL): the
weight gradient of a GroupLinear.

    D[g] = A[rows of g].T @ B[rows of g]        A: (M, Ma)   B: (M, Nb)   D: (G, Ma, Nb)   offsets: (G+1,)

For ``dW[g] = dY_g.T @ X_g``: A = dY (Ma = out_features), B = X (Nb = in_features), D = dW in the weight's
(G, out, in) layout. The reduction length of group g is its row count, known only on the device.

- **Gathered operands.** ``gather_a`` / ``gather_b``: that operand is a (T, ·) token matrix and routed row r
  reads its row ``index[r]``. An MoE FC1's weight gradient reads x through the routing index this way where the
  tile policy says so (kernels/tile_policy.py `gather_in_wgrad`: many rows per group), and no gathered copy of x
  is written (kernels/gather_producer.py does the same for the forward's A).
- **Producer, no gather: TMA**, warp 0 of the producer warpgroup, as the varlen-M kernel's. A k-step is
  ``tile_k`` rows from the group's first row; the rows of its last k-step past the group's end belong to the
  next group, so the consumers zero them in both smem tiles before the wgmma reads them (a partial k-step:
  once per tile; fenced for the async proxy). ``cluster_m = 2``: a CTA pair works on two neighbouring m-tiles
  of one (group, n-tile) in lockstep and B's tile (the rows of X, the same for both) reaches both by TMA
  multicast, each CTA loading half: a third less L2 traffic per FLOP at 128x256 (cuBLAS's weight gradient does
  the same; ncu: without it the kernel is L2-bound).
- **Producer, one gathered operand: TMA and cp.async.** The operand read in order comes by TMA (warp 0, as
  above); the gathered one by 16-byte ``cp.async`` from the whole producer warpgroup: every row of it is one
  contiguous run of a tile's columns, so a row read through an index costs what a plain one does. Its rows past
  the group's end, padding rows (index -1) and columns past Ma / Nb are copied with source size 0, i.e.
  zero-filled; the TMA operand's rows past the group's end are zeroed by the consumers as above. Thread t of the
  warpgroup copies chunk ``t % 8`` (8 elements) of every 64-column swizzle atom of rows ``t // 8 + 16 j``. One
  ``PipelineTmaAsync`` ring whose full barriers expect ``1 + 128`` arrivals, as kernels/gather_producer.py's: warp
  0's arrive with the TMA bytes, and one ``cp.async.mbarrier.arrive.noinc`` per producer thread. With A gathered
  (an MoE FC2's dY) B still comes by TMA, so a CTA pair on neighbouring m-tiles shares it by multicast as above
  (each CTA gathers its own A columns; a stage is released only when both CTAs' consumers are done); a gathered
  B has no pair. Why not cp.async for both: measured on an H100 that kernel was slower than regathering x and
  running the TMA kernel on 5 of 7 MoE FC1 gradients (docs/benchmarks.md, "The weight-gradient kernel alone").
- **Producer, both operands gathered: cp.async** for both, as the gathered operand above; the full barrier of
  a stage counts one ``cp.async.mbarrier.arrive.noinc`` per thread.
- **Operands are MN-major** (a row is a k-step, contiguous along Ma or Nb): the smem tiles use the MN-major
  128-byte-swizzle atom and wgmma reads both transposed.
- **Tiles.** Every group has the same ``mt x nt`` output tiles; the schedule walks units of ``cluster_m``
  m-tiles (one per CTA of a cluster): unit u belongs to group ``u // (mu nt)`` (groups in order, m fastest
  within one, so neighbouring clusters share a group's rows in L2). A tile's k-steps are
  ``ceil(rows_g / tile_k)``: an empty group's tiles run no k-step and store zeros. Static schedule
  (``unit += clusters``).
- **Consumers** as in kernels/mainloop.py: cooperative (two warpgroups split a 128-row tile) or pingpong (each
  owns every other tile; a named-barrier pair orders their mainloops). With varlen k-steps a pingpong
  warpgroup skips the other's tile in the smem ring by that tile's own k-step count (the unit ``clusters``
  further in the static order).
- **Epilogue**: D seen as a (G * Ma, Nb) matrix whose group g owns rows ``[g Ma, (g+1) Ma)``. A 16-bit D is
  stored 4 columns (8 bytes) per thread: neighbouring lanes swap one packed pair by a shuffle, so a quad writes
  a whole 32-byte sector of a row per store (the wgmma fragment gives each lane 2 columns of every 8, which
  stored as they are write half sectors; at Qwen3's T = 1024, where the epilogue dominates, the kernel took 2.3x
  torch._grouped_mm's time with those and 0.88x with these: bench/bench_wgrad.py). With ``store_bytes = 16`` (the
  tile policy's store-bound tile, below 192 rows per group, where the kernel is its store) a quad transposes its 4x4
  words and each lane stores 8 columns of one chunk (16 bytes; kernels/fragment_io.py store8_transposed).
  ``n_fastest`` walks a group's n-tiles fastest in the schedule (measured, not taken by the policy).
  A 32-bit D goes through :class:`kernels.tile_epilogue.TileEpilogue` with the identity.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .dtypes import cutlass_dtype
from .epilogue import IdentityEpilogue
from .fragment_io import store_tile16
from .mainloop import PINGPONG_BARRIER, REGISTER_SPLIT, consumer_ids, end_mainloop, mma_k_step
from .scheduler import multicast_mask
from .tile_epilogue import TileEpilogue

__all__ = ["VarlenKGemmKernel", "PRODUCER_THREADS"]

#: Threads of the producer warpgroup (with a gathered operand all of them load it; warp 0 issues the TMA loads).
PRODUCER_THREADS = 128
#: Bytes one cp.async moves: 8 bf16/fp16 elements, the unit of the 128-byte swizzle.
CHUNK_BYTES = 16
#: Elements of one MN-major swizzle atom row (128 bytes of 16-bit values): 8 chunks, one per thread of a row.
ATOM_COLS = 64
#: Named barrier of the consumers that zero a partial k-step's rows (+ the pingpong warpgroup's parity);
#: kernels/mainloop.py's pingpong order barriers are 8 and 9.
ZERO_BARRIER = 10


class VarlenKGemmKernel:
    """The kernel for ``config`` (:class:`kernels.tile_policy.WgradConfig`) in ``dtype`` (bf16/fp16 operands, fp32
    accumulation), storing D in ``out_dtype`` (None: ``dtype``)."""

    def __init__(self, config, dtype: str, out_dtype: str | None = None):
        self.cfg = config
        self.ab_dtype = cutlass_dtype(dtype)
        self.acc_dtype = Float32
        self.tile_m, self.tile_n, self.tile_k = config.tile_m, config.tile_n, config.tile_k
        assert self.tile_m in (64, 128) and self.tile_n % ATOM_COLS == 0 and self.tile_n <= 256
        assert self.tile_m % ATOM_COLS == 0 and self.tile_k % 16 == 0
        self.pingpong = bool(config.pingpong)
        self.num_mma_wg = 2 if self.pingpong else self.tile_m // 64
        self.mma_atoms_m = 1 if self.pingpong else self.num_mma_wg
        self.threads = 128 * (1 + self.num_mma_wg)
        self.stages = config.stages
        self.gather_a, self.gather_b = bool(config.gather_a), bool(config.gather_b)
        self.tma = not (self.gather_a or self.gather_b)           # both operands by TMA
        self.hybrid = self.gather_a != self.gather_b                # the gathered one by cp.async, the other by TMA
        self.cluster_m = config.cluster_m
        # a CTA pair shares B's tile by TMA multicast: both operands by TMA, or A gathered and B by TMA
        assert self.cluster_m in (1, 2) and (self.tma or (self.hybrid and self.gather_a) or self.cluster_m == 1), \
            "multicast needs a TMA-loaded B"
        # the cp.async producer keeps a k-step's rows in registers, as the gather-A producer does
        self.producer_regs, self.consumer_regs = REGISTER_SPLIT[not self.tma]
        self.epi = IdentityEpilogue(out_dtype)
        self.tile_epi = TileEpilogue(self.epi, dtype, self.tile_n, 0)
        self.out_dtype = cutlass_dtype(out_dtype or dtype)

    # ------------------------------------------------------------------ host-side (traced) entry
    @cute.jit
    def __call__(self, pA: cute.Pointer, pB: cute.Pointer, pOffs: cute.Pointer, pIdx: cute.Pointer,
                 pD: cute.Pointer, M: Int32, a_rows: Int32, b_rows: Int32, Ma: cutlass.Constexpr,
                 Nb: cutlass.Constexpr, G: cutlass.Constexpr, num_ctas: Int32, stream):
        self.Ma, self.Nb, self.G = Ma, Nb, G
        self.m_tiles = (Ma + self.tile_m - 1) // self.tile_m
        self.n_tiles = (Nb + self.tile_n - 1) // self.tile_n
        self.m_units = (self.m_tiles + self.cluster_m - 1) // self.cluster_m
        self.group_units = self.m_units * self.n_tiles
        mA = cute.make_tensor(pA, cute.make_layout((a_rows, Ma), stride=(Ma, 1)))
        mB = cute.make_tensor(pB, cute.make_layout((b_rows, Nb), stride=(Nb, 1)))
        mIdx = cute.make_tensor(pIdx, cute.make_layout((M,)))
        mOffs = cute.make_tensor(pOffs, cute.make_layout((G + 1,)))
        tensors = self.tile_epi.make_tensors((pD,), G * Ma, G, Nb)

        mn = warpgroup.OperandMajorMode.MN
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, mn, mn, self.acc_dtype, (self.mma_atoms_m, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        self.sA_layout = self._smem_layout(self.tile_m)
        self.sB_layout = self._smem_layout(self.tile_n)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.sB_layout)], 1024]

        self.shared_storage = SharedStorage
        if const_expr(self.tma):
            # the operands as (columns, rows) tensors: a TMA box is tile columns x tile_k rows, MN-major
            sA_one = cute.slice_(self.sA_layout, (None, None, 0))
            sB_one = cute.slice_(self.sB_layout, (None, None, 0))
            tma_a, tA = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), cute.make_tensor(pA, cute.make_layout((Ma, a_rows), stride=(1, Ma))),
                sA_one, (self.tile_m, self.tile_k))
            b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_m > 1) else \
                cpasync.CopyBulkTensorTileG2SOp()
            tma_b, tB = cpasync.make_tiled_tma_atom(
                b_op, cute.make_tensor(pB, cute.make_layout((Nb, b_rows), stride=(1, Nb))), sB_one,
                (self.tile_n, self.tile_k), num_multicast=self.cluster_m)
            self.tx_bytes = cute.size_in_bytes(self.ab_dtype, sA_one) + cute.size_in_bytes(self.ab_dtype, sB_one)
            self.kernel_tma(tma_a, tA, tma_b, tB, mOffs, tuple(tensors), self.tiled_mma, self.sA_layout,
                            self.sB_layout).launch(
                grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), cluster=(self.cluster_m, 1, 1),
                smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1, stream=stream)
        elif const_expr(self.hybrid):
            # the operand read in order by TMA, as a (columns, rows) tensor; the gathered one stays row-major
            if const_expr(self.gather_b):
                one, width, ptr, cols, rows = cute.slice_(self.sA_layout, (None, None, 0)), self.tile_m, pA, Ma, a_rows
            else:
                one, width, ptr, cols, rows = cute.slice_(self.sB_layout, (None, None, 0)), self.tile_n, pB, Nb, b_rows
            # (A gathered, cluster_m = 2: B's tile multicast to the pair, each CTA loading half of the box)
            in_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_m > 1) else \
                cpasync.CopyBulkTensorTileG2SOp()
            tma_in, tIn = cpasync.make_tiled_tma_atom(
                in_op, cute.make_tensor(ptr, cute.make_layout((cols, rows), stride=(1, cols))), one,
                (width, self.tile_k), num_multicast=self.cluster_m)
            self.tx_bytes = cute.size_in_bytes(self.ab_dtype, one)
            self.kernel_hybrid(tma_in, tIn, mA if const_expr(self.gather_a) else mB, mIdx, mOffs, tuple(tensors),
                               self.tiled_mma, self.sA_layout, self.sB_layout).launch(
                grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), cluster=(self.cluster_m, 1, 1),
                smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1, stream=stream)
        else:
            self.kernel(mA, mB, mIdx, mOffs, tuple(tensors), self.tiled_mma, self.sA_layout,
                        self.sB_layout).launch(
                grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), smem=SharedStorage.size_in_bytes(),
                min_blocks_per_mp=1, stream=stream)

    def _smem_layout(self, width: int):
        """A (width, tile_k, stages) ring of MN-major tiles: 128-byte swizzle atoms along the width."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.COL_MAJOR, self.ab_dtype, width), self.ab_dtype)
        return cute.tile_to_shape(atom, (width, self.tile_k, self.stages), order=(1, 0, 2))

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mIdx: cute.Tensor, mOffs: cute.Tensor, epi_tensors: tuple,
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineCpAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, PRODUCER_THREADS),
            # every thread of the warpgroups that read a stage releases it (pingpong: one warpgroup per stage)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.mma_atoms_m),
        )
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        cute.arch.sync_threads()

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            self.produce_gathered(None, None, mA, mB, mIdx, mOffs, sA, sB, ab_pipe, tidx, Int32(0), Int32(0), bidx,
                                  grid)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            self.consume(tiled_mma, sA, sB, mOffs, epi_tensors, ab_pipe, tidx, wg_idx, Int32(0), bidx, grid)

    @cute.kernel
    def kernel_tma(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                   mOffs: cute.Tensor, epi_tensors: tuple, tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
                   sB_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
        rank, ab_pipe, sA, sB = self.tma_ring(1, sA_layout, sB_layout)

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if warp_idx == 0:
                self.produce_tma(tma_a, mA, tma_b, mB, mOffs, sA, sB, ab_pipe, rank, bidx, grid)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            self.consume(tiled_mma, sA, sB, mOffs, epi_tensors, ab_pipe, tidx, wg_idx, rank, bidx, grid)

    @cute.kernel
    def kernel_hybrid(self, tma_in: cute.CopyAtom, mIn: cute.Tensor, mGath: cute.Tensor, mIdx: cute.Tensor,
                      mOffs: cute.Tensor, epi_tensors: tuple, tiled_mma: cute.TiledMma,
                      sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        """One gathered operand (``mGath``, row-major (T, ·)): it comes by cp.async, the other (``mIn`` through
        ``tma_in``) by TMA; with ``cluster_m = 2`` (A gathered) a CTA pair on neighbouring m-tiles shares B's tile,
        each CTA loading half of the box and multicasting it, as the TMA kernel's pairs."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_in)
        # a full barrier's arrivals: warp 0's arrive expecting the TMA bytes, and one cp.async arrive per producer
        # thread
        rank, ab_pipe, sA, sB = self.tma_ring(1 + PRODUCER_THREADS, sA_layout, sB_layout)

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            # (the gathered operand fills the slot of A or B its config names; the other slot is not read)
            self.produce_gathered(tma_in, mIn, mGath, mGath, mIdx, mOffs, sA, sB, ab_pipe, tidx, warp_idx, rank,
                                  bidx, grid)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            self.consume(tiled_mma, sA, sB, mOffs, epi_tensors, ab_pipe, tidx, wg_idx, rank, bidx, grid)

    @cute.jit
    def tma_ring(self, producers: cutlass.Constexpr, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        """Trace time, the prologue of a kernel whose stages TMA fills (wholly, or beside cp.async: ``producers``
        arrivals per full barrier): (this CTA's rank in its cluster, the ``PipelineTmaAsync`` ring, sA, sB). A stage
        is released by every consumer warp that reads it, in each CTA its B tile was multicast to."""
        rank = Int32(0)
        if const_expr(self.cluster_m > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_m * self.mma_atoms_m * 4),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))
        return rank, ab_pipe, sA, sB

    # ------------------------------------------------------------------ schedule
    def unit_coords(self, unit):
        """(group, first m-tile, n-tile) of schedule unit ``unit`` (groups in order, m fastest within one, or n
        with ``n_fastest``); a unit is ``cluster_m`` neighbouring m-tiles, one per CTA of a cluster."""
        g = unit // self.group_units
        local = unit - g * self.group_units
        if self.cfg.n_fastest:
            return g, (local // self.n_tiles) * self.cluster_m, local % self.n_tiles
        return g, (local % self.m_units) * self.cluster_m, local // self.m_units

    @cute.jit
    def k_steps(self, mOffs: cute.Tensor, unit: Int32) -> Int32:
        """The k-steps of ``unit``'s group (0 past the last unit)."""
        g = cutlass.min(unit // self.group_units, self.G - 1)
        steps = (mOffs[g + 1] - mOffs[g] + (self.tile_k - 1)) // self.tile_k
        return cutlass.select_(unit < self.G * self.group_units, steps, Int32(0))

    # ------------------------------------------------------------------ producer
    def operand_copy(self) -> cute.TiledCopy:
        """The 128 producer threads over a (width, tile_k) MN-major stage: 8 threads per row (the 8 16-byte
        chunks of a 64-column swizzle atom), 16 rows per pass."""
        chunk = CHUNK_BYTES * 8 // self.ab_dtype.width
        per_row = ATOM_COLS // chunk
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.ab_dtype,
                                   num_bits_per_copy=CHUNK_BYTES * 8)
        threads = cute.make_layout((per_row, PRODUCER_THREADS // per_row), stride=(1, per_row))
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((chunk, 1)))

    @cute.jit
    def produce_gathered(self, tma_in, mIn, mA: cute.Tensor, mB: cute.Tensor, mIdx: cute.Tensor,
                         mOffs: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, ab_pipe, ptid: Int32, warp_idx: Int32,
                         rank: Int32, bidx: Int32, grid: Int32):
        """The producer warpgroup of a kernel with gathered operands: every thread copies its rows of each gathered
        operand (read through the index; zero-filled past the group's end and the operand's width). With one
        gathered operand (``hybrid``) the other comes by TMA: per k-step warp 0 waits for the empty stage, arrives
        expecting its bytes and issues its box (``tma_in`` over ``mIn``), the other warps wait for the empty stage
        themselves, and every thread arrives once its copies have landed; in a CTA pair (A gathered) warp 0 issues
        its half of B's box, multicast to both CTAs (``rank``: this CTA's). Both gathered: a cp.async ring."""
        tiled_copy = self.operand_copy()
        thr_copy = tiled_copy.get_slice(ptid)
        tAsA = thr_copy.partition_D(sA)                                        # (chunk, atoms, rows, stage)
        tAcA = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.tile_k)))
        tBsB = thr_copy.partition_D(sB)
        tBcB = thr_copy.partition_S(cute.make_identity_tensor((self.tile_n, self.tile_k)))
        rows = cute.size(tAcA, mode=[2])        # the same rows of a k-step for both operands
        total = self.G * self.group_units
        clusters = grid // self.cluster_m
        b_mask = multicast_mask(self.cluster_m, rank)
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        tile_id = bidx // self.cluster_m
        while tile_id < total:
            g, m0, n_idx = self.unit_coords(tile_id)
            m_idx = m0 + rank
            row_start = mOffs[g]
            row_end = mOffs[g + 1]
            steps = (row_end - row_start + (self.tile_k - 1)) // self.tile_k
            tIsI, tIgI = None, None
            if const_expr(self.hybrid):
                # the operand read in order: B's n-tile where A is gathered, else A's m-tile
                in_sm, in_width, in_idx = (sB, self.tile_n, n_idx) if const_expr(self.gather_a) else \
                    (sA, self.tile_m, m_idx)
                gIn = cute.local_tile(cute.domain_offset((0, row_start), mIn), (in_width, self.tile_k), (in_idx, None))
                tIsI, tIgI = cpasync.tma_partition(tma_in, rank, cute.make_layout(self.cluster_m),
                                                   cute.group_modes(in_sm, 0, 2), cute.group_modes(gIn, 0, 2))
            for kt in cutlass.range(steps, unroll=1):
                # this thread's rows of the k-step and their tokens, read before the wait for an empty stage so
                # that the index loads overlap it
                live = cute.make_rmem_tensor((rows,), Boolean)
                token = cute.make_rmem_tensor((rows,), Int32)
                for j in cutlass.range_constexpr(rows):
                    r = row_start + kt * self.tile_k + tAcA[0, 0, j][1]
                    live[j] = r < row_end
                    token[j] = Int32(0)
                    if live[j]:
                        token[j] = mIdx[r]
                    if token[j] < 0:   # a padding row (-1): zero-filled as past the group's end
                        live[j] = False
                        token[j] = Int32(0)
                stage = prod_state.index
                bar = None
                if const_expr(self.hybrid):
                    bar = ab_pipe.producer_get_barrier(prod_state)
                    if warp_idx == 0:
                        ab_pipe.producer_acquire(prod_state)   # empty wait + arrive expecting the TMA bytes
                        cute.copy(tma_in, tIgI[(None, kt)], tIsI[(None, stage)], tma_bar_ptr=bar, mcast_mask=b_mask)
                    else:
                        ab_pipe.sync_object_empty.wait(stage, prod_state.phase)
                else:
                    ab_pipe.producer_acquire(prod_state)
                if const_expr(self.gather_a):
                    self.copy_rows(tiled_copy, mA, token, live, tAcA, tAsA, stage, m_idx * self.tile_m, self.Ma,
                                   self.tile_m)
                if const_expr(self.gather_b):
                    self.copy_rows(tiled_copy, mB, token, live, tBcB, tBsB, stage, n_idx * self.tile_n, self.Nb,
                                   self.tile_n)
                if const_expr(self.hybrid):
                    cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                else:
                    ab_pipe.producer_commit(prod_state)
                prod_state.advance()
            tile_id = tile_id + clusters
        # leave no copy in flight behind an exiting thread, nor a stage the consumers still read
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        if const_expr(self.hybrid):
            if warp_idx == 0:
                ab_pipe.producer_tail(prod_state)
        else:
            ab_pipe.producer_tail(prod_state)

    def copy_rows(self, tiled_copy, mX: cute.Tensor, token, live, tXcX, tXsX, stage, col0, limit: int, width: int):
        """Trace time: this thread's 16-byte chunks of a gathered operand's k-step rows (token rows of ``mX``) into
        ``stage``, zero-filled past the group's end (``live``) and past the operand's ``limit`` columns."""
        chunk = CHUNK_BYTES * 8 // self.ab_dtype.width
        # (a CTA pair's second CTA may work on an m-tile past Ma: an odd m-tile count)
        edge = limit % width != 0 or self.cluster_m > 1
        for j in range(cute.size(tXcX, mode=[2])):
            gX = cute.tiled_divide(cute.append_ones(mX[token[j], None], up_to_rank=2), (chunk, 1))
            for i in range(cute.size(tXcX, mode=[1])):
                col = col0 + tXcX[0, i, j][0]
                ok = cute.make_rmem_tensor((1,), Boolean)
                ok[0] = live[j] & (col < limit) if edge else live[j]
                cute.copy(tiled_copy, gX[None, col // chunk, 0], tXsX[None, i, j, stage], pred=ok)

    @cute.jit
    def produce_tma(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                    mOffs: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, ab_pipe, rank: Int32, bidx: Int32,
                    grid: Int32):
        """Warp 0: the TMA loads of the CTA's tiles (A its own m-tile; B half of the n-tile, multicast to the
        cluster's CTAs)."""
        b_mask = multicast_mask(self.cluster_m, rank)
        total = self.G * self.group_units
        clusters = grid // self.cluster_m
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        unit = bidx // self.cluster_m
        while unit < total:
            g, m0, n_idx = self.unit_coords(unit)
            row_start = mOffs[g]
            steps = (mOffs[g + 1] - row_start + (self.tile_k - 1)) // self.tile_k
            gA = cute.local_tile(cute.domain_offset((0, row_start), mA), (self.tile_m, self.tile_k),
                                 (m0 + rank, None))
            tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                               cute.group_modes(gA, 0, 2))
            gB = cute.local_tile(cute.domain_offset((0, row_start), mB), (self.tile_n, self.tile_k), (n_idx, None))
            tBsB, tBgB = cpasync.tma_partition(tma_b, rank, cute.make_layout(self.cluster_m),
                                               cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
            for kt in cutlass.range(steps, unroll=1):
                ab_pipe.producer_acquire(prod_state)
                bar = ab_pipe.producer_get_barrier(prod_state)
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, prod_state.index)], tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, prod_state.index)], tma_bar_ptr=bar,
                          mcast_mask=b_mask)
                ab_pipe.producer_commit(prod_state)
                prod_state.advance()
            unit = unit + clusters
        ab_pipe.producer_tail(prod_state)

    def zero_copy(self, threads: int) -> cute.TiledCopy:
        """``threads`` consumer threads over a (width, tile_k) MN-major stage: 16-byte stores of zeros, 8 threads
        per row (one 64-column swizzle atom), ``threads / 8`` rows per pass (the producer's cp.async partition)."""
        chunk = CHUNK_BYTES * 8 // self.ab_dtype.width
        per_row = ATOM_COLS // chunk
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype, num_bits_per_copy=CHUNK_BYTES * 8)
        layout = cute.make_layout((per_row, threads // per_row), stride=(1, per_row))
        return cute.make_tiled_copy_tv(atom, layout, cute.make_layout((chunk, 1)))

    @cute.jit
    def zero_tail_rows(self, sA: cute.Tensor, sB: cute.Tensor, stage, first_row: Int32, t: Int32,
                       threads: cutlass.Constexpr):
        """Zero rows ``[first_row, tile_k)`` of both operands' tiles in ``stage`` (the part of a group's last
        k-step that TMA filled with the next group's rows): one 16-byte store per chunk, ``threads`` consumer
        threads (``t``: this thread's index among them)."""
        zero_copy = self.zero_copy(threads)
        thr = zero_copy.get_slice(t)
        for s, width in ((sA, self.tile_m), (sB, self.tile_n)):
            dst = thr.partition_D(s)                                            # (chunk, atoms, rows, stage)
            zeros = cute.make_rmem_tensor(dst[None, 0, 0, 0].shape, self.ab_dtype)
            zeros.fill(0.0)
            crd = thr.partition_S(cute.make_identity_tensor((width, self.tile_k)))
            for j in cutlass.range_constexpr(cute.size(crd, mode=[2])):
                if crd[0, 0, j][1] >= first_row:
                    for i in cutlass.range_constexpr(cute.size(crd, mode=[1])):
                        cute.copy(zero_copy, zeros, dst[None, i, j, stage])

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, mOffs: cute.Tensor,
                epi_tensors: tuple, ab_pipe, tidx: Int32, wg_idx: Int32, rank: Int32, bidx: Int32, grid: Int32):
        cwg, ctid = consumer_ids(self.pingpong, tidx, wg_idx)
        thr_mma = tiled_mma.get_slice(ctid)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        num_k_blocks = cute.size(tCrA, mode=[2])
        total = self.G * self.group_units
        clusters = grid // self.cluster_m
        # consumers that read a stage: both warpgroups (cooperative) or the tile's own (pingpong)
        readers = 128 * self.mma_atoms_m
        zero_t = ctid
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        rel_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tile_id = bidx // self.cluster_m
        if const_expr(self.pingpong):
            # warpgroup 1 takes the CTA's second unit: it starts past warpgroup 0's first in the ring
            first = Int32(self.k_steps(mOffs, tile_id) * cwg)
            read_state.advance(first)
            rel_state.advance(first)
            tile_id = tile_id + cwg * clusters
            if cwg == 0:
                cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER, number_of_threads=256)
        while tile_id < total:
            g, m0, n_idx = self.unit_coords(tile_id)
            m_idx = m0 + rank
            steps = self.k_steps(mOffs, tile_id)
            tail = mOffs[g + 1] - mOffs[g] - (steps - 1) * self.tile_k   # rows of the last k-step
            if const_expr(self.pingpong):
                cute.arch.barrier(barrier_id=PINGPONG_BARRIER + cwg, number_of_threads=256)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.fence()
            for kt in cutlass.range(steps, unroll=1):
                ab_pipe.consumer_wait(read_state)
                if const_expr(self.tma or self.hybrid):
                    if kt == steps - 1 and tail < self.tile_k:
                        # TMA read the next group's rows into the last k-step: zero them before the wgmma
                        self.zero_tail_rows(sA, sB, read_state.index, tail, zero_t, readers)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=ZERO_BARRIER + cwg, number_of_threads=readers)
                mma_k_step(tiled_mma, acc, tCrA, tCrB, read_state.index, num_k_blocks)
                # the previous k-step's wgmma has finished reading its stage once at most this one is in flight
                warpgroup.wait_group(1)
                if kt > 0:
                    ab_pipe.consumer_release(rel_state)
                    rel_state.advance()
                read_state.advance()
            end_mainloop(self.pingpong, cwg)
            if steps > 0:
                ab_pipe.consumer_release(rel_state)
                rel_state.advance()

            row0 = g * self.Ma + m_idx * self.tile_m
            if const_expr(self.out_dtype.width == 16):
                store_tile16(acc, tCcC, epi_tensors[0], row0, (g + 1) * self.Ma, n_idx * self.tile_n, self.Nb,
                             self.out_dtype, self.cfg.store_bytes)
            else:
                self.tile_epi.run(acc, tCcC, epi_tensors, row0, (g + 1) * self.Ma, g, n_idx, self.Nb)

            if const_expr(self.pingpong):
                # skip the other warpgroup's unit in the ring: the next one in the CTA's static order
                other = Int32(self.k_steps(mOffs, tile_id + clusters))
                read_state.advance(other)
                rel_state.advance(other)
                tile_id = tile_id + 2 * clusters
            else:
                tile_id = tile_id + clusters
