"""An activation declaration's AST -> ActivationDef: names in scope, expressions, defaults and limits.

Why its own module: an activation body is a small language of its own (arguments, parameters, lets in order,
`dy` in grads, calls of earlier activations expanded inline), and every rule about it lives here, reported at
its source location. Fusion patterns are checked in fusion_semantics.py; loader.py puts files together.

    activation_def(decl, ctx, known_activations, builtin) -> ActivationDef
    expression_from_source(text, args, params) -> a fusion.symbolic expression (the inverse of to_source)
"""
from __future__ import annotations

import math

from fusion.patterns import ast as A
from fusion.patterns.activation import DY, ActivationDef
from fusion.patterns.diagnostics import SourceContext, did_you_mean
from fusion.patterns.limits import MAX_EXPRESSION_DEPTH, expr_depth
from fusion.symbolic import (
    BinOp, Call, FUNCTIONS, Expr, Neg, Num, Param, Var, evaluate, gradient, is_constant, simplify,
    substitute,
)

PARAM_TYPES = ("float",)


class _Scope:
    """Names visible in an activation expression: arguments, parameters, lets (in order), dy (in grads)."""

    def __init__(self, decl: A.ActivationDecl, ctx: SourceContext):
        self.decl, self.ctx = decl, ctx
        self.names: dict[str, Expr] = {}
        self.kinds: dict[str, str] = {}
        self.later_lets: dict[str, A.SourceLoc] = {}


def _to_expr(e, scope: _Scope, acts: dict[str, ActivationDef], allow_dy: bool) -> Expr:
    ctx = scope.ctx

    def unknown_function(e: A.ECall):
        names = list(dict.fromkeys([*FUNCTIONS, *acts]))
        user = [a for a in acts if a not in FUNCTIONS]
        raise ctx.error(e.loc, f"unknown function '{e.fn}'{did_you_mean(e.fn, names)}",
                        expected="a function (" + ", ".join(FUNCTIONS) + ")" +
                                 (" or a declared activation (" + ", ".join(user) + ")" if user else ""))

    def go(e) -> Expr:
        if isinstance(e, A.ENum):
            return Num(e.value)
        if isinstance(e, A.EName):
            if e.name == DY and allow_dy:
                return Var(DY)
            if e.name in scope.names:
                return scope.names[e.name]
            if e.name in scope.later_lets:
                where = scope.later_lets[e.name]
                if getattr(scope, "current_let", None) == e.name:
                    raise ctx.error(e.loc, f"'{e.name}' is defined in terms of itself")
                raise ctx.error(e.loc, f"'{e.name}' is used before its definition (let at line {where.line}); "
                                       f"a let may use only names defined above it, so lets cannot be cyclic")
            if e.name == DY:
                raise ctx.error(e.loc, "'dy' (the incoming gradient) exists only in `grad(arg) = ...`")
            if e.name in FUNCTIONS or e.name in acts:
                raise ctx.error(e.loc, f"'{e.name}' is a function; call it: {e.name}(...)")
            known = list(scope.names) + ([DY] if allow_dy else [])
            raise ctx.error(e.loc, f"unknown name '{e.name}'{did_you_mean(e.name, known)}",
                            expected="one of: " + ", ".join(known))
        if isinstance(e, A.EUnary):
            if e.op == "not":
                raise ctx.error(e.loc, "'not' is for chain predicates; in an activation use where(cond, a, b)")
            v = go(e.operand)
            return Neg(v) if e.op == "-" else v
        if isinstance(e, A.EBinary):
            if e.op in ("and", "or"):
                raise ctx.error(e.loc, f"'{e.op}' is for chain predicates; in an activation nest where(...) "
                                       f"conditions instead")
            if e.op == "%":
                raise ctx.error(e.loc, "'%' is for chain predicates, not activation expressions")
            lhs, rhs = go(e.lhs), go(e.rhs)
            if e.op == "**" and not is_constant(rhs):
                raise ctx.error(e.rhs.loc, "the exponent of '**' must be constant (numbers and parameters); "
                                           "for a variable exponent write exp(b * log(a))")
            return BinOp(e.op, lhs, rhs)
        if isinstance(e, A.ECall):
            if e.fn not in FUNCTIONS and e.fn not in acts:
                unknown_function(e)
            args = [go(a) for a in e.args]
            if e.fn in FUNCTIONS:
                n = FUNCTIONS[e.fn].arity
                if len(args) != n:
                    raise ctx.error(e.loc, f"{e.fn}() takes {n} argument{'s' if n != 1 else ''}, got {len(args)}")
                return Call(e.fn, tuple(args))
            if e.fn in acts:
                callee = acts[e.fn]
                if len(args) != len(callee.args):
                    raise ctx.error(e.loc, f"activation {e.fn}() takes {len(callee.args)} argument"
                                           f"{'s' if len(callee.args) != 1 else ''} ({', '.join(callee.args)}), "
                                           f"got {len(args)}")
                mapping = {Var(a): v for a, v in zip(callee.args, args)}
                mapping.update({Param(n, d): Num(d) for n, d in callee.params})  # callee params: defaults
                return substitute(callee.forward_expr, mapping)
            unknown_function(e)  # pragma: no cover - checked above
        if isinstance(e, A.EStr):
            raise ctx.error(e.loc, "strings are for chain predicates, not activation expressions")
        if isinstance(e, A.EBool):
            raise ctx.error(e.loc, "true/false are for chain predicates; in an activation use 1 and 0")
        if isinstance(e, A.EIn):
            raise ctx.error(e.loc, "'in' is for chain predicates, not activation expressions")
        raise ctx.error(getattr(e, "loc", scope.decl.loc), f"unexpected expression {e!r}")  # pragma: no cover

    return go(e)


def _constant_value(e, ctx: SourceContext, what: str) -> float:
    """A parameter default: numbers, arithmetic and functions of numbers, with a finite value."""
    dummy = A.ActivationDecl("", (), (), (), e.loc)
    scope = _Scope(dummy, ctx)
    expr = simplify(_to_expr(e, scope, {}, allow_dy=False))  # unknown names (not constants) raise here
    if isinstance(expr, Num) and math.isfinite(expr.value):
        return expr.value
    value = float(evaluate(expr, {}))  # the folding left it (or made inf): what is it?
    if math.isinf(value):
        raise ctx.error(e.loc, f"{what} overflows: it evaluates to {value}, beyond float64's range (about "
                               f"1.8e308), or divides by zero")
    raise ctx.error(e.loc, f"{what} is not a real number: it evaluates to {value}")


def _check_depth(expr: Expr, cache: dict, ctx: SourceContext, loc: A.SourceLoc, what: str) -> Expr:
    """`expr` (lets and called activations expanded) nests at most MAX_EXPRESSION_DEPTH levels."""
    depth = expr_depth(expr, cache)
    if depth > MAX_EXPRESSION_DEPTH:
        raise ctx.error(loc, f"{what}, with the lets and activations it uses expanded, is nested {depth} levels "
                             f"deep; the limit is {MAX_EXPRESSION_DEPTH}",
                        expected="a shallower expression (docs/pattern-language.md, Limits)")
    return expr


def activation_def(decl: A.ActivationDecl, ctx: SourceContext, acts: dict[str, ActivationDef],
                   builtin: bool) -> ActivationDef:
    """The ActivationDef of `activation NAME(args; params) { ... }`: lets inlined in order, the forward and
    every gradient (given, else derived) as fusion.symbolic expressions, within the nesting limit."""
    name_loc = decl.name_loc or decl.loc
    if len(decl.args) not in (1, 2):
        raise ctx.error(name_loc, f"activation '{decl.name}' has {len(decl.args)} arguments; an activation "
                                  f"takes 1 (x) or 2 (gate, up: gated)")
    scope = _Scope(decl, ctx)
    defined: dict[str, A.SourceLoc] = {}

    def define(name: str, loc: A.SourceLoc, what: str, value: Expr):
        if name == DY:
            raise ctx.error(loc, f"'dy' is reserved for the incoming gradient; name the {what} differently")
        if name in FUNCTIONS:
            raise ctx.error(loc, f"'{name}' is a built-in function; name the {what} differently")
        if name in defined:
            first = defined[name]
            raise ctx.error(loc, f"'{name}' is already defined (line {first.line}, column {first.column})")
        defined[name] = loc
        scope.names[name] = value

    for a in decl.args:
        define(a.name, a.loc, "argument", Var(a.name))
    params = []
    for p in decl.params:
        if p.type not in PARAM_TYPES:
            raise ctx.error(p.type_loc or p.loc, f"unknown parameter type '{p.type}'",
                            expected=" or ".join(PARAM_TYPES))
        if p.default is None:
            raise ctx.error(p.loc, f"parameter '{p.name}' needs a default: `{p.name}: float = 1.0`")
        default = _constant_value(p.default, ctx, f"the default of '{p.name}'")
        define(p.name, p.loc, "parameter", Param(p.name, default))
        params.append((p.name, default))

    for s in decl.body:
        if isinstance(s, A.LetStmt):
            scope.later_lets.setdefault(s.name, s.loc)

    lets, forward, grads = [], None, {}
    depths: dict = {}  # expression node -> depth, shared by this declaration's checks
    grad_stmts: list[A.GradStmt] = []
    for s in decl.body:
        if isinstance(s, A.LetStmt):
            scope.current_let = s.name
            if s.name in defined:  # report the duplicate before evaluating a self-reference
                first = defined[s.name]
                raise ctx.error(s.loc, f"'{s.name}' is already defined (line {first.line}, column {first.column})")
            value = _check_depth(_to_expr(s.expr, scope, acts, allow_dy=False), depths, ctx, s.loc,
                                 f"let '{s.name}'")
            scope.current_let = None
            scope.later_lets.pop(s.name, None)
            define(s.name, s.loc, "let", value)
            lets.append((s.name, value))
        elif isinstance(s, A.ForwardStmt):
            if forward is not None:
                raise ctx.error(s.loc, f"activation '{decl.name}' has a second `forward = ...` "
                                       f"(the first is at line {forward[1].line})")
            forward = (_check_depth(_to_expr(s.expr, scope, acts, allow_dy=False), depths, ctx, s.loc,
                                    "the forward"), s.loc)
        else:
            grad_stmts.append(s)
            if s.arg not in [a.name for a in decl.args]:
                args = ", ".join(a.name for a in decl.args)
                raise ctx.error(s.arg_loc or s.loc, f"grad({s.arg}): '{s.arg}' is not an argument of "
                                                    f"'{decl.name}'", expected=f"one of its arguments: {args}")
            if s.arg in grads:
                raise ctx.error(s.loc, f"a second grad({s.arg}) in activation '{decl.name}'")
            grads[s.arg] = _check_depth(_to_expr(s.expr, scope, acts, allow_dy=True), depths, ctx, s.loc,
                                        f"grad({s.arg})")
    if forward is None:
        raise ctx.error(name_loc, f"activation '{decl.name}' has no `forward = ...`")
    fwd = forward[0]
    arg_names = tuple(a.name for a in decl.args)
    grad_exprs, given = {}, {}
    for a in arg_names:
        if a in grads:
            grad_exprs[a], given[a] = grads[a], True
        else:
            grad_exprs[a], given[a] = _check_depth(gradient(fwd, a), depths, ctx, forward[1],
                                                   f"the derived gradient of '{a}'"), False
    return ActivationDef(decl.name, arg_names, tuple(params), fwd, grad_exprs, decl.loc, tuple(lets), given,
                         builtin)


def expression_from_source(text: str, args=("x",), params: dict | None = None, allow_dy: bool = True,
                           activations: dict | None = None, filename: str = "<expr>") -> Expr:
    """Parse one activation expression to a fusion.symbolic expression, with `args` as Vars and `params`
    (name -> default) as Params in scope (and `dy` when allow_dy). The inverse of fusion.symbolic.to_source."""
    from fusion.patterns.parser import parse_expression

    e = parse_expression(text, filename)
    pf = A.PatternFile(filename, "activation __expr__(__x__) { forward =\n" + text + "\n}", ())
    scope = _Scope(A.ActivationDecl("__expr__", (), (), (), A.SourceLoc(filename, 1, 1)), SourceContext(pf))
    for a in args:
        scope.names[a] = Var(a)
    for n, d in (params or {}).items():
        scope.names[n] = Param(n, d)
    return _to_expr(e, scope, dict(activations or {}), allow_dy)
