"""Elementwise fp32 math for epilogues, callable at kernel trace time on ``cutlass.Float32`` values.

Generated epilogue code should only use these names plus ``+ - * /`` and Python float constants. Which of them
an expression function calls is that function's entry in the registry (fusion/symbolic/functions.py, `kernel`).
"""
from __future__ import annotations

import math as _m

import cutlass
import cutlass.cute as cute
from cutlass import Float32

#: log2(e): exp(x) = exp2(x * LOG2E), x ** p = exp2(log(x) * p * LOG2E).
LOG2E = 1.0 / _m.log(2.0)


def _f(x):
    return x if isinstance(x, Float32) else Float32(x)


def exp(x):
    return cute.math.exp2(_f(x) * LOG2E, fastmath=True)


def exp2(x):
    return cute.math.exp2(_f(x), fastmath=True)


def log(x):
    return cute.math.log(_f(x), fastmath=True)


def sqrt(x):
    return cute.math.sqrt(_f(x), fastmath=True)


def rcp(x):
    return cute.arch.rcp_approx(_f(x))


def sigmoid(x):
    return rcp(1.0 + exp(-_f(x)))


def silu(x):
    x = _f(x)
    return x * sigmoid(x)


def tanh(x):
    return cute.math.tanh(_f(x), fastmath=True)


def gelu_tanh(x):
    x = _f(x)
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def erf(x):
    return cute.math.erf(_f(x))


def softplus(x):
    x = _f(x)
    # log(1 + exp(x)), linear for large x
    return where(x > 20.0, x, log(1.0 + exp(x)))


def abs(x):  # noqa: A001
    return cute.math.abs(_f(x))


def maximum(a, b):
    return cute.arch.fmax(_f(a), _f(b))


def minimum(a, b):
    return cute.arch.fmin(_f(a), _f(b))


def relu(x):
    return maximum(x, 0.0)


def clamp(x, lo=None, hi=None):
    x = _f(x)
    if lo is not None:
        x = maximum(x, lo)
    if hi is not None:
        x = minimum(x, hi)
    return x


def where(cond, a, b):
    return cutlass.select_(cond, _f(a), _f(b))


#: Integer exponents up to this magnitude are multiplied out (as fusion/runtime/torch_math.py does).
POW_UNROLL = 64


def pow_const(x, p: float):
    """x ** p for a Python constant p.

    An integer p of either sign is exact for negative x too (the reference is finite there): |p| <= POW_UNROLL
    is unrolled into multiplications (a reciprocal for p < 0), a larger one is |x| ** p through exp2/log with
    the sign of x restored for odd p. Only a fractional p goes through exp2(p * log2(x)): NaN for x < 0, as
    in the reference.
    """
    x = _f(x)
    p = float(p)
    if p.is_integer():
        n = int(-p if p < 0 else p)
        if n <= POW_UNROLL:
            r = Float32(1.0)
            for _ in range(n):
                r = r * x
            return rcp(r) if p < 0 else r
        magnitude = exp2(log(abs(x)) * (p * LOG2E))
        return where(x < 0.0, -magnitude, magnitude) if n % 2 else magnitude
    return exp2(log(x) * (p * LOG2E))
