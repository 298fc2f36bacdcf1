"""Device-side MoE routing: scores, top-k, renormalization, a stable sort by expert, token rounding.

Everything here runs on the logits' device with static shapes and no host sync (no .item(), .tolist(),
nonzero or boolean-mask indexing), so a whole routing step can be captured in a CUDA graph with dynamic
routing and traced by torch.compile(fullgraph=True).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusion.errors import DTypeError, OpArgumentError, ShapeError
from fusion.ops.routing import layout_of

SCORES = {"softmax": lambda z: torch.softmax(z, dim=-1), "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class RouteResult:
    """The routing of T tokens to E experts, as M routed rows grouped by expert.

    index (M,) int64: the token of routed row i; -1 for a padding row.
    group_sizes (E,) int32: rows per expert; rows [offset_e, offset_e + group_sizes[e]) go to expert e, in
        expert order, and within an expert in increasing token order. Sums to M, or with round_to to at
        most M (the rows past the sum are padding).
    probs (M,) in the logits' dtype: the weight of each routed row (0 for padding); differentiable w.r.t.
        the logits.
    expert (M,) int64: the expert of routed row i; -1 for padding.
    rows_by_token (M,) int64 and token_offsets (T + 2,) int64: for each token its routed rows, for a combine:
        token t's rows are rows_by_token[token_offsets[t]:token_offsets[t + 1]], in increasing row order (the
        order Combine adds them); the padding rows come last. Without round_to every token has exactly k rows
        and rows_by_token.view(T, k) is the per-token table. Computed when first read (token_layout: a sort
        of the M rows), not by route(): on a small batch every routing op costs tens of microseconds of host
        time. On a GPU without round_to, route's kernels write it with the rows (fusion.ops.routing.layout_of
        finds it by `index`, as an experts block's Combine does).
    """

    index: torch.Tensor
    group_sizes: torch.Tensor
    probs: torch.Tensor
    expert: torch.Tensor
    tokens: int

    @property
    def rows_by_token(self) -> torch.Tensor:
        return self._layout()[0]

    @property
    def token_offsets(self) -> torch.Tensor:
        return self._layout()[1]

    def _layout(self):
        cached = self.__dict__.get("_token_layout")
        if cached is None:
            cached = layout_of(self.index, self.tokens)
            object.__setattr__(self, "_token_layout", cached)
        return cached

    @property
    def num_rows(self) -> torch.Tensor:
        """The routed rows that are not padding, as a 0-d tensor on the device (no sync)."""
        return self.group_sizes.sum()


def capacity(tokens: int, experts: int, k: int, round_to: int | None = None) -> int:
    """The static number M of routed rows route() returns: T*k, or T*k + E*(round_to // 2) with token rounding
    (rounding an expert's count to the nearer multiple of R adds at most R // 2 rows)."""
    return tokens * k + (experts * (round_to // 2) if round_to else 0)


def _validate(logits, k, score, bias, round_to) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ShapeError(f"route: logits must be a 2-D tensor (tokens, experts), got {shape}; flatten leading "
                         f"dims with logits.reshape(-1, logits.shape[-1])")
    if not logits.is_floating_point():
        raise DTypeError(f"route: logits must be floating point, got {logits.dtype}")
    experts = logits.shape[1]
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise ShapeError(f"route: k must be an int in [1, {experts}] (the number of experts), got {k!r}")
    if score not in SCORES:
        raise OpArgumentError(f"route: score must be one of {sorted(SCORES)}, got {score!r}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (experts,):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ShapeError(f"route: bias must be a tensor of shape ({experts},) (one per expert), got {shape}")
        if bias.device != logits.device:
            raise ShapeError(f"route: bias is on {bias.device} but logits are on {logits.device}")
    if round_to is not None and (not isinstance(round_to, int) or isinstance(round_to, bool) or round_to < 1):
        raise OpArgumentError(f"route: round_to must be a positive int (a tile size such as 128) or None, "
                              f"got {round_to!r}")


def route(logits: torch.Tensor, k: int, score: str = "softmax", bias: torch.Tensor | None = None,
          normalize: bool = True, round_to: int | None = None) -> RouteResult:
    """Route T tokens to their top-k of E experts: logits (T, E) -> RouteResult (see its fields).

    score: "softmax" (over all E experts) or "sigmoid" (per expert), computed in float32 (float64 for float64
        logits). bias: (E,) added to the scores for the selection only (DeepSeek-V3's load-balancing bias):
        it changes which experts are chosen, never the probabilities, and gets no gradient.
    normalize: divide each token's k probabilities by their sum (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS);
        False keeps the raw scores (OLMoE, Switch). With k=1 and normalize=True every prob is 1 and the
        router gets no gradient.
    Ties pick the lower expert index (a stable sort), so routing is deterministic.
    On a Hopper GPU, without round_to, three kernels run it (fusion/runtime/route.py: two forward, one backward)
    instead of these torch ops, which stay the reference (same rules; scores may differ in the last bits).

    round_to=R (token rounding, as SonicMoE): each expert's count c is rounded to the nearer multiple of R,
    an exact half (c % R == R / 2) rounding up, and capped at T. Rounding down drops that expert's rows
    with the lowest probs; rounding up adds the tokens not yet routed to it with the highest probs (their
    prob is their score, divided by the same per-token sum as their top-k when normalize=True). Equal probs:
    the lower token is kept, or added, first. The number of rows is then data-dependent, so the tensors have
    the static size M = capacity(T, E, k, R) = T*k + E*(R // 2) and the rows past sum(group_sizes) are
    padding: index == -1, expert == -1, probs == 0.
    """
    _validate(logits, k, score, bias, round_to)
    if round_to is None:
        from fusion.runtime import route as route_kernels

        if route_kernels.takes(logits, k, bias):
            return RouteResult(*route_kernels.route_top_k(logits, k, score, bias, normalize), logits.shape[0])
        if torch.is_grad_enabled() and logits.requires_grad:
            index, group_sizes, probs, expert = _TopKRoute.apply(logits, k, score, bias, normalize)
        else:   # nothing to differentiate: the same ops without the autograd node's bookkeeping
            index, group_sizes, probs, expert = _top_k_route(logits, k, score, bias, normalize)[:4]
        return RouteResult(index, group_sizes, probs, expert, logits.shape[0])
    scores = SCORES[score](logits.to(_compute_dtype(logits)))
    top = _top_k(scores, bias, k)
    probs_all = scores
    if normalize:
        tiny = torch.finfo(scores.dtype).tiny
        probs_all = scores / scores.gather(1, top).sum(dim=1, keepdim=True).clamp_min(tiny)
    return _rounded(top, probs_all, round_to, logits.dtype)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _top_k(scores: torch.Tensor, bias: torch.Tensor | None, k: int) -> torch.Tensor:
    """Each token's k chosen experts (T, k), best first. A stable descending sort, not topk: ties must go to the
    lower expert, deterministically. The bias changes the choice only."""
    select = scores.detach()
    if bias is not None:
        select = select + bias.detach().to(scores.dtype)
    return torch.sort(select, dim=1, descending=True, stable=True).indices[:, :k]


def _top_k_route(logits, k: int, score: str, bias, normalize: bool, for_backward: bool = False):
    """(index, group_sizes, probs, expert, saved): top-k routing without token rounding; `saved` what
    _TopKRoute's backward reads (scores, top, weights, denom, clamped, order), with `for_backward`."""
    scores = SCORES[score](logits.to(_compute_dtype(logits)))
    top = _top_k(scores, bias, k)
    weights = scores.gather(1, top)
    denom = clamped = None
    if normalize:
        tiny = torch.finfo(scores.dtype).tiny
        total = weights.sum(dim=1, keepdim=True)
        denom = total.clamp_min(tiny)
        if for_backward:
            clamped = total < tiny   # clamp_min passes no gradient there
        weights = weights / denom
    index, group_sizes, probs, expert, order = _sorted_by_expert(top, weights, logits.shape[1], logits.dtype)
    saved = (scores, top, weights, denom, clamped, order) if for_backward else ()
    return index, group_sizes, probs, expert, saved


class _TopKRoute(torch.autograd.Function):
    """Top-k routing without token rounding as one autograd node: logits -> (index, group_sizes, probs, expert),
    only probs differentiable. Its backward is the chain rule of the ops the forward runs (the scores, the
    gather of the chosen ones, the renormalization, the sort into rows by expert) written out in a dozen ops.
    Autograd through those ops records nine nodes and runs about twenty-five ops in the backward, each a
    dispatch and a launch on the host: on a small batch the host is the bottleneck of a whole MoE layer."""

    @staticmethod
    def forward(fctx, logits, k: int, score: str, bias, normalize: bool):
        index, group_sizes, probs, expert, saved = _top_k_route(logits, k, score, bias, normalize, for_backward=True)
        fctx.save_for_backward(*saved)
        fctx.score, fctx.logits_dtype = score, logits.dtype
        fctx.mark_non_differentiable(index, group_sizes, expert)
        return index, group_sizes, probs, expert

    @staticmethod
    def backward(fctx, _index, _sizes, dprobs, _expert):
        scores, top, weights, denom, clamped, order = fctx.saved_tensors
        # the routed rows' gradients back to their (token, slot): `order` is a permutation of the T*k slots
        dw = torch.empty_like(weights).view(-1).index_copy_(0, order, dprobs.to(weights.dtype)).view_as(weights)
        if denom is not None:
            # w = s / D with D = clamp_min(sum s): ds = (dw - sum(dw * w)) / D, the sum's term 0 where clamped
            through = (dw * weights).sum(dim=1, keepdim=True).masked_fill_(clamped, 0)
            dw = (dw - through) / denom
        dscores = torch.zeros_like(scores).scatter_(1, top, dw)
        if fctx.score == "softmax":
            dz = torch._softmax_backward_data(dscores, scores, 1, scores.dtype)
        else:
            dz = torch.ops.aten.sigmoid_backward(dscores, scores)
        return dz.to(fctx.logits_dtype), None, None, None, None


def _sorted_by_expert(top: torch.Tensor, weights: torch.Tensor, num_experts: int, dtype: torch.dtype):
    """Top-k (T, k) -> rows grouped by expert, within an expert by token (a stable sort of token-major rows):
    (index, group_sizes, probs, expert, order), order[r] the token-major slot t * k + j of routed row r."""
    k = top.shape[1]
    # The narrowest key dtype: a radix sort makes one pass per key byte (8 passes for int64). `top` is a slice of
    # the sort's indices: the cast copies it contiguous, so the flattening after it is a view, not a second copy.
    key = top.to(torch.uint8 if num_experts <= 256 else torch.int16 if num_experts < 2 ** 15
                 else torch.int32).view(-1)
    keys_sorted, order = torch.sort(key, stable=True)
    experts_sorted = keys_sorted.long()
    index = torch.div(order, k, rounding_mode="floor")
    probs = weights.reshape(-1).index_select(0, order).to(dtype)
    bounds = torch.arange(num_experts + 1, device=top.device, dtype=experts_sorted.dtype)
    group_sizes = torch.searchsorted(experts_sorted, bounds).diff().to(torch.int32)
    return index, group_sizes, probs, experts_sorted, order


def _rounded(top: torch.Tensor, probs_all: torch.Tensor, R: int, dtype: torch.dtype) -> RouteResult:
    """Token rounding on dense (T, E) tables, static shapes throughout (see route)."""
    tokens, num_experts = probs_all.shape
    device = top.device
    chosen = torch.zeros(tokens, num_experts, dtype=torch.bool, device=device).scatter_(1, top, True)
    counts = chosen.sum(0)
    quotient, remainder = torch.div(counts, R, rounding_mode="floor"), counts % R
    target = ((quotient + (2 * remainder >= R).long()) * R).clamp_max(tokens)
    adds = (target > counts).unsqueeze(0)
    # Per expert, one ranking of tokens: an expert that grows keeps its chosen tokens (+inf) then ranks the
    # others by prob; one that shrinks ranks its chosen tokens by prob and never takes the others (-inf).
    p = probs_all.detach()
    inf = torch.full_like(p, float("inf"))
    key = torch.where(chosen, torch.where(adds, inf, p), torch.where(adds, p, -inf))
    ranking = torch.sort(key, dim=0, descending=True, stable=True).indices
    rank = torch.empty_like(ranking).scatter_(0, ranking, torch.arange(tokens, device=device)
                                              .unsqueeze(1).expand(tokens, num_experts))
    keep = rank < target.unsqueeze(0)
    # Destination row of each kept (t, e): expert e's offset + kept tokens before t; others go to a dump slot.
    m_cap = capacity(tokens, num_experts, top.shape[1], R)
    starts = torch.cumsum(target, 0) - target
    # The running count of kept tokens per expert, as a scan along the *inner* dimension of an (E, T) copy: a
    # scan of (T, E) along dim 0 runs torch's outer-dimension kernel, 3.5 ms of Qwen3-30B-A3B's 6.9 ms forward
    # at T=16384 on an H100 (bench/profile_moe.py --path fusion_rounded), against microseconds this way.
    kept_before = torch.cumsum(keep.t().to(torch.int32, memory_format=torch.contiguous_format), 1).t()
    # (masked_fill, not torch.where with a number: that first copies the number to the device)
    dest = (starts.unsqueeze(0) + kept_before - 1).masked_fill(~keep, m_cap).reshape(-1)
    token_of = torch.arange(tokens, device=device).repeat_interleave(num_experts)
    expert_of = torch.arange(num_experts, device=device).repeat(tokens)
    index = torch.full((m_cap + 1,), -1, dtype=torch.long, device=device).scatter_(0, dest, token_of)[:m_cap]
    expert = torch.full((m_cap + 1,), -1, dtype=torch.long, device=device).scatter_(0, dest, expert_of)[:m_cap]
    # probs through a differentiable gather; padding rows read an appended 0.
    flat = (index * num_experts + expert).masked_fill(index < 0, tokens * num_experts)
    padded = torch.cat([probs_all.reshape(-1), probs_all.new_zeros(1)])
    probs = padded.index_select(0, flat).to(dtype)
    return RouteResult(index, target.to(torch.int32), probs, expert, tokens)
