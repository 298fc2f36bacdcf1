"""`to_cute(bindings, exprs)`: Python source lines of fp32 elementwise math for a CuTe DSL epilogue.

The function table is data: a dict from function name to a template string whose `{0}`, `{1}`, `{2}` are
the (already printed, parenthesised) arguments. Two tables ship:

  CUTE_PRECISE  cute.math.* with default (IEEE) lowering
  CUTE_FAST     fastmath: exp via exp2 (ex2.approx), sigmoid(x) = 1 / (1 + exp2(-x * log2(e))),
                tanh with fastmath, etc.

A codegen engineer picks one, or copies and edits one (`{**CUTE_FAST, "tanh": "..."}`). Names assumed in
the emitting module: `cute` (import cutlass.cute as cute). Operands are TensorSSA / Float32 values or Python
floats; comparisons produce boolean TensorSSA used by `cute.where`.

An argument that a template uses more than once is hoisted into a temporary first, so no argument
expression is ever evaluated twice.
"""
from __future__ import annotations

import math
import string

from fusion.symbolic.expr import BinOp, Call, COMPARE_OPS, Expr, Neg, Num, Param, Var
from fusion.symbolic.source import _prec, _PREC

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

CUTE_PRECISE: dict[str, str] = {
    "exp": "cute.math.exp({0})",
    "log": "cute.math.log({0})",
    "sqrt": "cute.math.sqrt({0})",
    "tanh": "cute.math.tanh({0})",
    "erf": "cute.math.erf({0})",
    "abs": "cute.math.abs({0})",
    "min": "cute.math.min({0}, {1})",
    "max": "cute.math.max({0}, {1})",
    "clamp": "cute.math.min(cute.math.max({0}, {1}), {2})",
    "where": "cute.where({0}, {1}, {2})",
    "sigmoid": "1.0 / (1.0 + cute.math.exp(-{0}))",
    "softplus": "cute.math.max({0}, 0.0) + cute.math.log1p(cute.math.exp(-cute.math.abs({0})))",
    "relu": "cute.math.max({0}, 0.0)",
    "silu": "{0} / (1.0 + cute.math.exp(-{0}))",
    "gelu_tanh": f"0.5 * {{0}} * (1.0 + cute.math.tanh({SQRT_2_OVER_PI!r} * ({{0}} + 0.044715 * {{0}} * {{0}} * {{0}})))",
    # `**` with a number exponent: special forms first, the generic pow last.
    "pow2": "{0} * {0}",
    "pow3": "{0} * {0} * {0}",
    "pow0.5": "cute.math.sqrt({0})",
    "pow-1": "1.0 / {0}",
    "pow": "cute.math.pow({0}, {1})",
}

CUTE_FAST: dict[str, str] = {
    **CUTE_PRECISE,
    "exp": f"cute.math.exp2({{0}} * {LOG2E!r}, fastmath=True)",
    "log": f"cute.math.log2({{0}}, fastmath=True) * {LN2!r}",
    "sqrt": "cute.math.sqrt({0}, fastmath=True)",
    "tanh": "cute.math.tanh({0}, fastmath=True)",
    "sigmoid": f"1.0 / (1.0 + cute.math.exp2({{0}} * {-LOG2E!r}, fastmath=True))",
    "silu": f"{{0}} / (1.0 + cute.math.exp2({{0}} * {-LOG2E!r}, fastmath=True))",
    "softplus": f"cute.math.max({{0}}, 0.0) + cute.math.log2(1.0 + cute.math.exp2(cute.math.abs({{0}}) * {-LOG2E!r}, fastmath=True), fastmath=True) * {LN2!r}",
    "gelu_tanh": f"0.5 * {{0}} * (1.0 + cute.math.tanh({SQRT_2_OVER_PI!r} * ({{0}} + 0.044715 * {{0}} * {{0}} * {{0}}), fastmath=True))",
}

_PY_OPS = {"+": "+", "-": "-", "*": "*", "/": "/"}


def _format_float(v: float) -> str:
    if math.isinf(v):
        return "float('inf')" if v > 0 else "-float('inf')"
    return repr(float(v))


def _placeholder_counts(template: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None and field != "":
            counts[int(field)] = counts.get(int(field), 0) + 1
    return counts


def to_cute(bindings, exprs, *, out_names=None, table: dict[str, str] | None = None,
            names: dict[str, str] | None = None, params: dict[str, float] | None = None,
            temp_prefix: str = "_v") -> list[str]:
    """Assignment lines computing `exprs` into `out_names` (default out0, out1...).

    bindings: [(name, expr)] as returned by cse(); each becomes a local.
    table: the function table (default CUTE_PRECISE).
    names: Var/Param name -> Python expression to read it (default: the same name).
    params: Param name -> number to inline as a constant (overrides `names`; otherwise defaults are
        inlined when a Param has one and `names` does not mention it).
    """
    table = CUTE_PRECISE if table is None else table
    names = dict(names or {})
    params = dict(params or {})
    exprs = [exprs] if isinstance(exprs, Expr) else list(exprs)
    out_names = list(out_names) if out_names is not None else [f"out{i}" for i in range(len(exprs))]
    if len(out_names) != len(exprs):
        raise ValueError("out_names and exprs differ in length")
    lines: list[str] = []
    counter = [0]

    def hoist(text: str) -> str:
        name = f"{temp_prefix}{counter[0]}"
        counter[0] += 1
        lines.append(f"{name} = {text}")
        return name

    def wrap(child: Expr, need: int) -> str:
        text = go(child)
        return f"({text})" if _prec(child) < need else text

    def atom(child: Expr) -> str:
        """An argument for a template: a name, a number, or a hoisted/parenthesised expression."""
        text = go(child)
        if isinstance(child, (Var, Param)) or (isinstance(child, Num) and child.value >= 0):
            return text
        return f"({text})"

    def apply(key: str, args: list[Expr]) -> str:
        template = table[key]
        counts = _placeholder_counts(template)
        printed = []
        for i, a in enumerate(args):
            text = atom(a)
            if counts.get(i, 0) > 1 and not isinstance(a, (Var, Param, Num)):
                text = hoist(text)
            printed.append(text)
        return template.format(*printed)

    def go(e: Expr) -> str:
        if isinstance(e, Num):
            return _format_float(e.value)
        if isinstance(e, Param):
            if e.name in params:
                return _format_float(params[e.name])
            if e.name in names:
                return names[e.name]
            if e.default is not None:
                return _format_float(e.default)
            return e.name
        if isinstance(e, Var):
            return names.get(e.name, e.name)
        if isinstance(e, Neg):
            return "-" + wrap(e.operand, _PREC["neg"])
        if isinstance(e, Call):
            return apply(e.fn, list(e.args))
        if isinstance(e, BinOp):
            if e.op == "**":
                if isinstance(e.rhs, Num):
                    v = e.rhs.value
                    key = f"pow{_format_float(v).rstrip('0').rstrip('.') if v != int(v) else int(v)}"
                    if key in table:
                        return f"({apply(key, [e.lhs])})"
                return apply("pow", [e.lhs, e.rhs])
            p = _prec(e)
            if e.op in COMPARE_OPS:
                return f"{wrap(e.lhs, p + 1)} {e.op} {wrap(e.rhs, p + 1)}"
            return f"{wrap(e.lhs, p)} {_PY_OPS[e.op]} {wrap(e.rhs, p + 1)}"
        raise TypeError(f"cannot print {e!r}")  # pragma: no cover

    for name, expr in bindings:
        lines.append(f"{names.get(name, name)} = {go(expr)}")
    for name, expr in zip(out_names, exprs):
        lines.append(f"{name} = {go(expr)}")
    return lines
