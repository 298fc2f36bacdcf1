"""The expression nodes of `.fpat` files and their source locations: one expression language for activation
bodies and chain predicates. A module of its own so that the predicate evaluator (fusion.patterns.predicates)
needs only these, not the pattern declarations that call it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusion.symbolic.printer import Apply, Atom, Infix, Member, Prefix, format_number, render


@dataclass(frozen=True)
class SourceLoc:
    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


# ---------------------------------------------------------------------------------------------------------
# Expression AST: one expression language for activation bodies and chain predicates. The loader turns
# activation expressions into fusion.symbolic nodes; predicates keep these nodes (Predicate.expr) and are
# evaluated by fusion.patterns.predicates.evaluate_predicate, never by Python eval. Each node says how it prints
# (`form()`): render_expression prints through the language's one printer (fusion/symbolic/printer.py).


def render_expression(e) -> str:
    """Canonical text of an expression AST (what explain() shows for a predicate)."""
    return render(e, lambda node: node.form())


@dataclass(frozen=True)
class ENum:
    value: float
    loc: SourceLoc
    is_int: bool = False

    def form(self):
        return Atom(format_number(self.value))


@dataclass(frozen=True)
class EStr:
    value: str
    loc: SourceLoc

    def form(self):
        return Atom(f'"{self.value}"')


@dataclass(frozen=True)
class EBool:
    value: bool
    loc: SourceLoc

    def form(self):
        return Atom("true" if self.value else "false")


@dataclass(frozen=True)
class EName:
    name: str
    loc: SourceLoc

    def form(self):
        return Atom(self.name)


@dataclass(frozen=True)
class ECall:
    fn: str
    args: tuple
    loc: SourceLoc

    def form(self):
        return Apply(self.fn, self.args)


@dataclass(frozen=True)
class EUnary:
    """op: "-", "+" or "not"."""

    op: str
    operand: Any
    loc: SourceLoc

    def form(self):
        return Prefix(self.op, self.operand)


@dataclass(frozen=True)
class EBinary:
    """op: + - * / % **, comparisons < <= > >= == !=, or the logical "and" / "or"."""

    op: str
    lhs: Any
    rhs: Any
    loc: SourceLoc

    def form(self):
        return Infix(self.op, self.lhs, self.rhs)


@dataclass(frozen=True)
class EIn:
    """`operand in (a, b, ...)`."""

    operand: Any
    choices: tuple
    loc: SourceLoc

    def form(self):
        return Member(self.operand, self.choices)
