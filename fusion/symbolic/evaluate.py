"""`evaluate(expr, env)`: THE reference implementation of every activation, in torch.

Differentiable by torch autograd, and exact in float64. Each function's implementation is its registry
entry's `torch` (fusion/symbolic/functions.py, which also gives the conventions at ties and kinks, shared with
the derivative rules); comparisons are boolean tensors, used as a number true is 1 and false is 0.
"""
from __future__ import annotations

from typing import Mapping

import torch

from fusion.symbolic.expr import BinOp, Call, Expr, Neg, Num, Param, Var, postorder
from fusion.symbolic.functions import FUNCTIONS


class UnboundNameError(KeyError):
    """evaluate() met a Var, or a Param without default, that env does not give."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text
        return str(self.args[0]) if self.args else ""


_COMPARE = {
    "<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne,
}


def _reference_tensor(env: Mapping[str, object]):
    for v in env.values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype, v.device
    return torch.float64, torch.device("cpu")


def evaluate(expr: Expr, env: Mapping[str, object] | None = None) -> torch.Tensor:
    """Value of `expr` with names from `env` (tensors or numbers); Params fall back to their defaults.

    Constants take the dtype and device of the first floating-point tensor in env (float64 on the CPU
    when there is none). Shared subexpressions are computed once.
    """
    env = dict(env or {})
    dtype, device = _reference_tensor(env)

    def tensor(v):
        if isinstance(v, torch.Tensor):
            if v.dtype == torch.bool:
                return v.to(dtype)
            return v
        return torch.tensor(float(v), dtype=dtype, device=device)

    values: dict[Expr, torch.Tensor] = {}
    for node in postorder(expr):
        if isinstance(node, Num):
            out = torch.tensor(node.value, dtype=dtype, device=device)
        elif isinstance(node, Var):
            if node.name not in env:
                raise UnboundNameError(f"no value for {node.name!r} (env has {sorted(env)})")
            out = tensor(env[node.name])
        elif isinstance(node, Param):
            if node.name in env:
                out = tensor(env[node.name])
            elif node.default is not None:
                out = torch.tensor(node.default, dtype=dtype, device=device)
            else:
                raise UnboundNameError(f"parameter {node.name!r} has no default and no value was given")
        elif isinstance(node, Neg):
            out = -tensor(values[node.operand])
        elif isinstance(node, BinOp):
            a, b = values[node.lhs], values[node.rhs]
            if node.op in _COMPARE:
                out = _COMPARE[node.op](a, b)
            else:
                a, b = tensor(a), tensor(b)
                if node.op == "+":
                    out = a + b
                elif node.op == "-":
                    out = a - b
                elif node.op == "*":
                    out = a * b
                elif node.op == "/":
                    out = a / b
                else:
                    out = _pow(a, node.rhs, b)
        elif isinstance(node, Call):
            args = [values[c] for c in node.args]
            if node.fn == "where":
                args = [args[0]] + [tensor(a) for a in args[1:]]
            else:
                args = [tensor(a) for a in args]
            out = FUNCTIONS[node.fn].torch(*args)
        else:  # pragma: no cover
            raise TypeError(f"cannot evaluate {node!r}")
        values[node] = out
    return tensor(values[expr])


def _pow(a: torch.Tensor, exponent_node: Expr, b: torch.Tensor) -> torch.Tensor:
    # A number exponent goes in as a Python scalar: torch.pow(x, 2) has the gradient 2x (also at x=0,
    # where a tensor exponent's gradient path would touch log(0)).
    if isinstance(exponent_node, Num):
        v = exponent_node.value
        if v == 2.0:
            return a * a
        return torch.pow(a, v)
    return torch.pow(a, b)

