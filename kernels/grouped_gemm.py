"""Persistent, warp-specialized grouped GEMM for sm_90a (CuTe DSL), with a generated epilogue.

D[rows of g] = epilogue(A[rows of g] @ B[g].T)

- A: (M, K) row-major, rows of all groups concatenated; M is dynamic (one compile for every batch).
- B: (G, N, K) K-major (nn.Linear weight per group).
- offsets: (G+1,) int32 device tensor of cumulative row offsets.
- warp roles: warpgroup 0 = producer (warp 0 issues TMA loads of A/B into a multi-stage smem ring),
  warpgroups 1..2 = wgmma consumers (cooperative on a tile_m=128 tile, 64 rows each) + epilogue.
- tile scheduler: walks (group, m-tile, n-tile) on the device from the offsets; static persistent
  (tile t -> CTA t % grid) or dynamic (global atomic counter, broadcast through smem).
- rows of a tile past the group's end are computed (TMA of A reads the next group's rows) but never
  stored: the epilogue masks every store by the group's row range.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64, Float32, Boolean, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass._mlir.dialects import llvm

from .epilogue import Epilogue, RowVector, GroupVector, AuxInput, MXFP8Output

_BIG = 1 << 30
_PP_BAR = 8      # named barriers 8, 9: pingpong mainloop order (warpgroup 0, 1)
_EPI_BATCH = 8  # 8-column chunks per epilogue batch (see _epilogue)
# Registers a consumer thread may hold across the mainloop (fp32 accumulator + prefetched epilogue
# inputs): the AuxInput values of a tile are loaded before its mainloop (see _epilogue_prefetch) as long
# as the accumulator plus the packed 16-bit pairs stay under this.
_PREFETCH_REGS = 136
_PREFETCH_MIN = 16

_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "uint8": cutlass.Uint8,
}


def cutlass_dtype(name):
    if not isinstance(name, str):
        name = str(name).replace("torch.", "")
    return _DTYPES[name]


class GroupedGemmKernel:
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
        self.tile_n_log = self.tile_n // 2 if self.gated else self.tile_n
        for o in epilogue.outputs:
            if isinstance(o, MXFP8Output):
                assert self.tile_n_log % 32 == 0, "MXFP8 output needs 32-column blocks within a tile"
        # prefetch of AuxInput values into registers before the tile's mainloop: how many packed pairs
        acc_regs = self.tile_m * self.tile_n // (128 * self.mma_atoms_m)
        self.prefetch_pairs = 0
        aux16 = [s for s in epilogue.inputs if isinstance(s, AuxInput)
                 and cutlass_dtype(s.dtype or dtype).width == 16]
        if aux16:
            budget = _PREFETCH_REGS - acc_regs
            if budget >= _PREFETCH_MIN:
                self.prefetch_pairs = budget

    # ------------------------------------------------------------------ host-side (traced) entry
    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,
        pB: cute.Pointer,
        pOffs: cute.Pointer,
        pCounter: cute.Pointer,
        ptrs: tuple,
        M: Int32,
        N: cutlass.Constexpr,
        K: cutlass.Constexpr,
        G: cutlass.Constexpr,
        num_ctas: Int32,
        stream,
    ):
        mA = cute.make_tensor(pA, cute.make_layout((M, K), stride=(K, 1)))
        mB = cute.make_tensor(pB, cute.make_layout((N, K, G), stride=(K, 1, N * K)))
        mOffs = cute.make_tensor(pOffs, cute.make_layout((G + 1,)))
        mCounter = cute.make_tensor(pCounter, cute.make_layout((1,)))
        n_log = N // 2 if const_expr(self.gated) else N
        # epilogue tensors, in the order: inputs..., outputs... (MXFP8 outputs take two slots)
        tensors = []
        i = 0
        for spec in self.epi.inputs:
            p = ptrs[i]
            i += 1
            if const_expr(isinstance(spec, RowVector)):
                tensors.append(cute.make_tensor(p, cute.make_layout((M,))))
            elif const_expr(isinstance(spec, GroupVector)):
                w = 2 * n_log if spec.paired else n_log
                tensors.append(cute.make_tensor(p, cute.make_layout((G, w), stride=(w, 1))))
            else:
                w = 2 * n_log if spec.paired else n_log
                tensors.append(cute.make_tensor(p, cute.make_layout((M, w), stride=(w, 1))))
        for spec in self.epi.outputs:
            p = ptrs[i]
            i += 1
            w = 2 * n_log if spec.paired else n_log
            tensors.append(cute.make_tensor(p, cute.make_layout((M, w), stride=(w, 1))))
            if const_expr(isinstance(spec, MXFP8Output)):
                p2 = ptrs[i]
                i += 1
                tensors.append(cute.make_tensor(p2, cute.make_layout((M, w // 32), stride=(w // 32, 1))))

        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            self.acc_dtype, (self.mma_atoms_m, 1, 1), tiler_mn=(64, self.tile_n),
        )
        self.tiled_mma_log = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            self.acc_dtype, (self.mma_atoms_m, 1, 1), tiler_mn=(64, self.tile_n_log),
        )
        a_layout_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.ab_dtype, self.tile_k), self.ab_dtype
        )
        self.sA_layout = cute.tile_to_shape(a_layout_atom, (self.tile_m, self.tile_k, self.stages), order=(0, 1, 2))
        self.sB_layout = cute.tile_to_shape(a_layout_atom, (self.tile_n, self.tile_k, self.stages), order=(0, 1, 2))
        sA_one = cute.slice_(self.sA_layout, (None, None, 0))
        sB_one = cute.slice_(self.sB_layout, (None, None, 0))
        tma_a, tma_tA = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, sA_one, (self.tile_m, self.tile_k)
        )
        tma_b, tma_tB = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, sB_one, (self.tile_n, self.tile_k)
        )
        self.tx_bytes = cute.size_in_bytes(self.ab_dtype, sA_one) + cute.size_in_bytes(self.ab_dtype, sB_one)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sched: cute.struct.MemRange[cutlass.Int64, 2 * self.sched_stages]
            tile_slot: cute.struct.MemRange[Int32, self.sched_stages]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.sB_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a, tma_tA, tma_b, tma_tB, mOffs, mCounter, tuple(tensors), M, N, K, G,
            self.tiled_mma, self.tiled_mma_log, self.sA_layout, self.sB_layout,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), smem=SharedStorage.size_in_bytes(),
                 min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ device helpers
    @cute.jit
    def _group_tiles(self, mOffs: cute.Tensor, g: Int32, G: cutlass.Constexpr, n_tiles: cutlass.Constexpr):
        gi = cutlass.min(g, G - 1)
        rows = mOffs[gi + 1] - mOffs[gi]
        cnt = ((rows + (self.tile_m - 1)) // self.tile_m) * n_tiles
        return cutlass.select_(g < G, cnt, Int32(_BIG))

    @cute.jit
    def _advance(self, mOffs, tile_id: Int32, g: Int32, base: Int32, cnt: Int32, G: cutlass.Constexpr,
                 n_tiles: cutlass.Constexpr):
        while tile_id >= base + cnt:
            base = base + cnt
            g = g + 1
            cnt = self._group_tiles(mOffs, g, G, n_tiles)
        return g, base, cnt

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
        epi_tensors: tuple,
        M: Int32,
        N: cutlass.Constexpr,
        K: cutlass.Constexpr,
        G: cutlass.Constexpr,
        tiled_mma: cute.TiledMma,
        tiled_mma_log: cute.TiledMma,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_tiles = (N + self.tile_n - 1) // self.tile_n
        k_tiles = (K + self.tile_k - 1) // self.tile_k

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        prod_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # one arrive per consumer warp that reads a stage (pingpong: one warpgroup reads each stage)
        cons_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_atoms_m * 4)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=prod_group,
            consumer_group=cons_group,
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        if const_expr(self.dynamic):
            # sched pipeline: producer warp fetches the next tile id and publishes it to consumers.
            sched_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.sched.data_ptr(),
                num_stages=self.sched_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 128),
            )
        sTile = storage.tile_slot.get_tensor(cute.make_layout((self.sched_stages,)))
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        cute.arch.sync_threads()

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(40)
            if warp_idx == 0:
                # ---------------------------------------------------------- producer (TMA loads)
                prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                if const_expr(self.dynamic):
                    sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                               self.sched_stages)
                tile_id = bidx
                g = Int32(0)
                base = Int32(0)
                cnt = self._group_tiles(mOffs, g, G, n_tiles)
                g, base, cnt = self._advance(mOffs, tile_id, g, base, cnt, G, n_tiles)
                if const_expr(self.dynamic):
                    sched_pipe.producer_acquire(sched_state)
                    if cute.arch.lane_idx() == 0:
                        sTile[sched_state.index] = tile_id
                    sched_pipe.producer_commit(sched_state)
                    sched_state.advance()
                while g < G:
                    local = tile_id - base
                    mt = cnt // n_tiles
                    m_idx = local % mt
                    n_idx = local // mt
                    row0 = mOffs[g] + m_idx * self.tile_m
                    gA = cute.local_tile(cute.domain_offset((row0, 0), mA), (self.tile_m, self.tile_k), (0, None))
                    gB = cute.local_tile(mB[None, None, g], (self.tile_n, self.tile_k), (n_idx, None))
                    tAsA, tAgA = cpasync.tma_partition(
                        tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
                    )
                    tBsB, tBgB = cpasync.tma_partition(
                        tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
                    )
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ab_pipe.producer_acquire(prod_state)
                        bar = ab_pipe.producer_get_barrier(prod_state)
                        cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, prod_state.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, prod_state.index)], tma_bar_ptr=bar)
                        ab_pipe.producer_commit(prod_state)
                        prod_state.advance()
                    # next tile
                    if const_expr(self.dynamic):
                        nt = Int32(0)
                        if cute.arch.lane_idx() == 0:
                            nt = cute.arch.atomic_add(mCounter.iterator.llvm_ptr, Int32(1)) + grid
                        tile_id = cute.arch.shuffle_sync(nt, 0)
                    else:
                        tile_id = tile_id + grid
                    g, base, cnt = self._advance(mOffs, tile_id, g, base, cnt, G, n_tiles)
                    if const_expr(self.dynamic):
                        sched_pipe.producer_acquire(sched_state)
                        if cute.arch.lane_idx() == 0:
                            sTile[sched_state.index] = tile_id
                        sched_pipe.producer_commit(sched_state)
                        sched_state.advance()
                if const_expr(self.dynamic and self.pingpong):
                    # pingpong consumers read entries in pairs (the other warpgroup's, then their own):
                    # a second end-of-work entry lets the warpgroup that skips the first one stop too
                    sched_pipe.producer_acquire(sched_state)
                    if cute.arch.lane_idx() == 0:
                        sTile[sched_state.index] = tile_id
                    sched_pipe.producer_commit(sched_state)
                    sched_state.advance()
                ab_pipe.producer_tail(prod_state)
        else:
            cute.arch.warpgroup_reg_alloc(232)
            # -------------------------------------------------------------- consumers (wgmma + epilogue)
            if const_expr(self.pingpong):
                cwg = wg_idx - 1            # this consumer warpgroup's parity in the CTA's tile sequence
                ctid = tidx % 128
            else:
                ctid = tidx - 128
            thr_mma = tiled_mma.get_slice(ctid)
            thr_mma_log = tiled_mma_log.get_slice(ctid)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            cC = cute.make_identity_tensor((self.tile_m, self.tile_n_log))
            tCcC = thr_mma_log.partition_C(cC)
            acc_shape = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))).shape
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            num_k_blocks = cute.size(tCrA, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            rel_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            if const_expr(self.pingpong):
                # warpgroup 1 starts after warpgroup 0's first tile in the smem ring
                read_state.advance(cwg * k_tiles)
                rel_state.advance(cwg * k_tiles)
            if const_expr(self.dynamic):
                sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.sched_stages)
                sched_pipe.consumer_wait(sched_state)
                tile_id = sTile[sched_state.index]
                sched_pipe.consumer_release(sched_state)
                sched_state.advance()
                if const_expr(self.pingpong):
                    # warpgroup 1 skips entry 0 (warpgroup 0's tile) and takes entry 1
                    t1 = tile_id
                    if cwg == 1:
                        sched_pipe.consumer_wait(sched_state)
                        t1 = sTile[sched_state.index]
                        sched_pipe.consumer_release(sched_state)
                    sched_state.advance(cwg)
                    tile_id = cutlass.select_(cwg == 1, t1, tile_id)
            else:
                tile_id = bidx
                if const_expr(self.pingpong):
                    tile_id = bidx + cwg * grid
            g = Int32(0)
            base = Int32(0)
            cnt = self._group_tiles(mOffs, g, G, n_tiles)
            g, base, cnt = self._advance(mOffs, tile_id, g, base, cnt, G, n_tiles)
            if const_expr(self.pingpong):
                if cwg == 0:
                    # warpgroup 0 goes first: pre-arrive on its own mainloop barrier
                    cute.arch.barrier_arrive(barrier_id=_PP_BAR, number_of_threads=256)
            while g < G:
                local = tile_id - base
                mt = cnt // n_tiles
                m_idx = local % mt
                n_idx = local // mt
                row_start = mOffs[g]
                row_end = mOffs[g + 1]
                row0 = row_start + m_idx * self.tile_m

                # ---- epilogue inputs read from global memory, issued now so that the loads complete
                # under the mainloop instead of stalling the epilogue
                pre = None
                if const_expr(self.prefetch_pairs > 0):
                    pre = self._epilogue_prefetch(tCcC, epi_tensors, row0, row_end, n_idx, N)

                # ---- mainloop
                if const_expr(self.pingpong):
                    # wait for the other warpgroup to have issued its whole mainloop: tensor cores go to
                    # one warpgroup at a time, and every smem stage of this tile then has its previous
                    # fill consumed (mbarrier parity waits can only tell adjacent phases apart)
                    cute.arch.barrier(barrier_id=_PP_BAR + cwg, number_of_threads=256)
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                ab_pipe.consumer_wait(read_state)
                for kb in cutlass.range_constexpr(num_k_blocks):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read_state.index)],
                              tCrB[(None, None, kb, read_state.index)], acc)
                warpgroup.commit_group()
                read_state.advance()
                for kt in cutlass.range(1, k_tiles, unroll=1):
                    ab_pipe.consumer_wait(read_state)
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read_state.index)],
                                  tCrB[(None, None, kb, read_state.index)], acc)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
                    ab_pipe.consumer_release(rel_state)
                    rel_state.advance()
                    read_state.advance()
                if const_expr(self.pingpong):
                    cute.arch.barrier_arrive(barrier_id=_PP_BAR + 1 - cwg, number_of_threads=256)
                warpgroup.wait_group(0)
                ab_pipe.consumer_release(rel_state)
                rel_state.advance()

                # ---- epilogue
                self._epilogue(acc, tCcC, epi_tensors, row0, row_end, g, n_idx, N, pre)

                # ---- next tile
                if const_expr(self.pingpong):
                    # skip the other warpgroup's tile in the smem ring and in the tile sequence
                    read_state.advance(k_tiles)
                    rel_state.advance(k_tiles)
                    if const_expr(self.dynamic):
                        sched_pipe.consumer_wait(sched_state)
                        sched_pipe.consumer_release(sched_state)
                        sched_state.advance()
                        sched_pipe.consumer_wait(sched_state)
                        tile_id = sTile[sched_state.index]
                        sched_pipe.consumer_release(sched_state)
                        sched_state.advance()
                    else:
                        tile_id = tile_id + 2 * grid
                elif const_expr(self.dynamic):
                    sched_pipe.consumer_wait(sched_state)
                    tile_id = sTile[sched_state.index]
                    sched_pipe.consumer_release(sched_state)
                    sched_state.advance()
                else:
                    tile_id = tile_id + grid
                g, base, cnt = self._advance(mOffs, tile_id, g, base, cnt, G, n_tiles)

    # ------------------------------------------------------------------ epilogue (trace-time)
    def _row_addr(self, t, grow, col, dt):
        """Byte address of element (grow, col) of a row-major 2-D tensor (64-bit)."""
        return t.iterator.toint() + (Int64(grow) * t.layout.stride[0] + Int64(col)) * (dt.width // 8)

    def _frag_cols(self, tCcC, col0, mm, h, nn):
        """The thread's first logical column of fragment (mm, h, nn) and its first paired column.  Chunk
        c of the wgmma accumulator fragment is 8*c columns further (paired: 16*c)."""
        lc0 = col0 + tCcC[((0, h, 0), mm, nn)][1]
        return lc0, (lc0 // 8) * 16 + (lc0 % 8)

    def _epilogue_prefetch(self, tCcC, epi_tensors, row0, row_end, n_idx, N):
        """Trace time, before the tile's mainloop: load the RowVector values of the thread's rows and, in
        the order the epilogue consumes them, up to ``prefetch_pairs`` AuxInput pairs (2 adjacent 16-bit
        values packed in one 32-bit register, 0 where masked).  Returns {key: value} for _epilogue.
        Addresses are one 64-bit base per fragment row plus constants, so that what the epilogue shares
        with them (the same bases) costs few registers across the mainloop."""
        epi = self.epi
        n_log = N // 2 if self.gated else N
        col0 = n_idx * self.tile_n_log
        n_v, n_h, n_c = tCcC.shape[0]
        n_mm, n_nn = tCcC.shape[1], tCcC.shape[2]
        col_exact = n_log % self.tile_n_log == 0
        pre = {}
        left = self.prefetch_pairs
        for mm in range(n_mm):
            for h in range(n_h):
                grow = row0 + tCcC[((0, h, 0), mm, 0)][0]
                row_ok = grow < row_end
                for ii, spec in enumerate(epi.inputs):
                    if isinstance(spec, RowVector):
                        pre[("row", ii, mm, h)] = _load1(epi_tensors[ii], grow, row_ok)
                for nn in range(n_nn):
                    lc0, pc0 = self._frag_cols(tCcC, col0, mm, h, nn)
                    for ii, spec in enumerate(epi.inputs):
                        if not isinstance(spec, AuxInput):
                            continue
                        dt = cutlass_dtype(spec.dtype or self.dtype_name)
                        if dt.width != 16:
                            continue
                        t = epi_tensors[ii]
                        base = self._row_addr(t, grow, pc0 if spec.paired else lc0, dt)
                        for c in range(n_c):
                            halves = 2 if spec.paired else 1
                            if left < halves:
                                break
                            left -= halves
                            ok = row_ok if col_exact else row_ok & (lc0 + 8 * c < n_log)
                            if spec.paired:
                                pre[("aux", ii, mm, h, nn, c)] = (_ld32(base + 32 * c, ok),
                                                                  _ld32(base + 32 * c + 16, ok))
                            else:
                                pre[("aux", ii, mm, h, nn, c)] = _ld32(base + 16 * c, ok)
        return pre

    def _epilogue(self, acc, tCcC, epi_tensors, row0, row_end, g, n_idx, N, pre=None):
        """Plain Python, runs at trace time: unrolled over the thread's fragment.

        Per fragment row, the 8-column chunks are processed in batches of ``_EPI_BATCH``: the batch's
        input loads (2-element vectors; none for what ``pre`` holds, see _epilogue_prefetch), the epilogue
        math, then the batch's stores.  The stores keep the next batch's loads from being hoisted (the
        pointers may alias), which bounds the live registers (no spills with inputs at wide tiles) while a
        batch's loads still overlap.  Addresses: one 64-bit base per (tensor, fragment row) plus
        constants (chunk c is 8 columns further, 16 when paired)."""
        epi = self.epi
        n_log = N // 2 if self.gated else N
        col0 = n_idx * self.tile_n_log
        col_exact = n_log % self.tile_n_log == 0
        frag_shape = tCcC.shape
        n_v, n_h, n_c = frag_shape[0]
        assert n_v == 2, "wgmma accumulator: 2 adjacent columns per thread and chunk"
        n_mm = frag_shape[1]
        n_nn = frag_shape[2]
        n_in = len(epi.inputs)
        in_tensors = epi_tensors[:n_in]
        out_tensors = epi_tensors[n_in:]
        out_dtypes = [cutlass_dtype(s.dtype if s.dtype is not None else self.dtype_name) for s in epi.outputs]
        in_dtypes = [cutlass_dtype(s.dtype if s.dtype is not None else self.dtype_name) for s in epi.inputs]
        has_mx = any(isinstance(s, MXFP8Output) for s in epi.outputs)
        batch = _EPI_BATCH if n_c % _EPI_BATCH == 0 else n_c
        if has_mx:
            assert n_c % 4 == 0 and batch % 4 == 0
        for mm in range(n_mm):
            for h in range(n_h):
                r = tCcC[((0, h, 0), mm, 0)][0]
                grow = row0 + r
                row_ok = grow < row_end
                row_vals = {}
                for ii in range(n_in):
                    spec = epi.inputs[ii]
                    if isinstance(spec, RowVector):
                        if pre is not None and ("row", ii, mm, h) in pre:
                            row_vals[ii] = pre[("row", ii, mm, h)]
                        else:
                            row_vals[ii] = _load1(in_tensors[ii], grow, row_ok)
                for nn in range(n_nn):
                    lc0, pc0 = self._frag_cols(tCcC, col0, mm, h, nn)
                    in_base = {}
                    for ii, spec in enumerate(epi.inputs):
                        if isinstance(spec, RowVector):
                            continue
                        rr = grow if isinstance(spec, AuxInput) else g
                        in_base[ii] = self._row_addr(in_tensors[ii], rr, pc0 if spec.paired else lc0, in_dtypes[ii])
                    out_base = {}
                    ot = 0
                    for oi, spec in enumerate(epi.outputs):
                        if not isinstance(spec, MXFP8Output):
                            out_base[oi] = self._row_addr(out_tensors[ot], grow, pc0 if spec.paired else lc0,
                                                          out_dtypes[oi])
                        ot += 2 if isinstance(spec, MXFP8Output) else 1
                    for c0 in range(0, n_c, batch):
                        cs = list(range(c0, c0 + batch))
                        # results[oi][k][v] for chunk cs[k]
                        results = [[[None] * n_v for _ in cs] for _ in epi.outputs]
                        lcols = []
                        oks = []
                        for k, c in enumerate(cs):
                            lcol = lc0 + 8 * c
                            col_ok = lcol < n_log
                            ok = row_ok if col_exact else row_ok & col_ok
                            lcols.append(lcol)
                            oks.append(ok)
                            # inputs at (row or group, columns lcol, lcol+1): one 2-element vector load per
                            # (input, half); in_vals[ii][v] = value, or (gate-half, up-half) when paired
                            in_vals = {}
                            for ii in range(n_in):
                                spec = epi.inputs[ii]
                                if isinstance(spec, RowVector):
                                    continue
                                dt = in_dtypes[ii]
                                eb = dt.width // 8
                                ok_in = ok if isinstance(spec, AuxInput) else (True if col_exact else col_ok)
                                pkey = ("aux", ii, mm, h, nn, c)
                                if pre is not None and pkey in pre:
                                    if spec.paired:
                                        a0, a1 = _unpack2(pre[pkey][0], dt)
                                        b0, b1 = _unpack2(pre[pkey][1], dt)
                                        in_vals[ii] = ((a0, b0), (a1, b1))
                                    else:
                                        in_vals[ii] = _unpack2(pre[pkey], dt)
                                elif spec.paired:
                                    a0, a1 = _load2_at(in_base[ii] + 16 * c * eb, ok_in, dt)
                                    b0, b1 = _load2_at(in_base[ii] + (16 * c + 8) * eb, ok_in, dt)
                                    in_vals[ii] = ((a0, b0), (a1, b1))
                                else:
                                    in_vals[ii] = _load2_at(in_base[ii] + 8 * c * eb, ok_in, dt)
                            for v in range(n_v):
                                args = []
                                if self.gated:
                                    args.append(acc[((v, h, 2 * c), mm, nn)])
                                    args.append(acc[((v, h, 2 * c + 1), mm, nn)])
                                else:
                                    args.append(acc[((v, h, c), mm, nn)])
                                for ii in range(n_in):
                                    spec = epi.inputs[ii]
                                    if isinstance(spec, RowVector):
                                        args.append(row_vals[ii])
                                    elif spec.paired:
                                        args.append(in_vals[ii][v][0])
                                        args.append(in_vals[ii][v][1])
                                    else:
                                        args.append(in_vals[ii][v])
                                res = epi.apply(*args)
                                if not isinstance(res, (tuple, list)):
                                    res = (res,)
                                assert len(res) == epi.num_apply_results(), "apply returned a wrong count"
                                kk = 0
                                for oi, spec in enumerate(epi.outputs):
                                    if spec.paired:
                                        results[oi][k][v] = (res[kk], res[kk + 1])
                                        kk += 2
                                    else:
                                        results[oi][k][v] = res[kk]
                                        kk += 1
                        ot = 0
                        for oi, spec in enumerate(epi.outputs):
                            dt = out_dtypes[oi]
                            eb = dt.width // 8
                            t = out_tensors[ot]
                            if isinstance(spec, MXFP8Output):
                                self._store_mxfp8(results[oi], lcols, oks, t, out_tensors[ot + 1], grow, row_ok)
                                ot += 2
                                continue
                            for k, c in enumerate(cs):
                                rk = results[oi][k]
                                if spec.paired:
                                    _store2_at(out_base[oi] + 16 * c * eb, rk[0][0], rk[1][0], dt, oks[k])
                                    _store2_at(out_base[oi] + (16 * c + 8) * eb, rk[0][1], rk[1][1], dt, oks[k])
                                else:
                                    _store2_at(out_base[oi] + 8 * c * eb, rk[0], rk[1], dt, oks[k])
                            ot += 1

    def _store_mxfp8(self, res, lcols, oks, t, ts, grow, row_ok):
        """res[c][v]: fp32 values of logical columns lcols[c] + v.  A 32-column block = 4 consecutive
        8-column chunks; each quad of lanes holds the 32 values (2 per chunk per lane).

        Exact docs/quantization.md rule, on the value rounded to the GEMM dtype (what a high-precision
        ``Output`` of the same value stores, so ``mxfp8_quantize_2d(hp.float())`` reproduces the bytes):
        block amax over the finite elements only (integer max of the |x| bit patterns), the scale
        exponent from the amax bits, elements = RNE_e4m3(x * 2^-e) with 2^-e built from bits (exact),
        NaN and +-Inf -> 0x7F."""
        n_c = len(res)
        assert n_c % 4 == 0
        ab = self.ab_dtype
        for b in range(n_c // 4):
            ys = {}
            amax_bits = Int32(0)
            for c in range(4 * b, 4 * b + 4):
                for v in range(2):
                    y = Float32(Float32(res[c][v]).to(ab))       # round to the GEMM dtype and back
                    bits = _f32_bits(y) & 0x7FFFFFFF
                    fin = bits < 0x7F800000
                    ys[(c, v)] = (y, fin)
                    amax_bits = cutlass.max(amax_bits, cutlass.select_(fin, bits, Int32(0)))
            amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 1))
            amax_bits = cutlass.max(amax_bits, cute.arch.shuffle_sync_bfly(amax_bits, 2))
            e8, inv_scale = _e8m0_scale_bits(amax_bits)
            qnan = _bits_f32(Int32(0x7FFFFFFF))
            for c in range(4 * b, 4 * b + 4):
                q = []
                for v in range(2):
                    y, fin = ys[(c, v)]
                    q.append(Float32(cutlass.select_(fin, y * inv_scale, qnan)))
                _store2(t, grow, lcols[c], q[0], q[1], cutlass.Float8E4M3FN, oks[c])
            # lane 0 of the quad writes the scale byte
            first = lcols[4 * b]
            _store_scale(ts, grow, first // 32, e8, oks[4 * b] & ((first % 32) == 0))


@cute.jit
def _load1(t: cute.Tensor, i: Int32, ok: Boolean) -> Float32:
    v = Float32(0.0)
    if ok:
        v = Float32(t[i])
    return v


@cute.jit
def _ld32(addr: Int64, ok: Boolean) -> Int32:
    """One 32-bit load at a byte address (0 where not ok): 2 adjacent 16-bit values."""
    v = Int32(0)
    if ok:
        p = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4)
        v = cute.make_tensor(p, cute.make_layout((1,)))[0]
    return v


@cute.jit
def _load2_at(addr: Int64, ok: Boolean, dt: cutlass.Constexpr):
    """Load 2 adjacent values at a byte address with one vector load (0 where not ok)."""
    frag = cute.make_rmem_tensor((2,), dt)
    frag.fill(0.0)
    if ok:
        p = cute.make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=2 * dt.width // 8)
        cute.autovec_copy(cute.make_tensor(p, cute.make_layout((2,))), frag)
    return Float32(frag[0]), Float32(frag[1])


@cute.jit
def _store2_at(addr: Int64, v0: Float32, v1: Float32, dt: cutlass.Constexpr, ok: Boolean):
    """Store 2 adjacent values at a byte address with one vector store."""
    frag = cute.make_rmem_tensor((2,), dt)
    frag[0] = v0.to(dt)
    frag[1] = v1.to(dt)
    if ok:
        p = cute.make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=2 * dt.width // 8)
        cute.autovec_copy(frag, cute.make_tensor(p, cute.make_layout((2,))))


def _unpack2(v, dt):
    """(col, col+1) as fp32 from a word loaded by _ld32 (little endian: col in the low half)."""
    if dt is cutlass.BFloat16:
        return _bits_f32(v << 16), _bits_f32(v & -65536)
    frag = cute.make_rmem_tensor((1,), Int32)
    frag[0] = v
    h = cute.recast_tensor(frag, dt)
    return Float32(h[0]), Float32(h[1])


@cute.jit
def _load2d(t: cute.Tensor, r: Int32, c: Int32, ok: Boolean) -> Float32:
    v = Float32(0.0)
    if ok:
        v = Float32(t[r, c])
    return v


@cute.jit
def _store2(t: cute.Tensor, row: Int32, col: Int32, v0: Float32, v1: Float32, dt: cutlass.Constexpr, ok: Boolean):
    """Store 2 adjacent values (col, col+1) with one vector store."""
    frag = cute.make_rmem_tensor((2,), dt)
    frag[0] = v0.to(dt)
    frag[1] = v1.to(dt)
    if ok:
        off = Int64(row) * t.layout.stride[0] + Int64(col)
        addr = t.iterator.toint() + off * (dt.width // 8)
        p = cute.make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=2 * dt.width // 8)
        dst = cute.make_tensor(p, cute.make_layout((2,)))
        cute.autovec_copy(frag, dst)


@cute.jit
def _store_scale(ts: cute.Tensor, row: Int32, col: Int32, e8: Int32, ok: Boolean):
    if ok:
        ts[row, col] = cutlass.Uint8(e8)


def _f32_bits(x) -> Int32:
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value()))


def _bits_f32(b) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(b).ir_value()))


def _e8m0_scale(amax):
    return _e8m0_scale_bits(_f32_bits(amax) & 0x7FFFFFFF)


def _e8m0_scale_bits(bits):
    """Exact MXFP8 scale (docs/quantization.md): e = ceil(log2(amax / 448)) from the fp32 bits,
    amax = 1.f * 2^E -> e = E - 8 + (f > 0.75); amax == 0 / subnormal -> e = -127; clamp [-127, 127].
    Returns (E8M0 byte as Int32, 2^-e as fp32)."""
    biased = bits >> 23
    frac = bits & 0x7FFFFF
    e = biased - 135 + cutlass.select_(frac > 0x600000, Int32(1), Int32(0))
    e = cutlass.select_(biased == 0, Int32(-127), e)
    e = cutlass.max(cutlass.min(e, Int32(127)), Int32(-127))
    inv = _bits_f32((cutlass.min(127 - e, Int32(254))) << 23)
    return e + 127, inv
