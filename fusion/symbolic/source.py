"""`to_source(expr)`: the .fpat expression text of an expression (the parser reads it back).

Printed by fusion/symbolic/printer.py (the one precedence table; parentheses only where needed; any depth);
numbers print exactly (printer.format_number).
"""
from __future__ import annotations

from fusion.symbolic.expr import Expr, Param, Var
from fusion.symbolic.printer import Atom, format_number, render

__all__ = ["to_source", "bindings_to_source", "format_number"]


def to_source(expr: Expr, names: dict[str, str] | None = None) -> str:
    """Expression text; `names` optionally renames Vars/Params when printing."""
    names = names or {}

    def form(node: Expr):
        if isinstance(node, (Var, Param)) and node.name in names:
            return Atom(names[node.name])
        return node.form()

    return render(expr, form)


def bindings_to_source(bindings, exprs, out_names=("forward",)) -> str:
    """`let` lines for bindings, then `name = expr` lines: the body of an activation declaration."""
    lines = [f"let {name} = {to_source(e)}" for name, e in bindings]
    lines += [f"{n} = {to_source(e)}" for n, e in zip(out_names, exprs)]
    return "\n".join(lines)
