"""Gather and Combine: the ops that move token rows to routed (expert-sorted) rows and back.

Both read the extra input `index` (one int per routed row: the token it came from, -1 for a padding row).
Gather is the first op of an MoE experts block, Combine the last; between them every op sees M = index.numel()
rows. Their math lives in two autograd functions that are each other's backward:

  gather_rows(x, index)          row i = x[index[i]], zeros where index[i] == -1
  combine_rows(y, index, tokens) row t = sum of the rows i with index[i] == t, padding rows skipped

combine_rows never uses atomics (index_add_ on CUDA does): the rows are put in token order by a stable argsort
of index, so each token's rows are contiguous and in increasing i, and `torch.segment_reduce` adds each
segment sequentially (one thread per segment and feature on CUDA). The result depends only on `index`, never
on scheduling: bitwise reproducible. Cost: an argsort of M ints, a gather of M rows, one read of them, a
write of `tokens` rows; bfloat16/float16 rows are summed in float32.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fusion.ops.base import Op, OpSpec, RunContext

#: Dtypes summed in float32 by combine_rows (then rounded once), like a fused kernel's fp32 accumulator.
_ACCUMULATE_IN_FLOAT32 = (torch.bfloat16, torch.float16)


def token_layout(index: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token, its routed rows: (rows_by_token (M,) int64, token_offsets (tokens + 2,) int64).

    Token t's rows are rows_by_token[token_offsets[t]:token_offsets[t + 1]], in increasing row order; the
    padding rows (index -1) form the last segment, [token_offsets[tokens], token_offsets[tokens + 1]) = up to M.
    Computed on the device without a host sync (stable argsort + searchsorted; static shapes).
    """
    # int32 keys where they fit: half the radix passes of int64. masked_fill, not torch.where with a Python
    # number: where first makes the number a device tensor (a host-to-device copy; about 200 us of host time per
    # call under cProfile on an H100 machine, against tens for masked_fill).
    key_dtype = torch.int32 if tokens < 2 ** 31 - 1 else torch.int64
    key = index.to(key_dtype).masked_fill(index < 0, tokens)
    sorted_key, rows_by_token = torch.sort(key, stable=True)
    bounds = torch.arange(tokens + 2, device=index.device, dtype=sorted_key.dtype)
    token_offsets = torch.searchsorted(sorted_key, bounds)
    return rows_by_token, token_offsets


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x's rows through `index`, padding rows (-1) reading an appended zero row. Zeroing them after the gather
    instead (masked_fill with a broadcast row mask) is an unvectorized pass over all M rows: 0.8 ms per call,
    twice in an 11 ms Qwen3 training step on an H100, where copying the T token rows once costs a k-th of a pass
    over the routed rows."""
    index = index.long()
    rows = index.masked_fill(index < 0, x.shape[0])   # (not torch.where with a number: see token_layout)
    return torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))]).index_select(0, rows)


def _combine(y: torch.Tensor, index: torch.Tensor, tokens: int, layout=None) -> torch.Tensor:
    rows_by_token, offsets = token_layout(index, tokens) if layout is None else layout
    rows = y.index_select(0, rows_by_token)
    if rows.dtype in _ACCUMULATE_IN_FLOAT32:
        rows = rows.float()
    # unsafe=True: skip segment_reduce's validation, which reads the lengths on the host (a sync).
    sums = torch.segment_reduce(rows, "sum", offsets=offsets, unsafe=True)
    return sums[:tokens].to(y.dtype)


class GatherRows(torch.autograd.Function):
    """x (T, d), index (M,) -> (M, d); backward: combine_rows (a deterministic sum into tokens)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.tokens = x.shape[0]
        return _gather(x, index)

    @staticmethod
    def backward(ctx, dy):
        (index,) = ctx.saved_tensors
        return CombineRows.apply(dy, index, ctx.tokens, None), None


class CombineRows(torch.autograd.Function):
    """y (M, d), index (M,), tokens T -> (T, d); backward: gather_rows."""

    @staticmethod
    def forward(ctx, y, index, tokens, layout):
        ctx.save_for_backward(index)
        return _combine(y, index, tokens, layout)

    @staticmethod
    def backward(ctx, dy):
        (index,) = ctx.saved_tensors
        return GatherRows.apply(dy, index), None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Row i of the result is x[index[i]]; zeros where index[i] == -1 (padding). Differentiable in x."""
    return GatherRows.apply(x, index)


def combine_rows(y: torch.Tensor, index: torch.Tensor, tokens: int, layout=None) -> torch.Tensor:
    """Row t of the result (tokens rows) is the sum of the rows i of y with index[i] == t, added in increasing
    i; rows with index -1 are skipped. Deterministic, no atomics. Differentiable in y. `layout`: token_layout(
    index, tokens) when the caller has it (an argsort of M ints saved)."""
    return CombineRows.apply(y, index, int(tokens), layout)


#: Token layouts that whoever made an index already knows (the GPU route of fusion/runtime/route.py writes its
#: layout in the same launches), by index tensor: (index._version, tokens, layout). Weak keys: an entry lives as
#: long as its index; a changed index (another version) or another token count is not matched.
_KNOWN_LAYOUTS = WeakIdKeyDictionary()


def remember_token_layout(index: torch.Tensor, tokens: int, layout: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Record `layout` (what token_layout(index, tokens) returns, made by its producer) for the calls that read
    `index`: they then skip the sort that token_layout runs."""
    _KNOWN_LAYOUTS[index] = (index._version, tokens, layout)


def layout_of(index: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_layout(index, tokens), or the layout its producer recorded for this index (remember_token_layout):
    an index that route() made on the GPU brings its layout along."""
    if not torch.compiler.is_compiling():   # (traced: dynamo cannot read the weak table; it routes by torch ops)
        known = _KNOWN_LAYOUTS.get(index)
        if known is not None and known[0] == index._version and known[1] == tokens:
            return known[2]
    return token_layout(index, tokens)


def call_layout(ctx: RunContext):
    """The token layout of the call's index (layout_of), made once per call: a block's Combine and its Gather's
    backward share it (RunContext.derived)."""
    return ctx.derive("token_layout", lambda: layout_of(ctx.index, ctx.tokens))


class Gather(Op, kind="gather"):
    """First op of an MoE experts block: row i of its output is x[index[i]] (the token of routed row i).

    Reads the extra input `index` (int32/int64, shape (M,), values in [-1, T)); a padding row (index -1) is
    zeros. Every op after it sees M rows; `Combine()` brings them back to the block's T rows.
    """

    @property
    def spec(self) -> OpSpec:
        return OpSpec(name="Gather", kind="gather", extra_inputs=("index",))

    def reference(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        return gather_rows(x, ctx.index)

    def input_grad(self, dy: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        """d x: each token's routed-row gradients summed (a combine), as GatherRows.backward."""
        return combine_rows(dy, ctx.index, ctx.tokens, call_layout(ctx))

    def describe(self) -> str:
        return "Gather()"


class Combine(Op, kind="combine"):
    """Last op of an MoE experts block: row t of its output is the sum of the rows i with index[i] == t.

    Reads the same `index` as the block's Gather; the output has as many rows as the block's input. The sum
    runs in a fixed order (increasing i) with no atomics, so it is bitwise reproducible; padding rows are
    skipped. Its backward is a gather.
    """

    @property
    def spec(self) -> OpSpec:
        return OpSpec(name="Combine", kind="combine", extra_inputs=("index",))

    def reference(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        return combine_rows(x, ctx.index, ctx.tokens, call_layout(ctx))

    def input_grad(self, dy: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        """d y: each routed row gets its token's gradient (a gather), as CombineRows.backward."""
        return gather_rows(dy, ctx.index)

    def describe(self) -> str:
        return "Combine()"
