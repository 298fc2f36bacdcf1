"""The functions of the expression language: one registry entry each, everything the compiler knows of one.

    Function(name, arity, torch, derivative, kernel)

name, arity   what a pattern file may call, and with how many arguments (expr.Call and the loader check it)
torch         the reference implementation on tensors (evaluate(), and so every op's reference and its
              autograd)
derivative    the differential d f(args), given the arguments and their derivatives: derivative(S, args, dargs).
              S is fusion.symbolic.simplifier, the simplifying constructors (passed in: the simplifier builds
              expression nodes, which check their function against this table, so this module imports neither)
kernel        the name of the function in the epilogue math module `em` that generated kernel code calls:
              fusion.kernels.epi_math on the GPU, fusion.runtime.torch_math when emulated (named by string:
              kernels/ imports nothing of fusion.symbolic)

Adding a function is one entry here (plus its `em` function in both math modules, when it is new there).

Conventions at non-smooth points, the same in `torch` and in `derivative` (so autograd of evaluate() and the
symbolic derivative agree everywhere, including at ties and kinks):

  min(a, b)        where(a <= b, a, b)          ties select (and pass the gradient to) a
  max(a, b)        where(a >= b, a, b)          ties select a
  clamp(x, lo, hi) min(max(x, lo), hi)          x keeps the gradient on the closed interval [lo, hi], like
                                                torch.clamp; lo or hi get it where they are selected
  relu(x)          torch.relu                   relu'(0) = 0
  abs(x)           torch.abs                    abs'(0) = 0
  softplus(x)      torch.logaddexp(x, 0)        log(1 + e^x) without overflow (no threshold cut-off)
  gelu_tanh(x)     F.gelu(x, approximate="tanh")
  where(c, a, b)   torch.where(c, a, b)         c is a comparison (or a number: nonzero is true); c is not
                                                differentiated
  silu, sigmoid, tanh, erf, exp, log, sqrt      the torch functions
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715
TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


@dataclass(frozen=True)
class Function:
    name: str
    arity: int
    torch: Callable[..., torch.Tensor]
    derivative: Callable[[Any, tuple, tuple], Any]
    kernel: str


def _min(a, b):
    return torch.where(a <= b, a, b)


def _max(a, b):
    return torch.where(a >= b, a, b)


def _where(c, a, b):
    return torch.where(c if c.dtype == torch.bool else c != 0, a, b)


def _chain(prime: Callable[[Any, Any], Any]):
    """The differential of a one-argument function from its derivative prime(S, a): f'(a) * da."""
    return lambda S, args, d: S.mul(prime(S, args[0]), d[0])


def _clamp_derivative(S, args, d):
    x, lo, hi = args
    dx, dlo, dhi = d
    inside = S.call("where", S.compare("<=", x, hi), dx, dhi)
    below = S.call("where", S.compare("<=", lo, hi), dlo, dhi)
    return S.call("where", S.compare(">=", x, lo), inside, below)


def _sigmoid_prime(S, a):
    s = S.call("sigmoid", a)
    return S.mul(s, S.sub(1.0, s))


def _silu_prime(S, a):
    s = S.call("sigmoid", a)
    return S.mul(s, S.add(1.0, S.mul(a, S.sub(1.0, s))))


def _gelu_tanh_prime(S, a):
    inner = S.mul(SQRT_2_OVER_PI, S.add(a, S.mul(GELU_TANH_CUBIC, S.pow_(a, 3.0))))
    t = S.call("tanh", inner)
    left = S.mul(0.5, S.add(1.0, t))
    dinner = S.mul(SQRT_2_OVER_PI, S.add(1.0, S.mul(3.0 * GELU_TANH_CUBIC, S.pow_(a, 2.0))))
    right = S.mul(S.mul(0.5, a), S.mul(S.sub(1.0, S.mul(t, t)), dinner))
    return S.add(left, right)


#: name -> Function, in the order error messages list them.
FUNCTIONS: dict[str, Function] = {f.name: f for f in (
    Function("min", 2, _min, kernel="minimum",
             derivative=lambda S, a, d: S.call("where", S.compare("<=", a[0], a[1]), d[0], d[1])),
    Function("max", 2, _max, kernel="maximum",
             derivative=lambda S, a, d: S.call("where", S.compare(">=", a[0], a[1]), d[0], d[1])),
    Function("clamp", 3, lambda x, lo, hi: _min(_max(x, lo), hi), kernel="clamp", derivative=_clamp_derivative),
    Function("abs", 1, torch.abs, kernel="abs", derivative=_chain(
        lambda S, a: S.call("where", S.compare(">", a, 0.0), 1.0,
                            S.call("where", S.compare("<", a, 0.0), -1.0, 0.0)))),
    Function("exp", 1, torch.exp, kernel="exp", derivative=_chain(lambda S, a: S.call("exp", a))),
    Function("log", 1, torch.log, kernel="log", derivative=_chain(lambda S, a: S.div(1.0, a))),
    Function("sqrt", 1, torch.sqrt, kernel="sqrt", derivative=_chain(lambda S, a: S.div(0.5, S.call("sqrt", a)))),
    Function("sigmoid", 1, torch.sigmoid, kernel="sigmoid", derivative=_chain(_sigmoid_prime)),
    Function("tanh", 1, torch.tanh, kernel="tanh",
             derivative=_chain(lambda S, a: S.sub(1.0, S.mul(S.call("tanh", a), S.call("tanh", a))))),
    Function("softplus", 1, lambda x: torch.logaddexp(x, torch.zeros_like(x)), kernel="softplus",
             derivative=_chain(lambda S, a: S.call("sigmoid", a))),
    Function("erf", 1, torch.erf, kernel="erf",
             derivative=_chain(lambda S, a: S.mul(TWO_OVER_SQRT_PI, S.call("exp", S.neg(S.mul(a, a)))))),
    Function("relu", 1, torch.relu, kernel="relu",
             derivative=_chain(lambda S, a: S.call("where", S.compare(">", a, 0.0), 1.0, 0.0))),
    Function("gelu_tanh", 1, lambda x: F.gelu(x, approximate="tanh"), kernel="gelu_tanh",
             derivative=_chain(_gelu_tanh_prime)),
    Function("silu", 1, F.silu, kernel="silu", derivative=_chain(_silu_prime)),
    Function("where", 3, _where, kernel="where",
             derivative=lambda S, a, d: S.call("where", a[0], d[1], d[2])),
)}
