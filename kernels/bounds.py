"""The group-bounds prologue: one launch that turns `group_sizes` into the grouped GEMMs' row bounds.

Per call, a grouped block needs, on the device and without a host sync: the sizes validated (each in
[0, rows], summing to rows), their int32 row bounds [0, o_1, ..., o_G] (what our kernels and
torch._grouped_mm read), and zeroed tile counters for the dynamic schedulers. In torch that is a dozen
small ops (sum, min, max, compares, an async assert, cumsum, pad), each costing 10-20 us of host time on a
Hopper host: more than the whole budget of a fused call. This kernel does all of it in one launch of one
warp, through the same integer-argument TVM-FFI path as the GEMMs (about 1 us of host time).

Validation: a size outside [0, rows], or a sum other than `rows`, prints the problem on the device and traps, as
torch's device asserts do: the error surfaces at the next synchronizing call, and the CUDA context is lost.

Sums saturate at rows + 1, so no int32 or int64 wrap can make bad sizes look valid.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_ptr

from .dtypes import cutlass_dtype
from .utility_kernel import UtilityKernel, compile_once

#: Threads of the one warp that runs the prologue; each owns ceil(G / 32) consecutive groups.
LANES = 32


def _trap():
    """Abort the kernel (PTX `trap`): the launch fails and the CUDA context reports an error."""
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


class GroupBoundsKernel:
    """Trace-time parameters: ``G`` groups, the sizes' dtype ("int32", "int64", or None for one group of all
    rows, a dense block)."""

    def __init__(self, G: int, sizes_dtype: str | None):
        self.G = G
        self.sizes_dtype = sizes_dtype
        self.per_lane = (G + LANES - 1) // LANES
        self.message = ("fusion: group_sizes must each be in [0, rows] and sum to exactly rows = %d; got a sum "
                        "of %d (counted up to rows + 1) or a size out of range\n")

    @cute.jit
    def __call__(self, pSizes: cute.Pointer, pOut: cute.Pointer, rows: Int32, counters: Int32, stream):
        mSizes = cute.make_tensor(pSizes, cute.make_layout((self.G,)))
        mOut = cute.make_tensor(pOut, cute.make_layout((self.G + 1 + counters,)))
        self.kernel(mSizes, mOut, rows, counters).launch(grid=(1, 1, 1), block=(LANES, 1, 1), stream=stream)

    @cute.jit
    def _saturating_add(self, a: Int32, b: Int32, cap: Int32) -> Int32:
        return cutlass.min(a + b, cap)

    @cute.kernel
    def kernel(self, mSizes: cute.Tensor, mOut: cute.Tensor, rows: Int32, counters: Int32):
        lane, _, _ = cute.arch.thread_idx()
        cap = rows + 1
        bad = Int32(0)
        values = []
        local = Int32(0)
        # load, check and sum this lane's groups (consecutive, so the scan below is a plain prefix)
        for j in cutlass.range_constexpr(self.per_lane):
            i = lane * self.per_lane + j
            size = Int32(0)
            if const_expr(self.sizes_dtype is None):
                size = cutlass.select_(i == 0, rows, Int32(0))
            else:
                if i < self.G:
                    raw = mSizes[cutlass.min(i, self.G - 1)]
                    if const_expr(self.sizes_dtype == "int64"):
                        wide = Int64(raw)
                        out_of_range = (wide < Int64(0)) | (wide > Int64(rows))
                        bad = bad | Int32(out_of_range)
                        size = Int32(cutlass.max(cutlass.min(wide, Int64(rows)), Int64(0)))
                    else:
                        narrow = Int32(raw)
                        bad = bad | Int32((narrow < 0) | (narrow > rows))
                        size = cutlass.max(cutlass.min(narrow, rows), Int32(0))
            values.append(size)
            local = self._saturating_add(local, size, cap)
        # inclusive scan of the lane sums across the warp (saturating: associative for non-negative values)
        scan = local
        for k in cutlass.range_constexpr(5):
            offset = 1 << k
            other = cute.arch.shuffle_sync_up(scan, offset)
            if lane >= offset:
                scan = self._saturating_add(scan, other, cap)
        total = cute.arch.shuffle_sync(scan, LANES - 1)
        before = scan - local
        if const_expr(self.sizes_dtype is not None):  # one group of all rows (dense) needs no check
            bad = bad | Int32(total != rows)
            if cute.arch.vote_any_sync(bad != 0):
                if lane == 0:
                    cute.printf(self.message, rows, total)
                _trap()
        if lane == 0:
            mOut[0] = Int32(0)
        running = before
        for j in cutlass.range_constexpr(self.per_lane):
            i = lane * self.per_lane + j
            running = running + values[j]
            if i < self.G:
                mOut[i + 1] = running
        c = lane
        while c < counters:
            mOut[self.G + 1 + c] = Int32(0)
            c = c + LANES


def compile_group_bounds(G: int, sizes_dtype: str | None) -> UtilityKernel:
    """The prologue for `G` groups and sizes of `sizes_dtype` ("int32", "int64"; None: one group of all rows),
    compiled once per process; `launch(sizes_ptr, out_ptr, rows, counters, stream)` with plain integers."""
    def build():
        from cutlass.runtime import make_fake_stream

        sizes = make_ptr(cutlass_dtype(sizes_dtype or "int32"), 0, cute.AddressSpace.gmem, assumed_align=4)
        out = make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
        return cute.compile(GroupBoundsKernel(G, sizes_dtype), sizes, out, Int32(1), Int32(0), make_fake_stream(),
                            options="--enable-tvm-ffi")

    return compile_once(("bounds", G, sizes_dtype), build)
