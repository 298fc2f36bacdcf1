"""The one printer of the expression language, with its one precedence table.

Every expression text goes through `render`: fusion.symbolic expressions (to_source, repr, and the kernel code
of to_cute) and the .fpat AST (predicates, as explain() shows them). A caller says what each node is, as a
Form; the printer decides the parentheses:

    Atom(text)                a number, name, string or boolean (text starting with "-" binds like unary minus)
    Prefix(op, operand)       unary - + and not
    Infix(op, lhs, rhs)       + - * / % ** comparisons, and or
    Apply(fn, args)           fn(a, b, ...)
    Member(operand, choices)  operand in (a, b, ...)

Precedence, loosest first, is Python's, so the same printer writes pattern text and generated Python:
    or < and < not < comparisons, in < + - < * / % < unary - + < ** < atoms
`**` is right-associative and its exponent may be a unary minus (`x ** -p`); comparisons do not chain, so a
comparison inside a comparison is parenthesised; the other operators are left-associative. Parentheses appear
only where needed. Printing is iterative (children first), so an expression of any depth prints.

This module imports nothing of fusion, so the node modules (fusion/symbolic/expr.py,
fusion/patterns/expr_ast.py) can print with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

PRECEDENCE = {"or": 1, "and": 2, "not": 3, "cmp": 4, "in": 4, "+": 5, "-": 5, "*": 6, "/": 6, "%": 6, "neg": 7,
              "**": 8, "atom": 9}
COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")


@dataclass(frozen=True)
class Atom:
    text: str
    children = ()


@dataclass(frozen=True)
class Prefix:
    op: str
    operand: Any

    @property
    def children(self):
        return (self.operand,)


@dataclass(frozen=True)
class Infix:
    op: str
    lhs: Any
    rhs: Any

    @property
    def children(self):
        return (self.lhs, self.rhs)


@dataclass(frozen=True)
class Apply:
    fn: str
    args: tuple

    @property
    def children(self):
        return tuple(self.args)


@dataclass(frozen=True)
class Member:
    operand: Any
    choices: tuple

    @property
    def children(self):
        return (self.operand, *self.choices)


def format_number(v: float) -> str:
    """A number as the pattern language writes it: integers without a point, others by repr (exact)."""
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"{v} has no literal in the pattern language")
    if v.is_integer() and abs(v) < 1e16:
        return str(int(v))
    return repr(v)


def precedence(form) -> int:
    if isinstance(form, Atom):
        return PRECEDENCE["neg"] if form.text.startswith("-") else PRECEDENCE["atom"]
    if isinstance(form, Prefix):
        return PRECEDENCE["not"] if form.op == "not" else PRECEDENCE["neg"]
    if isinstance(form, Infix):
        return PRECEDENCE["cmp"] if form.op in COMPARE_OPS else PRECEDENCE[form.op]
    if isinstance(form, Member):
        return PRECEDENCE["in"]
    return PRECEDENCE["atom"]  # Apply


def _text(form, child: Callable[[Any, int], str]) -> str:
    """One node's text; child(node, need) is a child's text, parenthesised when it binds looser than `need`."""
    if isinstance(form, Atom):
        return form.text
    if isinstance(form, Apply):
        return f"{form.fn}({', '.join(child(a, 0) for a in form.args)})"
    p = precedence(form)
    if isinstance(form, Prefix):
        return ("not " if form.op == "not" else form.op) + child(form.operand, p)
    if isinstance(form, Member):
        return f"{child(form.operand, p + 1)} in ({', '.join(child(c, 0) for c in form.choices)})"
    if form.op == "**":
        return f"{child(form.lhs, p + 1)} ** {child(form.rhs, PRECEDENCE['neg'])}"
    if form.op in COMPARE_OPS:
        return f"{child(form.lhs, p + 1)} {form.op} {child(form.rhs, p + 1)}"
    return f"{child(form.lhs, p)} {form.op} {child(form.rhs, p + 1)}"


def render(root, form_of: Callable[[Any], Any]) -> str:
    """The text of the tree (or DAG) under `root`; form_of(node) gives a node's Form, whose children are nodes
    again. Each distinct node object is printed once."""
    forms: dict[int, Any] = {}
    texts: dict[int, str] = {}

    def child(node, need: int) -> str:
        text = texts[id(node)]
        return f"({text})" if precedence(forms[id(node)]) < need else text

    stack = [root]
    while stack:
        node = stack[-1]
        key = id(node)
        if key in texts:
            stack.pop()
            continue
        if key not in forms:
            forms[key] = form_of(node)
            pending = [c for c in forms[key].children if id(c) not in texts]
            if pending:
                stack.extend(reversed(pending))
                continue
        texts[key] = _text(forms[key], child)
        stack.pop()
    return texts[id(root)]
