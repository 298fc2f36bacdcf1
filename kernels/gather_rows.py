"""The MoE gather as one copy kernel: routed row r takes token row index[r], a padding row (index -1) zeros.

    out[r, :] = x[index[r], :] if index[r] >= 0 else 0          x: (T, d)   index: (M,)   out: (M, d)

What an MoE block runs where its Gather is not fused into a GEMM's A loads: the Combine's backward (each routed
row takes its token's gradient) and the gathered x recomputed for FC1's weight gradient (where that kernel
does not read x through the index itself: fusion/runtime/wgrad_gemm.py `gathers`). The reference
(fusion/ops/routing.py `_gather`) appends a zero row to a copy of the T token rows and index_selects from it: a
second pass over the tokens and five small ops before the copy. This kernel reads each routed row's token once,
writes each routed row once, and writes the zeros of a padding row itself.

Layout: a CTA of 128 threads covers 128 16-byte column chunks of ``ROWS`` consecutive routed rows (grid: row
blocks x column blocks); a thread copies its chunk of each row, the rows' loads issued before their stores.
Launched through TVM-FFI with integer arguments, like the combine and the grouped GEMMs.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_ptr

from .dtypes import cutlass_dtype
from .utility_kernel import UtilityKernel, compile_once

#: Threads per CTA; each moves 16 bytes of a row per row.
THREADS = 128
#: Routed rows per CTA: their loads are in flight together.
ROWS = 4
_CHUNK_BYTES = 16
_INDEX_DTYPES = {"int32": Int32, "int64": Int64}


class GatherRowsKernel:
    """Trace-time parameters: the rows' dtype, width ``d`` (a multiple of 16 bytes of elements) and the index's
    integer dtype ("int32" or "int64")."""

    def __init__(self, dtype: str, d: int, index_dtype: str = "int64"):
        self.dtype = cutlass_dtype(dtype)
        self.vec = _CHUNK_BYTES * 8 // self.dtype.width
        if d % self.vec:
            raise ValueError(f"gather kernel: d={d} must be a multiple of {self.vec} ({dtype}, 16-byte chunks)")
        if index_dtype not in _INDEX_DTYPES:
            raise ValueError(f"gather kernel: index dtype {index_dtype!r} is not one of {sorted(_INDEX_DTYPES)}")
        self.index_dtype = _INDEX_DTYPES[index_dtype]
        self.d = d
        self.chunks = d // self.vec
        self.col_blocks = (self.chunks + THREADS - 1) // THREADS

    @cute.jit
    def __call__(self, pX: cute.Pointer, pIdx: cute.Pointer, pOut: cute.Pointer, T: Int32, M: Int32, stream):
        # rows as (rows, chunks, vec): chunk c of row r is 16 contiguous bytes
        mX = cute.make_tensor(pX, cute.make_layout((T, self.chunks, self.vec), stride=(self.d, self.vec, 1)))
        mOut = cute.make_tensor(pOut, cute.make_layout((M, self.chunks, self.vec), stride=(self.d, self.vec, 1)))
        mIdx = cute.make_tensor(pIdx, cute.make_layout((M,)))
        self.kernel(mX, mIdx, mOut, M).launch(grid=((M + ROWS - 1) // ROWS, self.col_blocks, 1),
                                              block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIdx: cute.Tensor, mOut: cute.Tensor, M: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        rb, cb, _ = cute.arch.block_idx()
        c = cb * THREADS + tidx
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=_CHUNK_BYTES * 8)
        if c < self.chunks:
            frags = [cute.make_rmem_tensor((self.vec,), self.dtype) for _ in range(ROWS)]
            row0 = rb * ROWS
            for i in cutlass.range_constexpr(ROWS):
                r = row0 + i
                frags[i].fill(0)
                if r < M:
                    t = Int64(mIdx[r])
                    if t >= 0:
                        cute.copy(atom, mX[t, c, None], frags[i])
            for i in cutlass.range_constexpr(ROWS):
                r = row0 + i
                if r < M:
                    cute.copy(atom, frags[i], mOut[r, c, None])


def compile_gather_rows(dtype: str, d: int, index_dtype: str) -> UtilityKernel:
    """The gather for rows of `dtype` ("bfloat16", "float16", "float32"), width `d` and an `index_dtype` ("int32",
    "int64") index, compiled once per process; `launch(x_ptr, index_ptr, out_ptr, T, M, stream)` with plain
    integers."""
    def build():
        from cutlass.runtime import make_fake_stream

        rows = make_ptr(cutlass_dtype(dtype), 0, cute.AddressSpace.gmem, assumed_align=16)
        index = make_ptr(_INDEX_DTYPES[index_dtype], 0, cute.AddressSpace.gmem,
                         assumed_align=8 if index_dtype == "int64" else 4)
        return cute.compile(GatherRowsKernel(dtype, d, index_dtype), rows, index, rows, Int32(1), Int32(1),
                            make_fake_stream(), options="--enable-tvm-ffi")

    return compile_once(("gather_rows", dtype, d, index_dtype), build)
