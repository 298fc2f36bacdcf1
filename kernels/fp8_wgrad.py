"""Persistent FP8 block-scaled grouped GEMM whose reduction runs over each group's rows (varlen-K), for sm_90a
(CuTe DSL): the weight gradient of an fp8_block GroupLinear in the recipe's FP8 operands.

    D[g][m, n] = sum over the 128-row blocks s of group g:  sum_r A[m, s, r] B[n, s, r] * sa[s, m] * sb[s, n]

For ``dW[g] = dY_g.T @ X_g``: A is dY's columnwise FP8-block copy, B is X's (docs/quantization.md: 128-row blocks
per group, a partial last block per group), both in the *slot layout* that the quantize kernel writes with
``slots=True`` (kernels/fp8_quantize.py):

- A: (Ma, L) E4M3 codes, row-major, ``L = 128 * capacity``: row m holds column m of dY, block slot s in bytes
  ``[128 s, 128 s + 128)``, zeros past the group's last row. Every k-tile is one whole slot, so a k-tile never
  straddles two groups and nothing needs masking: the zero codes add nothing. ``capacity = ceil(M/128) + G``, the
  columnwise scales' (fusion/quant/blocks.py).
- B: (Nb, L) the same for X.
- sa: (capacity, Ma), sb: (capacity, Nb) float32: the columnwise block scales (``cw_scale``), one per slot and
  column (0.0 in unused slots).
- offsets: (G+1,) int32 group row bounds on the device. Group g's slots are ``first_g .. first_g + ceil(n_g / 128)
  - 1`` with ``first_g = sum_{h<g} ceil(n_h / 128)``; each warp role keeps ``first_g`` as a running sum, since the
  static schedule walks the groups in order.

Both operands are K-major, which is what FP8 wgmma requires (it has no transposed 8-bit operand): that is why the
columnwise copies are stored transposed. Both scales vary along the output tile (``sa`` per row, ``sb`` per column)
and per k-tile, so the promotion of a k-tile's partial sums is ``acc += part * (sa[row] * sb[col])``: one FMUL
and one FFMA per element, the column scales read from the stage's shared memory per 8-column chunk.

Warp roles as kernels/fp8_gemm.py's: warp 0 of warpgroup 0 loads by TMA, per k-tile, A's (tile_m x 128) box,
B's (tile_n x 128) box and the two scale vectors (tile_m and tile_n floats) into one stage under its mbarrier;
warpgroups 1..2 each own 64 rows of every 128-row wave of the tile (one wave at tile_m = 128, two at 256, sharing
one scratch fragment as kernels/fp8_mainloop.py's m-waves do). ``ctas_per_sm = 2``: warpgroup 1 alone walks a 128 x
128 tile as two 64-row m-waves and two CTAs share an SM (``.minnctapersm 2``, setmaxnreg 32 / 224, three stages in
half the shared memory, a grid of two CTAs an SM), so one CTA's epilogue (its tile's store) runs while the other's
wgmma do, as the FP8 forward's lone GEMMs do (kernels/fp8_gemm.py). ``cluster_n = 2``: a CTA pair works on two
neighbouring n-tiles of one (group, m-tile) in lockstep, and A's box (the same for both) reaches both by TMA
multicast, each CTA loading half of it: a third less L2 traffic per FLOP at 256 x 128. Session o measured the pair
slower on eight weight gradients of twelve; session ag, at this kernel, 0.4-10.4% faster than single CTAs on all 22
it timed and 2.1-2.4% off the FP8 steps that run it, so the tile policy pairs (kernels/tile_policy.py
`choose_fp8_wgrad_config`); the two-CTA tile measured slower in the step (off). Tiles: every group has the same
``mt x nt`` tiles; unit u (``cluster_n`` neighbouring n-tiles, one per CTA of a cluster) is group ``u // (mt nu)``,
m fastest within it; static schedule (``unit += clusters``). An empty group's tiles run no k-tile and store zeros.
D is (G, Ma, Nb) in 16 bits, stored 4 columns per lane, or 8 with ``store_bytes = 16``
(:func:`kernels.fragment_io.store_tile16`). ``ordered_waves``: the two consumer warpgroups take turns issuing their
waves (kernels/fp8_mainloop.py ``take_turn``), so one promotes while the other's wgmma run; faster alone, slower in
the FP8 steps, which run at the card's power limit (off; tile_policy.FP8_WGRAD_ORDERED_WAVES).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from .dtypes import cutlass_dtype
from .fp8_mainloop import MAX_SHARED_CARVEOUT, TWO_CTA_REGISTER_SPLIT, first_turn, issue_wave, last_turn, pass_turn, \
    take_turn
from .fp8_scales import SCALE_BLOCK
from .fragment_io import store_tile16
from .mainloop import REGISTER_SPLIT
from .scheduler import multicast_mask

__all__ = ["Fp8VarlenKGemmKernel"]

FP8 = cutlass.Float8E4M3FN


class Fp8VarlenKGemmKernel:
    """The kernel for ``config`` (:class:`kernels.tile_policy.WgradConfig`: tile_m 128 or 256, tile_n a multiple
    of 16 up to 128, tile_k 128), storing D in ``out_dtype`` (bfloat16 or float16)."""

    def __init__(self, config, out_dtype: str = "bfloat16"):
        self.cfg = config
        self.tile_m, self.tile_n, self.tile_k = config.tile_m, config.tile_n, config.tile_k
        assert self.tile_m in (128, 256) and self.tile_k == SCALE_BLOCK, "FP8 wgrad tiles are 128/256 x n x 128"
        assert self.tile_n % 16 == 0 and self.tile_n <= 128
        self.stages = config.stages
        # two CTAs an SM (config.ctas_per_sm = 2): one consumer warpgroup a CTA walks a 128-row tile as two 64-row
        # m-waves, and the SM's two CTAs drift apart, so one's epilogue runs under the other's wgmma (the FP8
        # forward's two-CTA tile, kernels/fp8_gemm.py)
        self.ctas_per_sm = int(getattr(config, "ctas_per_sm", 1))
        assert self.ctas_per_sm in (1, 2)
        self.num_mma_wg = 2 if self.ctas_per_sm == 1 else 1
        self.wave_rows = 64 * self.num_mma_wg          # the tile's rows one wave covers (64 per warpgroup)
        self.waves = self.tile_m // self.wave_rows
        self.threads = 128 * (1 + self.num_mma_wg)
        self.out_dtype = cutlass_dtype(out_dtype)
        assert self.out_dtype.width == 16, "D is stored in 16 bits"
        self.producer_regs, self.consumer_regs = \
            REGISTER_SPLIT[False] if self.ctas_per_sm == 1 else TWO_CTA_REGISTER_SPLIT
        self.cluster_n = int(getattr(config, "cluster_n", 1))
        assert self.cluster_n in (1, 2) and self.tile_m % (8 * self.cluster_n) == 0
        assert self.ctas_per_sm == 1 or (self.tile_m == 128 and self.cluster_n == 1), "two CTAs an SM: 128-row single"
        #: the two consumer warpgroups issue their waves in turn (:meth:`consume`); one warpgroup has no turns to take
        self.ordered = bool(getattr(config, "ordered_waves", False)) and self.num_mma_wg == 2

    # ------------------------------------------------------------------ host-side (traced) entry
    @cute.jit
    def __call__(self, pA: cute.Pointer, pB: cute.Pointer, pSA: cute.Pointer, pSB: cute.Pointer,
                 pOffs: cute.Pointer, pD: cute.Pointer, capacity: Int32, Ma: cutlass.Constexpr,
                 Nb: cutlass.Constexpr, G: cutlass.Constexpr, num_ctas: Int32, stream):
        self.Ma, self.Nb, self.G = Ma, Nb, G
        self.m_tiles = (Ma + self.tile_m - 1) // self.tile_m
        self.n_tiles = (Nb + self.tile_n - 1) // self.tile_n
        self.n_units = (self.n_tiles + self.cluster_n - 1) // self.cluster_n
        self.group_units = self.m_tiles * self.n_units
        L = capacity * SCALE_BLOCK
        mA = cute.make_tensor(pA, cute.make_layout((Ma, L), stride=(L, 1)))
        mB = cute.make_tensor(pB, cute.make_layout((Nb, L), stride=(L, 1)))
        mSA = cute.make_tensor(pSA, cute.make_layout((Ma, capacity), stride=(1, Ma)))
        mSB = cute.make_tensor(pSB, cute.make_layout((Nb, capacity), stride=(1, Nb)))
        mOffs = cute.make_tensor(pOffs, cute.make_layout((G + 1,)))
        mD = cute.make_tensor(pD, cute.make_layout((G * Ma, Nb), stride=(Nb, 1)))

        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            FP8, FP8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32, (self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, FP8, self.tile_k), FP8)
        self.sA_layout = cute.tile_to_shape(atom, (self.tile_m, self.tile_k, self.stages), order=(0, 1, 2))
        self.sB_layout = cute.tile_to_shape(atom, (self.tile_n, self.tile_k, self.stages), order=(0, 1, 2))
        self.sSA_layout = cute.make_layout((self.tile_m, 1, self.stages))
        self.sSB_layout = cute.make_layout((self.tile_n, 1, self.stages))
        sA_one = cute.slice_(self.sA_layout, (None, None, 0))
        sB_one = cute.slice_(self.sB_layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        a_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_n > 1) else g2s
        tma_a, tma_tA = cpasync.make_tiled_tma_atom(a_op, mA, sA_one, (self.tile_m, self.tile_k),
                                                    num_multicast=self.cluster_n)
        tma_b, tma_tB = cpasync.make_tiled_tma_atom(g2s, mB, sB_one, (self.tile_n, self.tile_k))
        tma_sa, tma_tSA = cpasync.make_tiled_tma_atom(g2s, mSA, cute.make_layout((self.tile_m, 1)),
                                                      (self.tile_m, 1))
        tma_sb, tma_tSB = cpasync.make_tiled_tma_atom(g2s, mSB, cute.make_layout((self.tile_n, 1)),
                                                      (self.tile_n, 1))
        # out-of-bounds box elements (rows past Ma or Nb) are zero-filled and still counted by the transaction
        self.tx_bytes = (cute.size_in_bytes(FP8, sA_one) + cute.size_in_bytes(FP8, sB_one)
                         + 4 * (self.tile_m + self.tile_n))

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(self.sB_layout)], 1024]
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sSA_layout)], 128]
            sSB: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sSB_layout)], 128]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, tma_tA, tma_b, tma_tB, tma_sa, tma_tSA, tma_sb, tma_tSB, mOffs, mD, self.tiled_mma,
                    self.sA_layout, self.sB_layout, self.sSA_layout, self.sSB_layout).launch(
            grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), cluster=(self.cluster_n, 1, 1),
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=self.ctas_per_sm,
            # two CTAs an SM need the whole 228 KiB carveout (stated, so compiling asks no device for it)
            preferred_smem_carveout=MAX_SHARED_CARVEOUT if self.ctas_per_sm > 1 else None, stream=stream)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_sa: cute.CopyAtom, mSA: cute.Tensor, tma_sb: cute.CopyAtom, mSB: cute.Tensor,
               mOffs: cute.Tensor, mD: cute.Tensor, tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, sSA_layout: cute.Layout, sSB_layout: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_a, tma_b, tma_sa, tma_sb):
                cpasync.prefetch_descriptor(atom)
        rank = Int32(0)
        if const_expr(self.cluster_n > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        storage = SmemAllocator().allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            # one release per consumer warp, in each CTA of the pair (either CTA's producer filled half of A)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.cluster_n * self.num_mma_wg * 4),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_n, 1, 1)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_n, 1), is_relaxed=True)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sSA = storage.sSA.get_tensor(sSA_layout)
        sSB = storage.sSB.get_tensor(sSB_layout)
        pipeline_init_wait(cluster_shape_mn=(self.cluster_n, 1))

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if warp_idx == 0:
                self.produce(tma_a, mA, tma_b, mB, tma_sa, mSA, tma_sb, mSB, mOffs, sA, sB, sSA, sSB, ab_pipe,
                             rank, bidx, grid)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            self.consume(tiled_mma, sA, sB, sSA, sSB, mOffs, mD, ab_pipe, tidx, rank, bidx, grid)

    # ------------------------------------------------------------------ schedule
    def unit_coords(self, unit, rank):
        """(group, m-tile, n-tile of CTA ``rank``) of schedule unit ``unit``: groups in order, m fastest within one;
        a unit is ``cluster_n`` neighbouring n-tiles (the pair's second may lie past Nb: zeros read, nothing
        stored)."""
        g = unit // self.group_units
        local = unit - g * self.group_units
        return g, local % self.m_tiles, (local // self.m_tiles) * self.cluster_n + rank

    @cute.jit
    def k_tiles(self, mOffs: cute.Tensor, g: Int32) -> Int32:
        """Group ``g``'s 128-row blocks: its k-tiles and its slots."""
        return (mOffs[g + 1] - mOffs[g] + (self.tile_k - 1)) // self.tile_k

    @cute.jit
    def first_slot(self, mOffs: cute.Tensor, g_from: Int32, slot: Int32, g: Int32) -> Int32:
        """Group ``g``'s first slot from group ``g_from``'s (``slot``; ``g >= g_from``): the running sum over the
        groups between, which the static schedule visits in order."""
        for h in cutlass.range(g_from, g, unroll=1):
            slot = slot + self.k_tiles(mOffs, h)
        return slot

    # ------------------------------------------------------------------ producer
    @cute.jit
    def produce(self, tma_a, mA: cute.Tensor, tma_b, mB: cute.Tensor, tma_sa, mSA: cute.Tensor, tma_sb,
                mSB: cute.Tensor, mOffs: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor, sSA: cute.Tensor,
                sSB: cute.Tensor, ab_pipe, rank: Int32, bidx: Int32, grid: Int32):
        """Warp 0: per k-tile of the CTA's tiles, the operand boxes and the two scale vectors of one slot; in a CTA
        pair, half of A's box, multicast to both CTAs (``rank``: this CTA's)."""
        total = self.G * self.group_units
        one = cute.make_layout(1)
        a_mask = multicast_mask(self.cluster_n, rank)
        clusters = grid // self.cluster_n
        prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        unit = bidx // self.cluster_n
        g_seen = Int32(0)
        slot0 = Int32(0)
        while unit < total:
            g, m_idx, n_idx = self.unit_coords(unit, rank)
            slot0 = self.first_slot(mOffs, g_seen, slot0, g)
            g_seen = g
            steps = self.k_tiles(mOffs, g)
            gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (m_idx, None))
            tAsA, tAgA = cpasync.tma_partition(tma_a, rank, cute.make_layout(self.cluster_n),
                                               cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
            gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (n_idx, None))
            tBsB, tBgB = cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
            gSA = cute.local_tile(mSA, (self.tile_m, 1), (m_idx, None))
            tSs, tSg = cpasync.tma_partition(tma_sa, 0, one, cute.group_modes(sSA, 0, 2),
                                             cute.group_modes(gSA, 0, 2))
            gSB = cute.local_tile(mSB, (self.tile_n, 1), (n_idx, None))
            tTs, tTg = cpasync.tma_partition(tma_sb, 0, one, cute.group_modes(sSB, 0, 2),
                                             cute.group_modes(gSB, 0, 2))
            for kt in cutlass.range(steps, unroll=1):
                ab_pipe.producer_acquire(prod_state)
                bar = ab_pipe.producer_get_barrier(prod_state)
                stage = prod_state.index
                slot = slot0 + kt
                cute.copy(tma_a, tAgA[(None, slot)], tAsA[(None, stage)], tma_bar_ptr=bar, mcast_mask=a_mask)
                cute.copy(tma_b, tBgB[(None, slot)], tBsB[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma_sa, tSg[(None, slot)], tSs[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma_sb, tTg[(None, slot)], tTs[(None, stage)], tma_bar_ptr=bar)
                ab_pipe.producer_commit(prod_state)
                prod_state.advance()
            unit = unit + clusters
        ab_pipe.producer_tail(prod_state)

    # ------------------------------------------------------------------ consumers
    def promote(self, acc, wave, part, row_scales, sSB, col0, stage):
        """``acc[wave] += part * (sa[row] * sb[col])`` over the thread's fragment (trace-time loops): per 8-column
        chunk ``c`` the thread's two columns ``col0 + 8c + (0, 1)`` read their scales from the stage."""
        n_v, n_h, n_c = part.shape[0]
        for c in range(n_c):
            col_scales = [sSB[(col0 + 8 * c + v, 0, stage)] for v in range(n_v)]
            for h in range(n_h):
                for v in range(n_v):
                    i = ((v, h, c), wave, 0)
                    acc[i] = part[((v, h, c), 0, 0)] * (row_scales[h] * col_scales[v]) + acc[i]

    @cute.jit
    def consume(self, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, sSA: cute.Tensor,
                sSB: cute.Tensor, mOffs: cute.Tensor, mD: cute.Tensor, ab_pipe, tidx: Int32, rank: Int32,
                bidx: Int32, grid: Int32):
        ctid = tidx - 128
        thr_mma = tiled_mma.get_slice(ctid)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        # per m-wave, the operand over its slice of the A ring (64 or 128 rows: 1024-byte multiples, the swizzle holds)
        tCrA = [tiled_mma.make_fragment_A(thr_mma.partition_A(
            cute.local_tile(sA, (self.wave_rows, self.tile_k, self.stages), (w, 0, 0)))) for w in range(self.waves)]
        tCcW = thr_mma.partition_C(cute.make_identity_tensor((self.wave_rows, self.tile_n)))      # one wave
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        assert cute.size(tCcC.shape[1]) == self.waves and cute.size(tCcC.shape[2]) == 1
        assert cute.size(tCcW.shape[1]) == 1 and cute.size(tCcW.shape[2]) == 1, "one wgmma atom per wave"
        acc = cute.make_rmem_tensor(tCcC.shape, Float32)
        part = cute.make_rmem_tensor(tCcW.shape, Float32)
        n_h = cute.size(tCcW.shape[0][1])
        rows = [tCcW[((0, h, 0), 0, 0)][0] for h in range(n_h)]     # the thread's rows of a wave
        col0 = tCcW[((0, 0, 0), 0, 0)][1]                             # its first column (chunk 0)
        total = self.G * self.group_units
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        clusters = grid // self.cluster_n
        unit = bidx // self.cluster_n
        cwg = ctid // 128
        first_turn(self.ordered, cwg)
        while unit < total:
            g, m_idx, n_idx = self.unit_coords(unit, rank)
            steps = self.k_tiles(mOffs, g)
            acc.fill(0.0)
            for kt in cutlass.range(steps, unroll=1):
                ab_pipe.consumer_wait(read_state)
                stage = read_state.index
                for w in cutlass.range_constexpr(self.waves):
                    take_turn(self.ordered, cwg)
                    tiled_mma = issue_wave(tiled_mma, part, tCrA[w], tCrB, stage)
                    # the row scales' shared-memory loads go out before the wait, under the wgmma
                    row_scales = [sSA[(self.wave_rows * w + r, 0, stage)] for r in rows]
                    warpgroup.wait_group(0)
                    pass_turn(self.ordered, cwg)
                    self.promote(acc, w, part, row_scales, sSB, col0, stage)
                ab_pipe.consumer_release(read_state)
                read_state.advance()
            store_tile16(acc, tCcC, mD, g * self.Ma + m_idx * self.tile_m, (g + 1) * self.Ma,
                         n_idx * self.tile_n, self.Nb, self.out_dtype, self.cfg.store_bytes)
            unit = unit + clusters
        last_turn(self.ordered, cwg)
