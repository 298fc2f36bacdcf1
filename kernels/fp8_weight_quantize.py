"""The FP8-block weight quantize kernel: a ``(G, N, K)`` bf16/fp16 weight to its 128x128-block E4M3 codes, scales and
the transposed copy, in one pass (what ``fusion.quant.quantize_weight_fp8_block`` computes with torch).

Why a kernel: an fp8_block GroupLinear quantizes its weight again after every optimizer step (its cache follows the
parameter's version), so a training loop pays it once per weight per step. The torch reference spends about twenty
launches a group with float32 temporaries several times the weight's size, and a Python loop over the groups; at MoE
scale that is milliseconds of host and device a step, next to FP8 steps of a few milliseconds. This kernel reads the
weight once and writes each code twice (the dgrad's transposed copy beside it): the bytes of ``w.clone()``.

One CTA a 128x128 block ``(g, nb, kb)``, 128 threads. Thread ``t`` of warp ``w`` holds rows ``8 q .. 8 q + 7`` and
columns ``16 c .. 16 c + 15`` of the block (``q = lane % 16``, ``c = 2 w + lane // 16``): two 16-byte loads a row
(a warp reads 16 rows of 64 contiguous bytes), one 16-byte store of a row's codes (16 rows of 32 bytes), and after a
4x4 byte transpose of its codes in registers (``prmt``) one 8-byte store a column of the transposed copy (a warp
writes 2 columns of 128 contiguous bytes). The block's amax: the integer max of the finite magnitudes' bits over the
thread (bf16 a packed pair at a time, as the quantize kernel's), a warp butterfly, and four warps through shared
memory; the scale and the codes by the one rule of kernels/pow2_quant.py (bit for bit the reference:
docs/quantization.md).

Shapes: ``N % 8 == 0`` and ``K % 16 == 0`` (a thread's 8 rows and 16 columns are all inside the weight or all
outside; every FP8 GEMM's weight is: its widths are multiples of 16), any ``G`` up to 65535.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_ptr
from cutlass.memory import SmemAllocator

from .dtypes import cutlass_dtype
from .fragment_io import unpack2
from .pow2_quant import (bf16_pair_amax_bits, finite_abs2_bf16, finite_abs_bits, fp8_block_scale_bits, max2_u16,
                         pack4_e4m3, scaled_clean_pair, scaled_or_nan)
from .utility_kernel import UtilityKernel, compile_once

BLOCK = 128
THREADS = 128
ROWS = 8          # rows of the block a thread holds
COLS = 16         # columns of the block a thread holds
_WARPS = THREADS // 32
MAX_GROUPS = 65535   # the grid's z extent


def prmt(a, b, selector: int) -> Int32:
    """Four bytes picked from the eight of ``(a, b)`` (``a`` bytes 0-3, ``b`` bytes 4-7), one nibble of
    ``selector`` a result byte, lowest first (PTX ``prmt.b32``)."""
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(a).ir_value(), Int32(b).ir_value()],
                                 f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r"))


def transpose4x4(r0, r1, r2, r3) -> list:
    """Four words of four rows' bytes (word i: row i, columns 0-3) as four words of four columns' bytes (word j:
    column j, rows 0-3): six ``prmt``."""
    t0, t1 = prmt(r0, r1, 0x5140), prmt(r2, r3, 0x5140)   # rows (0, 1), (2, 3): columns 0-1 interleaved
    t2, t3 = prmt(r0, r1, 0x7362), prmt(r2, r3, 0x7362)   # columns 2-3 interleaved
    return [prmt(t0, t1, 0x5410), prmt(t0, t1, 0x7632), prmt(t2, t3, 0x5410), prmt(t2, t3, 0x7632)]


class FP8WeightQuantizeKernel:
    """Trace-time parameters: the weight's dtype ("bfloat16", "float16") and its last two dims ``N``, ``K``."""

    def __init__(self, dtype: str, N: int, K: int):
        self.dtype = cutlass_dtype(dtype)
        if self.dtype.width != 16:
            raise ValueError(f"FP8 weight quantize kernel: {dtype}; it reads bfloat16 or float16 weights")
        if N <= 0 or K <= 0 or N % ROWS or K % COLS:
            raise ValueError(f"FP8 weight quantize kernel: a ({N}, {K}) weight; it takes N % {ROWS} == 0 and "
                             f"K % {COLS} == 0")
        self.N, self.K = N, K
        #: bf16 values tested and folded a packed pair at a time (pow2_quant.finite_abs2_bf16); fp16 a value at a time
        self.pairs = self.dtype is cutlass.BFloat16
        self.nnb, self.nkb = -(-N // BLOCK), -(-K // BLOCK)

    @cute.jit
    def __call__(self, pW: cute.Pointer, pData: cute.Pointer, pScale: cute.Pointer, pDataT: cute.Pointer,
                 pScaleT: cute.Pointer, G: Int32, stream):
        self.kernel(pW, pData, pScale, pDataT, pScaleT).launch(
            grid=(self.nkb, self.nnb, G), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, pW: cute.Pointer, pData: cute.Pointer, pScale: cute.Pointer, pDataT: cute.Pointer,
               pScaleT: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        kb, nb, g = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        q = lane % 16
        c = warp * 2 + lane // 16
        N, K = self.N, self.K
        row0 = nb * BLOCK + q * ROWS          # the thread's first row of the weight (n)
        col0 = kb * BLOCK + c * COLS          # its first column (k)
        ok = (row0 < N) & (col0 < K)
        smem = SmemAllocator()
        sAmax = smem.allocate_tensor(Int32, cute.make_layout((_WARPS,)), 16)

        # the thread's 8 rows x 16 values, as 8 words a row (two 16-byte loads; zeros where outside the weight)
        words = cute.make_rmem_tensor((ROWS * COLS // 2,), Int32)
        words.fill(0)
        w_row = pW.toint() + (Int64(g) * N * K + Int64(row0) * K + col0) * 2
        if ok:
            for u in cutlass.range_constexpr(ROWS):
                for h in cutlass.range_constexpr(2):
                    src = cute.make_tensor(cute.make_ptr(Int32, w_row + u * K * 2 + h * 16, cute.AddressSpace.gmem,
                                                         assumed_align=16), cute.make_layout((4,)))
                    dst = cute.make_tensor(words.iterator + (u * 8 + h * 4), cute.make_layout((4,)))
                    cute.autovec_copy(src, dst)

        # the block's amax: the integer max of the finite magnitudes' bits. bf16 a packed pair at a time: each word's
        # non-finite halves made quiet NaNs in place (what the encode then scales with no per-value test) and its
        # magnitudes folded by max.u16x2 into four running maxima (independent chains)
        if const_expr(self.pairs):
            runs = [Int32(0)] * 4
            for u in cutlass.range_constexpr(ROWS):
                for j in cutlass.range_constexpr(COLS // 2):
                    mag, words[u * 8 + j] = finite_abs2_bf16(words[u * 8 + j])
                    runs[j % 4] = max2_u16(runs[j % 4], mag)
            run = bf16_pair_amax_bits(max2_u16(max2_u16(runs[0], runs[1]), max2_u16(runs[2], runs[3])))
        else:
            run = Int32(0)
            for u in cutlass.range_constexpr(ROWS):
                for j in cutlass.range_constexpr(COLS // 2):
                    for y in unpack2(words[u * 8 + j], self.dtype):
                        bits, _ = finite_abs_bits(y)
                        run = cutlass.max(run, bits)
        for k in cutlass.range_constexpr(5):
            run = cutlass.max(run, cute.arch.shuffle_sync_bfly(run, 1 << k))
        if lane == 0:
            sAmax[warp] = run
        cute.arch.sync_threads()
        amax = sAmax[0]
        for w in cutlass.range_constexpr(1, _WARPS):
            amax = cutlass.max(amax, sAmax[w])
        scale_bits, inv = fp8_block_scale_bits(amax)
        if tidx == 0:
            s_at = cute.make_ptr(Int32, pScale.toint() + ((Int64(g) * self.nnb + nb) * self.nkb + kb) * 4,
                                 cute.AddressSpace.gmem, assumed_align=4)
            cute.make_tensor(s_at, cute.make_layout((1,)))[0] = scale_bits
            st_at = cute.make_ptr(Int32, pScaleT.toint() + ((Int64(g) * self.nkb + kb) * self.nnb + nb) * 4,
                                  cute.AddressSpace.gmem, assumed_align=4)
            cute.make_tensor(st_at, cute.make_layout((1,)))[0] = scale_bits

        # codes, a row at a time: 16 values -> 4 words, stored as one 16-byte row piece
        codes = cute.make_rmem_tensor((ROWS * 4,), Int32)   # codes[4 u + m]: row u, columns 4 m .. 4 m + 3
        for u in cutlass.range_constexpr(ROWS):
            vals = []
            for j in cutlass.range_constexpr(COLS // 2):
                if const_expr(self.pairs):   # clean words: the products convert as they are
                    vals.extend(scaled_clean_pair(words[u * 8 + j], inv))
                else:
                    for y in unpack2(words[u * 8 + j], self.dtype):
                        _, fin = finite_abs_bits(y)
                        vals.append(scaled_or_nan(y, fin, inv))
            for m in cutlass.range_constexpr(4):
                codes[4 * u + m] = pack4_e4m3(*vals[4 * m:4 * m + 4])
        d_row = pData.toint() + Int64(g) * N * K + Int64(row0) * K + col0
        if ok:
            for u in cutlass.range_constexpr(ROWS):
                dst = cute.make_tensor(cute.make_ptr(Int32, d_row + u * K, cute.AddressSpace.gmem, assumed_align=16),
                                       cute.make_layout((4,)))
                cute.autovec_copy(cute.make_tensor(codes.iterator + 4 * u, cute.make_layout((4,))), dst)

        # the transposed copy: column j of the thread's 16 is 8 bytes (its 8 rows) at data_t[g, col0 + j, row0]
        t_col = pDataT.toint() + Int64(g) * N * K + Int64(col0) * N + row0
        if ok:
            for m in cutlass.range_constexpr(4):
                lo = transpose4x4(*(codes[4 * u + m] for u in range(4)))
                hi = transpose4x4(*(codes[4 * u + m] for u in range(4, 8)))
                for jj in cutlass.range_constexpr(4):
                    pair = cute.make_rmem_tensor((2,), Int32)
                    pair[0] = lo[jj]
                    pair[1] = hi[jj]
                    dst = cute.make_tensor(cute.make_ptr(Int32, t_col + (4 * m + jj) * N, cute.AddressSpace.gmem,
                                                         assumed_align=8), cute.make_layout((2,)))
                    cute.autovec_copy(pair, dst)


def build_kernel(dtype: str, N: int, K: int, keep_cubin: bool = False):
    """``(compiled function, kernel)``: ``cute.compile`` of the kernel with placeholder pointers; with `keep_cubin`
    the function's ``__cubin__`` holds the binary (dumped into a temporary directory, not the working one)."""
    import shlex
    import tempfile

    from cutlass.runtime import make_fake_stream

    kernel = FP8WeightQuantizeKernel(dtype, N, K)
    w = make_ptr(kernel.dtype, 0, cute.AddressSpace.gmem, assumed_align=16)
    codes = make_ptr(cutlass.Uint8, 0, cute.AddressSpace.gmem, assumed_align=16)
    floats = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16)
    with tempfile.TemporaryDirectory() as dump:
        options = "--enable-tvm-ffi" + (f" --keep-cubin --dump-dir={shlex.quote(dump)}" if keep_cubin else "")
        fn = cute.compile(kernel, w, codes, floats, codes, floats, Int32(1), make_fake_stream(), options=options)
    return fn, kernel


def compile_fp8_weight_quantize(dtype: str, N: int, K: int) -> UtilityKernel:
    """The kernel for ``(G, N, K)`` weights of ``dtype``, compiled once per process: ``launch(w, data, scale,
    data_t, scale_t, G, stream)`` with plain integers (pointers, torch's stream)."""
    return compile_once(("fp8_weight_quantize", dtype, N, K), lambda: build_kernel(dtype, N, K)[0])
