"""The kernels' epilogue math (fusion/kernels/epi_math.py) on the CPU: its `cute` calls are replaced by the
torch functions they stand for (in float64), so the formulas it chooses (unrolled powers, exp2/log, the
reciprocal) run as written. They must equal the reference and what backend="emulate" computes
(fusion/runtime/torch_math.py); a difference is a silent fused-vs-reference mismatch on the GPU."""
import importlib
import math
import types

import pytest
import torch

# fusion.kernels first: it sets CUTE_DSL_ARCH=sm_90a, which the DSL reads once, when cutlass is first imported
# (importing cutlass first would pin the process to the DSL's default architecture).
import fusion.kernels as K

from fusion.runtime import torch_math  # noqa: E402
from fusion.symbolic import FUNCTIONS  # noqa: E402


class _Float32:
    """Stands for cutlass.Float32: a value becomes a float64 tensor (isinstance is never true, so epi_math's
    _f always converts, which is the identity on a tensor)."""

    def __new__(cls, value):
        return torch.as_tensor(value, dtype=torch.float64)


_CUTE = types.SimpleNamespace(
    math=types.SimpleNamespace(exp2=lambda x, fastmath=False: torch.exp2(x),
                               log=lambda x, fastmath=False: torch.log(x),
                               sqrt=lambda x, fastmath=False: torch.sqrt(x),
                               tanh=lambda x, fastmath=False: torch.tanh(x),
                               erf=lambda x: torch.erf(x), abs=lambda x: torch.abs(x)),
    arch=types.SimpleNamespace(rcp_approx=lambda x: 1.0 / x, fmax=torch.maximum, fmin=torch.minimum),
)


@pytest.fixture
def em(monkeypatch):
    module = importlib.import_module(K.__name__ + ".epi_math")
    monkeypatch.setattr(module, "cute", _CUTE)
    monkeypatch.setattr(module, "Float32", _Float32)
    monkeypatch.setattr(module, "cutlass", types.SimpleNamespace(select_=lambda c, a, b: torch.where(c, a, b)))
    return module


X = torch.tensor([-3.5, -2.0, -1.25, -1.0, -0.5, -0.1, 0.1, 0.5, 1.0, 1.5, 2.0, 3.0], dtype=torch.float64)


@pytest.mark.parametrize("p", [-1, -2, -3, -4, -7, -64, 0, 1, 2, 3, 5, 8, 9, 12, 64, 65, 66, -65, -66, 101])
def test_pow_const_integer_exponents_are_exact_for_negative_x(em, p):
    """x ** p for an integer p of either sign: finite for x < 0 like the reference (negative exponents other
    than -1 used to go through exp2(log(x)...): NaN)."""
    got = torch.broadcast_to(em.pow_const(X, p), X.shape)  # p = 0 gives the constant 1
    want = torch.pow(X, p)
    assert torch.isfinite(got).all() or not torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got, torch_math.pow_const(X, p), rtol=1e-12, atol=0)


@pytest.mark.parametrize("p", [0.5, -0.5, 1.5, 2.5, -2.25])
def test_pow_const_fractional_exponents(em, p):
    """A fractional power of a negative number is NaN in the reference too; of a positive one, exact."""
    got, want = em.pow_const(X, p), torch.pow(X, p)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got[X > 0], want[X > 0], rtol=1e-12, atol=0)


def test_pow_const_of_zero(em):
    zero = torch.zeros(1, dtype=torch.float64)
    assert em.pow_const(zero, -2).item() == math.inf and em.pow_const(zero, 0).item() == 1.0
    assert em.pow_const(zero, 3).item() == 0.0


@pytest.mark.parametrize("name", ["exp", "exp2", "log", "sqrt", "rcp", "sigmoid", "silu", "tanh", "gelu_tanh",
                                  "erf", "softplus", "abs", "relu"])
def test_unary_functions_match_the_emulation(em, name):
    """The emulation follows the kernel's formulas. (softplus: the kernel's log(1 + exp(x)) and the emulation's
    log1p differ by far less than 1e-15 absolute where exp(x) underflows against 1.)"""
    x = torch.linspace(-30, 30, 241, dtype=torch.float64)
    if name in ("log", "sqrt"):
        x = x.abs() + 0.5
    torch.testing.assert_close(getattr(em, name)(x), getattr(torch_math, name)(x), rtol=1e-12, atol=1e-15)


#: Arguments in each function's domain; the others take (X, Y, Z)[:arity].
_DOMAIN = {"log": lambda: (X.abs() + 0.5,), "sqrt": lambda: (X.abs() + 0.5,),
           "clamp": lambda: (X, -X.flip(0).abs() - 0.1, X.abs() + 0.1),
           "where": lambda: (X > 0.3, X, X.flip(0))}


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_every_function_runs_in_the_kernel_as_its_registry_entry_says(em, fn):
    """A function of the language becomes a call of its registry entry's `kernel` function: the kernel's math
    module and the emulation both have it, and both compute the reference (the entry's `torch`)."""
    f = FUNCTIONS[fn]
    args = _DOMAIN[fn]() if fn in _DOMAIN else (X, X.flip(0), X * 0.5)[:f.arity]
    want = f.torch(*args)
    torch.testing.assert_close(getattr(em, f.kernel)(*args), want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(getattr(torch_math, f.kernel)(*args), want, rtol=1e-9, atol=1e-12)
