"""The MoE combine as one aggregation kernel: each token's routed rows summed in a fixed order, no atomics.

    out[t, :] = sum over j in [offsets[t], offsets[t + 1]) of y[rows[j], :]      (float32 sum, rounded once)

`rows` and `offsets` are a token layout (fusion.ops.routing.token_layout: the routed rows of each token in
increasing row order), so the result depends on the routing alone, never on scheduling: bitwise reproducible,
as the reference (a stable sort, a gather and torch.segment_reduce) is. The reference moves every routed row
through memory four times (gathered copy, float32 copy, read by the reduction, and the sort of rows); this
kernel reads each routed row once and writes each token row once.

The same kernel is the backward of a Gather (the gradients of a token's routed rows summed into the token).

Layout: a CTA of 128 threads covers 128 16-byte column chunks of one token (grid: tokens x column blocks); a
thread accumulates its chunk over the token's rows in float32 registers. Launched through TVM-FFI with integer
arguments, like the grouped GEMMs.
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import make_ptr

from .dtypes import cutlass_dtype
from .utility_kernel import UtilityKernel, compile_once

#: Threads per CTA; each loads 16 bytes of a row per step.
THREADS = 128
_CHUNK_BYTES = 16


class CombineKernel:
    """Trace-time parameters: the rows' dtype and width ``d`` (a multiple of 16 bytes of elements)."""

    def __init__(self, dtype: str, d: int):
        self.dtype = cutlass_dtype(dtype)
        self.vec = _CHUNK_BYTES * 8 // self.dtype.width
        if d % self.vec:
            raise ValueError(f"combine kernel: d={d} must be a multiple of {self.vec} ({dtype}, 16-byte chunks)")
        self.d = d
        self.chunks = d // self.vec
        self.col_blocks = (self.chunks + THREADS - 1) // THREADS

    @cute.jit
    def __call__(self, pY: cute.Pointer, pRows: cute.Pointer, pOffs: cute.Pointer, pOut: cute.Pointer, M: Int32,
                 T: Int32, stream):
        # rows as (M, chunks, vec): chunk c of row r is 16 contiguous bytes
        mY = cute.make_tensor(pY, cute.make_layout((M, self.chunks, self.vec), stride=(self.d, self.vec, 1)))
        mOut = cute.make_tensor(pOut, cute.make_layout((T, self.chunks, self.vec), stride=(self.d, self.vec, 1)))
        mRows = cute.make_tensor(pRows, cute.make_layout((M,)))
        mOffs = cute.make_tensor(pOffs, cute.make_layout((T + 1,)))
        self.kernel(mY, mRows, mOffs, mOut).launch(grid=(T, self.col_blocks, 1), block=(THREADS, 1, 1),
                                                   stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mRows: cute.Tensor, mOffs: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, cb, _ = cute.arch.block_idx()
        c = cb * THREADS + tidx
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=_CHUNK_BYTES * 8)
        if c < self.chunks:
            acc = cute.make_rmem_tensor((self.vec,), Float32)
            acc.fill(0.0)
            frag = cute.make_rmem_tensor((self.vec,), self.dtype)
            start = Int64(mOffs[t])
            end = Int64(mOffs[t + 1])
            j = start
            while j < end:
                r = Int64(mRows[j])
                cute.copy(atom, mY[r, c, None], frag)
                acc.store(acc.load() + frag.load().to(Float32))
                j = j + 1
            frag.store(acc.load().to(self.dtype))
            cute.copy(atom, frag, mOut[t, c, None])


def compile_combine(dtype: str, d: int) -> UtilityKernel:
    """The combine for rows of `dtype` ("bfloat16", "float16", "float32") and width `d`, with int64 rows and
    offsets (a token layout), compiled once per process; `launch(y_ptr, rows_ptr, offsets_ptr, out_ptr, M, T,
    stream)` with plain integers."""
    def build():
        from cutlass.runtime import make_fake_stream

        rows = make_ptr(cutlass_dtype(dtype), 0, cute.AddressSpace.gmem, assumed_align=16)
        index = make_ptr(Int64, 0, cute.AddressSpace.gmem, assumed_align=8)
        return cute.compile(CombineKernel(dtype, d), rows, index, index, rows, Int32(1), Int32(1), make_fake_stream(),
                            options="--enable-tvm-ffi")

    return compile_once(("combine", dtype, d), build)
