"""Simplifying constructors and `simplify(expr)`.

Rules (local, cheap, value-preserving for finite inputs):
  constant folding of every operator and function whose arguments are all numbers;
  x + 0, 0 + x, x - 0 -> x;  0 - x -> -x;  x - x -> 0;  x + (-y) -> x - y;  (-x) + y -> y - x
  x * 1, 1 * x -> x;  x * 0, 0 * x -> 0;  x * -1 -> -x;  (-x) * (-y) -> x * y;  (-x) * y -> -(x * y)
  x / 1 -> x;  0 / x -> 0;  x / -1 -> -x;  (-x) / (-y) -> x / y
  x ** 1 -> x;  x ** 0 -> 1;  --x -> x;  -(number) -> number
  numbers gather to the left of products: x * 2 -> 2 * x;  2 * (3 * x) -> 6 * x
  where(c, a, a) -> a;  where(number, a, b) -> a or b;  comparisons of numbers -> 1 or 0
`x * 0 -> 0` assumes x is finite (the usual convention of symbolic differentiation; the derivative of an
expression never multiplies by an infinity on the inputs it is defined on).
"""
from __future__ import annotations

import math

from fusion.symbolic.evaluate import evaluate
from fusion.symbolic.expr import (
    BinOp, Call, COMPARE_OPS, Expr, Neg, Num, as_expr, transform,
)

ZERO = Num(0.0)
ONE = Num(1.0)


def _num(e: Expr) -> float | None:
    return e.value if isinstance(e, Num) else None


def _fold_call(fn: str, values: list[float]) -> Num | None:
    """Fold a call on numbers through the reference evaluator (float64), so folding == evaluation."""
    try:
        v = float(evaluate(Call(fn, tuple(Num(x) for x in values)), {}))
    except (ValueError, ArithmeticError):  # pragma: no cover - defensive
        return None
    if math.isnan(v) or math.isinf(v):
        return None  # keep the call: a literal cannot spell nan/inf
    return Num(v)


def neg(a) -> Expr:
    a = as_expr(a)
    if isinstance(a, Num):
        return Num(-a.value)
    if isinstance(a, Neg):
        return a.operand
    if isinstance(a, BinOp) and a.op == "-":  # -(x - y) -> y - x
        return sub(a.rhs, a.lhs)
    return Neg(a)


def add(a, b) -> Expr:
    a, b = as_expr(a), as_expr(b)
    x, y = _num(a), _num(b)
    if x is not None and y is not None:
        return Num(x + y)
    if x == 0.0:
        return b
    if y == 0.0:
        return a
    if isinstance(b, Neg):
        return sub(a, b.operand)
    if isinstance(b, Num) and b.value < 0:
        return sub(a, Num(-b.value))
    if isinstance(a, Neg):
        return sub(b, a.operand)
    return BinOp("+", a, b)


def sub(a, b) -> Expr:
    a, b = as_expr(a), as_expr(b)
    x, y = _num(a), _num(b)
    if x is not None and y is not None:
        return Num(x - y)
    if y == 0.0:
        return a
    if x == 0.0:
        return neg(b)
    if a == b:
        return ZERO
    if isinstance(b, Neg):
        return add(a, b.operand)
    if isinstance(b, Num) and b.value < 0:
        return add(a, Num(-b.value))
    return BinOp("-", a, b)


def mul(a, b) -> Expr:
    a, b = as_expr(a), as_expr(b)
    x, y = _num(a), _num(b)
    if x is not None and y is not None:
        return Num(x * y)
    if y is not None:  # numbers to the left
        a, b, x, y = b, a, y, x
    if x == 0.0:
        return ZERO
    if x == 1.0:
        return b
    if x == -1.0:
        return neg(b)
    if isinstance(a, Neg) and isinstance(b, Neg):
        return mul(a.operand, b.operand)
    if isinstance(a, Neg):
        return neg(mul(a.operand, b))
    if isinstance(b, Neg):
        return neg(mul(a, b.operand))
    if x is not None:
        if x < 0:
            return neg(mul(Num(-x), b))
        if isinstance(b, BinOp) and b.op == "*" and isinstance(b.lhs, Num):
            return mul(Num(x * b.lhs.value), b.rhs)
    return BinOp("*", a, b)


def div(a, b) -> Expr:
    a, b = as_expr(a), as_expr(b)
    x, y = _num(a), _num(b)
    if x is not None and y is not None and y != 0.0:
        return Num(x / y)
    if x == 0.0:
        return ZERO
    if y == 1.0:
        return a
    if y == -1.0:
        return neg(a)
    if isinstance(a, Neg) and isinstance(b, Neg):
        return div(a.operand, b.operand)
    if isinstance(a, Neg):
        return neg(div(a.operand, b))
    if isinstance(b, Neg):
        return neg(div(a, b.operand))
    return BinOp("/", a, b)


def pow_(a, b) -> Expr:
    a, b = as_expr(a), as_expr(b)
    x, y = _num(a), _num(b)
    if y == 0.0:
        return ONE
    if y == 1.0:
        return a
    if x is not None and y is not None:
        try:
            v = x ** y
        except (OverflowError, ZeroDivisionError):
            v = None
        if isinstance(v, float) and math.isfinite(v):
            return Num(v)
    if isinstance(a, BinOp) and a.op == "**" and isinstance(a.rhs, Num) and y is not None \
            and float(a.rhs.value).is_integer() and float(y).is_integer():
        return pow_(a.lhs, Num(a.rhs.value * y))  # (x**2)**3 -> x**6 (integer exponents only)
    return BinOp("**", a, b)


def compare(op: str, a, b) -> Expr:
    a, b = as_expr(a), as_expr(b)
    x, y = _num(a), _num(b)
    if x is not None and y is not None:
        r = {"<": x < y, "<=": x <= y, ">": x > y, ">=": x >= y, "==": x == y, "!=": x != y}[op]
        return ONE if r else ZERO
    return BinOp(op, a, b)


def call(fn: str, *args) -> Expr:
    args = tuple(as_expr(a) for a in args)
    if fn == "where":
        c, a, b = args
        if isinstance(c, Num):
            return a if c.value != 0.0 else b
        if a == b:
            return a
        return Call("where", args)
    if all(isinstance(a, Num) for a in args):
        folded = _fold_call(fn, [a.value for a in args])
        if folded is not None:
            return folded
    return Call(fn, args)


_BINARY = {"+": add, "-": sub, "*": mul, "/": div, "**": pow_}


def binop(op: str, a, b) -> Expr:
    if op in COMPARE_OPS:
        return compare(op, a, b)
    return _BINARY[op](a, b)


def _rebuild(node: Expr, children: tuple[Expr, ...]) -> Expr:
    if isinstance(node, BinOp):
        return binop(node.op, *children)
    if isinstance(node, Neg):
        return neg(children[0])
    if isinstance(node, Call):
        return call(node.fn, *children)
    return node


def simplify(expr):
    """Rebuild bottom-up through the simplifying constructors (an Expr, or a list of them)."""
    return transform(expr, _rebuild)
