"""`evaluate(expr, env)`: THE reference implementation of every activation, in torch.

Differentiable by torch autograd, and exact in float64. Function semantics (the derivative rules in
diff.py follow the same conventions, so autograd of evaluate() and the symbolic derivative agree
everywhere, including at ties and kinks):

  min(a, b)        torch.where(a <= b, a, b)   ties select (and pass the gradient to) a
  max(a, b)        torch.where(a >= b, a, b)   ties select a
  clamp(x, lo, hi) min(max(x, lo), hi)          x keeps the gradient on the closed interval [lo, hi], like
                                                torch.clamp
  relu(x)          torch.relu                   relu'(0) = 0
  abs(x)           torch.abs                    abs'(0) = 0
  softplus(x)      torch.logaddexp(x, 0)        log(1 + e^x) without overflow (no threshold cut-off)
  gelu_tanh(x)     F.gelu(x, approximate="tanh")
  silu, sigmoid, tanh, erf, exp, log, sqrt      the torch functions
  where(c, a, b)   torch.where(c, a, b)         c is a comparison (or a number: nonzero is true)
  comparisons      boolean tensors; used as a number, true is 1 and false is 0
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F

from fusion.symbolic.expr import BinOp, Call, Expr, Neg, Num, Param, Var, postorder


class UnboundNameError(KeyError):
    """evaluate() met a Var, or a Param without default, that env does not give."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text
        return str(self.args[0]) if self.args else ""


def _softplus(x):
    return torch.logaddexp(x, torch.zeros_like(x))


def _min(a, b):
    return torch.where(a <= b, a, b)


def _max(a, b):
    return torch.where(a >= b, a, b)


#: name -> torch implementation on tensors.
TORCH_FUNCTIONS = {
    "min": _min,
    "max": _max,
    "clamp": lambda x, lo, hi: _min(_max(x, lo), hi),
    "abs": torch.abs,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "softplus": _softplus,
    "erf": torch.erf,
    "relu": torch.relu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "where": lambda c, a, b: torch.where(c if c.dtype == torch.bool else c != 0, a, b),
}

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
            out = TORCH_FUNCTIONS[node.fn](*args)
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


LOG2E = 1.0 / math.log(2.0)
