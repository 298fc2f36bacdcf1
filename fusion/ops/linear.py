"""GroupLinear and Linear: per-group (per-expert) GEMMs, the ops fused kernels are built around."""
from __future__ import annotations

import math

import torch

from fusion.errors import OpArgumentError
from fusion.grouped import grouped_matmul, row_group_index
from fusion.ops import args
from fusion.ops.args import flag, positive_int
from fusion.ops.base import Op, OpSpec, RunContext, shape_error

#: weight_format values: "bf16" (None is the same) uses the parameter as is, whatever its dtype; "fp8_block"
#: quantizes it in 128x128 FP8 blocks (cached per parameter version) and runs the FP8-block recipe
#: (docs/quantization.md).
WEIGHT_FORMATS = ("bf16", "fp8_block")


class WeightFormatError(OpArgumentError):
    """A (Group)Linear was given a weight_format it does not know."""


def check_weight_format(op_name: str, value) -> str:
    fmt = "bf16" if value is None else value
    if not isinstance(fmt, str) or fmt not in WEIGHT_FORMATS:
        raise WeightFormatError(f"{op_name}: weight_format must be one of {WEIGHT_FORMATS} (or None, the same as "
                                f"'bf16': the parameter as is), got {value!r}; 'fp8_block' quantizes the weight "
                                f"in 128x128 FP8 blocks")
    return fmt


def as_high_precision(x: torch.Tensor) -> torch.Tensor:
    """A quantized input (QuantizedTensor) is consumed as its exact dequantized value on the reference path;
    the gradient passes straight through to the quantize op."""
    from fusion.quant import dequantize

    return dequantize(x)


class GroupLinear(Op, kind="gemm"):
    """Rows of x are split into consecutive groups by `group_sizes`; group g computes x_g @ W[g].T (+ b[g]).

    weight: (num_groups, out_features, in_features), bias: (num_groups, out_features): the canonical layout
    that state_dict() holds, whatever a fused kernel repacks internally.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = False,
                 device=None, dtype=None, weight_format=None):
        super().__init__()
        op = type(self).__name__
        num_groups = positive_int(op, "num_groups", num_groups, "the number of groups, e.g. experts")
        in_features = positive_int(op, "in_features", in_features)
        out_features = positive_int(op, "out_features", out_features)
        bias = flag(op, "bias", bias)
        factory = args.factory(op, device, dtype)
        self.weight_format = check_weight_format(op, weight_format)
        self._fp8_weight = None
        if self.weight_format == "fp8_block":
            from fusion.quant.fp8_weight import FP8BlockWeightCache

            # a plain attribute, not a buffer: never in state_dict(), re-quantized when the weight changes
            self._fp8_weight = FP8BlockWeightCache()
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        self.bias = (torch.nn.Parameter(torch.empty(num_groups, out_features, **factory)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Like nn.Linear, independently per group: kaiming-uniform(a=sqrt(5)) weight, uniform bias."""
        for g in range(self.num_groups):
            torch.nn.init.kaiming_uniform_(self.weight[g], a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    @property
    def spec(self) -> OpSpec:
        return OpSpec(
            name="GroupLinear",
            kind="gemm",
            attrs={"num_groups": self.num_groups, "in_features": self.in_features,
                   "out_features": self.out_features, "bias": self.bias is not None,
                   "weight_format": self.weight_format},
            extra_inputs=("group_sizes",),
        )

    def describe(self) -> str:
        """Like Op.describe, with weight_format shown only when it is not the default."""
        attrs = {k: v for k, v in self.spec.attrs.items() if not (k == "weight_format" and v == "bf16")}
        return f"{self.spec.name}(" + ", ".join(f"{k}={v}" for k, v in attrs.items()) + ")"

    def quantized_weight(self):
        """The weight's FP8-block buffers (fusion.quant.FP8BlockWeight), from the cache; None for "bf16". The
        parameter is read from `_parameters` (a replayed FP8 call asks for each weight's blocks, and nn.Module's
        attribute lookup was a third of this call's host time)."""
        cache = self._fp8_weight
        if cache is None:
            return None
        weight = self._parameters.get("weight")
        return cache.get(self.weight if weight is None else weight)

    def check_input(self, in_features: int) -> None:
        if in_features != self.in_features:
            raise shape_error(self, f"expects {self.in_features} input features, got {in_features}")


    def output_features(self, in_features: int) -> int:  # noqa: D102 - shape rule
        self.check_input(in_features)
        return self.out_features

    def reference(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        if self.weight_format == "fp8_block":
            from fusion.quant.fp8_linear import fp8_block_linear

            y = fp8_block_linear(x, self.weight, ctx.group_sizes, self.quantized_weight())
            if self.bias is not None:
                y = y + self.bias[row_group_index(ctx.group_sizes, y.shape[0])]
            return y
        x = as_high_precision(x)
        y = grouped_matmul(x, self.weight, ctx.group_sizes, ctx.offsets)
        if self.bias is not None:
            y = y + self.bias[row_group_index(ctx.group_sizes, x.shape[0])]
        return y


class Linear(GroupLinear):
    """The dense case: one group. Weight is (out_features, in_features) like nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None,
                 weight_format=None):
        super().__init__(1, in_features, out_features, bias=bias, device=device, dtype=dtype,
                         weight_format=weight_format)
        # Canonical dense layout: drop the group dimension from the parameters users see.
        self.weight = torch.nn.Parameter(self.weight.data[0])
        if self.bias is not None:
            self.bias = torch.nn.Parameter(self.bias.data[0])

    @property
    def spec(self) -> OpSpec:
        return OpSpec(
            name="Linear",
            kind="gemm",
            attrs={"num_groups": 1, "in_features": self.in_features,
                   "out_features": self.out_features, "bias": self.bias is not None,
                   "weight_format": self.weight_format},
        )

    def reference(self, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        if self.weight_format == "fp8_block":
            from fusion.quant.fp8_linear import fp8_block_linear

            y = fp8_block_linear(x, self.weight, None, self.quantized_weight())
            return y if self.bias is None else y + self.bias
        x = as_high_precision(x)
        return torch.nn.functional.linear(x, self.weight, self.bias)
