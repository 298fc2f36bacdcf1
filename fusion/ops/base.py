"""The op protocol: what every op tells the planner, as data, and how it runs unfused.

The planner never inspects op classes; it reads `OpSpec`s. That keeps patterns (data in .fpat files)
matchable against ops without Python if-chains, and lets user-declared activations look exactly like
built-in ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from fusion.errors import ShapeError
from fusion.inputs import make_context
from fusion.op_table import OP_KINDS, OP_TABLE
from fusion.run_context import RunContext


@dataclass(frozen=True)
class OpSpec:
    """Everything the planner may know about an op, as plain data.

    name: the op's public class name ("GroupLinear", "SwiGLU", "Activation"...).
    kind: one of OP_KINDS.
    attrs: constraint-able attributes (ints, floats, bools, strings), e.g. in_features, gated, columnwise.
    extra_inputs: keyword inputs of Sequential.__call__ the op reads ("group_sizes", "scale"...).
    """

    name: str
    kind: str
    attrs: Mapping[str, Any] = field(default_factory=dict)
    extra_inputs: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in OP_KINDS:
            raise ValueError(f"OpSpec {self.name}: kind {self.kind!r} is not one of {OP_KINDS}")

    @property
    def gated(self) -> bool:
        return bool(self.attrs.get("gated", False))

    @property
    def grad_reads_input(self) -> bool:
        """Whether the op's gradient needs the value entering it, so the forward must keep it (or the backward
        recompute it): a GEMM (its wgrad), an activation, a clamp, a per-row scale. The planner's dataflow and
        the matcher's check of a pattern's `save` both ask this."""
        if self.kind in ("gemm", "activation") or self.name == "Clamp":
            return True
        return self.name == "Scale" and bool(self.attrs.get("per_row"))

    def signature(self) -> tuple:
        """Hashable identity used for plan caching."""
        return (self.name, self.kind, tuple(sorted(self.attrs.items())), self.extra_inputs)


class Op(torch.nn.Module):
    """Base of every op. Subclasses set `spec` (property) and implement `reference` and `out_features`, and
    declare their kind in the class statement (`class MyOp(Op, kind="elementwise")`, see fusion/op_table.py)."""

    #: the kind this class declared (or inherited), OpSpec.kind of its instances
    op_kind: str | None = None

    def __init_subclass__(cls, kind: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if kind is not None:
            if kind not in OP_KINDS:
                raise ValueError(f"op class {cls.__name__}: kind {kind!r} is not one of {OP_KINDS}")
            cls.op_kind = kind
        if cls.op_kind is not None and not cls.__name__.startswith("_"):
            OP_TABLE[cls.__name__] = cls.op_kind

    @property
    def spec(self) -> OpSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def op_name(self) -> str:
        return self.spec.name

    def output_features(self, in_features: int) -> int:
        """The shape rule: features of the output given features of the input (rows never change)."""
        return in_features

    def check_input(self, in_features: int) -> None:
        """Raise ShapeError, naming this op, if it cannot take `in_features`. Default: anything goes."""

    def reference(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    #: Ops whose input gradient is a function of the output gradient alone (no parameters, no value, no
    #: gradient for their extra inputs) define `input_grad(dy, ctx)`; the fused runtime's backward calls it
    #: instead of rerunning the op's reference under autograd (a Gather's backward would gather again first).
    input_grad = None

    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        """Run this op alone on the reference path (handy in tests)."""
        ctx = make_context([self], x, extra)
        return self.reference(x, ctx)

    def describe(self) -> str:
        """Short text for explain(): `Name(attr=value, ...)`."""
        shown = ", ".join(f"{k}={v}" for k, v in self.spec.attrs.items() if k not in ("gated",))
        return f"{self.spec.name}({shown})"

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.spec.attrs.items())


def shape_error(op: Op, message: str) -> ShapeError:
    return ShapeError(f"{op.describe()}: {message}")
