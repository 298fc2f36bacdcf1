"""`to_source(expr)`: the .fpat expression text of an expression (the parser reads it back).

Parenthesises by precedence only where needed; numbers print with repr() so they read back exactly.
Precedence, loosest first: comparisons < + - < * / < unary - < ** (right-associative, like Python).
"""
from __future__ import annotations

import math

from fusion.symbolic.expr import BinOp, Call, COMPARE_OPS, Expr, Neg, Num, Param, Var, postorder

_PREC = {"cmp": 1, "+": 2, "-": 2, "*": 3, "/": 3, "neg": 4, "**": 5, "atom": 6}


def format_number(v: float) -> str:
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"{v} has no literal in the pattern language")
    if v.is_integer() and abs(v) < 1e16:
        return str(int(v))
    return repr(v)


def _prec(e: Expr) -> int:
    if isinstance(e, Num):
        return _PREC["neg"] if e.value < 0 else _PREC["atom"]
    if isinstance(e, BinOp):
        return _PREC["cmp"] if e.op in COMPARE_OPS else _PREC[e.op]
    if isinstance(e, Neg):
        return _PREC["neg"]
    return _PREC["atom"]


def to_source(expr: Expr, names: dict[str, str] | None = None) -> str:
    """Expression text; `names` optionally renames Vars/Params when printing. Built bottom-up (children
    first, iteratively), so an expression of any depth prints without recursion."""
    names = names or {}
    text: dict[Expr, str] = {}

    def wrap(child: Expr, need: int) -> str:
        return f"({text[child]})" if _prec(child) < need else text[child]

    for e in postorder(expr):
        if isinstance(e, Num):
            s = format_number(e.value)
        elif isinstance(e, (Var, Param)):
            s = names.get(e.name, e.name)
        elif isinstance(e, Neg):
            s = "-" + wrap(e.operand, _PREC["neg"])
        elif isinstance(e, Call):
            s = f"{e.fn}({', '.join(text[a] for a in e.args)})"
        elif isinstance(e, BinOp):
            p = _prec(e)
            if e.op == "**":  # right-assoc; the exponent may be a unary minus as in Python
                s = f"{wrap(e.lhs, p + 1)} ** {wrap(e.rhs, _PREC['neg'])}"
            elif e.op in COMPARE_OPS:  # comparisons do not chain
                s = f"{wrap(e.lhs, p + 1)} {e.op} {wrap(e.rhs, p + 1)}"
            else:  # left-assoc
                s = f"{wrap(e.lhs, p)} {e.op} {wrap(e.rhs, p + 1)}"
        else:  # pragma: no cover
            raise TypeError(f"cannot print {e!r}")
        text[e] = s
    return text[expr]


def bindings_to_source(bindings, exprs, out_names=("forward",)) -> str:
    """`let` lines for bindings, then `name = expr` lines: the body of an activation declaration."""
    lines = [f"let {name} = {to_source(e)}" for name, e in bindings]
    lines += [f"{n} = {to_source(e)}" for n, e in zip(out_names, exprs)]
    return "\n".join(lines)
