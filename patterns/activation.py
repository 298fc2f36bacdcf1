"""ActivationDef: a declared activation, its expressions, and its torch reference (forward and backward).

    d = get_activation("clamped_swiglu")
    d.name, d.args, d.params, d.gated, d.loc
    d.forward_expr                      # fusion.symbolic expression, lets inlined (shared nodes)
    d.lets                              # ((name, expr), ...) as declared, for display
    d.grad_exprs                        # {arg: d(forward)/d(arg) * dy}, given (`grad(arg) = ...`) or derived
    d.grad_given                        # {arg: True if the file gave it}
    d.forward(gate, up, limit=10.0)     # evaluate() of forward_expr
    d.backward(dy, gate, up)            # (dgate, dup)
    d.reference(x, **params)            # gated: gate, up = x.chunk(2, -1); else forward(x)
    d.param_defaults()                  # {"limit": 7.0, "alpha": 1.702}
    d.expressions()                     # cse([forward, *grads]) -> (bindings, [forward, grad_arg0, ...])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fusion.errors import OpArgumentError, ShapeError
from fusion.patterns.ast import SourceLoc
from fusion.symbolic import Expr, cse, evaluate, to_source
from fusion.symbolic.source import format_number

#: The name of the incoming gradient inside `grad(arg) = ...`.
DY = "dy"


@dataclass(frozen=True, eq=False)
class ActivationDef:
    name: str
    args: tuple[str, ...]
    params: tuple[tuple[str, float], ...]  # (name, default), in declaration order
    forward_expr: Expr
    grad_exprs: dict[str, Expr]
    loc: SourceLoc
    lets: tuple[tuple[str, Expr], ...] = ()
    grad_given: dict[str, bool] = field(default_factory=dict)
    builtin: bool = False
    doc: str = ""

    # ------------------------------------------------------------------ data
    @property
    def gated(self) -> bool:
        return len(self.args) == 2

    def param_defaults(self) -> dict[str, float]:
        return dict(self.params)

    def param_values(self, **overrides: Any) -> dict[str, Any]:
        """Defaults updated by `overrides`; an unknown parameter is a TypeError naming the known ones."""
        defaults = self.param_defaults()
        unknown = sorted(set(overrides) - set(defaults))
        if unknown:
            known = ", ".join(defaults) or "none"
            raise OpArgumentError(f"activation {self.name!r} has no parameter(s) {unknown}; its parameters: {known}")
        return {**defaults, **overrides}

    def expressions(self) -> tuple[list[tuple[str, Expr]], list[Expr]]:
        """Forward and every gradient with shared subexpressions bound once (for codegen)."""
        return cse([self.forward_expr, *(self.grad_exprs[a] for a in self.args)])

    def to_source(self) -> str:
        """A declaration that parses back to an equivalent activation (lets inlined)."""
        params = ", ".join(f"{n}: float = {format_number(v)}" for n, v in self.params)
        head = f"activation {self.name}({', '.join(self.args)}{'; ' + params if params else ''}) {{"
        lines = [head, f"    forward = {to_source(self.forward_expr)}"]
        for a in self.args:
            if self.grad_given.get(a):
                lines.append(f"    grad({a}) = {to_source(self.grad_exprs[a])}")
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"ActivationDef({self.name!r}, args={self.args}, params={dict(self.params)}, at {self.loc})"

    # ------------------------------------------------------------------ torch
    def _env(self, tensors, params) -> dict:
        if len(tensors) != len(self.args):
            raise OpArgumentError(f"activation {self.name!r} takes {len(self.args)} argument(s) "
                                  f"({', '.join(self.args)}), got {len(tensors)}")
        env = dict(self.param_values(**params))
        env.update(zip(self.args, tensors))
        return env

    def forward(self, *args: torch.Tensor, **params: Any) -> torch.Tensor:
        return evaluate(self.forward_expr, self._env(args, params))

    def backward(self, dy: torch.Tensor, *args: torch.Tensor, **params: Any) -> tuple[torch.Tensor, ...]:
        env = self._env(args, params)
        env[DY] = dy
        return tuple(evaluate(self.grad_exprs[a], env) for a in self.args)

    def reference(self, x: torch.Tensor, **params: Any) -> torch.Tensor:
        if self.gated:
            if x.shape[-1] % 2:
                raise ShapeError(f"activation {self.name!r} is gated: it splits its input into two halves "
                                 f"(gate, up), so it needs an even feature count, got {x.shape[-1]}")
            gate, up = x.chunk(2, -1)
            return self.forward(gate, up, **params)
        return self.forward(x, **params)
