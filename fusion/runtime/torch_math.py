"""The epilogue math module (`em`) for backend="emulate": the names of fusion.kernels.epi_math, computed with
torch on whole tensors in the emulated kernel's compute dtype (float32, or float64 for float64 blocks).

The generated epilogue source calls `em.<fn>(...)` and ordinary `+ - * /`; executed with this module instead
of the kernel's, the same source runs on any device. Formulas follow epi_math where the kernel's choice is
visible in the result (sigmoid as 1 / (1 + exp(-x)), softplus linear above 20, integer powers multiplied
out), so emulate tests what the kernel computes rather than what torch would.
"""
from __future__ import annotations

import builtins

import torch


def _t(x, like=None):
    if isinstance(x, torch.Tensor):
        return x
    if like is not None:
        return torch.as_tensor(x, dtype=like.dtype, device=like.device)
    return torch.as_tensor(x, dtype=torch.float64)


def _pair(a, b):
    """Both operands as tensors of one dtype and device (a Python number takes the other's)."""
    if isinstance(a, torch.Tensor):
        return a, _t(b, a)
    if isinstance(b, torch.Tensor):
        return _t(a, b), b
    return _t(a), _t(b)


def exp(x):
    return torch.exp(x)


def exp2(x):
    return torch.exp2(x)


def log(x):
    return torch.log(x)


def sqrt(x):
    return torch.sqrt(x)


def rcp(x):
    return 1.0 / x


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x):
    return x * sigmoid(x)


def tanh(x):
    return torch.tanh(x)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def erf(x):
    return torch.erf(x)


def softplus(x):
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def abs(x):  # noqa: A001 - mirrors epi_math
    return torch.abs(x)


def maximum(a, b):
    a, b = _pair(a, b)
    return torch.maximum(a, b)


def minimum(a, b):
    a, b = _pair(a, b)
    return torch.minimum(a, b)


def relu(x):
    return torch.clamp(x, min=0.0)


def clamp(x, lo=None, hi=None):
    return torch.clamp(x, lo, hi)


def where(cond, a, b):
    a, b = _pair(a, b)
    return torch.where(cond, a, b)


def pow_const(x, p: float):
    """x ** p for a constant p: integer powers multiplied out (negative ones as a reciprocal), else torch."""
    p = float(p)
    if p.is_integer() and builtins.abs(p) <= 64:
        n = int(builtins.abs(p))
        r = torch.ones_like(x)
        for _ in range(n):
            r = r * x
        return 1.0 / r if p < 0 else r
    return torch.pow(x, p)


#: What `_f32(v)` means in generated code: a float32 value; here, a tensor in the compute dtype.
def as_value(v):
    return v


def functions() -> dict:
    """The names generated code reads from `em`."""
    return {name: globals()[name] for name in (
        "exp", "exp2", "log", "sqrt", "rcp", "sigmoid", "silu", "tanh", "gelu_tanh", "erf", "softplus", "abs",
        "maximum", "minimum", "relu", "clamp", "where", "pow_const")}

