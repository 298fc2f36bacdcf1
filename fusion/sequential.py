"""Sequential: a chain of ops run as one planned block, with one autograd graph through all of it."""
from __future__ import annotations

from typing import Iterable

import torch

from fusion.errors import DeviceError, DTypeError, ExtraInputError, GroupSizesError, ShapeError
from fusion.grouped import group_offsets
from fusion.ops.base import Op, RunContext

BACKENDS = ("auto", "reference", "fused")
#: Dtypes each device type runs. float64 runs on the CPU reference path only (gradcheck, references).
SUPPORTED_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16, torch.float64),
    "cuda": (torch.bfloat16, torch.float16, torch.float32),
}


def _fixed_in_features(op: Op) -> int | None:
    """The input features an op pins (GEMMs, biases), or None when it takes any width."""
    for attr in ("in_features", "features"):
        if attr in op.spec.attrs and op.spec.attrs[attr] is not None:
            return int(op.spec.attrs[attr])
    return None


def feature_chain(ops: list[Op], in_features: int | None = None) -> list[int | None]:
    """Features entering each op and leaving the last: [in_0, in_1, ..., out]; raises ShapeError naming
    both ops and both shapes at the first mismatch."""
    feats = [in_features]
    feat = in_features
    for i, op in enumerate(ops):
        if feat is None:
            feat = _fixed_in_features(op)
            feats[-1] = feat
        if feat is not None:
            try:
                op.check_input(feat)
            except ShapeError as err:
                if i == 0:
                    raise ShapeError(f"input x has shape (M, {feat}) but op 0 {err}") from None
                raise ShapeError(f"shape mismatch: op {i - 1} {ops[i - 1].describe()} outputs (M, {feat}), "
                                 f"but op {i} {err}") from None
            feat = op.output_features(feat)
        feats.append(feat)
    return feats


def _check_group_sizes(ops: list[Op], group_sizes, x: torch.Tensor, check_sum: bool) -> None:
    num_groups = {op.spec.attrs["num_groups"] for op in ops if "group_sizes" in op.spec.extra_inputs}
    if not isinstance(group_sizes, torch.Tensor):
        raise GroupSizesError(f"group_sizes must be an int tensor of shape ({min(num_groups)},) on x's device, "
                              f"got {type(group_sizes).__name__}")
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise GroupSizesError(f"group_sizes must have dtype int32 or int64, got {group_sizes.dtype}; "
                              f"pass counts.to(torch.int32)")
    if group_sizes.dim() != 1 or group_sizes.numel() not in num_groups:
        raise GroupSizesError(f"group_sizes must have shape ({min(num_groups)},) (one count per group), got "
                              f"{tuple(group_sizes.shape)}")
    if group_sizes.device != x.device:
        raise GroupSizesError(f"group_sizes is on {group_sizes.device} but x is on {x.device}; keep the counts "
                              f"on x's device (no host copy is needed): group_sizes.to(x.device)")
    rows = x.shape[0]
    if x.device.type == "cpu" or check_sum:
        # On the CPU (and on the reference backend) this reads the sizes on the host, which is free or
        # expected there. The fused GPU path checks asynchronously instead (no host sync).
        total = int(group_sizes.sum())
        if total != rows:
            raise GroupSizesError(f"group_sizes sums to {total} but x has {rows} rows; every row must "
                                  f"belong to exactly one group")
        if bool((group_sizes < 0).any()):
            raise GroupSizesError("group_sizes has negative counts")
    else:
        torch._assert_async(group_sizes.sum() == rows, "fusion: group_sizes does not sum to x.shape[0]")


def make_context(ops: list[Op], x: torch.Tensor, extra: dict, check_sum: bool = True) -> RunContext:
    """Validate the keyword inputs of one call against what the ops read; build the shared RunContext."""
    readers: dict[str, list[str]] = {}
    for i, op in enumerate(ops):
        for name in op.spec.extra_inputs:
            readers.setdefault(name, []).append(f"op {i} {op.describe()}")
    missing = [n for n in readers if n not in extra or extra[n] is None]
    if missing:
        n = missing[0]
        raise ExtraInputError(f"missing keyword input {n!r}, read by {readers[n][0]}; call it as "
                              f"mlp(x, {n}=...)")
    unexpected = sorted(set(extra) - set(readers))
    if unexpected:
        wanted = ", ".join(readers) or "none"
        raise ExtraInputError(f"unexpected keyword input(s) {unexpected}: no op reads them (inputs read by "
                              f"this block: {wanted})")
    ctx = RunContext()
    if "group_sizes" in readers:
        _check_group_sizes(ops, extra["group_sizes"], x, check_sum)
        ctx.group_sizes = extra["group_sizes"]
        ctx.offsets = group_offsets(ctx.group_sizes)
    for name, value in extra.items():
        if name == "group_sizes":
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ExtraInputError(f"keyword input {name!r} must be a floating-point tensor of shape "
                                  f"({x.shape[0]},), got {type(value).__name__}")
        if value.shape != (x.shape[0],):
            raise ExtraInputError(f"keyword input {name!r} must have shape ({x.shape[0]},) (one value per row "
                                  f"of x), got {tuple(value.shape)}")
        if value.device != x.device:
            raise DeviceError(f"keyword input {name!r} is on {value.device} but x is on {x.device}")
        ctx.extra[name] = value
    return ctx


class Sequential(torch.nn.Module):
    """A block of ops run in order; matched patterns run fused, every other op runs its reference.

    backend: "auto" (fused where a pattern matches on this device, reference elsewhere), "reference"
    (every op unfused), "fused" (raise FallbackError, with the reasons, if any op would fall back).
    """

    def __init__(self, *ops: Op, backend: str = "auto"):
        super().__init__()
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        if not ops:
            raise ValueError("Sequential needs at least one op")
        for i, op in enumerate(ops):
            if not isinstance(op, Op):
                raise TypeError(f"Sequential: argument {i} is {type(op).__name__}, not a fusion op; use the ops "
                                f"of fusion (GroupLinear, SwiGLU, Scale, ...)")
            self.add_module(str(i), op)
        if backend not in BACKENDS:
            raise ValueError(f"Sequential: backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        groups = {op.spec.attrs["num_groups"] for op in ops if "group_sizes" in op.spec.extra_inputs}
        if len(groups) > 1:
            raise ShapeError(f"all grouped ops of one Sequential share group_sizes, but they declare different "
                             f"group counts {sorted(groups)}")
        self.features = feature_chain(list(ops))

    # -- container protocol -------------------------------------------------------------------------
    @property
    def ops(self) -> list[Op]:
        return list(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> Op:
        return self.ops[i]

    def __iter__(self) -> Iterable[Op]:
        return iter(self.ops)

    # -- running --------------------------------------------------------------------------------------
    def _check_tensors(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Sequential: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ShapeError(f"Sequential: x must be 2-D (rows, features), got shape {tuple(x.shape)}; "
                             f"flatten leading dims with x.reshape(-1, x.shape[-1])")
        for name, p in self.named_parameters():
            if p.device != x.device:
                raise DeviceError(f"Sequential: x is on {x.device} but parameter {name!r} is on {p.device}; "
                                  f"move the block with mlp.to({str(x.device)!r})")
        allowed = SUPPORTED_DTYPES.get(x.device.type, SUPPORTED_DTYPES["cuda"])
        if x.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise DTypeError(f"Sequential: x has dtype {x.dtype}; on {x.device.type} the supported dtypes are "
                             f"{names}")
        for name, p in self.named_parameters():
            if p.dtype != x.dtype:
                raise DTypeError(f"Sequential: x has dtype {x.dtype} but parameter {name!r} has {p.dtype}; "
                                 f"convert the block with mlp.to({x.dtype}) (or x.to({p.dtype}))")

    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        from fusion.runtime import execute

        self._check_tensors(x)
        feature_chain(self.ops, x.shape[-1])
        return execute(self, x, extra)

    # -- planning -------------------------------------------------------------------------------------
    def plan(self, dtype: torch.dtype = torch.bfloat16, target: str = "sm_90"):
        """The fusion plan for this block at `dtype` on `target` (computable on any machine)."""
        from fusion.planner import plan_for

        return plan_for(self, dtype=dtype, target=target)

    def explain(self, format: str = "text", dtype: torch.dtype | None = None, target: str | None = None) -> str:
        """What the plan launches, forward and backward, and why anything was left unfused."""
        from fusion.explain import explain

        return explain(self, format=format, dtype=dtype, target=target)

    def compile(self, dtype: torch.dtype = torch.bfloat16, target: str = "sm_90a"):
        """Compile every fused kernel of the plan ahead of time (no GPU needed); returns the kernels."""
        from fusion.runtime.compile import compile_plan

        return compile_plan(self, dtype=dtype, target=target)
