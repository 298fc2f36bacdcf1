"""The inputs of one block call: x and the keyword inputs its ops read, validated, as a RunContext.

`BlockInputs(ops)` works out once per block what the ops read (and errors in that: colliding names, a
misplaced Gather/Combine); `context(x, extra)` then checks one call's tensors. The checks read no data on a
GPU (values are checked with asynchronous device asserts there, so a call can be captured in a CUDA graph);
on the CPU, and with backend="reference", they read sizes and indices on the host, where that is free or
expected.

Keyword inputs: `group_sizes` (int, (G,), read by grouped ops), `index` (int, (M,), read by Gather/Combine)
and float per-row inputs named by the ops (Scale's `scale`): (rows,) in x's dtype, on x's device. After a
Gather the grouped ops see M = index.numel() routed rows, so per-row inputs and group_sizes count those.
"""
from __future__ import annotations

import torch

from fusion.errors import DeviceError, DTypeError, ExtraInputError, GroupSizesError, ShapeError
from fusion.grouped import group_offsets
from fusion.run_context import INT_INPUTS, RESERVED_INPUTS, RunContext


def _moe_structure(ops) -> bool:
    """Whether the block starts with a Gather; raises ShapeError if Gather or Combine is misplaced."""
    kinds = [op.spec.kind for op in ops]
    for i, kind in enumerate(kinds):
        if kind == "gather" and i != 0:
            raise ShapeError(f"op {i} {ops[i].describe()} must be the first op of its block (it maps the T "
                             f"token rows to the routed rows); move it to the front")
        if kind == "combine" and i != len(ops) - 1:
            raise ShapeError(f"op {i} {ops[i].describe()} must be the last op of its block (it sums the routed "
                             f"rows back into tokens); move it to the end")
    if "combine" in kinds and kinds[0] != "gather":
        raise ShapeError("Combine() needs a Gather() as the block's first op: Combine returns as many rows as "
                         "the block's input, which a Gather maps to routed rows; start the block with Gather()")
    return bool(kinds) and kinds[0] == "gather"


class BlockInputs:
    """What the ops of a block read, worked out once; `context` validates one call."""

    def __init__(self, ops):
        self.ops = list(ops)
        self.gathers = _moe_structure(self.ops)
        self.readers: dict[str, str] = {}
        for i, op in enumerate(self.ops):
            for name in op.spec.extra_inputs:
                self.readers.setdefault(name, f"op {i} {op.describe()}")
        for name, reader in self.readers.items():
            if name in RESERVED_INPUTS and (name not in INT_INPUTS or reader_kind(self.ops, name) == "float"):
                use = {"x": "the data input", "self": "the module itself"}.get(name, "its " + name)
                raise ExtraInputError(f"{reader} reads a keyword input named {name!r}, which the block call "
                                      f"already uses for {use}; "
                                      f"give it another name, e.g. Scale(name='probs')")
        self.names = frozenset(self.readers)
        self.floats = tuple(n for n in self.readers if n not in INT_INPUTS)
        self.num_groups = sorted({op.spec.attrs["num_groups"] for op in self.ops
                                  if "group_sizes" in op.spec.extra_inputs})

    def context(self, x: torch.Tensor, extra: dict, check_sum: bool = True, host: bool | None = None,
                device_checked: bool = False) -> RunContext:
        """`host`: read values on the host for the checks (default: on the CPU or when `check_sum`); False under
        torch.compile, where checks are asynchronous device asserts (nothing data-dependent is traced).
        `device_checked`: the caller's program validates the group sizes' values and computes their offsets on
        the device in one launch (fusion/runtime/bounds.py); only their dtype, shape and device are checked here,
        and ctx.offsets is left to the program. After a Gather the program's routed prologue also checks the
        index values and the padding rows, and absorbs the padding into the last group (ctx.group_sizes stays
        the caller's sizes until it runs)."""
        if extra.keys() != self.names or any(v is None for v in extra.values()):
            self._name_error(extra)
        if host is None:
            host = x.device.type == "cpu" or check_sum
        ctx = RunContext()
        rows = x.shape[0]
        if self.gathers:
            if isinstance(extra["index"], torch.Tensor) and extra["index"].numel() == 0:
                device_checked = False  # no routed rows: nothing for the routed prologue to launch on
            ctx.index = _check_index(extra["index"], x, host, values=not device_checked)
            ctx.tokens, rows = x.shape[0], ctx.index.numel()
        if "group_sizes" in self.names:
            sizes = _check_group_sizes(self.num_groups, extra["group_sizes"], x, host, rows, ctx.index,
                                       device_checked)
            ctx.group_sizes = ctx.routed_group_sizes = sizes
            if self.gathers and not device_checked:
                ctx.group_sizes = _absorb_padding(sizes, rows)
            if not device_checked:
                ctx.offsets = group_offsets(ctx.group_sizes)
        for name in self.floats:
            ctx.extra[name] = _check_float(name, extra[name], x, rows, self.gathers)
        return ctx

    def routed_context(self, x: torch.Tensor, index: torch.Tensor, sizes: torch.Tensor, probs_name: str,
                       probs: torch.Tensor) -> RunContext | None:
        """context(x, {"index": index, "group_sizes": sizes, probs_name: probs}, device_checked=True) for routing
        tensors that route's kernels have just made for x (the merged MoE node: fusion/runtime/moe_node.py): an
        int64 index (M,), int32 sizes (E,) and probs (M,) in the logits' dtype, all on x's device, valid by
        construction. Only what the caller's modules chose is checked here (the probs' dtype against x's, the
        experts' group count, the block's input names); None where one differs, so that context() runs and raises
        its error. The index values and the sizes are checked on the device by the program's routed prologue, as
        for any device-checked call. (context() costs 20-25 µs of host a call on the GPU machines' CPUs.)"""
        if (probs.dtype != x.dtype or sizes.shape[0] not in self.num_groups or self.floats != (probs_name,)
                or len(self.names) != 3 or not self.gathers):
            return None
        return RunContext(group_sizes=sizes, routed_group_sizes=sizes, extra={probs_name: probs}, index=index,
                          tokens=x.shape[0])

    def _name_error(self, extra: dict):
        missing = [n for n in self.readers if extra.get(n) is None]
        if missing:
            n = missing[0]
            raise ExtraInputError(f"missing keyword input {n!r}, read by {self.readers[n]}; call it as "
                                  f"mlp(x, {n}=...)")
        unexpected = sorted(set(extra) - self.names)
        wanted = ", ".join(self.readers) or "none"
        raise ExtraInputError(f"unexpected keyword input(s) {unexpected}: no op reads them (inputs read by "
                              f"this block: {wanted})")


def reader_kind(ops, name: str) -> str:
    """"float" when some op reads `name` as a per-row float input (a Scale), else "int"."""
    for op in ops:
        if name in op.spec.extra_inputs and op.spec.name == "Scale":
            return "float"
    return "int"


def make_context(ops, x: torch.Tensor, extra: dict, check_sum: bool = True) -> RunContext:
    """Validate one call of `ops` (see BlockInputs); for callers without a cached BlockInputs."""
    return BlockInputs(ops).context(x, extra, check_sum)


def _check_float(name: str, value, x: torch.Tensor, rows: int, gathers: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise ExtraInputError(f"keyword input {name!r} must be a floating-point tensor of shape ({rows},), got "
                              f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else ' ' + str(value.dtype)}")
    if value.shape != (rows,):
        what = "routed row (index.numel())" if gathers else "row of x"
        raise ExtraInputError(f"keyword input {name!r} must have shape ({rows},) (one value per {what}), got "
                              f"{tuple(value.shape)}")
    if value.device != x.device:
        raise DeviceError(f"keyword input {name!r} is on {value.device} but x is on {x.device}; move it with "
                          f"{name}.to(x.device)")
    if value.dtype != x.dtype:
        raise DTypeError(f"keyword input {name!r} has dtype {value.dtype} but x has {x.dtype}; per-row inputs are "
                         f"read in the block's dtype (no hidden conversion or promotion): pass "
                         f"{name}.to({x.dtype})")
    return value


def _check_group_sizes(num_groups: list, group_sizes, x: torch.Tensor, host: bool, rows: int,
                       index: torch.Tensor | None, device_checked: bool = False) -> torch.Tensor:
    """`rows`: the rows the grouped ops see (x's, or M = index.numel() after a Gather). With `index` (a Gather
    first) the sizes may sum to less than M, and every row past the sum must be padding (index -1).
    `device_checked`: the values are checked by the caller's device prologue; only the metadata here."""
    want = num_groups[0]
    if not isinstance(group_sizes, torch.Tensor):
        raise GroupSizesError(f"group_sizes must be an int tensor of shape ({want},) on x's device, got "
                              f"{type(group_sizes).__name__}")
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise GroupSizesError(f"group_sizes must have dtype int32 or int64, got {group_sizes.dtype}; pass "
                              f"counts.to(torch.int32)")
    if group_sizes.dim() != 1 or group_sizes.numel() not in num_groups:
        raise GroupSizesError(f"group_sizes must have shape ({want},) (one count per group), got "
                              f"{tuple(group_sizes.shape)}")
    if group_sizes.device != x.device:
        raise GroupSizesError(f"group_sizes is on {group_sizes.device} but x is on {x.device}; keep the counts on "
                              f"x's device (no host copy is needed): group_sizes.to(x.device)")
    if device_checked:
        return group_sizes
    if index is not None:
        _check_padding_rows(group_sizes, index, rows, host)
        return group_sizes
    if host:
        # Each size in [0, rows] first: then the int64 sum cannot overflow, and a sum equal to rows is real.
        if bool((group_sizes < 0).any()):
            raise GroupSizesError(f"group_sizes has negative counts: {group_sizes.tolist()[:16]}")
        if bool((group_sizes > rows).any()):
            raise GroupSizesError(f"group_sizes has a count larger than x's {rows} rows; the counts must sum to "
                                  f"x.shape[0]")
        total = int(group_sizes.sum())
        if total != rows:
            raise GroupSizesError(f"group_sizes sums to {total} but x has {rows} rows; every row must belong to "
                                  f"exactly one group")
    else:
        # numel() >= 1 (num_groups > 0). Each size in [0, rows] as well as the sum: int64 sums wrap, so sizes
        # of 2**62 could sum to `rows`.
        ok = (group_sizes.sum() == rows) & (group_sizes.min() >= 0) & (group_sizes.max() <= rows)
        torch._assert_async(ok, "fusion: group_sizes must be in [0, x.shape[0]] and sum to x.shape[0]")
    return group_sizes


def _check_padding_rows(group_sizes: torch.Tensor, index: torch.Tensor, rows: int, host: bool) -> None:
    """After a Gather: sizes >= 0 summing to at most M = rows, and rows past the sum are padding (index -1)."""
    if host:
        if bool((group_sizes < 0).any()):
            raise GroupSizesError("group_sizes has negative counts")
        if bool((group_sizes > rows).any()):
            raise GroupSizesError(f"group_sizes has a count larger than the {rows} routed rows")
    total = group_sizes.sum()
    past_sum = torch.arange(rows, device=index.device) >= total
    stray = (past_sum & (index >= 0)).any()
    if not host:
        ok = (total <= rows) & ~stray & ((group_sizes >= 0) & (group_sizes <= rows)).all()  # no int64 wrap
        torch._assert_async(ok, "fusion: group_sizes must be in [0, index.numel()] and sum to at most "
                                "index.numel(), and rows past the sum must have index -1")
        return
    if int(total) > rows:
        raise GroupSizesError(f"group_sizes sums to {int(total)} but index has {rows} routed rows; the sizes "
                              f"must count the routed rows (r.group_sizes from fusion.moe.route)")
    if bool(stray):
        raise GroupSizesError(f"group_sizes sums to {int(total)} (< {rows} routed rows) but a row past that sum "
                              f"has an index other than -1; rows past the sum belong to no group and must be "
                              f"padding (index -1)")


def _check_index(index, x: torch.Tensor, host: bool, values: bool = True) -> torch.Tensor:
    """The extra input `index` of Gather/Combine: int32/int64 (M,) on x's device, values in [-1, T) (`values`
    False: left to the routed prologue, which checks them on the device)."""
    tokens = x.shape[0]
    if not isinstance(index, torch.Tensor):
        raise ExtraInputError(f"index must be an int tensor of shape (M,) on x's device (the token of each "
                              f"routed row, r.index from fusion.moe.route), got {type(index).__name__}")
    if index.dtype not in (torch.int32, torch.int64):
        raise ExtraInputError(f"index must have dtype int32 or int64, got {index.dtype}; pass index.long()")
    if index.dim() != 1:
        raise ExtraInputError(f"index must be 1-D (one token per routed row), got shape {tuple(index.shape)}; "
                              f"flatten it with index.reshape(-1)")
    if index.device != x.device:
        raise DeviceError(f"index is on {index.device} but x is on {x.device}; keep it on x's device: "
                          f"index.to(x.device)")
    if index.numel() == 0 or not values:
        return index
    if not host:
        torch._assert_async(((index >= -1) & (index < tokens)).all(), "fusion: index out of range [-1, x.shape[0])")
    elif bool(((index < -1) | (index >= tokens)).any()):
        lo, hi = int(index.min()), int(index.max())
        raise ExtraInputError(f"index has values in [{lo}, {hi}] but must lie in [-1, {tokens}): x has {tokens} "
                              f"token rows, and -1 marks a padding row")
    return index


def _absorb_padding(group_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """Sizes summing to exactly `rows`: the padding rows past sum(group_sizes) join the last group (on the
    device, no sync). They are zeros from the Gather, and Combine skips them, so they change no result; they
    only cost compute."""
    padding = rows - group_sizes.sum()
    last = torch.zeros_like(group_sizes)
    last.narrow(0, last.numel() - 1, 1).fill_(1)  # fill_ with a Python number: no host-to-device copy
    return group_sizes + last * padding
