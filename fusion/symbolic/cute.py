"""`to_cute(bindings, exprs)`: Python source lines of fp32 elementwise math for a CuTe DSL epilogue.

The lines are straight-line Python over `+ - * /`, comparisons, float constants and calls into the epilogue
math module, named `em` (MATH_MODULE) in the generated code: fusion.kernels.epi_math in the kernel (fast-math
forms), fusion.runtime.torch_math when backend="emulate" runs the same source with torch. A function call
becomes `em.<kernel>(...)`, `kernel` being the function's registry entry (fusion/symbolic/functions.py), so
this module holds no table of functions. `**` with a constant exponent has short forms (POWER_FORMS), any
other power is `em.pow_const`. Printed by fusion/symbolic/printer.py: Python's precedence is the
language's.

A power form that reads its base more than once (x * x) gets a compound base hoisted into a temporary first,
so no expression is evaluated twice.
"""
from __future__ import annotations

import itertools
import math

from fusion.symbolic.expr import BinOp, Call, Expr, Num, Param, Var, transform
from fusion.symbolic.functions import FUNCTIONS
from fusion.symbolic.printer import Apply, Atom, Infix, render

#: The name generated code gives the epilogue math module.
MATH_MODULE = "em"

#: `base ** exponent` for these constant exponents, as kernel code (a Form over the base node).
POWER_FORMS = {
    2.0: lambda a: Infix("*", a, a),
    3.0: lambda a: Infix("*", BinOp("*", a, a), a),
    0.5: lambda a: Apply(f"{MATH_MODULE}.sqrt", (a,)),
    -1.0: lambda a: Infix("/", Num(1.0), a),
}
#: The exponents whose form reads the base more than once.
_REPEATED_BASE = (2.0, 3.0)


def _format_float(v: float) -> str:
    if math.isinf(v):
        return "float('inf')" if v > 0 else "-float('inf')"
    return repr(float(v))


def _constant_exponent(node: Expr) -> float | None:
    if isinstance(node, BinOp) and node.op == "**" and isinstance(node.rhs, Num):
        return node.rhs.value
    return None


def to_cute(bindings, exprs, *, out_names=None, names: dict[str, str] | None = None,
            params: dict[str, float] | None = None, temp_prefix: str = "_v") -> list[str]:
    """Assignment lines computing `exprs` into `out_names` (default out0, out1...).

    bindings: [(name, expr)] as returned by cse(); each becomes a local.
    names: Var/Param name -> Python expression to read it (default: the same name).
    params: Param name -> number to inline as a constant (overrides `names`; otherwise defaults are
        inlined when a Param has one and `names` does not mention it).
    """
    names = dict(names or {})
    params = dict(params or {})
    exprs = [exprs] if isinstance(exprs, Expr) else list(exprs)
    out_names = list(out_names) if out_names is not None else [f"out{i}" for i in range(len(exprs))]
    if len(out_names) != len(exprs):
        raise ValueError("out_names and exprs differ in length")
    lines: list[str] = []
    temps = itertools.count()

    def form(e: Expr):
        if isinstance(e, Num):
            return Atom(_format_float(e.value))
        if isinstance(e, Param):
            if e.name in params:
                return Atom(_format_float(params[e.name]))
            if e.name not in names and e.default is not None:
                return Atom(_format_float(e.default))
            return Atom(names.get(e.name, e.name))
        if isinstance(e, Var):
            return Atom(names.get(e.name, e.name))
        if isinstance(e, Call):
            return Apply(f"{MATH_MODULE}.{FUNCTIONS[e.fn].kernel}", e.args)
        if isinstance(e, BinOp) and e.op == "**":
            short = POWER_FORMS.get(_constant_exponent(e))
            return short(e.lhs) if short else Apply(f"{MATH_MODULE}.pow_const", (e.lhs, e.rhs))
        return e.form()

    def hoist(node: Expr, children: tuple[Expr, ...]) -> Expr:
        node = node.rebuild(children)
        if _constant_exponent(node) in _REPEATED_BASE and not isinstance(node.lhs, (Var, Param, Num)):
            temp = f"{temp_prefix}{next(temps)}"
            lines.append(f"{temp} = {render(node.lhs, form)}")
            node = BinOp("**", Var(temp), node.rhs)
        return node

    def assign(target: str, expr: Expr) -> None:
        expr = transform(expr, hoist)
        lines.append(f"{target} = {render(expr, form)}")

    for name, expr in bindings:
        assign(names.get(name, name), expr)
    for name, expr in zip(out_names, exprs):
        assign(name, expr)
    return lines
