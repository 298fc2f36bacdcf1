"""Elementwise ops that fused epilogues absorb: Clamp, Scale, Bias."""
from __future__ import annotations

import math

import torch

from fusion.errors import OpArgumentError
from fusion.grouped import row_group_index
from fusion.ops.args import factory, finite_number, input_name, positive_int
from fusion.ops.base import Op, OpSpec, RunContext, shape_error


class Clamp(Op, kind="elementwise"):
    """Elementwise clamp to [min, max]; either bound may be None."""

    def __init__(self, min: float | None = None, max: float | None = None):
        super().__init__()
        min = finite_number("Clamp", "min", min, allow_none=True)
        max = finite_number("Clamp", "max", max, allow_none=True)
        if min is None and max is None:
            raise OpArgumentError("Clamp: give min, max or both (Clamp() with neither does nothing)")
        if min is not None and max is not None and min > max:
            raise OpArgumentError(f"Clamp: min {min} is greater than max {max}; swap them")
        self.min, self.max = min, max

    @property
    def spec(self) -> OpSpec:
        return OpSpec(name="Clamp", kind="elementwise", attrs={"min": self.min, "max": self.max})

    def reference(self, x, ctx=None):
        return torch.clamp(x, self.min, self.max)


class Scale(Op, kind="elementwise"):
    """Multiply by a constant (`value`), or each row by the extra input `name` of shape (M,) (router probs)."""

    def __init__(self, value: float | None = None, name: str = "scale"):
        super().__init__()
        self.value = finite_number("Scale", "value", value, allow_none=True)
        self.name = input_name("Scale", "name", name)

    @property
    def per_row(self) -> bool:
        return self.value is None

    @property
    def spec(self) -> OpSpec:
        return OpSpec(name="Scale", kind="elementwise",
                      attrs={"value": self.value, "name": self.name if self.per_row else None,
                             "per_row": self.per_row},
                      extra_inputs=(self.name,) if self.per_row else ())

    def describe(self) -> str:
        return f"Scale(value={self.value})" if not self.per_row else f"Scale(name={self.name!r})"

    def reference(self, x, ctx: RunContext):
        if not self.per_row:
            return x * self.value
        return x * ctx.extra[self.name].unsqueeze(-1)


class Bias(Op, kind="elementwise"):
    """Add a bias of `features`, one per group when `num_groups` is given (rows grouped by group_sizes)."""

    def __init__(self, features: int, num_groups: int | None = None, device=None, dtype=None):
        super().__init__()
        features = positive_int("Bias", "features", features)
        if num_groups is not None:
            num_groups = positive_int("Bias", "num_groups", num_groups, "one bias per group; None for one bias")
        self.features, self.num_groups = features, num_groups
        shape = (features,) if num_groups is None else (num_groups, features)
        self.bias = torch.nn.Parameter(torch.empty(shape, **factory("Bias", device, dtype)))
        bound = 1 / math.sqrt(features)
        torch.nn.init.uniform_(self.bias, -bound, bound)

    @property
    def spec(self) -> OpSpec:
        return OpSpec(name="Bias", kind="elementwise",
                      attrs={"features": self.features, "num_groups": self.num_groups,
                             "per_group": self.num_groups is not None},
                      extra_inputs=("group_sizes",) if self.num_groups is not None else ())

    def check_input(self, in_features: int) -> None:
        if in_features != self.features:
            raise shape_error(self, f"has {self.features} features but its input has {in_features}")

    def reference(self, x, ctx: RunContext):
        if self.num_groups is None:
            return x + self.bias
        return x + self.bias[row_group_index(ctx.group_sizes, x.shape[0])]
