"""Register <-> global memory moves of the epilogue, at 64-bit byte addresses, predicated.

The epilogue keeps one 64-bit base address per (tensor, fragment row) and reaches every element of the
row by a constant offset from it, so addresses cost few registers. Pairs of adjacent columns move as one
vector (32-bit for 16-bit types, 16-bit for e4m3); masked loads yield 0, masked stores do nothing.

:func:`store4_swapped` stores 16-bit values 4 columns at a time: a wgmma accumulator gives each lane of a quad 2
columns of every 8, so 2-column stores write half 32-byte sectors (every store instruction touches twice the
sectors its bytes need); neighbouring lanes swap one packed pair by a shuffle instead, and each stores 4
columns of one of two neighbouring chunks, so the quad writes whole sectors.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm


def row_addr(t: cute.Tensor, row, col, dt):
    """Byte address of element (row, col) of a row-major 2-D tensor (64-bit arithmetic)."""
    return t.iterator.toint() + (Int64(row) * t.layout.stride[0] + Int64(col)) * (dt.width // 8)


@cute.jit
def load1(t: cute.Tensor, i: Int32, ok: Boolean) -> Float32:
    """``t[i]`` as fp32 (0 where not ok)."""
    v = Float32(0.0)
    if ok:
        v = Float32(t[i])
    return v


@cute.jit
def load_word(addr: Int64, ok: Boolean) -> Int32:
    """One 32-bit load at a byte address (0 where not ok): 2 adjacent 16-bit values."""
    v = Int32(0)
    if ok:
        p = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4)
        v = cute.make_tensor(p, cute.make_layout((1,)))[0]
    return v


@cute.jit
def load2(addr: Int64, ok: Boolean, dt: cutlass.Constexpr):
    """2 adjacent values at a byte address, one vector load, as fp32 (0 where not ok)."""
    frag = cute.make_rmem_tensor((2,), dt)
    frag.fill(0.0)
    if ok:
        p = cute.make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=2 * dt.width // 8)
        cute.autovec_copy(cute.make_tensor(p, cute.make_layout((2,))), frag)
    return Float32(frag[0]), Float32(frag[1])


@cute.jit
def store2(addr: Int64, v0: Float32, v1: Float32, dt: cutlass.Constexpr, ok: Boolean):
    """Store 2 adjacent values (converted to ``dt``) at a byte address with one vector store."""
    frag = cute.make_rmem_tensor((2,), dt)
    frag[0] = v0.to(dt)
    frag[1] = v1.to(dt)
    if ok:
        p = cute.make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=2 * dt.width // 8)
        cute.autovec_copy(frag, cute.make_tensor(p, cute.make_layout((2,))))


@cute.jit
def store_f32(t: cute.Tensor, row: Int32, col: Int32, v: Float32, ok: Boolean):
    """``t[row, col] = v`` for a row-major float32 tensor, where ok."""
    if ok:
        t[row, col] = v


def quad_sum(v: Float32) -> Float32:
    """The sum of ``v`` over the lane's quad (lanes 4i..4i+3: one accumulator row of a wgmma fragment), in every
    lane of it; a fixed butterfly, so the same inputs give the same bits. Every lane of the warp must call it."""
    v = v + cute.arch.shuffle_sync_bfly(v, 1)
    return v + cute.arch.shuffle_sync_bfly(v, 2)


@cute.jit
def store2_rc(t: cute.Tensor, row: Int32, col: Int32, v0: Float32, v1: Float32, dt: cutlass.Constexpr,
              ok: Boolean):
    """Store 2 adjacent values at (row, col), (row, col + 1) of a row-major tensor, one vector store."""
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
def store_byte(ts: cute.Tensor, row: Int32, col: Int32, e8: Int32, ok: Boolean):
    """``ts[row, col] = e8`` as uint8 where ok."""
    if ok:
        ts[row, col] = cutlass.Uint8(e8)


def unpack2(v, dt):
    """(col, col + 1) as fp32 from a word loaded by :func:`load_word` (little endian: col in the low half)."""
    if dt is cutlass.BFloat16:
        return bits_f32(v << 16), bits_f32(v & -65536)
    # fp16: each half's 16 bits reinterpreted as a half, then widened (a recast rmem fragment read back the
    # wrong element for the high half: tests/test_kernels_gpu.py::test_dgrad_canonical, fp16 with prefetch)
    lo = cutlass.Int16(v & 0xFFFF)
    hi = cutlass.Int16((v >> 16) & 0xFFFF)
    return (Float32(dt(llvm.bitcast(dt.mlir_type, lo.ir_value()))),
            Float32(dt(llvm.bitcast(dt.mlir_type, hi.ir_value()))))


def f32_bits(x) -> Int32:
    """The bit pattern of an fp32 value."""
    return Int32(llvm.bitcast(Int32.mlir_type, Float32(x).ir_value()))


def bits_f32(b) -> Float32:
    """The fp32 value of a bit pattern."""
    return Float32(llvm.bitcast(Float32.mlir_type, Int32(b).ir_value()))


def pack2(v0, v1, dt) -> Int32:
    """Two fp32 values as one word of two 16-bit ``dt`` values (v0 in the low half)."""
    pair = cute.make_rmem_tensor((2,), dt)
    pair[0] = v0.to(dt)
    pair[1] = v1.to(dt)
    return cute.recast_tensor(pair, Int32)[0]


@cute.jit
def store4_swapped(addr_c: Int64, pair_c, pair_c1, ok_c: Boolean, ok_c1: Boolean, odd: Boolean,
                   dt: cutlass.Constexpr):
    """Store a lane's 2-column pairs of chunks c and c+1 (8 columns apart; ``addr_c`` = the byte address of its
    pair in chunk c, ``ok_*`` its predicates) together with its quad neighbour's (lane ^ 1, ``odd`` = this lane
    is the odd one): the even lane stores 4 columns of chunk c, the odd lane 4 of chunk c+1, one 8-byte store
    each. Every lane of the warp must call it (the swap is a shuffle); rows must be 8-byte aligned."""
    w0 = pack2(pair_c[0], pair_c[1], dt)
    w1 = pack2(pair_c1[0], pair_c1[1], dt)
    got = cute.arch.shuffle_sync_bfly(cutlass.select_(odd, w0, w1), 1)
    store4_run(addr_c, cutlass.select_(odd, got, w0), cutlass.select_(odd, w1, got), ok_c, ok_c1, odd, dt.width // 8)


@cute.jit
def store4_run(addr_c: Int64, first: Int32, second: Int32, ok_c: Boolean, ok_c1: Boolean, odd: Boolean,
               eb: cutlass.Constexpr):
    """The 8-byte store of a lane's 4-column run after the quad swap (:func:`store4_swapped`): the even lane's run
    is columns 0-3 of chunk c (``addr_c``: the byte address of this lane's own pair in chunk c), the odd lane's
    columns 0-3 of chunk c+1; ``first``, ``second`` the run's two words (pairs of ``eb``-byte values)."""
    words = cute.make_rmem_tensor((2,), Int32)
    words[0] = first
    words[1] = second
    # the odd lane's own pair of chunk c+1 is its 4-column run's second half: the run starts 2 columns before
    addr = cutlass.select_(odd, addr_c + (8 - 2) * eb, addr_c)
    if cutlass.select_(odd, ok_c1, ok_c):
        p = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=8)
        cute.autovec_copy(words, cute.make_tensor(p, cute.make_layout((2,))))


@cute.jit
def store_tile16(acc: cute.Tensor, tCcC: cute.Tensor, mD: cute.Tensor, row0: Int32, row_end: Int32, col0: Int32,
                 cols: cutlass.Constexpr, dt: cutlass.Constexpr, store_bytes: cutlass.Constexpr = 8):
    """Store a tile's wgmma accumulator (coordinates ``tCcC``) to the row-major 16-bit ``mD`` at (``row0``,
    ``col0``), rows below ``row_end`` and columns below ``cols``, 4 columns per lane and store
    (:func:`store4_swapped`; D's rows 8-byte aligned), or with ``store_bytes = 16`` 8 columns per lane
    (:func:`store8_transposed`; D's rows 16-byte aligned and 4 chunks to a fragment row): the epilogue of the
    weight-gradient kernels."""
    odd = (cute.arch.lane_idx() & 1) == 1
    q = cute.arch.lane_idx() & 3
    n_v, n_h, n_c = tCcC.shape[0]
    eb = dt.width // 8
    for mm in cutlass.range_constexpr(cute.size(tCcC, mode=[1])):
        for nn in cutlass.range_constexpr(cute.size(tCcC, mode=[2])):
            for h in cutlass.range_constexpr(n_h):
                grow = row0 + tCcC[((0, h, 0), mm, nn)][0]
                row_ok = grow < row_end
                col = col0 + tCcC[((0, h, 0), mm, nn)][1]        # this lane's column in chunk 0
                base = row_addr(mD, grow, col, dt)
                if cutlass.const_expr(store_bytes == 16):
                    for c in cutlass.range_constexpr(0, n_c, 4):
                        pairs = [(acc[((0, h, c + j), mm, nn)], acc[((1, h, c + j), mm, nn)]) for j in range(4)]
                        # this lane stores chunk c + q: its first column is 8 (c + q) past chunk 0's, 2 q before col
                        store8_transposed(base + 8 * c * eb, pairs, q,
                                          row_ok & (col - 2 * q + 8 * (c + q) < cols), dt)
                else:
                    for c in cutlass.range_constexpr(0, n_c, 2):
                        store4_swapped(base + 8 * c * eb,
                                       (acc[((0, h, c), mm, nn)], acc[((1, h, c), mm, nn)]),
                                       (acc[((0, h, c + 1), mm, nn)], acc[((1, h, c + 1), mm, nn)]),
                                       row_ok & (col + 8 * c < cols), row_ok & (col + 8 * (c + 1) < cols), odd, dt)


def _swap_round(w: list, bit: Boolean, m: int) -> list:
    """One butterfly round of a quad's 4x4 word transpose (:func:`store8_transposed`): lane l and lane l ^ m swap
    the words j whose bit ``m`` differs from l's (``bit``: l's bit ``m`` is set), each receiving the other's word
    j ^ m; a word whose bit matches stays."""
    out = list(w)
    for lo in range(4):
        if lo & m:
            continue
        hi = lo | m
        # the word this lane gives away: hi where its bit is clear (hi mismatches), lo where set
        got = cute.arch.shuffle_sync_bfly(cutlass.select_(bit, w[lo], w[hi]), m)
        out[lo] = cutlass.select_(bit, got, w[lo])
        out[hi] = cutlass.select_(bit, w[hi], got)
    return out


@cute.jit
def store8_transposed(addr_c: Int64, pairs, q: Int32, ok: Boolean, dt: cutlass.Constexpr):
    """Store a quad's 2-column pairs of 4 neighbouring chunks c..c+3 (``pairs[j]``: this lane's pair of chunk c + j;
    ``addr_c`` the byte address of its pair in chunk c; ``q`` its lane in the quad) as one 16-byte store per lane:
    a 4x4 transpose of the quad's packed words in two butterfly rounds (4 shuffles) gives lane q the 8 columns of
    chunk c + q, which ``ok`` guards. Every lane of the warp must call it; D's rows must be 16-byte aligned."""
    w = [pack2(p[0], p[1], dt) for p in pairs]
    w = _swap_round(w, (q & 1) == 1, 1)
    w = _swap_round(w, (q & 2) == 2, 2)
    words = cute.make_rmem_tensor((4,), Int32)
    for j in cutlass.range_constexpr(4):
        words[j] = w[j]
    eb = dt.width // 8
    # chunk c + q's first column: 8 q columns past chunk c's, whose pair this lane holds at column 2 q
    addr = addr_c + Int64(q) * (6 * eb)
    if ok:
        p = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16)
        cute.autovec_copy(words, cute.make_tensor(p, cute.make_layout((4,))))
