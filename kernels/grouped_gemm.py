"""Persistent, warp-specialized grouped GEMM for sm_90a (CuTe DSL), with a generated epilogue.

D[rows of g] = epilogue(A[rows of g] @ B[g].T)

- A: (M, K) row-major, rows of all groups concatenated; M is dynamic (one compile for every batch).
- B: ``b_major="K"``: (G, N, K), K contiguous (an nn.Linear weight per group, as a forward reads it);
  ``b_major="MN"``: (G, K, N), N contiguous (the same weight read by the dgrad dX = dY @ W[g], K = out,
  N = in: no transposed copy). A gated GEMM reads the canonical (G, N, K) weight, gate rows then up rows.
- offsets: (G+1,) int32 device tensor of cumulative row offsets.
- warp roles (kernels/mainloop.py): warpgroup 0 = producer (warp 0 issues TMA loads of A/B into a
  multi-stage smem ring), warpgroups 1..2 = wgmma consumers + epilogue (kernels/tile_epilogue.py).
- ``gather_a``: A is the (a_rows, K) token matrix and routed row r multiplies A[index[r]] (zeros where index[r]
  is -1); the whole producer warpgroup loads A by cp.async through the index, warp 0 still loads B by TMA (either
  major) and takes the dynamic schedule's tile ids (kernels/gather_producer.py). An MoE FC1's forward gathers x
  this way, FC2's dgrad the tokens' gradient dY.
- tile scheduler (kernels/scheduler.py): walks (group, m-tile, n-tile) on the device from the offsets.
- ``cluster_n = 2``: CTA pairs (clusters of 2) work on neighbouring n-tiles of one m-tile; each CTA loads
  half of the A tile's rows by TMA and multicasts it to both, so A crosses L2 once per pair (the weights'
  B tiles differ per CTA). TMA-loaded A, an even number of n-tiles; with the dynamic schedule rank 0's producer
  takes the tile ids and sends them to rank 1's (kernels/scheduler.py).
- ``cluster_m = 2``: CTA pairs work on neighbouring m-tiles of one group and n-tile; each loads half of the B
  tile (the weight's, the same for both: half of each box, gate and up, when gated) and multicasts it, so B
  crosses L2 once per pair; A is each CTA's own, by TMA or gathered. For a GEMM whose n-tiles do not pair up
  (an odd count: GPT-OSS's 2880 at 128x192), and for a gathering kernel (its A cannot be multicast). A group
  with an odd m-tile count leaves rank 1 of its last pair a tile past the group's rows (masked: nothing stored).
- rows of a tile past the group's end are computed (TMA of A reads the next group's rows) but never
  stored: the epilogue masks every store by the group's row range.

This module holds the host-side (traced) setup: tensors, smem layouts, TMA atoms, shared storage, the
launch, and the kernel's prologue (pipelines) that hands over to the warp roles.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Float32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .dtypes import cutlass_dtype
from .epilogue import Epilogue, AuxInput, MXFP8Output
from .gather_producer import GatherProducer
from .mainloop import REGISTER_SPLIT, WarpRoles
from .scheduler import PEER_SLOTS, TileScheduler
from .tile_policy import one_band_limit, resolved_band
from .tile_epilogue import TileEpilogue

# Registers a consumer thread may hold across the mainloop (fp32 accumulator + prefetched epilogue
# inputs): the AuxInput values of a tile are loaded before its mainloop (see TileEpilogue.prefetch) as
# long as the accumulator plus the packed 16-bit pairs stay under this.
_PREFETCH_REGS = 136
_PREFETCH_MIN = 16


__all__ = ["GroupedGemmKernel", "cutlass_dtype"]


class GroupedGemmKernel(WarpRoles, GatherProducer):
    def __init__(self, config, epilogue: Epilogue, dtype: str):
        self.cfg = config
        self.epi = epilogue
        self.ab_dtype = cutlass_dtype(dtype)
        self.dtype_name = dtype
        self.acc_dtype = Float32
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_k = config.tile_k
        assert self.tile_m in (64, 128), "tile_m must be 64 or 128"
        assert self.tile_n % 16 == 0 and self.tile_n <= 256
        self.pingpong = bool(getattr(config, "pingpong", False))
        # cooperative: the consumer warpgroups split one tile (64 rows each); pingpong: 2 consumer
        # warpgroups, each owns whole tiles (tile_m rows) and they alternate tiles, so one's epilogue
        # runs while the other's mainloop keeps the tensor cores busy.
        self.num_mma_wg = 2 if self.pingpong else self.tile_m // 64
        self.mma_atoms_m = 1 if self.pingpong else self.num_mma_wg   # warpgroups sharing one tile
        self.threads = 128 * (1 + self.num_mma_wg)
        self.sched_stages = 4 if self.pingpong else 2
        self.stages = config.stages
        self.dynamic = config.dynamic
        self.gated = epilogue.gated
        self.b_major = getattr(config, "b_major", "K")
        self.gather_a = bool(getattr(config, "gather_a", False))
        # gather_a with A's rows by one TMA box per row (kernels/gather_producer.py), not cp.async
        self.gather_tma = self.gather_a and bool(getattr(config, "gather_tma", False))
        self.cluster_n = int(getattr(config, "cluster_n", 1))
        self.cluster_m = int(getattr(config, "cluster_m", 1))
        self.band_m = resolved_band(config)    # the tile order's band (kernels/scheduler.py)
        # a tile whose rows end within its first 64 issues only their wgmma (kernels/mainloop.py)
        self.short_tiles = bool(getattr(config, "short_tiles", False)) and self.tile_m == 128
        assert self.cluster_n in (1, 2) and self.cluster_m in (1, 2), "cluster_n and cluster_m are 1 or 2"
        assert self.cluster_size <= 2, "a CTA pair along m or along n, not both"
        assert self.cluster_n == 1 or not self.gather_a or self.gather_tma, \
            "a CTA pair along n multicasts a TMA-loaded A: gathered only by TMA rows (gather_tma)"
        # cluster_m: each rank loads half of every B box (both halves of a gated tile), so a box's rows split
        # into two halves of whole 8-row swizzle atoms
        assert self.cluster_m == 1 or (self.tile_n // (2 if epilogue.gated else 1)) % 16 == 0, \
            "cluster_m splits each B box in two: its rows must be a multiple of 16"
        self.peer_ids = self.dynamic and self.cluster_size > 1   # rank 0 sends the tile ids it takes to rank 1
        self.producer_regs, self.consumer_regs = REGISTER_SPLIT[self.gather_a]
        assert self.b_major in ("K", "MN"), "b_major is 'K' or 'MN'"
        assert not (self.gated and self.b_major == "MN"), "a gated GEMM reads a K-major B"
        assert not self.gated or self.tile_k * self.ab_dtype.width == 1024, \
            "gated: tile_k spans one 128-byte swizzle atom (the two half-tile TMA boxes tile the B stage)"
        self.tile_n_log = self.tile_n // 2 if self.gated else self.tile_n
        for o in epilogue.outputs:
            if isinstance(o, MXFP8Output):
                assert self.tile_n_log % 32 == 0, "MXFP8 output needs 32-column blocks within a tile"
        # prefetch of AuxInput values into registers before the tile's mainloop: how many packed pairs
        acc_regs = self.tile_m * self.tile_n // (128 * self.mma_atoms_m)
        prefetch_pairs = 0
        aux16 = [s for s in epilogue.inputs if isinstance(s, AuxInput)
                 and cutlass_dtype(s.dtype or dtype).width == 16]
        if aux16:
            budget = _PREFETCH_REGS - acc_regs
            if budget >= _PREFETCH_MIN:
                prefetch_pairs = budget
        self.tile_epi = TileEpilogue(epilogue, dtype, self.tile_n_log, prefetch_pairs, acc_regs,
                                     config.quad_beside_fp8)

    # ------------------------------------------------------------------ host-side (traced) entry
    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,
        pB: cute.Pointer,
        pOffs: cute.Pointer,
        pCounter: cute.Pointer,
        pIdx: cute.Pointer,
        ptrs: tuple,
        M: Int32,
        a_rows: Int32,
        N: cutlass.Constexpr,
        K: cutlass.Constexpr,
        G: cutlass.Constexpr,
        num_ctas: Int32,
        stream,
    ):
        self.N, self.K, self.G = N, K, G
        n_log = N // 2 if const_expr(self.gated) else N
        self.k_tiles = (K + self.tile_k - 1) // self.tile_k
        self.sched = TileScheduler(self.tile_m, (n_log + self.tile_n_log - 1) // self.tile_n_log, G,
                                   self.dynamic, self.pingpong, self.cluster_n, self.band_m,
                                   one_band_limit(self.band_m, self.tile_m, K, 2), self.cluster_m)
        # A: the (M, K) rows of the groups, or with gather_a the (a_rows, K) tokens that index (M,) picks
        mA = cute.make_tensor(pA, cute.make_layout((a_rows if const_expr(self.gather_a) else M, K), stride=(K, 1)))
        mIdx = cute.make_tensor(pIdx, cute.make_layout((M,)))
        # B as the MMA sees it, (N, K, G), whatever its memory order
        b_stride = (K, 1, N * K) if const_expr(self.b_major == "K") else (1, N, N * K)
        mB = cute.make_tensor(pB, cute.make_layout((N, K, G), stride=b_stride))
        mOffs = cute.make_tensor(pOffs, cute.make_layout((G + 1,)))
        mCounter = cute.make_tensor(pCounter, cute.make_layout((1,)))
        tensors = self.tile_epi.make_tensors(ptrs, M, G, n_log)

        b_layout = utils.LayoutEnum.ROW_MAJOR if const_expr(self.b_major == "K") else utils.LayoutEnum.COL_MAJOR
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, warpgroup.OperandMajorMode.K, b_layout.sm90_mma_major_mode(),
            self.acc_dtype, (self.mma_atoms_m, 1, 1), tiler_mn=(64, self.tile_n),
        )
        # the logical tile's accumulator layout: coordinates for the epilogue only (never issues wgmma)
        self.tiled_mma_log = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            self.acc_dtype, (self.mma_atoms_m, 1, 1), tiler_mn=(64, self.tile_n_log),
        )
        a_layout_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.ab_dtype, self.tile_k), self.ab_dtype
        )
        self.sA_layout = cute.tile_to_shape(a_layout_atom, (self.tile_m, self.tile_k, self.stages), order=(0, 1, 2))
        # B: the smem atom of its major mode (K: rows of tile_k; MN: columns of tile_n), tiled along the
        # major mode first (dense_gemm's layouts)
        b_k_major = self.b_major == "K"
        b_layout_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(b_layout, self.ab_dtype, self.tile_k if b_k_major else self.tile_n),
            self.ab_dtype,
        )
        self.sB_layout = cute.tile_to_shape(b_layout_atom, (self.tile_n, self.tile_k, self.stages),
                                            order=(0, 1, 2) if b_k_major else (1, 0, 2))
        sA_one = cute.slice_(self.sA_layout, (None, None, 0))
        sB_one = cute.slice_(self.sB_layout, (None, None, 0))
        # gated: one TMA box is half a B tile (gate or up rows); tile_k is one swizzle atom, so a half
        # tile's smem layout is the first tile_n/2 rows of the stage's (kernels/mainloop.py loads both)
        b_box = (self.tile_n // 2 if self.gated else self.tile_n, self.tile_k)
        sB_box = cute.tile_to_shape(b_layout_atom, b_box, order=(0, 1)) if const_expr(self.gated) else sB_one
        b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_m > 1) else \
            cpasync.CopyBulkTensorTileG2SOp()
        tma_b, tma_tB = cpasync.make_tiled_tma_atom(b_op, mB, sB_box, b_box, num_multicast=self.cluster_m)
        if const_expr(self.gather_tma):
            # A through the index, one row per TMA box: the box is one 128-byte swizzle row (1 x tile_k), written at
            # the row's unswizzled start; the hardware swizzles by address, as one tile_m-row box would
            sA_row = cute.make_composed_layout(self.sA_layout.inner, 0,
                                               cute.make_layout((1, self.tile_k), stride=(self.tile_k, 1)))
            row_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_n > 1) else \
                cpasync.CopyBulkTensorTileG2SOp()
            # num_multicast=1 even for a pair: the pair splits the m-tile's rows by hand, each box still one whole
            # row; an atom built for 2 CTAs cuts its box in two (half a row, 64 bytes), so a stage's full barrier
            # would wait forever for the bytes it expects
            tma_a, tma_tA = cpasync.make_tiled_tma_atom(row_op, mA, sA_row, (1, self.tile_k), num_multicast=1)
        elif const_expr(self.gather_a):
            # A is read through the index by cp.async (kernels/gather_producer.py): no TMA descriptor of A;
            # the kernel's A slots take B's atom (never used as A) and the plain (a_rows, K) tensor
            tma_a, tma_tA = tma_b, mA
        else:
            a_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_n > 1) else \
                cpasync.CopyBulkTensorTileG2SOp()
            tma_a, tma_tA = cpasync.make_tiled_tma_atom(
                a_op, mA, sA_one, (self.tile_m, self.tile_k), num_multicast=self.cluster_n
            )
        # bytes a stage's TMA loads bring (gather_a by cp.async: B only; A's copies are counted as arrivals)
        self.tx_bytes = cute.size_in_bytes(self.ab_dtype, sB_one)
        if const_expr(not self.gather_a or self.gather_tma):
            self.tx_bytes += cute.size_in_bytes(self.ab_dtype, sA_one)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sched: cute.struct.MemRange[cutlass.Int64, 2 * self.sched_stages]
            tile_slot: cute.struct.MemRange[Int32, self.sched_stages]
            # a dynamic CTA pair's mailbox of tile ids (kernels/scheduler.py; empty otherwise)
            peer_bar: cute.struct.MemRange[cutlass.Int64, 2 * PEER_SLOTS if self.peer_ids else 0]
            peer_slot: cute.struct.MemRange[Int32, PEER_SLOTS if self.peer_ids else 0]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.sB_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a, tma_tA, tma_b, tma_tB, mOffs, mCounter, mIdx,
            tuple(tensors), M,
            self.tiled_mma, self.tiled_mma_log, self.sA_layout, self.sB_layout,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), cluster=(self.cluster_size, 1, 1),
                 smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mOffs: cute.Tensor,
        mCounter: cute.Tensor,
        mIdx: cute.Tensor,
        epi_tensors: tuple,
        M: Int32,
        tiled_mma: cute.TiledMma,
        tiled_mma_log: cute.TiledMma,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if warp_idx == 0:
            if const_expr(not self.gather_a or self.gather_tma):
                cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        storage, ab_pipe, sched_pipe, sTile, sA, sB = self.make_smem(sA_layout, sB_layout)
        self.cluster_sync_barriers()
        cute.arch.sync_threads()
        # the schedule walks clusters: a CTA pair shares one unit (its rank picks the n-tile, or the m-tile)
        rank = 0
        if const_expr(self.cluster_size > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            bidx = bidx // self.cluster_size
            grid = grid // self.cluster_size

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if const_expr(self.gather_a):
                self.produce_gather(mA, mIdx, tma_b, mB, mOffs, mCounter, sA, sB, ab_pipe, sched_pipe, sTile,
                                    tidx, warp_idx, bidx, grid, rank=rank, tma_a=tma_a)
            elif warp_idx == 0:
                self.produce(tma_a, mA, tma_b, mB, mOffs, mCounter, sA, sB, ab_pipe, sched_pipe, sTile,
                             bidx, grid, rank=rank)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            self.consume(tiled_mma, tiled_mma_log, sA, sB, mOffs, epi_tensors, ab_pipe, sched_pipe, sTile,
                         tidx, wg_idx, bidx, grid, rank=rank)
