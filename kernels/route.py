"""MoE top-k routing in three small kernels instead of about twenty torch ops (fusion.moe.route without token
rounding, on the GPU).

    forward:  RouteTopKKernel   logits (T, E)  -> top (T*k,) int16 experts, best first; w (T*k,) float32 weights;
                                                  token_offsets (T + 2,) int64
              RouteSortKernel   top, w         -> index, expert (M,) int64, probs (M,), group_sizes (E,) int32,
                                                  pos (T*k,) int32: the routed row of slot t*k + j;
                                                  rows_by_token (M,) int64: each token's rows, increasing
    backward: RouteGradKernel   logits, top, pos, dprobs (M,) -> dlogits (T, E)

Why: at a small batch the host is an MoE layer's bottleneck, and torch's routing (two sorts, a gather, the
renormalization, a searchsorted, and a dozen ops of its backward) cost about 540 µs of host time of a 2.2 ms
Qwen3-30B-A3B training step at 1024 tokens on an H100 (bench/host_split.py). Each kernel here launches through
TVM-FFI with plain integers, a few µs each.

Semantics are route()'s (fusion/moe/routing.py), computed in float32:
- scores: softmax over the E logits (exp(x - max) / sum) or the per-expert sigmoid;
- selection: the k largest of score + bias (bias optional), ties to the lower expert, NaN first (as torch's
  stable descending sort orders them);
- weights: the chosen scores, divided by their sum clamped to the smallest normal float when normalizing;
- rows: grouped by expert, within an expert by token (a stable counting sort of the token-major slots), so
  routing is deterministic: no atomics anywhere.
The token layout (fusion.ops.routing.token_layout: each token's rows in increasing order, which the Combine and
the Gather's backward read) falls out of the sort: a token's rows increase with its experts' ids, so slot
(t, j) goes to place t*k + (how many of t's experts are below its own); the offsets are t*k.
The backward recomputes the scores from the logits (nothing of size (T, E) is saved) and applies the chain rule
of the renormalization and of the softmax or sigmoid.

Layout: the per-token kernels run one warp per token (lane l holds experts l, l + 32, ...: E <= MAX_EXPERTS); the
sort runs one CTA per expert, which reads the T*k expert ids twice (a count of the experts before it, then its own
rows in token order with a block-wide scan per chunk of slots): every CTA writes only its own rows.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int16, Int32, Int64, const_expr
from cutlass.cute.runtime import make_ptr
from cutlass.memory import SmemAllocator

from .dtypes import cutlass_dtype
from .utility_kernel import UtilityKernel, compile_once

LANES = 32
#: Tokens (warps) per CTA of the per-token kernels.
TOKEN_WARPS = 4
#: The most experts a warp holds (32 values per lane) and the most experts a token picks.
MAX_EXPERTS = 1024
MAX_K = 32
#: Threads per CTA of the sort and slots per thread per chunk (a chunk: SORT_THREADS * SORT_VEC slots).
SORT_THREADS = 512
SORT_VEC = 16
SCORES = ("softmax", "sigmoid")
_TINY = float.fromhex("0x1p-126")   # torch.finfo(torch.float32).tiny


def _warp_max(x):
    for k in range(5):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, 1 << k))
    return x


def _warp_sum(x):
    for k in range(5):
        x = x + cute.arch.shuffle_sync_bfly(x, 1 << k)
    return x


class _TokenScores:
    """What the two per-token kernels share: the token's scores (and selection keys) in the lane's registers."""

    def __init__(self, dtype: str, E: int, k: int, score: str, normalize: bool, has_bias: bool):
        if score not in SCORES:
            raise ValueError(f"route kernel: score must be one of {SCORES}, got {score!r}")
        if not 1 <= k <= min(E, MAX_K) or E > MAX_EXPERTS:
            raise ValueError(f"route kernel: needs 1 <= k <= min(E, {MAX_K}) and E <= {MAX_EXPERTS}; got E={E}, k={k}")
        self.dtype = cutlass_dtype(dtype)
        self.E, self.k, self.score, self.normalize, self.has_bias = E, k, score, normalize, has_bias
        self.per_lane = (E + LANES - 1) // LANES

    @staticmethod
    def launch_shape(T) -> dict:
        """The launch's grid and block: one warp per token, TOKEN_WARPS tokens per CTA."""
        return {"grid": ((T + TOKEN_WARPS - 1) // TOKEN_WARPS, 1, 1), "block": (LANES * TOKEN_WARPS, 1, 1)}

    @cute.jit
    def warp_token(self):
        """(token, lane) of this thread."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        return bidx * TOKEN_WARPS + tidx // LANES, tidx % LANES

    @cute.jit
    def scores(self, mL: cute.Tensor, mBias: cute.Tensor, t: Int32, lane: Int32):
        """(scores, keys) of the lane's experts lane + 32 i (past E: score 0, key -inf, never chosen)."""
        xs = []
        for i in cutlass.range_constexpr(self.per_lane):
            e = lane + LANES * i
            x = Float32(-math.inf)
            if e < self.E:
                x = Float32(mL[t, cutlass.min(e, self.E - 1)])
            xs.append(x)
        scores = []
        if const_expr(self.score == "softmax"):
            m = xs[0]
            for i in cutlass.range_constexpr(1, self.per_lane):
                m = cute.arch.fmax(m, xs[i])
            m = _warp_max(m)
            total = Float32(0.0)
            ps = []
            for i in cutlass.range_constexpr(self.per_lane):
                p = Float32(0.0)
                if lane + LANES * i < self.E:
                    p = cute.math.exp(xs[i] - m)
                ps.append(p)
                total = total + p
            total = _warp_sum(total)
            for i in cutlass.range_constexpr(self.per_lane):
                scores.append(ps[i] / total)
        else:
            for i in cutlass.range_constexpr(self.per_lane):
                s = Float32(0.0)
                if lane + LANES * i < self.E:
                    s = Float32(1.0) / (Float32(1.0) + cute.math.exp(-xs[i]))
                scores.append(s)
        keys = []
        for i in cutlass.range_constexpr(self.per_lane):
            e = lane + LANES * i
            key = scores[i]
            if const_expr(self.has_bias):
                key = key + Float32(mBias[cutlass.min(e, self.E - 1)])
            key = cutlass.select_(key != key, Float32(math.inf), key)   # NaN ranks first, as in torch's sort
            keys.append(cutlass.select_(e < self.E, key, Float32(-math.inf)))
        return scores, keys

    @cute.jit
    def top_k(self, scores, keys, lane: Int32):
        """The k chosen experts, best first, and their scores (warp-uniform lists): k rounds of a warp argmax
        (ties to the lower expert), each round's winner taken out."""
        taken = [Int32(0) for _ in range(self.per_lane)]
        experts, chosen = [], []
        none = Int32(self.E)   # "no candidate yet": loses to every expert
        for _ in cutlass.range_constexpr(self.k):
            best_key, best_e, best_s = Float32(-math.inf), none, Float32(0.0)
            for i in cutlass.range_constexpr(self.per_lane):   # ascending experts: strict > keeps the lower one
                e = lane + LANES * i
                better = (taken[i] == 0) & (e < self.E) & ((best_e == none) | (keys[i] > best_key))
                best_key = cutlass.select_(better, keys[i], best_key)
                best_e = cutlass.select_(better, e, best_e)
                best_s = cutlass.select_(better, scores[i], best_s)
            for b in cutlass.range_constexpr(5):
                o_key = cute.arch.shuffle_sync_bfly(best_key, 1 << b)
                o_e = cute.arch.shuffle_sync_bfly(best_e, 1 << b)
                o_s = cute.arch.shuffle_sync_bfly(best_s, 1 << b)
                take = (o_e != none) & ((best_e == none) | (o_key > best_key) | ((o_key == best_key) & (o_e < best_e)))
                best_key = cutlass.select_(take, o_key, best_key)
                best_e = cutlass.select_(take, o_e, best_e)
                best_s = cutlass.select_(take, o_s, best_s)
            for i in cutlass.range_constexpr(self.per_lane):
                taken[i] = taken[i] | Int32(lane + LANES * i == best_e)
            experts.append(best_e)
            chosen.append(best_s)
        return experts, chosen

    @cute.jit
    def denominator(self, chosen):
        """(the chosen scores' sum, that sum clamped to the smallest normal float): route()'s renormalization."""
        total = chosen[0]
        for j in cutlass.range_constexpr(1, self.k):
            total = total + chosen[j]
        return total, cute.arch.fmax(total, Float32(_TINY))


class RouteTopKKernel(_TokenScores):
    """Trace-time: logits dtype, E, k, score, normalize, has_bias. One warp per token."""

    @cute.jit
    def __call__(self, pL: cute.Pointer, pBias: cute.Pointer, pTop: cute.Pointer, pW: cute.Pointer,
                 pOffs: cute.Pointer, T: Int32, stream):
        mL = cute.make_tensor(pL, cute.make_layout((T, self.E), stride=(self.E, 1)))
        mBias = cute.make_tensor(pBias, cute.make_layout((self.E,)))
        mTop = cute.make_tensor(pTop, cute.make_layout((T * self.k,)))
        mW = cute.make_tensor(pW, cute.make_layout((T * self.k,)))
        mOffs = cute.make_tensor(pOffs, cute.make_layout((T + 2,)))
        self.kernel(mL, mBias, mTop, mW, mOffs, T).launch(**self.launch_shape(T), stream=stream)

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor, mW: cute.Tensor, mOffs: cute.Tensor,
               T: Int32):
        t, lane = self.warp_token()
        if t < T:
            scores, keys = self.scores(mL, mBias, t, lane)
            experts, chosen = self.top_k(scores, keys, lane)
            _, denom = self.denominator(chosen)
            if lane == 0:
                mOffs[t] = Int64(t) * self.k
                if t == T - 1:
                    mOffs[T] = Int64(T) * self.k
                    mOffs[T + 1] = Int64(T) * self.k
                for j in cutlass.range_constexpr(self.k):
                    mTop[t * self.k + j] = Int16(experts[j])
                    w = chosen[j]
                    if const_expr(self.normalize):
                        w = chosen[j] / denom
                    mW[t * self.k + j] = w


class RouteGradKernel(_TokenScores):
    """d logits of route's probs: one warp per token, the scores recomputed. Trace-time as RouteTopKKernel."""

    @cute.jit
    def __call__(self, pL: cute.Pointer, pBias: cute.Pointer, pTop: cute.Pointer, pPos: cute.Pointer,
                 pDProbs: cute.Pointer, pDL: cute.Pointer, T: Int32, M: Int32, stream):
        mL = cute.make_tensor(pL, cute.make_layout((T, self.E), stride=(self.E, 1)))
        mBias = cute.make_tensor(pBias, cute.make_layout((self.E,)))
        mTop = cute.make_tensor(pTop, cute.make_layout((T * self.k,)))
        mPos = cute.make_tensor(pPos, cute.make_layout((T * self.k,)))
        mDP = cute.make_tensor(pDProbs, cute.make_layout((M,)))
        mDL = cute.make_tensor(pDL, cute.make_layout((T, self.E), stride=(self.E, 1)))
        self.kernel(mL, mBias, mTop, mPos, mDP, mDL, T).launch(**self.launch_shape(T), stream=stream)

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mBias: cute.Tensor, mTop: cute.Tensor, mPos: cute.Tensor, mDP: cute.Tensor,
               mDL: cute.Tensor, T: Int32):
        t, lane = self.warp_token()
        if t < T:
            scores, _ = self.scores(mL, mBias, t, lane)
            experts, chosen = [], []
            for j in cutlass.range_constexpr(self.k):
                e = Int32(mTop[t * self.k + j])
                # the score of expert e lives in lane e % 32, register e // 32
                mine = scores[0]
                for i in cutlass.range_constexpr(1, self.per_lane):
                    mine = cutlass.select_(e // LANES == i, scores[i], mine)
                experts.append(e)
                chosen.append(cute.arch.shuffle_sync(mine, e % LANES))
            total, denom = self.denominator(chosen)
            ds = []
            for j in cutlass.range_constexpr(self.k):
                ds.append(Float32(mDP[Int64(mPos[t * self.k + j])]))
            if const_expr(self.normalize):
                # w_j = s_j / D, D = max(sum s, tiny): ds_j = (dw_j - sum_i dw_i w_i) / D, no sum term where clamped
                through = Float32(0.0)
                for j in cutlass.range_constexpr(self.k):
                    through = through + ds[j] * (chosen[j] / denom)
                through = cutlass.select_(total < Float32(_TINY), Float32(0.0), through)
                for j in cutlass.range_constexpr(self.k):
                    ds[j] = (ds[j] - through) / denom
            dot = Float32(0.0)
            if const_expr(self.score == "softmax"):
                for j in cutlass.range_constexpr(self.k):
                    dot = dot + ds[j] * chosen[j]
            for i in cutlass.range_constexpr(self.per_lane):
                e = lane + LANES * i
                d = Float32(0.0)
                for j in cutlass.range_constexpr(self.k):
                    d = cutlass.select_(experts[j] == e, ds[j], d)
                s = scores[i]
                g = d * s * (Float32(1.0) - s)
                if const_expr(self.score == "softmax"):
                    g = s * (d - dot)
                if e < self.E:
                    mDL[t, cutlass.min(e, self.E - 1)] = g.to(self.dtype)


class RouteSortKernel:
    """The stable counting sort of the T*k slots by expert: one CTA per expert. Trace-time: probs dtype, E, k."""

    def __init__(self, dtype: str, E: int, k: int):
        self.dtype = cutlass_dtype(dtype)
        self.E, self.k = E, k
        self.warps = SORT_THREADS // LANES

    @cute.jit
    def __call__(self, pTop: cute.Pointer, pW: cute.Pointer, pIndex: cute.Pointer, pExpert: cute.Pointer,
                 pProbs: cute.Pointer, pSizes: cute.Pointer, pPos: cute.Pointer, pLayout: cute.Pointer, S: Int32,
                 stream):
        mTop = cute.make_tensor(pTop, cute.make_layout((S,)))
        mW = cute.make_tensor(pW, cute.make_layout((S,)))
        mIndex = cute.make_tensor(pIndex, cute.make_layout((S,)))
        mExpert = cute.make_tensor(pExpert, cute.make_layout((S,)))
        mProbs = cute.make_tensor(pProbs, cute.make_layout((S,)))
        mSizes = cute.make_tensor(pSizes, cute.make_layout((self.E,)))
        mPos = cute.make_tensor(pPos, cute.make_layout((S,)))
        mLayout = cute.make_tensor(pLayout, cute.make_layout((S,)))
        self.kernel(mTop, mW, mIndex, mExpert, mProbs, mSizes, mPos, mLayout, S).launch(
            grid=(self.E, 1, 1), block=(SORT_THREADS, 1, 1), stream=stream)

    @cute.jit
    def _block_sums(self, a: Int32, b: Int32, sA: cute.Tensor, sB: cute.Tensor, warp: Int32, lane: Int32):
        """(sum of a, sum of b) over the CTA, every thread."""
        for k in cutlass.range_constexpr(5):
            a = a + cute.arch.shuffle_sync_bfly(a, 1 << k)
            b = b + cute.arch.shuffle_sync_bfly(b, 1 << k)
        if lane == 0:
            sA[warp] = a
            sB[warp] = b
        cute.arch.sync_threads()
        ta, tb = Int32(0), Int32(0)
        for w in cutlass.range_constexpr(self.warps):
            ta = ta + sA[w]
            tb = tb + sB[w]
        cute.arch.sync_threads()
        return ta, tb

    @cute.kernel
    def kernel(self, mTop: cute.Tensor, mW: cute.Tensor, mIndex: cute.Tensor, mExpert: cute.Tensor,
               mProbs: cute.Tensor, mSizes: cute.Tensor, mPos: cute.Tensor, mLayout: cute.Tensor, S: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        e, _, _ = cute.arch.block_idx()
        lane = tidx % LANES
        warp = tidx // LANES
        smem = SmemAllocator()
        sA = smem.allocate_tensor(Int32, cute.make_layout((self.warps,)), 16)
        sB = smem.allocate_tensor(Int32, cute.make_layout((self.warps,)), 16)
        # pass 1: the slots of experts before e (this expert's first row) and of e (its group size); each thread
        # reads SORT_VEC consecutive slots per step, unrolled, so that the loads overlap
        chunk = SORT_THREADS * SORT_VEC
        before, mine = Int32(0), Int32(0)
        base = Int32(0)
        while base < S:
            first = base + tidx * SORT_VEC
            for v in cutlass.range_constexpr(SORT_VEC):
                x = Int32(self.E)   # past the slots: neither below e nor e
                if first + v < S:
                    x = Int32(mTop[first + v])
                before = before + Int32(x < e)
                mine = mine + Int32(x == e)
            base = base + chunk
        start, count = self._block_sums(before, mine, sA, sB, warp, lane)
        if tidx == 0:
            mSizes[e] = count
        # pass 2: e's slots in token order, SORT_VEC consecutive slots per thread per chunk, a block-wide
        # exclusive scan of the per-thread counts placing each
        running = Int32(0)
        base = Int32(0)
        while (base < S) & (running < count):
            first = base + tidx * SORT_VEC
            flags = []
            local = Int32(0)
            for v in cutlass.range_constexpr(SORT_VEC):
                slot = first + v
                f = Int32(0)
                if slot < S:
                    f = Int32(Int32(mTop[slot]) == e)
                flags.append(f)
                local = local + f
            incl = local
            for k in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(incl, 1 << k)
                if lane >= (1 << k):
                    incl = incl + other
            if lane == LANES - 1:
                sA[warp] = incl
            cute.arch.sync_threads()
            warp_before, total = Int32(0), Int32(0)
            for w in cutlass.range_constexpr(self.warps):
                part = sA[w]
                warp_before = warp_before + cutlass.select_(w < warp, part, Int32(0))
                total = total + part
            cute.arch.sync_threads()
            row = start + running + warp_before + incl - local
            for v in cutlass.range_constexpr(SORT_VEC):
                if flags[v] != 0:
                    slot = first + v
                    mIndex[row] = Int64(slot // self.k)
                    mExpert[row] = Int64(e)
                    mProbs[row] = Float32(mW[slot]).to(self.dtype)
                    mPos[slot] = row
                    token0 = (slot // self.k) * self.k
                    below = Int32(0)
                    for j in cutlass.range_constexpr(self.k):
                        below = below + Int32(Int32(mTop[token0 + j]) < e)
                    mLayout[token0 + below] = Int64(row)
                    row = row + 1
            running = running + total
            base = base + chunk


def _ptr(dtype, align: int = 16):
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def compile_route_topk(dtype: str, E: int, k: int, score: str, normalize: bool, has_bias: bool) -> UtilityKernel:
    """`launch(logits_ptr, bias_ptr, top_ptr, w_ptr, offsets_ptr, T, stream)`: logits (T, E) of `dtype`, bias (E,)
    float32 (any address when has_bias is False); top (T*k,) int16, w (T*k,) float32 and the token offsets (T + 2,)
    int64 out."""
    def build():
        from cutlass.runtime import make_fake_stream

        return cute.compile(RouteTopKKernel(dtype, E, k, score, normalize, has_bias), _ptr(cutlass_dtype(dtype), 2),
                            _ptr(Float32, 4), _ptr(Int16, 2), _ptr(Float32, 4), _ptr(Int64, 8), Int32(1),
                            make_fake_stream(),
                            options="--enable-tvm-ffi")

    return compile_once(("route_topk", dtype, E, k, score, normalize, has_bias), build)


def compile_route_sort(dtype: str, E: int, k: int) -> UtilityKernel:
    """`launch(top_ptr, w_ptr, index_ptr, expert_ptr, probs_ptr, sizes_ptr, pos_ptr, layout_ptr, S, stream)`: S =
    T*k slots; index and expert (S,) int64, probs (S,) of `dtype`, sizes (E,) int32, pos (S,) int32 and the token
    layout's rows (S,) int64 out."""
    def build():
        from cutlass.runtime import make_fake_stream

        return cute.compile(RouteSortKernel(dtype, E, k), _ptr(Int16, 2), _ptr(Float32, 4), _ptr(Int64, 8),
                            _ptr(Int64, 8), _ptr(cutlass_dtype(dtype), 2), _ptr(Int32, 4), _ptr(Int32, 4),
                            _ptr(Int64, 8), Int32(1),
                            make_fake_stream(), options="--enable-tvm-ffi")

    return compile_once(("route_sort", dtype, E, k), build)


def compile_route_grad(dtype: str, E: int, k: int, score: str, normalize: bool, has_bias: bool) -> UtilityKernel:
    """`launch(logits_ptr, bias_ptr, top_ptr, pos_ptr, dprobs_ptr, dlogits_ptr, T, M, stream)`: dprobs (M,) of
    `dtype` (the probs' gradient), dlogits (T, E) of `dtype` out; the rest as the forward's."""
    def build():
        from cutlass.runtime import make_fake_stream

        p = _ptr(cutlass_dtype(dtype), 2)
        return cute.compile(RouteGradKernel(dtype, E, k, score, normalize, has_bias), p, _ptr(Float32, 4),
                            _ptr(Int16, 2), _ptr(Int32, 4), p, p, Int32(1), Int32(1), make_fake_stream(),
                            options="--enable-tvm-ffi")

    return compile_once(("route_grad", dtype, E, k, score, normalize, has_bias), build)
