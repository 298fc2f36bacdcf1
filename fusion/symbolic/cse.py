"""`cse(exprs)`: common-subexpression elimination into `let`-style bindings.

    bindings, outs = cse([forward, grad_gate, grad_up])
    # bindings: [("t0", sigmoid(gate)), ("t1", t0 * gate), ...] in dependency order
    # outs:     the expressions rewritten over the temporaries

A node is bound to a temporary when it is reached more than once (from two parents, or as two roots) and
is not a leaf (number, variable, parameter) or the negation of a leaf. Temporaries are `Var`s named
`{prefix}{i}`, skipping names already used by the expressions, so a printer emits them as locals
(to_cute) or `let`s (to_source).
"""
from __future__ import annotations

from fusion.symbolic.expr import Expr, Neg, Num, Param, Var, postorder


def _trivial(e: Expr) -> bool:
    return isinstance(e, (Num, Var, Param)) or (isinstance(e, Neg) and isinstance(e.operand, (Num, Var, Param)))


def cse(exprs, prefix: str = "t") -> tuple[list[tuple[str, Expr]], list[Expr]]:
    single = isinstance(exprs, Expr)
    roots = [exprs] if single else list(exprs)
    order = list(postorder(roots))
    uses: dict[Expr, int] = {n: 0 for n in order}
    for node in order:
        for child in node.children:
            uses[child] += 1
    for r in roots:
        uses[r] += 1
    taken = {n.name for n in order if isinstance(n, (Var, Param))}

    names: dict[Expr, str] = {}
    counter = 0
    for node in order:
        if uses[node] > 1 and not _trivial(node):
            while f"{prefix}{counter}" in taken:
                counter += 1
            names[node] = f"{prefix}{counter}"
            counter += 1

    rewritten: dict[Expr, Expr] = {}

    def ref(node: Expr) -> Expr:
        return Var(names[node]) if node in names else rewritten[node]

    bindings: list[tuple[str, Expr]] = []
    for node in order:
        new = node.rebuild(tuple(ref(c) for c in node.children)) if node.children else node
        rewritten[node] = new
        if node in names:
            bindings.append((names[node], new))
    outs = [ref(r) for r in roots]
    return bindings, outs
