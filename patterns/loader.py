"""AST -> (activation definitions, fusion patterns), with semantic checks reported at their source location.

    load_ast(pf, known_activations, known_patterns, builtin=False) -> (list[ActivationDef], list[FusionPattern])

`known_*` are what is already registered (name -> definition/pattern): activations may call activations
declared earlier (in this file or a file loaded before); a name declared twice is an error.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from fusion.patterns import ast as A
from fusion.patterns.activation import DY, ActivationDef
from fusion.patterns.diagnostics import did_you_mean, make_error
from fusion.patterns.files import BUILTIN_DIR
from fusion.patterns.limits import MAX_EXPRESSION_DEPTH, expr_depth
from fusion.patterns.predicates import check_predicate
from fusion.symbolic import (
    BinOp, Call, FUNCTIONS, Expr, Neg, Num, Param, Var, evaluate, gradient, is_constant, simplify,
    substitute,
)

from fusion.op_table import OP_KINDS, OP_TABLE
DTYPES = ("bfloat16", "float16", "float32")
DIRECTIONS = ("forward", "backward")
PORTS = ("in", "out")
FIELDS = ("kernel", "direction", "arch", "dtype", "priority", "epilogue", "save", "export")
PARAM_TYPES = ("float",)
_ARCH_RE = re.compile(r"^sm_(\d+)a?$")




def op_names() -> tuple[str, ...]:
    """The op names a chain element may list: the op table of fusion.ops (every op class defined so far)."""
    return tuple(OP_TABLE)


def ops_of_kind(kind: str) -> tuple[str, ...]:
    """The op names of one kind, and the kind itself (a chain element may list either)."""
    return tuple(name for name, k in OP_TABLE.items() if k == kind) + (kind,)


class _Ctx:
    def __init__(self, pf: A.PatternFile):
        self.pf = pf

    def error(self, loc: A.SourceLoc, message: str, expected: str | None = None):
        return make_error(loc, self.pf.source, message, expected)


# ===================================================================================================== activations
class _Scope:
    """Names visible in an activation expression: arguments, parameters, lets (in order), dy (in grads)."""

    def __init__(self, decl: A.ActivationDecl, ctx: _Ctx):
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


def _constant_value(e, ctx: _Ctx, what: str) -> float:
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


def _check_depth(expr: Expr, cache: dict, ctx: _Ctx, loc: A.SourceLoc, what: str) -> Expr:
    """`expr` (lets and called activations expanded) nests at most MAX_EXPRESSION_DEPTH levels."""
    depth = expr_depth(expr, cache)
    if depth > MAX_EXPRESSION_DEPTH:
        raise ctx.error(loc, f"{what}, with the lets and activations it uses expanded, is nested {depth} levels "
                             f"deep; the limit is {MAX_EXPRESSION_DEPTH}",
                        expected="a shallower expression (docs/pattern-language.md, Limits)")
    return expr


def _activation(decl: A.ActivationDecl, ctx: _Ctx, acts: dict[str, ActivationDef], builtin: bool) -> ActivationDef:
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


# ===================================================================================================== fusions
def _arch(item: A.FieldItem, ctx: _Ctx) -> tuple[int | None, int | None]:
    v = item.values[0]
    m = _ARCH_RE.match(str(v.value)) if v.kind == "name" else None
    if len(item.values) != 1 or not m:
        raise ctx.error(v.loc, f"arch takes one architecture like sm_90, got {v.value!r}", expected="sm_<number>")
    n = int(m.group(1))
    return {"=": (n, n), "==": (n, n), ">=": (n, None), ">": (n + 1, None), "<=": (None, n),
            "<": (None, n - 1)}.get(item.op, (None, None)) if item.op != "!=" else _arch_ne(item, ctx)


def _arch_ne(item, ctx):
    raise ctx.error(item.loc, "arch supports == >= > <= < (not !=)")


def _names(item: A.FieldItem, ctx: _Ctx, what: str) -> tuple[str, ...]:
    out = []
    for v in item.values:
        if v.kind not in ("name", "string"):
            raise ctx.error(v.loc, f"{item.key} takes {what}, got {v.value!r}")
        out.append(str(v.value))
    return tuple(out)


def _fusion(decl: A.FusionDecl, ctx: _Ctx, builtin: bool) -> A.FusionPattern:
    seen: dict[str, A.SourceLoc] = {}
    fields: dict[str, A.FieldItem] = {}
    arch_items: list[A.FieldItem] = []
    options: dict = {}
    chain_decl: A.ChainDecl | None = None
    for item in decl.items:
        if isinstance(item, A.ChainDecl):
            if chain_decl is not None:
                raise ctx.error(item.loc, f"fusion '{decl.name}' has a second chain (the first is at line "
                                          f"{chain_decl.loc.line})")
            chain_decl = item
        elif isinstance(item, A.OptionItem):
            if item.key in options:
                raise ctx.error(item.loc, f"option '{item.key}' is given twice")
            options[item.key] = item.value.value
        else:
            if item.key not in FIELDS:
                raise ctx.error(item.loc, f"unknown field '{item.key}'{did_you_mean(item.key, FIELDS)}",
                                expected="one of: " + ", ".join(FIELDS) + ", chain { ... }, option NAME = value")
            if item.op != "=" and item.key != "arch":
                raise ctx.error(item.loc, f"'{item.key}' is set with '=', not '{item.op}'")
            if item.key == "arch":
                arch_items.append(item)
                continue
            if item.key in seen:
                raise ctx.error(item.loc, f"field '{item.key}' is given twice (first at line {seen[item.key].line})")
            seen[item.key] = item.loc
            fields[item.key] = item

    name_loc = decl.name_loc or decl.loc
    if chain_decl is None or not chain_decl.elements:
        raise ctx.error(chain_decl.loc if chain_decl else name_loc,
                        f"fusion '{decl.name}' needs a non-empty `chain {{ label: Op ... }}`")
    if "kernel" not in fields:
        raise ctx.error(name_loc, f"fusion '{decl.name}' needs `kernel = NAME` (the kernel template)")

    # chain
    labels: dict[str, A.ChainElement] = {}
    names = op_names()
    known_ops = names + OP_KINDS
    for k, el in enumerate(chain_decl.elements):
        if el.label in labels:
            raise ctx.error(el.loc, f"label '{el.label}' is used twice in the chain")
        labels[el.label] = el
        op_locs = chain_decl.op_locs[k] if k < len(chain_decl.op_locs) else (el.loc,) * len(el.ops)
        for op, loc in zip(el.ops, op_locs):
            if op not in known_ops:
                raise ctx.error(loc, f"unknown op '{op}'{did_you_mean(op, known_ops)}",
                                expected="an op name (" + ", ".join(names) + ") or kind (" +
                                         ", ".join(OP_KINDS) + ")")
        for p in el.where:
            check_predicate(p.expr, ctx.error)

    direction = "forward"
    if "direction" in fields:
        (direction,) = _names(fields["direction"], ctx, "forward or backward")[:1] or ("",)
        if direction not in DIRECTIONS or len(fields["direction"].values) != 1:
            raise ctx.error(fields["direction"].values[0].loc, f"direction must be forward or backward, "
                                                               f"got {direction!r}", expected="forward, backward")
    gemm_ops, gather_ops = set(ops_of_kind("gemm")), set(ops_of_kind("gather"))
    gemm_positions = [k for k, el in enumerate(chain_decl.elements) if set(el.ops) <= gemm_ops]
    any_gemm = [k for k, el in enumerate(chain_decl.elements) if set(el.ops) & gemm_ops]
    # A forward kernel may load its A rows through an index: gather elements (not optional) may lead the GEMM.
    lead = 0
    while (direction == "forward" and lead < len(chain_decl.elements) - 1
           and set(chain_decl.elements[lead].ops) <= gather_ops and not chain_decl.elements[lead].optional):
        lead += 1
    want = lead if direction == "forward" else len(chain_decl.elements) - 1
    if gemm_positions != [want] or any_gemm != [want] or chain_decl.elements[want].optional:
        where_ = ("first (only Gather elements may precede it: the GEMM loads its A rows through their index)"
                  if direction == "forward" else "last")
        el = chain_decl.elements[want]
        raise ctx.error(el.loc, f"a {direction} fusion's chain has exactly one GEMM element ("
                                f"{', '.join(sorted(gemm_ops - {'gemm'}))} or gemm), not optional, and it comes "
                                f"{where_}: the kernel is a GEMM with an epilogue")

    kernel = _names(fields["kernel"], ctx, "a kernel template name")
    if len(kernel) != 1:
        raise ctx.error(fields["kernel"].loc, "kernel takes one name")
    arch_min, arch_max = 90, None
    if arch_items:
        arch_min = None
        for item in arch_items:
            lo, hi = _arch(item, ctx)
            if lo is not None:
                arch_min = lo if arch_min is None else max(arch_min, lo)
            if hi is not None:
                arch_max = hi if arch_max is None else min(arch_max, hi)
        if arch_min is None:
            arch_min = 0
        if arch_max is not None and arch_max < arch_min:
            raise ctx.error(arch_items[-1].loc, f"the arch constraints leave no architecture "
                                                f"(sm_{arch_min} .. sm_{arch_max})")
    dtypes = ("bfloat16", "float16")
    if "dtype" in fields:
        dtypes = _names(fields["dtype"], ctx, "dtype names")
        for v, d in zip(fields["dtype"].values, dtypes):
            if d not in DTYPES:
                raise ctx.error(v.loc, f"unknown dtype '{d}'{did_you_mean(d, DTYPES)}",
                                expected="one of: " + ", ".join(DTYPES))
    priority = None
    if "priority" in fields:
        v = fields["priority"].values[0]
        if v.kind != "number" or not float(v.value).is_integer() or len(fields["priority"].values) != 1:
            raise ctx.error(v.loc, f"priority takes one integer, got {v.value!r}")
        priority = int(v.value)
    epilogue = ()
    if "epilogue" in fields:
        epilogue = _names(fields["epilogue"], ctx, "chain labels")
        for v, lab in zip(fields["epilogue"].values, epilogue):
            if lab not in labels:
                raise ctx.error(v.loc, f"epilogue: '{lab}' is not a label of the chain{did_you_mean(lab, labels)}",
                                expected="one of: " + ", ".join(labels))
            if set(labels[lab].ops) & gemm_ops:
                raise ctx.error(v.loc, f"epilogue: '{lab}' is the GEMM itself; the epilogue lists the ops "
                                       f"applied after it")
        if len(set(epilogue)) != len(epilogue):
            raise ctx.error(fields["epilogue"].loc, "epilogue lists a label twice")
    refs = {}
    for key in ("save", "export"):
        out = []
        if key in fields:
            for v in fields[key].values:
                if v.kind != "ref":
                    raise ctx.error(v.loc, f"{key} takes label.in or label.out, got {v.value!r}",
                                    expected="label.in or label.out, e.g. gemm.out")
                lab, port = str(v.value).split(".", 1)
                if lab not in labels:
                    raise ctx.error(v.loc, f"{key}: '{lab}' is not a label of the chain"
                                           f"{did_you_mean(lab, labels)}", expected="one of: " + ", ".join(labels))
                if port not in PORTS:
                    raise ctx.error(v.loc, f"{key}: '{lab}.{port}': a port is 'in' or 'out'", expected="in, out")
                out.append(f"{lab}.{port}")
        refs[key] = tuple(out)
    return A.FusionPattern(name=decl.name, kernel=kernel[0], direction=direction, chain=chain_decl.elements,
                           epilogue=epilogue, loc=decl.loc, arch_min=arch_min, arch_max=arch_max, dtypes=dtypes,
                           priority=priority, save=refs["save"], export=refs["export"],
                           options=options)


# ===================================================================================================== files
def load_ast(pf: A.PatternFile, known_activations: dict | None = None, known_patterns: dict | None = None,
             builtin: bool = False) -> tuple[list[ActivationDef], list[A.FusionPattern]]:
    ctx = _Ctx(pf)
    acts = dict(known_activations or {})
    pats = dict(known_patterns or {})
    new_acts: list[ActivationDef] = []
    new_pats: list[A.FusionPattern] = []
    for decl in pf.decls:
        name_loc = decl.name_loc or decl.loc
        if isinstance(decl, A.ActivationDecl):
            if decl.name in acts:
                raise ctx.error(name_loc, _redefined("activation", decl.name, acts[decl.name].loc,
                                                     is_builtin_file(acts[decl.name].loc.file)))
            d = _activation(decl, ctx, acts, builtin)
            acts[d.name] = d
            new_acts.append(d)
        else:
            if decl.name in pats:
                p = pats[decl.name]
                raise ctx.error(name_loc, _redefined("fusion pattern", decl.name, p.loc,
                                                     is_builtin_file(p.loc.file)))
            p = _fusion(decl, ctx, builtin)
            pats[p.name] = p
            new_pats.append(p)
    return new_acts, new_pats


def is_builtin_file(path: str) -> bool:
    try:
        return Path(path).resolve().parent == BUILTIN_DIR
    except (OSError, ValueError):  # pragma: no cover
        return False


def _redefined(what: str, name: str, loc: A.SourceLoc, builtin: bool) -> str:
    origin = "a built-in, " if builtin else ""
    return (f"{what} '{name}' is already defined ({origin}at {loc.file}:{loc.line}:{loc.column}); "
            f"names are global across loaded files: pick another name")


def expression_from_source(text: str, args=("x",), params: dict | None = None, allow_dy: bool = True,
                           activations: dict | None = None, filename: str = "<expr>") -> Expr:
    """Parse one activation expression to a fusion.symbolic expression, with `args` as Vars and `params`
    (name -> default) as Params in scope (and `dy` when allow_dy). The inverse of fusion.symbolic.to_source."""
    from fusion.patterns.parser import parse_expression

    e = parse_expression(text, filename)
    pf = A.PatternFile(filename, "activation __expr__(__x__) { forward =\n" + text + "\n}", ())
    scope = _Scope(A.ActivationDecl("__expr__", (), (), (), A.SourceLoc(filename, 1, 1)), _Ctx(pf))
    for a in args:
        scope.names[a] = Var(a)
    for n, d in (params or {}).items():
        scope.names[n] = Param(n, d)
    return _to_expr(e, scope, dict(activations or {}), allow_dy)
