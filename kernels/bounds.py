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
    def _lane_sizes(self, mSizes: cute.Tensor, lane: Int32, rows: Int32):
        """This lane's groups (consecutive, so that the warp scan is a plain prefix): their sizes clamped to
        [0, rows], their sum saturating at rows + 1, and whether one was out of range."""
        cap = rows + 1
        bad = Int32(0)
        values = []
        local = Int32(0)
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
                        bad = bad | Int32((wide < Int64(0)) | (wide > Int64(rows)))
                        size = Int32(cutlass.max(cutlass.min(wide, Int64(rows)), Int64(0)))
                    else:
                        narrow = Int32(raw)
                        bad = bad | Int32((narrow < 0) | (narrow > rows))
                        size = cutlass.max(cutlass.min(narrow, rows), Int32(0))
            values.append(size)
            local = cutlass.min(local + size, cap)
        return values, local, bad

    @cute.jit
    def _warp_scan(self, local: Int32, lane: Int32, cap: Int32) -> Int32:
        """Inclusive scan of the lane sums across the warp (saturating at `cap`: associative for non-negative
        values, and no int32 wrap)."""
        scan = local
        for k in cutlass.range_constexpr(5):
            offset = 1 << k
            other = cute.arch.shuffle_sync_up(scan, offset)
            if lane >= offset:
                scan = cutlass.min(scan + other, cap)
        return scan

    @cute.jit
    def _write(self, mOut: cute.Tensor, lane: Int32, values, before: Int32, last: Int32, counters: Int32,
               sizes_too: cutlass.Constexpr = False):
        """Bounds [0, o_1, ..., o_{G-1}, last] (`before`: the sum of the groups before this lane's) and zeroed
        counters; `sizes_too`: after the counters also the G sizes those bounds make (the last one `last` less
        o_{G-1})."""
        if lane == 0:
            mOut[0] = Int32(0)
        running = before
        for j in cutlass.range_constexpr(self.per_lane):
            i = lane * self.per_lane + j
            running = running + values[j]
            if i < self.G:
                mOut[i + 1] = cutlass.select_(i == self.G - 1, last, running)
                if const_expr(sizes_too):
                    mOut[self.G + 1 + counters + i] = cutlass.select_(i == self.G - 1, last - (running - values[j]),
                                                                      values[j])
        c = lane
        while c < counters:
            mOut[self.G + 1 + c] = Int32(0)
            c = c + LANES

    @cute.kernel
    def kernel(self, mSizes: cute.Tensor, mOut: cute.Tensor, rows: Int32, counters: Int32):
        lane, _, _ = cute.arch.thread_idx()
        values, local, bad = self._lane_sizes(mSizes, lane, rows)
        scan = self._warp_scan(local, lane, rows + 1)
        total = cute.arch.shuffle_sync(scan, LANES - 1)
        if const_expr(self.sizes_dtype is not None):  # one group of all rows (dense) needs no check
            bad = bad | Int32(total != rows)
            if cute.arch.vote_any_sync(bad != 0):
                if lane == 0:
                    cute.printf(self.message, rows, total)
                _trap()
        self._write(mOut, lane, values, scan - local, total, counters)


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


#: Threads per CTA of the routed prologue, and routed rows each index-checking CTA takes.
ROUTED_THREADS = 128
ROUTED_CHUNK = 4096


class RoutedBoundsKernel(GroupBoundsKernel):
    """The prologue of an MoE experts block (a Gather first): what GroupBoundsKernel does, for routed rows.

    - CTA 0, warp 0: the sizes, each in [0, rows] and summing to *at most* rows (the rows past the sum are
      padding); bounds [0, o_1, ..., o_{G-1}, rows] (the padding joins the last group: the kernels compute
      its rows, zeros from the Gather, and the Combine skips them); the counters zeroed; after them the G
      sizes of those bounds (the ops that read sizes see the padding in the last group; torch.diff of the
      bounds was 50 us of host time a call on the lent H200 machine).
    - CTAs 1..: ``ROUTED_CHUNK`` routed rows each: ``index[r]`` in [-1, tokens), -1 on every row past the
      sizes' sum, and the gathering kernels' int32 copy of it (a padding row, -1, reads zeros there: the
      gather producers zero-fill it).

    In torch these are about twenty small ops per call (an index range check, the padding rows' check, the
    padding absorbed into the last group, the offsets, the int32 index), 10-40 us of host time each. A bad
    value prints the problem on the device and traps, like GroupBoundsKernel."""

    def __init__(self, G: int, sizes_dtype: str, index_dtype: str):
        super().__init__(G, sizes_dtype)
        self.index_dtype = index_dtype
        self.sizes_message = ("fusion: group_sizes must each be in [0, routed rows] and sum to at most the "
                              "routed rows = %d; got a sum of %d (counted up to rows + 1) or a size out of range\n")
        self.index_message = ("fusion: index[%d] = %lld: the index must lie in [-1, tokens = %d), and be -1 on "
                              "every routed row past sum(group_sizes) = %d (padding)\n")

    @cute.jit
    def __call__(self, pSizes: cute.Pointer, pIndex: cute.Pointer, pOut: cute.Pointer, pIdx32: cute.Pointer,
                 rows: Int32, tokens: Int32, counters: Int32, stream):
        mSizes = cute.make_tensor(pSizes, cute.make_layout((self.G,)))
        mIndex = cute.make_tensor(pIndex, cute.make_layout((rows,)))
        mOut = cute.make_tensor(pOut, cute.make_layout((self.G + 1 + counters + self.G,)))
        mIdx32 = cute.make_tensor(pIdx32, cute.make_layout((rows,)))
        chunks = (rows + (ROUTED_CHUNK - 1)) // ROUTED_CHUNK
        self.kernel(mSizes, mIndex, mOut, mIdx32, rows, tokens, counters).launch(
            grid=(1 + chunks, 1, 1), block=(ROUTED_THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mSizes: cute.Tensor, mIndex: cute.Tensor, mOut: cute.Tensor, mIdx32: cute.Tensor,
               rows: Int32, tokens: Int32, counters: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % LANES
        warp = tidx // LANES
        # every warp sums the sizes (a few loads per lane): the index checks need the total
        values, local, bad = self._lane_sizes(mSizes, lane, rows)
        scan = self._warp_scan(local, lane, rows + 1)
        total = cute.arch.shuffle_sync(scan, LANES - 1)
        if bidx == 0:
            if warp == 0:
                bad = bad | Int32(total > rows)
                if cute.arch.vote_any_sync(bad != 0):
                    if lane == 0:
                        cute.printf(self.sizes_message, rows, total)
                    _trap()
                # the padding joins the last group; the sizes so made follow the counters
                self._write(mOut, lane, values, scan - local, rows, counters, sizes_too=True)
        else:
            start = (bidx - 1) * ROUTED_CHUNK
            end = cutlass.min(start + ROUTED_CHUNK, rows)
            r = start + tidx
            while r < end:
                value = Int64(mIndex[r])
                wrong = (value < Int64(-1)) | (value >= Int64(tokens)) | ((r >= total) & (value != Int64(-1)))
                if wrong:
                    cute.printf(self.index_message, r, value, tokens, total)
                    _trap()
                mIdx32[r] = Int32(value)
                r = r + ROUTED_THREADS


def compile_routed_bounds(G: int, sizes_dtype: str, index_dtype: str) -> UtilityKernel:
    """The routed prologue (RoutedBoundsKernel) for `G` groups, sizes and index of the given dtypes ("int32",
    "int64"), compiled once per process; `launch(sizes_ptr, index_ptr, out_ptr, idx32_ptr, rows, tokens,
    counters, stream)` with plain integers (rows: the routed rows M = index.numel() >= 1; out: G + 1 + counters
    + G int32, the bounds, the counters and the sizes with the padding in the last group)."""
    def build():
        from cutlass.runtime import make_fake_stream

        sizes = make_ptr(cutlass_dtype(sizes_dtype), 0, cute.AddressSpace.gmem, assumed_align=4)
        index = make_ptr(cutlass_dtype(index_dtype), 0, cute.AddressSpace.gmem, assumed_align=4)
        out = make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
        idx32 = make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
        return cute.compile(RoutedBoundsKernel(G, sizes_dtype, index_dtype), sizes, index, out, idx32, Int32(1),
                            Int32(1), Int32(0), make_fake_stream(), options="--enable-tvm-ffi")

    return compile_once(("routed_bounds", G, sizes_dtype, index_dtype), build)
