"""Activations: the built-in SwiGLU, GeGLU, SReLU, and Activation(name) for any activation declared in a
.fpat file.

Every activation op is `kind="activation"` with attrs `activation` (the registry name, which codegen uses
to find the expression to compile) and `gated`. Built-ins compute their reference with direct torch
formulas; the registry's declarations of the same names are tested equal to them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fusion.errors import OpArgumentError
from fusion.ops.args import finite_number
from fusion.ops.base import Op, OpSpec, shape_error
from fusion.patterns.registry import get_activation


class _ActivationOp(Op, kind="activation"):
    activation_name: str = ""
    gated: bool = False

    @property
    def params(self) -> dict:
        return {}

    @property
    def spec(self) -> OpSpec:
        return OpSpec(name=type(self).__name__, kind="activation",
                      attrs={"activation": self.activation_name, "gated": self.gated, **self.params})

    def check_input(self, in_features: int) -> None:
        if self.gated and in_features % 2:
            raise shape_error(self, f"is gated: it splits its input into two halves (gate, up), so it needs an "
                                    f"even feature count, got {in_features}; make the previous op's "
                                    f"out_features even (2 * intermediate size)")

    def output_features(self, in_features: int) -> int:
        self.check_input(in_features)
        return in_features // 2 if self.gated else in_features

    def describe(self) -> str:
        return f"{type(self).__name__}()"


class SwiGLU(_ActivationOp):
    """a, b = x.chunk(2, -1); silu(a) * b (the first half of the features is the gate)."""

    activation_name, gated = "swiglu", True

    def reference(self, x, ctx=None):
        a, b = x.chunk(2, -1)
        return F.silu(a) * b


class GeGLU(_ActivationOp):
    """a, b = x.chunk(2, -1); gelu_tanh(a) * b."""

    activation_name, gated = "geglu", True

    def reference(self, x, ctx=None):
        a, b = x.chunk(2, -1)
        return F.gelu(a, approximate="tanh") * b


class SReLU(_ActivationOp):
    """relu(x) ** 2 (squared ReLU)."""

    activation_name, gated = "srelu", False

    def reference(self, x, ctx=None):
        return torch.square(F.relu(x))


class Activation(_ActivationOp):
    """An activation declared in a pattern file, by name, with its parameters (defaults from the file)."""

    def __init__(self, name: str, **params: float):
        super().__init__()
        if not isinstance(name, str):
            raise OpArgumentError(f"Activation: name must be the name (a str) of an activation declared in a "
                                  f".fpat file, got {type(name).__name__} {name!r}; e.g. Activation('silu'), or "
                                  f"SwiGLU() for the built-in gated one")
        self.definition = get_activation(name)  # raises UnknownActivationError, listing known names, if unknown
        unknown = set(params) - set(self.definition.param_defaults())
        if unknown:
            known = ", ".join(sorted(self.definition.param_defaults())) or "none"
            raise OpArgumentError(f"Activation({name!r}): unknown parameter(s) {sorted(unknown)}; "
                                  f"its parameters are: {known}")
        values = {k: finite_number(f"Activation({name!r})", k, v) for k, v in params.items()}
        self.activation_name = name
        self.gated = self.definition.gated
        self._params = {**self.definition.param_defaults(), **values}

    @property
    def params(self) -> dict:
        return dict(self._params)

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self._params.items())
        return f"Activation({self.activation_name!r}{', ' + shown if shown else ''})"

    def reference(self, x, ctx=None):
        return self.definition.reference(x, **self._params)
