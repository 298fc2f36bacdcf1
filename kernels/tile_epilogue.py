"""The epilogue protocol (kernels/epilogue.py) applied to one tile's accumulator fragment, at trace time.

Plain Python, unrolled over the thread's wgmma accumulator fragment: for every (row, 2 adjacent columns) it
loads the epilogue's inputs, calls ``Epilogue.apply`` on fp32 values and stores its results, masked by the
group's rows and by the logical width. Coordinates come from the *logical* tiled MMA (``tCcC``: the
accumulator layout of a ``tile_m x tile_n_log`` tile), so logical chunk ``c`` (8 columns) of a fragment row is
accumulator chunk ``c``. In a gated GEMM the B tile holds the gate rows in its first half and the up rows
in its second (kernels/mainloop.py), so the up value of the same column is accumulator chunk ``c + n_c``
(``n_c`` chunks per logical row fragment), ``tile_n / 2`` columns further, in the same thread.

Paired tensors (``paired=True``, width ``2n``) have the canonical split layout: gate half at columns
``[0, n)``, up half at ``[n, 2n)``; the gate and up values of logical column ``j`` are at ``j`` and ``n + j``,
a constant offset from one base address.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .dtypes import cutlass_dtype
from .epilogue import AuxInput, Epilogue, FP8BlockDequantOutput, FP8BlockOutput, GroupVector, MXFP8Output, \
    RowSumOutput, RowVector, extra_tensors, is_fp8_block
from .fp8_block_store import clean_words, lane_amax, lane_amax_clean, rounded, store_block_scale, \
    store_fp8_block_dequantized_row, store_fp8_block_halves, store_fp8_block_row, warp_amax_to
from .fragment_io import load1, load2, load_word, pack2, quad_sum, row_addr, store2, store4_swapped, store_f32, \
    unpack2
from .mxfp8_store import store_mxfp8

_EPI_BATCH = 8  # 8-column chunks per epilogue batch (see TileEpilogue.run)
# ... and where the accumulator takes more than 128 registers a thread and the epilogue reads an AuxInput: a
# 128x192 pingpong tile (192 accumulator registers) spilled at 8-chunk batches with FC2's d(SwiGLU*scale)
# (the saved pre-activation's gate and up values, 3 outputs) and does not at 4
_EPI_BATCH_WIDE_AUX = 4


class TileEpilogue:
    """``epilogue`` of a GEMM in ``dtype`` whose logical tile is ``tile_n_log`` columns wide (the GEMM
    tile, or half of it when gated); ``prefetch_pairs``: how many packed 16-bit AuxInput pairs
    :meth:`prefetch` may hold in registers across the mainloop; ``acc_regs``: the fp32 accumulator registers of a
    thread (they choose the epilogue's batch width, :meth:`run`); ``quad_beside_fp8``: 16-bit outputs beside an
    FP8-block output, and a dequantized FP8-block row, store 4 columns per lane too (GemmConfig.quad_beside_fp8,
    tile_policy.QUAD_BESIDE_FP8_BLOCK); ``hw_fp8_decode``: a dequantized FP8-block row decodes its codes by the
    hardware conversion (False: integer instructions, the FP8 kernel's A/B build, kernels/fp8_gemm.py
    Fp8DebugKnobs); ``clean_fp8_words``: bf16 values bound for an FP8-block output wait as clean packed words
    (fp8_block_store.lane_amax_clean; False: tested a value at a time, as before session z, the A/B build);
    ``mxfp8_sectors``: with clean words, an MXFP8 block's codes leave as one 32-byte sector (False: 2 bytes a lane and
    chunk, the A/B build of bench/probes/mxfp8_store_ab.py)."""

    def __init__(self, epilogue: Epilogue, dtype: str, tile_n_log: int, prefetch_pairs: int, acc_regs: int = 0,
                 quad_beside_fp8: bool = False, hw_fp8_decode: bool = True, clean_fp8_words: bool = True):
        self.epi = epilogue
        self.quad_beside_fp8 = quad_beside_fp8
        self.hw_fp8_decode = hw_fp8_decode
        self.clean_fp8_words = clean_fp8_words
        self.mxfp8_sectors = True
        self.dtype_name = dtype
        self.ab_dtype = cutlass_dtype(dtype)
        self.gated = epilogue.gated
        self.tile_n_log = tile_n_log
        self.prefetch_pairs = prefetch_pairs
        reads_aux = any(isinstance(s, AuxInput) for s in epilogue.inputs)
        self.batch = _EPI_BATCH_WIDE_AUX if reads_aux and acc_regs > 128 else _EPI_BATCH
        self.in_dtypes = [cutlass_dtype(s.dtype if s.dtype is not None else dtype) for s in epilogue.inputs]
        self.out_dtypes = [cutlass_dtype(s.dtype if s.dtype is not None else dtype) for s in epilogue.outputs]

    def logical_width(self, N):
        return N // 2 if self.gated else N

    def make_tensors(self, ptrs, M, G, n_log):
        """The epilogue's global tensors from their pointers, in the order inputs..., outputs... (an MXFP8
        output takes two slots: data, scales). Trace time, inside the kernel's host-side ``@cute.jit``."""
        tensors = []
        it = iter(ptrs)
        for spec in self.epi.inputs:
            p = next(it)
            w = 2 * n_log if spec.paired else n_log
            if isinstance(spec, RowVector):
                tensors.append(cute.make_tensor(p, cute.make_layout((M,))))
            elif isinstance(spec, GroupVector):
                tensors.append(cute.make_tensor(p, cute.make_layout((G, w), stride=(w, 1))))
            else:
                tensors.append(cute.make_tensor(p, cute.make_layout((M, w), stride=(w, 1))))
        for spec in self.epi.outputs:
            w = 2 * n_log if spec.paired else n_log
            if isinstance(spec, RowSumOutput):
                w = spec.parts(n_log)
            tensors.append(cute.make_tensor(next(it), cute.make_layout((M, w), stride=(w, 1))))
            if isinstance(spec, MXFP8Output):
                tensors.append(cute.make_tensor(next(it), cute.make_layout((M, w // 32), stride=(w // 32, 1))))
            if isinstance(spec, FP8BlockOutput):   # scales (ceil(w / 128), M) k-block-major; the amax's int32
                nb = -(-w // spec.block)
                tensors.append(cute.make_tensor(next(it), cute.make_layout((nb, M), stride=(M, 1))))
                tensors.append(cute.make_tensor(next(it), cute.make_layout((1,))))
        return tensors

    @staticmethod
    def _quad_stores(dt, n_log: int, batch: int) -> bool:
        """Whether an output stores 4 columns per lane (fragment_io.store4_swapped): 16-bit values, whole 8-column
        chunks (n_log % 8 == 0, so a 4-column run is valid or not as a whole and rows stay 8-byte aligned) and
        chunk pairs within a batch (an odd batch stores its last chunk 2 columns per lane: the 88-column logical
        tile of a gated 176-wide one, 11 chunks, which stored every chunk so before session w)."""
        return dt.width == 16 and n_log % 8 == 0 and batch >= 2

    def _packed(self, chunks, paired: bool) -> list:
        """A batch's results of one output (``chunks[k][v]``, a (gate, up) pair when paired) as one word per chunk
        (per half): the chunk's two values rounded to the GEMM dtype and packed (fragment_io.pack2)."""
        assert self.ab_dtype.width == 16, "an FP8-block output packs its pending values two to a 32-bit register"
        if paired:
            return [tuple(pack2(r[0][k], r[1][k], self.ab_dtype) for k in range(2)) for r in chunks]
        return [pack2(r[0], r[1], self.ab_dtype) for r in chunks]

    def _first_col(self, tCcC, col0, mm, h, nn):
        """The thread's first logical column of fragment (mm, h, nn); chunk c is 8*c columns further."""
        return col0 + tCcC[((0, h, 0), mm, nn)][1]

    def prefetch(self, tCcC, epi_tensors, row0, row_end, n_idx, N):
        """Before the tile's mainloop: load the RowVector values of the thread's rows and, in the order
        :meth:`run` consumes them, up to ``prefetch_pairs`` AuxInput pairs (2 adjacent 16-bit values packed
        in one 32-bit register, 0 where masked), so their latency hides under the mainloop.  Returns
        {key: value} for :meth:`run`.  Addresses are one 64-bit base per fragment row plus constants, so
        what the epilogue shares with them (the same bases) costs few registers across the mainloop."""
        epi = self.epi
        n_log = self.logical_width(N)
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
                        pre[("row", ii, mm, h)] = load1(epi_tensors[ii], grow, row_ok)
                for nn in range(n_nn):
                    lc0 = self._first_col(tCcC, col0, mm, h, nn)
                    for ii, spec in enumerate(epi.inputs):
                        if not isinstance(spec, AuxInput):
                            continue
                        dt = self.in_dtypes[ii]
                        if dt.width != 16:
                            continue
                        base = row_addr(epi_tensors[ii], grow, lc0, dt)
                        up = n_log * (dt.width // 8)   # byte offset of the up half
                        for c in range(n_c):
                            halves = 2 if spec.paired else 1
                            if left < halves:
                                break
                            left -= halves
                            ok = row_ok if col_exact else row_ok & (lc0 + 8 * c < n_log)
                            if spec.paired:
                                pre[("aux", ii, mm, h, nn, c)] = (load_word(base + 16 * c, ok),
                                                                  load_word(base + up + 16 * c, ok))
                            else:
                                pre[("aux", ii, mm, h, nn, c)] = load_word(base + 16 * c, ok)
        return pre

    def run(self, acc, tCcC, epi_tensors, row0, row_end, g, n_idx, N, pre=None):
        """Unrolled over the thread's fragment.

        Per fragment row, the 8-column chunks are processed in batches of ``self.batch`` chunks: the batch's
        input loads (2-element vectors; none for what ``pre`` holds, see :meth:`prefetch`), the epilogue
        math, then the batch's stores.  The stores keep the next batch's loads from being hoisted (the
        pointers may alias), which bounds the live registers (no spills with inputs at wide tiles) while a
        batch's loads still overlap.  Addresses: one 64-bit base per (tensor, fragment row) plus
        constants (chunk c is 8 columns further; the up half of a paired tensor n columns further)."""
        epi = self.epi
        n_log = self.logical_width(N)
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
        in_dtypes, out_dtypes = self.in_dtypes, self.out_dtypes
        has_mx = any(isinstance(s, MXFP8Output) for s in epi.outputs)
        # an FP8-block output quantizes a row's whole 128-column block at once: its values wait across the row's
        # batches (the other outputs store theirs batch by batch) and are quantized after the last one
        fp8b = [oi for oi, s in enumerate(epi.outputs) if isinstance(s, FP8BlockOutput)]
        # ... as does a dequantized FP8-block output (the round trip's values in the GEMM dtype)
        fp8d = [oi for oi, s in enumerate(epi.outputs) if isinstance(s, FP8BlockDequantOutput)]
        if fp8b or fp8d:
            assert self.tile_n_log == FP8BlockOutput.block and 8 * n_c == self.tile_n_log and n_nn == 1, \
                "FP8-block output: the logical tile must be one 128-column block, one wgmma atom wide"
            lane = cute.arch.lane_idx()
        # a row's block values wait packed: bf16 ones always, *clean* (fp8_block_store.lane_amax_clean: each pair's
        # non-finite test and its share of the block amax in a few integer instructions; since session z: Qwen3-30B-
        # A3B's training FP8 FC1 3304 -> 2928 SASS instructions, its FP8 dgrad 3992 -> 3704); fp16 ones where the
        # row holds more than one block (a dequantized output, a paired one or several)
        clean = bool(fp8b or fp8d) and self.clean_fp8_words and clean_words(self.ab_dtype)
        packs = clean or bool(fp8d) or len(fp8b) > 1 or any(epi.outputs[oi].paired for oi in fp8b)
        if fp8b:
            amax_run = {oi: Int32(0) for oi in fp8b}   # the thread's running max of the blocks' amax bits
        batch = self.batch if n_c % self.batch == 0 else n_c
        # (not beside an MXFP8 output: its quantization holds a batch's values, and with the swaps besides, the
        # "gemm-mxfp8" epilogue spilled: tests/test_compile_plans.py; beside an FP8-block output where the
        # configuration says: GemmConfig.quad_beside_fp8)
        swaps = not has_mx and (not fp8b or self.quad_beside_fp8)
        has_mx = has_mx or bool(fp8b)
        quad = [swaps and not isinstance(epi.outputs[oi], RowSumOutput)
                and self._quad_stores(out_dtypes[oi], n_log, batch) for oi in range(len(epi.outputs))]
        # row sums: one running float32 sum per (output, fragment row, block of the tile's columns), reduced over
        # the quad and stored once per row (RowSumOutput); a fragment row is one wgmma atom wide (n_nn == 1), so
        # chunk c of it lies in block 8 * c // block
        row_sums = [oi for oi, spec in enumerate(epi.outputs) if isinstance(spec, RowSumOutput)]
        if row_sums:
            assert n_nn == 1, "a row-sum output needs the accumulator one wgmma atom wide"
            lane = cute.arch.lane_idx()
        out_slot, ot = {}, 0    # output -> its first tensor (a quantized output's extra tensors follow its data)
        for oi, spec in enumerate(epi.outputs):
            out_slot[oi] = ot
            ot += 1 + len(extra_tensors(spec))
        odd = (cute.arch.lane_idx() & 1) == 1 if any(quad) else None   # the lane's parity in its quad
        if has_mx:
            assert n_c % 4 == 0 and batch % 4 == 0
        if self.gated:
            # one wgmma atom spans the tile's N: accumulator chunks [0, n_c) = gate, [n_c, 2 n_c) = up
            assert cute.size(acc.shape[0][2]) == 2 * n_c and cute.size(acc.shape[2]) == n_nn == 1, \
                "gated epilogue: the accumulator must be one wgmma atom wide (gate half, up half)"
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
                            row_vals[ii] = load1(in_tensors[ii], grow, row_ok)
                sums = {oi: [Float32(0.0)] * (self.tile_n_log // epi.outputs[oi].block) for oi in row_sums}
                for nn in range(n_nn):
                    lc0 = self._first_col(tCcC, col0, mm, h, nn)
                    in_base = {}
                    for ii, spec in enumerate(epi.inputs):
                        if isinstance(spec, RowVector):
                            continue
                        rr = grow if isinstance(spec, AuxInput) else g
                        in_base[ii] = row_addr(in_tensors[ii], rr, lc0, in_dtypes[ii])
                    out_base = {}
                    ot = 0
                    for oi, spec in enumerate(epi.outputs):
                        if not isinstance(spec, (MXFP8Output, FP8BlockOutput, RowSumOutput)):
                            out_base[oi] = row_addr(out_tensors[ot], grow, lc0, out_dtypes[oi])
                        ot += 1 + len(extra_tensors(spec))
                    # the row's (values, columns, oks) so far; where `packs`, the values rounded to the GEMM dtype
                    # (what the blocks quantize) and packed two to a register, and this lane's running amax bits of
                    # each half, folded in batch by batch (lane_amax): a dgrad holding its input gradient's quantized
                    # row and FC2's input's dequantized one spilled with float32 values and a second pass for the
                    # amax. An fp16 lone unpaired block output keeps float32 values, rounded at the row's end
                    # (fp8_block_store.rounded: packed with the per-value tests, FC1's kernel ran 248 more
                    # instructions; with bf16's clean words, 376 fewer)
                    pending = {oi: ([], [], []) for oi in fp8b + fp8d}
                    lane_max = {oi: [None, None] for oi in fp8b + fp8d}
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
                                        a0, a1 = unpack2(pre[pkey][0], dt)
                                        b0, b1 = unpack2(pre[pkey][1], dt)
                                        in_vals[ii] = ((a0, b0), (a1, b1))
                                    else:
                                        in_vals[ii] = unpack2(pre[pkey], dt)
                                elif spec.paired:
                                    a0, a1 = load2(in_base[ii] + 8 * c * eb, ok_in, dt)
                                    b0, b1 = load2(in_base[ii] + (n_log + 8 * c) * eb, ok_in, dt)
                                    in_vals[ii] = ((a0, b0), (a1, b1))
                                else:
                                    in_vals[ii] = load2(in_base[ii] + 8 * c * eb, ok_in, dt)
                            for v in range(n_v):
                                args = []
                                if self.gated:
                                    args.append(acc[((v, h, c), mm, nn)])
                                    args.append(acc[((v, h, c + n_c), mm, nn)])
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
                            if isinstance(spec, RowSumOutput):
                                for k, c in enumerate(cs):
                                    b = 8 * c // spec.block
                                    for v in range(n_v):
                                        val = results[oi][k][v]
                                        if not col_exact:   # columns past the logical width add nothing
                                            val = cutlass.select_(lcols[k] < n_log, val, Float32(0.0))
                                        sums[oi][b] = sums[oi][b] + val
                                ot += 1
                                continue
                            if isinstance(spec, MXFP8Output):
                                store_mxfp8(results[oi], lcols, oks, t, out_tensors[ot + 1], grow, self.ab_dtype,
                                            self.clean_fp8_words and clean_words(self.ab_dtype), self.mxfp8_sectors)
                                ot += 2
                                continue
                            if is_fp8_block(spec):
                                items = self._packed(results[oi], spec.paired) if packs else results[oi]
                                halves = [[w[k] for w in items] for k in range(2)] if spec.paired else [items]
                                for k, half in enumerate(halves):
                                    if clean:
                                        # bf16 words: the max and the non-finite values a pair at a time
                                        lane_max[oi][k], halves[k] = lane_amax_clean(half, oks, lane_max[oi][k])
                                    elif packs:
                                        lane_max[oi][k] = lane_amax(half, oks, self.ab_dtype, lane_max[oi][k])
                                items = list(zip(*halves)) if spec.paired else halves[0]
                                for part, got in zip(pending[oi], (items, lcols, oks)):
                                    part.extend(got)
                                ot += 1 + len(extra_tensors(spec))
                                continue
                            if quad[oi]:
                                # 4 columns per lane and store, whole 32-byte sectors (fragment_io.store4_swapped);
                                # an odd batch's last chunk below, 2 columns per lane
                                for k in range(0, len(cs) - 1, 2):
                                    c = cs[k]
                                    r0, r1 = results[oi][k], results[oi][k + 1]
                                    halves = ((0, 0), (1, n_log)) if spec.paired else ((None, 0),)
                                    for half, off in halves:
                                        p0 = (r0[0], r0[1]) if half is None else (r0[0][half], r0[1][half])
                                        p1 = (r1[0], r1[1]) if half is None else (r1[0][half], r1[1][half])
                                        store4_swapped(out_base[oi] + (off + 8 * c) * eb, p0, p1, oks[k], oks[k + 1],
                                                       odd, dt)
                            # 2 columns per lane: every chunk, or an odd batch's last one after the quad stores
                            for k in range(len(cs) - len(cs) % 2 if quad[oi] else 0, len(cs)):
                                c = cs[k]
                                rk = results[oi][k]
                                if spec.paired:
                                    store2(out_base[oi] + 8 * c * eb, rk[0][0], rk[1][0], dt, oks[k])
                                    store2(out_base[oi] + (n_log + 8 * c) * eb, rk[0][1], rk[1][1], dt,
                                           oks[k])
                                else:
                                    store2(out_base[oi] + 8 * c * eb, rk[0], rk[1], dt, oks[k])
                            ot += 1
                    for oi in fp8b:
                        row_items, cols, col_oks = pending[oi]   # packed words, or float32 pairs (`packs`)
                        t = out_tensors[out_slot[oi]]
                        scale_ok = row_ok & (lane % 4 == 0)   # lane 0 of the quad writes the row's scales
                        if epi.outputs[oi].paired:
                            # the gate half's block, then the up half's n_log columns further, each quantized on its
                            # own (FP8BlockOutput: the caller sees to n_log % 128 == 0), one at a time
                            amax_run[oi] = store_fp8_block_halves(
                                [w[0] for w in row_items], [w[1] for w in row_items], cols, col_oks, t,
                                out_tensors[out_slot[oi] + 1], grow, scale_ok, Int32(n_log), lane_max[oi],
                                amax_run[oi], self.ab_dtype, clean)
                        else:
                            items = row_items if packs else rounded(row_items, self.ab_dtype)
                            scale_bits, amax_bits = store_fp8_block_row(items, cols, col_oks, t, grow, self.ab_dtype,
                                                                        lane_max[oi][0], clean)
                            # the row's scale of block cols[0] // 128 (= n_idx)
                            store_block_scale(out_tensors[out_slot[oi] + 1], cols[0] // FP8BlockOutput.block, grow,
                                              scale_bits, scale_ok)
                            amax_run[oi] = cutlass.max(amax_run[oi], amax_bits)
                    for oi in fp8d:
                        # 4 columns per lane where 16-bit outputs beside FP8-block quantization do so (the
                        # configuration's quad_beside_fp8), one chunk pair at a time; else 2
                        words, _, col_oks = pending[oi]
                        store_fp8_block_dequantized_row(words, col_oks, out_base[oi], self.ab_dtype, lane_max[oi][0],
                                                        odd if quad[oi] and self.quad_beside_fp8 else None,
                                                        self.hw_fp8_decode, clean)
                # the row's sums: over the quad, then lane (block % 4) of it stores block's partial
                for oi in row_sums:
                    spec = epi.outputs[oi]
                    per_tile = self.tile_n_log // spec.block
                    for b in range(per_tile):
                        total = quad_sum(sums[oi][b])
                        blk = n_idx * per_tile + b
                        ok = row_ok & (lane % 4 == b % 4) & (blk < spec.parts(n_log))
                        store_f32(out_tensors[out_slot[oi]], grow, blk, total, ok)
        # the tensor's finite amax: the thread's blocks, the warp, one atomic max per warp and tile
        for oi in fp8b:
            warp_amax_to(out_tensors[out_slot[oi] + 2], amax_run[oi], lane)
