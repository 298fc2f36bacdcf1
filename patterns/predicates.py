"""`evaluate_predicate(expr, attrs)`: the small evaluator of chain `where` predicates (never Python eval).

Values are ints, floats, bools, strings and None (an attribute an op leaves unset, e.g. Clamp(max=None)).
Operators: `and` `or` `not` (short-circuit, like Python), comparisons `< <= > >= == !=`, `in (a, b, ...)`,
arithmetic `+ - * / % **` and unary `-` `+` on numbers. `/` is true division; `%` of integers is Python's
(non-negative for a positive divisor). A name is looked up in `attrs`; a name the op does not have raises
UnknownAttributeError (a KeyError) naming it and listing the attributes there are.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping

from fusion.patterns import expr_ast as A
from fusion.patterns.limits import power_problem


class UnknownAttributeError(KeyError):
    def __init__(self, name: str, attrs: Mapping[str, Any]):
        super().__init__(name)
        self.name = name
        self.available = sorted(attrs)

    def __str__(self) -> str:
        return f"unknown attribute {self.name!r}; this op has: {', '.join(self.available) or 'none'}"


class PredicateTypeError(TypeError):
    """A predicate that cannot be evaluated on an op's attrs (wrong types, a division by zero, a power beyond
    the limits); the matcher reports it as the reason the pattern does not apply."""


_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "%": operator.mod,
          "**": operator.pow}
_CMP = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "!=": operator.ne}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _value(e, attrs: Mapping[str, Any]):
    if isinstance(e, A.ENum):
        return int(e.value) if e.is_int else e.value
    if isinstance(e, (A.EStr, A.EBool)):
        return e.value
    if isinstance(e, A.EName):
        if e.name not in attrs:
            raise UnknownAttributeError(e.name, attrs)
        return attrs[e.name]
    if isinstance(e, A.EUnary):
        if e.op == "not":
            return not _truth(_value(e.operand, attrs))
        v = _value(e.operand, attrs)
        if not _is_number(v):
            raise PredicateTypeError(f"unary {e.op} needs a number, got {v!r}")
        return -v if e.op == "-" else v
    if isinstance(e, A.EIn):
        v = _value(e.operand, attrs)
        return any(v == _value(c, attrs) for c in e.choices)
    if isinstance(e, A.EBinary):
        if e.op == "and":
            return _truth(_value(e.lhs, attrs)) and _truth(_value(e.rhs, attrs))
        if e.op == "or":
            return _truth(_value(e.lhs, attrs)) or _truth(_value(e.rhs, attrs))
        a, b = _value(e.lhs, attrs), _value(e.rhs, attrs)
        if e.op in _CMP:
            if e.op in ("==", "!="):
                return _CMP[e.op](a, b)
            if not ((_is_number(a) and _is_number(b)) or (isinstance(a, str) and isinstance(b, str))):
                raise PredicateTypeError(f"cannot compare {a!r} {e.op} {b!r}")
            return _CMP[e.op](a, b)
        if not (_is_number(a) and _is_number(b)):
            raise PredicateTypeError(f"{e.op} needs numbers, got {a!r} and {b!r}")
        problem = power_problem(a, b) if e.op == "**" else None
        if problem:
            raise PredicateTypeError(problem)
        try:
            return _ARITH[e.op](a, b)
        except ZeroDivisionError:
            raise PredicateTypeError(f"division by zero in {a!r} {e.op} {b!r}") from None
        except OverflowError:
            raise PredicateTypeError(f"{a!r} {e.op} {b!r} overflows a float") from None
    if isinstance(e, A.ECall):
        raise PredicateTypeError(f"predicates cannot call functions ({e.fn})")
    raise PredicateTypeError(f"not a predicate expression: {e!r}")


def _truth(v) -> bool:
    return bool(v)


def check_predicate(expr, error) -> None:
    """What a chain predicate may hold, checked when its file loads: no calls, and no literal exponent of `**`
    beyond the limit. `error(loc, message)` makes the exception to raise (a PatternError at loc)."""
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, A.ECall):
            raise error(e.loc, f"predicates cannot call functions ('{e.fn}'); use attributes, numbers, strings, "
                               f"booleans, arithmetic, comparisons, and/or/not and `in (...)`")
        if isinstance(e, A.EBinary) and e.op == "**" and isinstance(e.rhs, A.ENum):
            exponent = e.rhs.value
            problem = power_problem(None, int(exponent) if float(exponent).is_integer() else exponent)
            if problem:
                raise error(e.rhs.loc, problem)
        stack.extend(getattr(e, f) for f in ("operand", "lhs", "rhs") if hasattr(e, f))
        stack.extend(getattr(e, "choices", ()))


def evaluate_predicate(expr, attrs: Mapping[str, Any]):
    """Evaluate a predicate expression AST against an op's attrs; returns the value (truthy = holds)."""
    return _value(expr, attrs)
