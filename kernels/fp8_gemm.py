"""Persistent grouped GEMM with FP8 (E4M3) operands and block scaling, for sm_90a (CuTe DSL).

D[rows of g] = epilogue(sum_kt (A[rows of g, kt] @ B[g, :, kt].T) * sa[kt, row] * sb[g, col // 128, kt])

The FP8-block recipe (DeepGEMM's "1d2d", Transformer Engine's Float8BlockScaling; docs/quantization.md):

- A: (M, K) E4M3 codes, row-major, rows of all groups concatenated; ``sa`` (ceil(K/128), M) float32,
  k-block-major: ``sa[kt, r]`` scales ``A[r, 128 kt : 128 kt + 128]``.
- B: (G, N, K) E4M3 codes, K-major (a GroupLinear weight as its forward reads it); ``sb`` (G, ceil(N/128),
  ceil(K/128)) float32: one scale per 128x128 block. A gated epilogue reads the canonical ``[gate; up]``
  weight, as the bf16 kernel does.
- offsets: (G+1,) int32 device tensor of group row bounds. M is a run-time argument.

``tile_k`` is 128: one activation scale per row and one weight scale per 128 columns cover a whole k-tile.
Each k-tile's wgmma partial sum goes to a scratch fp32 fragment, which the consumer then folds into the fp32
accumulator with the scales applied (``acc += part * sa * sb``): the promotion that keeps the tensor cores'
limited-precision FP8 accumulation to 128 products (kernels/fp8_mainloop.py).

Scales travel with the data: besides the A and B tiles, the producer's TMA loads ``128 + 4`` consecutive
floats of ``sa`` per 128 rows of the tile (a 1-D view of the whole tensor, so M needs no alignment; one box
per 128-row wave, as a box dimension holds at most 256 elements) and one 16-byte box of ``sb`` per scale slot
(kernels/fp8_scales.py) into each stage, under the same mbarrier. A TMA box must start on a
16-byte boundary of its innermost dimension (an unaligned start traps: "illegal instruction"), so every
scale box starts at the wanted float rounded down to a multiple of 4 and the consumers read ``shift =
coordinate % 4`` floats into it (:class:`Fp8DebugKnobs` keeps the unaligned start, for the bisect only).

Cooperative warp roles: warpgroup 0 is the producer, warpgroups 1..2 each own 64 rows of a 128-row tile; with
``ctas_per_sm = 2`` warpgroup 1 alone walks the tile as two 64-row waves, and two CTAs share an SM.
The scheduler (kernels/scheduler.py) and the epilogue protocol (kernels/tile_epilogue.py) are the bf16
kernel's, so every epilogue of kernels/epilogue.py (and the generated ones) applies; outputs default to bf16.

This module holds the host-side (traced) setup: tensors, smem layouts, TMA atoms, shared storage, the
launch, and the kernel's prologue.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .epilogue import Epilogue
from .fp8_mainloop import MAX_SHARED_CARVEOUT, TWO_CTA_REGISTER_SPLIT, Fp8WarpRoles
from .mainloop import REGISTER_SPLIT
from .fp8_scales import SA_BOX, SA_STAGE_FLOATS, SB_BOX, SB_SLOT_FLOATS, SCALE_BLOCK, num_slots, plan_segments
from .scheduler import PEER_SLOTS, TileScheduler
from .tile_policy import one_band_limit, resolved_band
from .tile_epilogue import TileEpilogue

__all__ = ["Fp8GroupedGemmKernel", "Fp8DebugKnobs", "N_WAVE_TILE", "TWO_CTA_REGISTER_SPLIT"]

FP8 = cutlass.Float8E4M3FN
SCALE_MODES = ("tma", "unaligned", "off")
#: The gated tile width walked as two n-waves (gate half, up half) of 128 columns each.
N_WAVE_TILE = 256


@dataclass(frozen=True)
class Fp8DebugKnobs:
    """Build variants that isolate a device fault (bench/fp8_bisect.py); the defaults are the kernel.

    ``scales``: "tma" (aligned scale boxes), "unaligned" (boxes start at the wanted float itself: the
    original layout, which traps where a start is not 16-byte aligned), "off" (no scale loads; the
    promotion multiplies by 1, so the kernel computes the product of the raw E4M3 codes).
    ``reg_realloc``: False leaves out ``setmaxnreg`` (every warpgroup keeps the launch's 168 registers; the
    consumers may then spill). ``int_decode``: a dequantized FP8-block row decodes its E4M3 codes with integer
    instructions, as before session y, instead of the hardware conversion (the same bits: the A/B build of
    bench/fp8_dgrad_epilogue.py). ``value_tests``: bf16 values bound for an FP8-block output are tested for
    finiteness and folded into the block amax a value at a time, as before session z, instead of a packed pair at a
    time (kernels/fp8_block_store.py lane_amax_clean; the same bits)."""
    scales: str = "tma"
    reg_realloc: bool = True
    int_decode: bool = False
    value_tests: bool = False


class Fp8GroupedGemmKernel(Fp8WarpRoles):
    def __init__(self, config, epilogue: Epilogue, out_dtype: str = "bfloat16",
                 debug: Fp8DebugKnobs = Fp8DebugKnobs()):
        assert debug.scales in SCALE_MODES, debug
        self.cfg = config
        self.debug = debug
        self.epi = epilogue
        self.ab_dtype = FP8
        self.acc_dtype = Float32
        self.tile_m, self.tile_n, self.tile_k = config.tile_m, config.tile_n, config.tile_k
        assert self.tile_m in (64, 128, 256) and self.tile_k == SCALE_BLOCK, "FP8 tiles are 64-256 x tile_n x 128"
        # a 256-row tile: each consumer warpgroup walks its 128 rows as two 64-row waves, one after the other,
        # through one scratch fragment (kernels/fp8_mainloop.py), so its registers hold 2 x 64 x tile_n / 128
        # accumulator floats and 64 x tile_n / 128 scratch ones per thread (DeepGEMM's BLOCK_M = 256 on sm90)
        # two CTAs an SM (config.ctas_per_sm = 2): one consumer warpgroup a CTA walks a 128-row tile as two 64-row
        # m-waves (the registers of the cooperative 256-row tile), and the SM's two CTAs drift apart, so one CTA's
        # epilogue runs while the other's wgmma do: the overlap a cooperative tile's two warpgroups, reaching their
        # epilogues together, cannot give (kernels/README.md, "Two CTAs an SM")
        self.ctas_per_sm = int(getattr(config, "ctas_per_sm", 1))
        assert self.ctas_per_sm in (1, 2)
        self.num_mma_wg = 2 if self.ctas_per_sm == 1 else 1
        #: the two consumer warpgroups issue their waves in turn (kernels/fp8_mainloop.py ``take_turn``)
        self.ordered = bool(getattr(config, "ordered_waves", False)) and self.num_mma_wg == 2
        self.mma_atoms_m = self.num_mma_wg
        self.wave_rows = 64 * self.num_mma_wg          # the tile's rows one wave covers (64 per warpgroup)
        self.waves = self.tile_m // self.wave_rows
        self.sa_boxes = max(1, self.tile_m // 128)     # activation-scale boxes a stage holds (one per 128 rows)
        # two CTAs an SM: a 128 x <= 128 tile, or a gated 64 x 256 one (one 64-row wave of the gate and up n-waves:
        # what each warpgroup of the cooperative 128 x 256 n-wave tile holds)
        assert self.ctas_per_sm == 1 or (self.tile_m == 128 and self.tile_n <= 128) or \
            (self.tile_m == 64 and epilogue.gated and self.tile_n == N_WAVE_TILE), "two CTAs an SM: 128 x <=128, 64 x 256"
        assert self.tile_m != 64 or self.ctas_per_sm == 2, "a 64-row tile is one warpgroup's: two CTAs an SM"
        assert self.tile_n % 16 == 0 and self.tile_n <= 256
        self.gated = epilogue.gated
        # a gated 128 x 256 tile: each consumer warpgroup walks the gate half and then the up half of its 64 rows
        # (two 128-column n-waves, one wgmma of 64 x 128 each) through one scratch fragment, the same registers
        # as the 256-row tile's m-waves; its 128 logical columns hold a whole 1 x 128 block of FC2's FP8 input,
        # so the epilogue can quantize it (kernels/fp8_block_store.py)
        self.n_waves = 2 if self.gated and self.tile_n == N_WAVE_TILE else 1
        assert self.n_waves == 1 or self.tile_m == self.wave_rows, "n-waves take one m-wave's rows"
        self.wave_n = self.tile_n // self.n_waves
        self.pingpong = False            # cooperative: the accumulator and the scratch fragment both fit
        self.threads = 128 * (1 + self.num_mma_wg)
        self.register_split = REGISTER_SPLIT[False] if self.ctas_per_sm == 1 else TWO_CTA_REGISTER_SPLIT
        self.sched_stages = 2
        self.stages = config.stages
        self.dynamic = config.dynamic
        # CTA pairs along n share the A tile by TMA multicast, as in the bf16 kernel (kernels/grouped_gemm.py);
        # each CTA loads its own scales (the activation scales are the pair's, but a few hundred bytes)
        self.cluster_n = int(getattr(config, "cluster_n", 1))
        # CTA pairs along m (neighbouring m-tiles of one group and n-tile) share the B tile the same way, each CTA
        # loading half of every B box (a gated tile's gate and up boxes alike) and multicasting it: for GEMMs
        # whose n-tiles do not pair up (GPT-OSS's 2880 logical columns: 23 n-tiles of 128). Each CTA loads its own
        # scales: its rows' activation scales differ, the weight scales are the pair's
        self.cluster_m = int(getattr(config, "cluster_m", 1))
        self.band_m = resolved_band(config)    # the tile order's band (kernels/scheduler.py)
        # a tile whose rows end within its first 64: the second warpgroup issues no wgmma (kernels/fp8_mainloop.py)
        self.short_tiles = bool(getattr(config, "short_tiles", False)) and self.waves == 1 and self.num_mma_wg == 2
        assert self.cluster_n in (1, 2) and self.cluster_m in (1, 2), "cluster_n and cluster_m are 1 or 2"
        assert self.cluster_m == 1 or self.cluster_n == 1, "a CTA pair lies along m or along n, not both"
        self.peer_ids = self.dynamic and self.cluster_size > 1   # rank 0 sends the tile ids it takes to rank 1
        self.tile_n_log = self.tile_n // 2 if self.gated else self.tile_n
        # the epilogue works in the output dtype (what MXFP8 outputs round to, what Outputs default to)
        self.tile_epi = TileEpilogue(epilogue, out_dtype, self.tile_n_log, 0,
                                     quad_beside_fp8=config.quad_beside_fp8, hw_fp8_decode=not debug.int_decode,
                                     clean_fp8_words=not debug.value_tests)

    # ------------------------------------------------------------------ host-side (traced) entry
    @cute.jit
    def __call__(
        self,
        pA: cute.Pointer,
        pB: cute.Pointer,
        pSA: cute.Pointer,
        pSB: cute.Pointer,
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
        self.N, self.K, self.G = N, K, G
        n_log = N // 2 if const_expr(self.gated) else N
        self.k_tiles = (K + self.tile_k - 1) // self.tile_k
        self.n_blocks = (N + SCALE_BLOCK - 1) // SCALE_BLOCK
        self.segments = plan_segments(self.tile_n, N, self.gated)
        self.slots = num_slots(self.segments)
        self.sched = TileScheduler(self.tile_m, (n_log + self.tile_n_log - 1) // self.tile_n_log, G,
                                   self.dynamic, False, self.cluster_n, self.band_m,
                                   one_band_limit(self.band_m, self.tile_m, K, 1), self.cluster_m)
        mA = cute.make_tensor(pA, cute.make_layout((M, K), stride=(K, 1)))
        mB = cute.make_tensor(pB, cute.make_layout((N, K, G), stride=(K, 1, N * K)))
        # scales as flat 1-D tensors: a TMA box may start at any element, so neither M nor the number of
        # k-blocks needs the 16-byte stride alignment a 2-D descriptor would
        mSA = cute.make_tensor(pSA, cute.make_layout((self.k_tiles * M,)))
        mSB = cute.make_tensor(pSB, cute.make_layout((G * self.n_blocks * self.k_tiles,)))
        mOffs = cute.make_tensor(pOffs, cute.make_layout((G + 1,)))
        mCounter = cute.make_tensor(pCounter, cute.make_layout((1,)))
        tensors = self.tile_epi.make_tensors(ptrs, M, G, n_log)

        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            FP8, FP8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            self.acc_dtype, (self.mma_atoms_m, 1, 1), tiler_mn=(64, self.wave_n),
        )
        # the logical tile's accumulator layout: coordinates for the epilogue only (never issues wgmma)
        self.tiled_mma_log = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            self.acc_dtype, (self.mma_atoms_m, 1, 1), tiler_mn=(64, self.tile_n_log),
        )
        # K-major operands, 128 one-byte elements per k-tile row: the 128-byte swizzle atom
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, FP8, self.tile_k), FP8
        )
        self.sA_layout = cute.tile_to_shape(atom, (self.tile_m, self.tile_k, self.stages), order=(0, 1, 2))
        self.sB_layout = cute.tile_to_shape(atom, (self.tile_n, self.tile_k, self.stages), order=(0, 1, 2))
        self.sSA_layout = cute.make_layout((SA_BOX, self.sa_boxes, self.stages),
                                           stride=(1, SA_STAGE_FLOATS, SA_STAGE_FLOATS * self.sa_boxes))
        self.sSB_layout = cute.make_layout((SB_BOX, self.slots, self.stages),
                                           stride=(1, SB_SLOT_FLOATS, SB_SLOT_FLOATS * self.slots))
        sA_one = cute.slice_(self.sA_layout, (None, None, 0))
        sB_one = cute.slice_(self.sB_layout, (None, None, 0))
        a_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_n > 1) else \
            cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_tA = cpasync.make_tiled_tma_atom(
            a_op, mA, sA_one, (self.tile_m, self.tile_k), num_multicast=self.cluster_n
        )
        # gated: one TMA box is half a B tile (gate or up rows); tile_k is one swizzle atom, so a half
        # tile's smem layout is the first tile_n/2 rows of the stage's
        b_box = (self.tile_n // 2 if self.gated else self.tile_n, self.tile_k)
        sB_box = cute.tile_to_shape(atom, b_box, order=(0, 1)) if const_expr(self.gated) else sB_one
        b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_m > 1) else \
            cpasync.CopyBulkTensorTileG2SOp()
        tma_b, tma_tB = cpasync.make_tiled_tma_atom(b_op, mB, sB_box, b_box, num_multicast=self.cluster_m)
        tma_sa, tma_tSA = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mSA, cute.make_layout((SA_BOX,)), (SA_BOX,)
        )
        tma_sb, tma_tSB = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mSB, cute.make_layout((SB_BOX,)), (SB_BOX,)
        )
        # out-of-bounds box elements are zero-filled and still counted by the transaction
        self.tx_bytes = cute.size_in_bytes(FP8, sA_one) + cute.size_in_bytes(FP8, sB_one)
        if const_expr(self.debug.scales != "off"):
            self.tx_bytes += 4 * (SA_BOX * self.sa_boxes + SB_BOX * self.slots)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sched: cute.struct.MemRange[cutlass.Int64, 2 * self.sched_stages]
            tile_slot: cute.struct.MemRange[Int32, self.sched_stages]
            # a dynamic CTA pair's mailbox of tile ids (kernels/scheduler.py; empty otherwise)
            peer_bar: cute.struct.MemRange[cutlass.Int64, 2 * PEER_SLOTS if self.peer_ids else 0]
            peer_slot: cute.struct.MemRange[Int32, PEER_SLOTS if self.peer_ids else 0]
            sA: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(self.sB_layout)], 1024]
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sSA_layout)], 128]
            sSB: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sSB_layout)], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a, tma_tA, tma_b, tma_tB, tma_sa, tma_tSA, tma_sb, tma_tSB, mOffs, mCounter, tuple(tensors),
            M, self.tiled_mma, self.tiled_mma_log, self.sA_layout, self.sB_layout, self.sSA_layout,
            self.sSB_layout,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads, 1, 1), cluster=(self.cluster_size, 1, 1),
                 smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=self.ctas_per_sm,
                 # two CTAs an SM need the whole 228 KiB carveout (stated, so compiling asks no device for it)
                 preferred_smem_carveout=MAX_SHARED_CARVEOUT if self.ctas_per_sm > 1 else None, stream=stream)

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_sa: cute.CopyAtom,
        mSA: cute.Tensor,
        tma_sb: cute.CopyAtom,
        mSB: cute.Tensor,
        mOffs: cute.Tensor,
        mCounter: cute.Tensor,
        epi_tensors: tuple,
        M: Int32,
        tiled_mma: cute.TiledMma,
        tiled_mma_log: cute.TiledMma,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sSA_layout: cute.Layout,
        sSB_layout: cute.Layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if warp_idx == 0:
            for atom in (tma_a, tma_b, tma_sa, tma_sb):
                cpasync.prefetch_descriptor(atom)

        storage, ab_pipe, sched_pipe, sTile, sA, sB = self.make_smem(sA_layout, sB_layout)
        sSA = storage.sSA.get_tensor(sSA_layout)
        sSB = storage.sSB.get_tensor(sSB_layout)
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
            if const_expr(self.debug.reg_realloc):
                cute.arch.warpgroup_reg_dealloc(self.register_split[0])
            if warp_idx == 0:
                self.produce(tma_a, mA, tma_b, mB, mOffs, mCounter, sA, sB, ab_pipe, sched_pipe, sTile,
                             bidx, grid, extras=(tma_sa, mSA, tma_sb, mSB, sSA, sSB, M), rank=rank)
        else:
            if const_expr(self.debug.reg_realloc):
                cute.arch.warpgroup_reg_alloc(self.register_split[1])
            self.consume_fp8(tiled_mma, tiled_mma_log, sA, sB, sSA, sSB, mOffs, epi_tensors, ab_pipe,
                             sched_pipe, sTile, tidx, bidx, grid, M, rank=rank)
