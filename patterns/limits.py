"""Limits that keep a pattern file from exhausting the compiler: a file can neither overflow Python's recursion
nor make matching hang. Documented in docs/pattern-language.md ("Limits").

MAX_EXPRESSION_DEPTH: how deeply an expression may nest. Every operator, call, unary minus, name and number
is a level (parentheses are free); `x + x + x` is 3 deep, a sum of n terms n deep, n nested calls n + 1 deep.
It holds for each expression as written (checked on the parse tree, before anything recursive walks it) and
for every activation's `let` values, forward and gradients with lets and called activations expanded (the
codegen, printers and Python's own parser of the generated epilogue recurse once or more per level; at 150
levels Python's parser already refuses the generated code: "too many nested parentheses").

MAX_PREDICATE_EXPONENT and MAX_PREDICATE_INT_BITS: `**` in a chain predicate computes with Python integers,
which grow without bound (`in_features ** 999999999` took 21 s): exponents beyond the first, and integer
results beyond the second, are refused.
"""
from __future__ import annotations

from lark import Tree

MAX_EXPRESSION_DEPTH = 100
MAX_PREDICATE_EXPONENT = 64
MAX_PREDICATE_INT_BITS = 4096

#: The parse-tree rules (fpat.lark aliases) that are expression nodes; each is one level.
EXPRESSION_RULES = frozenset({"or_", "and_", "not_", "compare", "in_", "binary", "neg", "pos", "pow", "number",
                              "string", "true", "false", "name", "call"})


def too_deep(tree: Tree):
    """The outermost expression node of the first expression nested deeper than MAX_EXPRESSION_DEPTH, and its
    depth; None when every expression is within the limit. Iterative: any depth of tree is fine."""
    stack = [(tree, 0, None)]  # (node, expression depth above it, its outermost expression ancestor)
    while stack:
        node, depth, root = stack.pop()
        if node.data in EXPRESSION_RULES:
            depth, root = depth + 1, root or node
            if depth > MAX_EXPRESSION_DEPTH:
                return root, _depth(root)
        stack.extend((c, depth, root) for c in node.children if isinstance(c, Tree))
    return None


def _depth(tree: Tree) -> int:
    deepest, stack = 0, [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        depth += node.data in EXPRESSION_RULES
        deepest = max(deepest, depth)
        stack.extend((c, depth) for c in node.children if isinstance(c, Tree))
    return deepest


def expr_depth(expr, cache: dict) -> int:
    """Depth of a fusion.symbolic expression (a DAG: shared nodes count once per path), iteratively; `cache`
    (node -> depth) is shared across the expressions of one declaration, so each node is measured once."""
    stack = [expr]
    while stack:
        node = stack[-1]
        if node in cache:
            stack.pop()
            continue
        pending = [c for c in node.children if c not in cache]
        if pending:
            stack.extend(pending)
            continue
        cache[node] = 1 + max((cache[c] for c in node.children), default=0)
        stack.pop()
    return cache[expr]


def power_problem(base, exponent) -> str | None:
    """Why a predicate may not compute base ** exponent (numbers), or None when it may."""
    if abs(exponent) > MAX_PREDICATE_EXPONENT:
        return (f"exponent {exponent!r} is beyond the limit of {MAX_PREDICATE_EXPONENT} for '**' in a predicate "
                f"(predicates compare sizes; a larger power only costs time)")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and base.bit_length() * exponent > MAX_PREDICATE_INT_BITS:
        return (f"{base!r} ** {exponent!r} has more than {MAX_PREDICATE_INT_BITS} bits, beyond the limit for "
                f"integers in a predicate")
    return None
