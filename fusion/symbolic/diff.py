"""`differentiate(expr, var)`: symbolic derivative, simplified, sharing subexpressions of the input.

Conventions at non-smooth points are those of evaluate() (and so of torch autograd on evaluate()):
  relu'(0) = 0, abs'(0) = 0;
  min(a, b): the gradient goes to the selected argument, a on ties (where(a <= b, da, db));
  max(a, b): likewise (where(a >= b, da, db));
  clamp(x, lo, hi) = min(max(x, lo), hi): x gets the gradient on the closed interval lo <= x <= hi, as
    with torch.clamp; lo or hi get it where they are selected;
  where(c, a, b): the condition is not differentiated (where(c, da, db));
  comparisons have derivative 0.
The derivative is memoised per node, so a DAG (shared subexpressions) is differentiated in linear time
and its shared parts stay shared in the result.
"""
from __future__ import annotations

import math

from fusion.symbolic.expr import BinOp, Call, Expr, Neg, Num, Param, Var, postorder
from fusion.symbolic import simplifier as S

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _gelu_tanh_prime(a: Expr) -> Expr:
    inner = S.mul(Num(_SQRT_2_OVER_PI), S.add(a, S.mul(Num(_GELU_C), S.pow_(a, Num(3.0)))))
    t = S.call("tanh", inner)
    left = S.mul(Num(0.5), S.add(Num(1.0), t))
    dinner = S.mul(Num(_SQRT_2_OVER_PI), S.add(Num(1.0), S.mul(Num(3.0 * _GELU_C), S.pow_(a, Num(2.0)))))
    right = S.mul(S.mul(Num(0.5), a), S.mul(S.sub(Num(1.0), S.mul(t, t)), dinner))
    return S.add(left, right)


def _sigmoid_prime(a: Expr) -> Expr:
    s = S.call("sigmoid", a)
    return S.mul(s, S.sub(Num(1.0), s))


def _silu_prime(a: Expr) -> Expr:
    s = S.call("sigmoid", a)
    return S.mul(s, S.add(Num(1.0), S.mul(a, S.sub(Num(1.0), s))))


#: d f(a) / d a for the one-argument functions, as expressions of a (data, not an if-chain).
UNARY_DERIVATIVES = {
    "abs": lambda a: S.call("where", S.compare(">", a, Num(0.0)), Num(1.0),
                            S.call("where", S.compare("<", a, Num(0.0)), Num(-1.0), Num(0.0))),
    "exp": lambda a: S.call("exp", a),
    "log": lambda a: S.div(Num(1.0), a),
    "sqrt": lambda a: S.div(Num(0.5), S.call("sqrt", a)),
    "sigmoid": _sigmoid_prime,
    "tanh": lambda a: S.sub(Num(1.0), S.mul(S.call("tanh", a), S.call("tanh", a))),
    "softplus": lambda a: S.call("sigmoid", a),
    "erf": lambda a: S.mul(Num(_TWO_OVER_SQRT_PI), S.call("exp", S.neg(S.mul(a, a)))),
    "relu": lambda a: S.call("where", S.compare(">", a, Num(0.0)), Num(1.0), Num(0.0)),
    "gelu_tanh": _gelu_tanh_prime,
    "silu": _silu_prime,
}


def _call_derivative(node: Call, d: dict[Expr, Expr]) -> Expr:
    args = node.args
    da = [d[a] for a in args]
    fn = node.fn
    if fn in UNARY_DERIVATIVES:
        if da[0] == S.ZERO:
            return S.ZERO
        return S.mul(UNARY_DERIVATIVES[fn](args[0]), da[0])
    if fn == "where":
        return S.call("where", args[0], da[1], da[2])
    if fn == "min":
        return S.call("where", S.compare("<=", args[0], args[1]), da[0], da[1])
    if fn == "max":
        return S.call("where", S.compare(">=", args[0], args[1]), da[0], da[1])
    if fn == "clamp":
        x, lo, hi = args
        dx, dlo, dhi = da
        inside = S.call("where", S.compare("<=", x, hi), dx, dhi)
        below = S.call("where", S.compare("<=", lo, hi), dlo, dhi)
        return S.call("where", S.compare(">=", x, lo), inside, below)
    raise NotImplementedError(f"no derivative rule for {fn}")  # pragma: no cover


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
            d[node] = _call_derivative(node, d)
        else:  # pragma: no cover
            raise TypeError(f"cannot differentiate {node!r}")
    return d[expr]


def gradient(expr: Expr, var: str, dy: Expr | str = "dy") -> Expr:
    """The backward of an elementwise function: d expr / d var * dy, simplified."""
    if isinstance(dy, str):
        dy = Var(dy)
    return S.mul(differentiate(expr, var), dy)
