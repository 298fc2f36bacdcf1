"""`differentiate(expr, var)`: symbolic derivative, simplified, sharing subexpressions of the input.

A function's rule is its registry entry's `derivative` (fusion/symbolic/functions.py, with the conventions at
non-smooth points, those of evaluate() and so of torch autograd on evaluate()); comparisons have derivative 0.
The derivative is memoised per node, so a DAG (shared subexpressions) is differentiated in linear time
and its shared parts stay shared in the result.
"""
from __future__ import annotations

from fusion.symbolic.expr import BinOp, Call, Expr, Neg, Num, Param, Var, postorder
from fusion.symbolic.functions import FUNCTIONS
from fusion.symbolic import simplifier as S


def _binop_derivative(node: BinOp, d: dict[Expr, Expr]) -> Expr:
    a, b = node.lhs, node.rhs
    da, db = d[a], d[b]
    op = node.op
    if op == "+":
        return S.add(da, db)
    if op == "-":
        return S.sub(da, db)
    if op == "*":
        return S.add(S.mul(da, b), S.mul(a, db))
    if op == "/":
        first = S.div(da, b)
        if db == S.ZERO:
            return first
        return S.sub(first, S.div(S.mul(a, db), S.pow_(b, Num(2.0))))
    if op == "**":
        base = S.mul(S.mul(b, S.pow_(a, S.sub(b, Num(1.0)))), da)
        if db == S.ZERO:
            return base
        # d(a**b) = a**b * log(a) * db + b * a**(b-1) * da
        return S.add(base, S.mul(S.mul(S.pow_(a, b), S.call("log", a)), db))
    return S.ZERO  # comparisons


def differentiate(expr: Expr, var: str) -> Expr:
    """d expr / d var, simplified. `var` is the name of a Var (Params are constants here)."""
    if isinstance(var, Var):
        var = var.name
    d: dict[Expr, Expr] = {}
    for node in postorder(expr):
        if isinstance(node, Var):
            d[node] = S.ONE if node.name == var else S.ZERO
        elif isinstance(node, (Num, Param)):
            d[node] = S.ZERO
        elif isinstance(node, Neg):
            d[node] = S.neg(d[node.operand])
        elif all(d[c] == S.ZERO for c in node.children):
            d[node] = S.ZERO
        elif isinstance(node, BinOp):
            d[node] = _binop_derivative(node, d)
        elif isinstance(node, Call):
            d[node] = FUNCTIONS[node.fn].derivative(S, node.args, tuple(d[a] for a in node.args))
        else:  # pragma: no cover
            raise TypeError(f"cannot differentiate {node!r}")
    return d[expr]


def gradient(expr: Expr, var: str, dy: Expr | str = "dy") -> Expr:
    """The backward of an elementwise function: d expr / d var * dy, simplified."""
    if isinstance(dy, str):
        dy = Var(dy)
    return S.mul(differentiate(expr, var), dy)
