"""Constructor argument checks shared by the ops: a bad argument fails when the op is built, with an
OpArgumentError naming the op, the argument and the fix, not later inside torch or a kernel.

Why strict: `GroupLinear(True, ...)` (a bool is an int in Python), `Clamp("a", "b")` or `Clamp(nan, 1)` used
to build an op that failed obscurely (or silently clamped nothing) at the first call.
"""
from __future__ import annotations

import keyword
import math
import numbers

import torch

from fusion.errors import OpArgumentError
from fusion.run_context import RESERVED_INPUTS


def positive_int(op: str, name: str, value, what: str = "") -> int:
    """An int >= 1 (a bool is not one: GroupLinear(True, ...) is a mistake, not one group)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        meaning = f" ({what})" if what else ""
        raise OpArgumentError(f"{op}: {name}{meaning} must be a positive int, got {value!r}; pass a whole "
                              f"number >= 1")
    return int(value)


def finite_number(op: str, name: str, value, allow_none: bool = False) -> float | None:
    """A finite real number (int or float, not a bool), or None when allowed; returned as a float."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        also = " or None" if allow_none else ""
        raise OpArgumentError(f"{op}: {name} must be a number{also}, got {type(value).__name__} {value!r}; "
                              f"pass a Python float such as 1.0")
    if not math.isfinite(float(value)):
        raise OpArgumentError(f"{op}: {name} must be a finite number, got {value!r}; "
                              + ("leave it None for no bound" if allow_none else "pass a finite float"))
    return float(value)


def flag(op: str, name: str, value) -> bool:
    """A bool (a string such as "no" is truthy: accepting it would silently mean True)."""
    if not isinstance(value, bool):
        raise OpArgumentError(f"{op}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def input_name(op: str, name: str, value) -> str:
    """The name of a keyword input an op reads: an identifier, not a Python keyword, not a reserved input."""
    if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value):
        raise OpArgumentError(f"{op}: {name} must be a Python identifier (it is a keyword argument of the block "
                              f"call), got {value!r}; e.g. {op}({name}='probs')")
    if value in RESERVED_INPUTS:
        meaning = {"x": "the data input", "self": "the module itself"}.get(value, f"the block's {value}")
        raise OpArgumentError(f"{op}: {name}={value!r} is reserved: a block call already uses {value!r} for "
                              f"{meaning}; pick another name, e.g. {op}({name}='probs')")
    return value


def factory(op: str, device, dtype) -> dict:
    """device/dtype for the op's parameters: None, or what torch accepts (a floating dtype)."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise OpArgumentError(f"{op}: dtype must be a floating torch.dtype or None, got {dtype!r}; e.g. "
                              f"dtype=torch.bfloat16")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError, ValueError) as err:
            reason = str(err).splitlines()[0]
            raise OpArgumentError(f"{op}: device {device!r} is not a device torch can use ({reason}); pass "
                                  f"e.g. 'cuda', 'cpu' or torch.device('cuda', 0)") from None
    return {"device": device, "dtype": dtype}
