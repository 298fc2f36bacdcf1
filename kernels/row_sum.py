"""Row sums of a fused dgrad's float32 partials, rounded once to the output dtype: one launch.

    out[r] = dtype(((p[r, 0] + p[r, 1]) + p[r, 2]) + ... + p[r, P-1])        p: (M, P) float32   out: (M,)

A row scale's gradient (the router probabilities' in an MoE block) comes out of the fused dgrad's epilogue as
float32 partial sums, one per 128 columns of the row (kernels.epilogue.RowSumOutput: a tile cannot add what other
tiles hold without atomics, which would make the sum's order, and so its bits, vary between runs). Adding them up
in torch is a reduction and a cast: two launches whose host time (35-40 us each on the lent H200 machine,
bench/probes/dgrad_host_lines.py) was most of the fused dgrad step's. This kernel does both in one launch through
the same integer-argument TVM-FFI path as the GEMMs, adding each row's partials left to right (a fixed order: the
same bits on every run).

Layout: one thread per row, ``THREADS`` rows per CTA; a row's P partials are P consecutive floats (P is a
compile-time constant, a few to a few dozen).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_ptr

from .dtypes import cutlass_dtype
from .utility_kernel import UtilityKernel, compile_once

#: Threads per CTA, one row each.
THREADS = 128
#: The output dtypes: a row scale's own dtype.
OUT_DTYPES = ("bfloat16", "float16", "float32")


class RowSumKernel:
    """Trace-time parameters: ``parts`` partials per row, the output's dtype (one of OUT_DTYPES)."""

    def __init__(self, parts: int, out_dtype: str):
        if parts < 1:
            raise ValueError(f"row-sum kernel: parts={parts} must be at least 1")
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"row-sum kernel: output dtype {out_dtype!r} is not one of {OUT_DTYPES}")
        self.parts = parts
        self.out_dtype = cutlass_dtype(out_dtype)

    @cute.jit
    def __call__(self, pIn: cute.Pointer, pOut: cute.Pointer, rows: Int32, stream):
        mIn = cute.make_tensor(pIn, cute.make_layout((rows, self.parts), stride=(self.parts, 1)))
        mOut = cute.make_tensor(pOut, cute.make_layout((rows,)))
        self.kernel(mIn, mOut, rows).launch(grid=((rows + (THREADS - 1)) // THREADS, 1, 1), block=(THREADS, 1, 1),
                                            stream=stream)

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mOut: cute.Tensor, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        r = bidx * THREADS + tidx
        if r < rows:
            total = Float32(mIn[r, 0])
            for p in cutlass.range_constexpr(1, self.parts):
                total = total + mIn[r, p]
            mOut[r] = total.to(self.out_dtype)


def compile_row_sum(parts: int, out_dtype: str) -> UtilityKernel:
    """The row sums of (M, `parts`) float32 partials into an (M,) tensor of `out_dtype`, compiled once per process;
    `launch(partials_ptr, out_ptr, M, stream)` with plain integers (M > 0)."""
    def build():
        from cutlass.runtime import make_fake_stream

        partials = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=4)
        out_type = cutlass_dtype(out_dtype)
        out = make_ptr(out_type, 0, cute.AddressSpace.gmem, assumed_align=out_type.width // 8)
        return cute.compile(RowSumKernel(parts, out_dtype), partials, out, Int32(1), make_fake_stream(),
                            options="--enable-tvm-ffi")

    return compile_once(("row_sum", parts, out_dtype), build)
