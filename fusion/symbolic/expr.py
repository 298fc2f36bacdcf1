"""Expression IR nodes: immutable, hashable, structurally equal.

Every node caches its hash, so dictionaries keyed by nodes (CSE, memoised evaluation, derivative caches)
are cheap even for deep trees; equality is structural with an identity fast path.

Nodes
    Num(value)                 a float constant
    Var(name)                  an activation argument (gate, up, x...) or the incoming gradient `dy`
    Param(name, default)       a named parameter; `default` is None when the declaration gave none
    Call(fn, args)             a function of the registry (fusion/symbolic/functions.py), with its arity
    BinOp(op, lhs, rhs)        + - * / ** and comparisons < <= > >= == !=
    Neg(operand)               unary minus

Python operators build raw nodes (no simplification): `Var("x") * 2 + 1`. Comparisons are built with
`cmp("<", a, b)` because `==` on nodes is structural equality. Each node says how it prints (`form()`, for
fusion/symbolic/printer.py); repr() shows the expression text.
"""
from __future__ import annotations

from typing import Callable, Iterator

from fusion.symbolic.functions import FUNCTIONS
from fusion.symbolic.printer import COMPARE_OPS, Apply, Atom, Infix, Prefix, format_number, render

ARITH_OPS = ("+", "-", "*", "/", "**")
BINARY_OPS = ARITH_OPS + COMPARE_OPS


class Expr:
    """Base of every node. Subclasses define `_fields`; `_key` is the structural identity."""

    __slots__ = ("_key", "_hash")
    _fields: tuple[str, ...] = ()

    def _init(self, *values) -> None:
        key = (type(self).__name__,) + values
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Expr) or self._hash != other._hash:
            return False
        return self._key == other._key

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __reduce__(self):
        return (type(self), tuple(getattr(self, f) for f in self._fields))

    @property
    def children(self) -> tuple["Expr", ...]:
        return ()

    def rebuild(self, children: tuple["Expr", ...]) -> "Expr":
        """A node of the same kind with new children (raw, no simplification)."""
        return self

    def form(self):
        """How the node prints: a fusion.symbolic.printer Form whose children are nodes."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {render(self, lambda node: node.form())}>"

    # Raw arithmetic builders, handy in tests and in hand-written rules.
    def __add__(self, o): return BinOp("+", self, as_expr(o))
    def __radd__(self, o): return BinOp("+", as_expr(o), self)
    def __sub__(self, o): return BinOp("-", self, as_expr(o))
    def __rsub__(self, o): return BinOp("-", as_expr(o), self)
    def __mul__(self, o): return BinOp("*", self, as_expr(o))
    def __rmul__(self, o): return BinOp("*", as_expr(o), self)
    def __truediv__(self, o): return BinOp("/", self, as_expr(o))
    def __rtruediv__(self, o): return BinOp("/", as_expr(o), self)
    def __pow__(self, o): return BinOp("**", self, as_expr(o))
    def __rpow__(self, o): return BinOp("**", as_expr(o), self)
    def __neg__(self): return Neg(self)


class Num(Expr):
    __slots__ = ("value",)
    _fields = ("value",)

    def __init__(self, value: float):
        value = float(value)
        if value == 0.0:
            value = 0.0  # one zero: -0.0 and 0.0 are the same node
        object.__setattr__(self, "value", value)
        self._init(value)

    def form(self):
        return Atom(format_number(self.value))


class Var(Expr):
    __slots__ = ("name",)
    _fields = ("name",)

    def __init__(self, name: str):
        object.__setattr__(self, "name", str(name))
        self._init(self.name)

    def form(self):
        return Atom(self.name)


class Param(Expr):
    __slots__ = ("name", "default")
    _fields = ("name", "default")

    def __init__(self, name: str, default: float | None = None):
        object.__setattr__(self, "name", str(name))
        object.__setattr__(self, "default", None if default is None else float(default))
        self._init(self.name, self.default)

    def form(self):
        return Atom(self.name)


class Call(Expr):
    __slots__ = ("fn", "args")
    _fields = ("fn", "args")

    def __init__(self, fn: str, args):
        args = tuple(as_expr(a) for a in args)
        if fn not in FUNCTIONS:
            raise ValueError(f"unknown function {fn!r}; known: {', '.join(FUNCTIONS)}")
        if len(args) != FUNCTIONS[fn].arity:
            raise ValueError(f"{fn} takes {FUNCTIONS[fn].arity} arguments, got {len(args)}")
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "args", args)
        self._init(fn, args)

    @property
    def children(self):
        return self.args

    def rebuild(self, children):
        return Call(self.fn, children)

    def form(self):
        return Apply(self.fn, self.args)


class BinOp(Expr):
    __slots__ = ("op", "lhs", "rhs")
    _fields = ("op", "lhs", "rhs")

    def __init__(self, op: str, lhs, rhs):
        if op not in BINARY_OPS:
            raise ValueError(f"unknown binary operator {op!r}")
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "lhs", as_expr(lhs))
        object.__setattr__(self, "rhs", as_expr(rhs))
        self._init(op, self.lhs, self.rhs)

    @property
    def children(self):
        return (self.lhs, self.rhs)

    def rebuild(self, children):
        return BinOp(self.op, *children)

    def form(self):
        return Infix(self.op, self.lhs, self.rhs)


class Neg(Expr):
    __slots__ = ("operand",)
    _fields = ("operand",)

    def __init__(self, operand):
        object.__setattr__(self, "operand", as_expr(operand))
        self._init(self.operand)

    @property
    def children(self):
        return (self.operand,)

    def rebuild(self, children):
        return Neg(children[0])

    def form(self):
        return Prefix("-", self.operand)


def as_expr(value) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, bool):
        return Num(1.0 if value else 0.0)
    if isinstance(value, (int, float)):
        return Num(value)
    raise TypeError(f"cannot make an expression of {value!r}")


def call(fn: str, *args) -> Call:
    return Call(fn, args)


def cmp(op: str, lhs, rhs) -> BinOp:
    if op not in COMPARE_OPS:
        raise ValueError(f"{op!r} is not a comparison")
    return BinOp(op, lhs, rhs)


def where(cond, a, b) -> Call:
    return Call("where", (cond, a, b))


def postorder(roots) -> Iterator[Expr]:
    """Each distinct node once, children before parents (iterative: deep trees are fine)."""
    if isinstance(roots, Expr):
        roots = (roots,)
    seen: set[Expr] = set()
    for root in roots:
        stack: list[tuple[Expr, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in seen:
                continue
            if expanded:
                seen.add(node)
                yield node
            else:
                stack.append((node, True))
                for child in reversed(node.children):
                    if child not in seen:
                        stack.append((child, False))


def transform(roots, fn: Callable[[Expr, tuple[Expr, ...]], Expr]):
    """Rebuild bottom-up: fn(node, new_children) -> new node. Returns a list matching `roots`."""
    single = isinstance(roots, Expr)
    roots = (roots,) if single else tuple(roots)
    done: dict[Expr, Expr] = {}
    for node in postorder(roots):
        done[node] = fn(node, tuple(done[c] for c in node.children))
    out = [done[r] for r in roots]
    return out[0] if single else out


def substitute(expr, mapping: dict[Expr, Expr]):
    """Replace nodes (usually Var/Param) by expressions, raw (no simplification)."""
    return transform(expr, lambda n, ch: mapping[n] if n in mapping else n.rebuild(ch))


def free_vars(expr) -> set[str]:
    return {n.name for n in postorder(expr) if isinstance(n, Var)}


def free_params(expr) -> set[str]:
    return {n.name for n in postorder(expr) if isinstance(n, Param)}


def depends_on(expr: Expr, var: str) -> bool:
    return any(isinstance(n, Var) and n.name == var for n in postorder(expr))


def is_constant(expr: Expr) -> bool:
    """No Var inside (numbers and parameters only)."""
    return not any(isinstance(n, Var) for n in postorder(expr))


def size(expr) -> int:
    """Number of distinct nodes (a DAG measure)."""
    return sum(1 for _ in postorder(expr))
