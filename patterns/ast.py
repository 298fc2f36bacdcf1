"""Typed AST of .fpat files.

The parser (patterns/parser.py) produces these; the loader turns them into the activation registry and the
pattern library the planner matches. Every node keeps its source location so errors and explain() can
point at a file and line.

CONTRACT: the matcher/planner (fusion/matcher.py, fusion/planner.py) consumes FusionPattern, ChainElement
and Predicate exactly as declared here. Extend with new optional fields only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# re-exported: the expression nodes are part of this AST
from fusion.patterns.expr_ast import (EBinary, EBool, ECall, EIn, EName, ENum, EStr, EUnary,  # noqa: F401
                                      SourceLoc)


@dataclass(frozen=True)
class Predicate:
    """A constraint on one matched op's attributes, e.g. `in_features % 64 == 0`.

    `expr` is a small expression tree (never Python source); `holds(attrs)` evaluates it against an op's
    OpSpec.attrs (plus derived names the matcher adds such as `dtype`), and `text` is the source text,
    shown by explain() when the predicate fails.
    """

    text: str
    expr: Any
    loc: SourceLoc

    def holds(self, attrs: dict) -> bool:  # implemented by the parser's predicate evaluator
        from fusion.patterns.predicates import evaluate_predicate

        return bool(evaluate_predicate(self.expr, attrs))


@dataclass(frozen=True)
class ChainElement:
    """One position of a pattern's op chain.

    label: the name used in `save`, `export` and explain() (e.g. "gemm", "act").
    ops: op names ("GroupLinear", "Linear", "Scale", ...) or op kinds ("activation", "gemm",
         "elementwise", "quantize"); an op matches if its OpSpec.name or OpSpec.kind is listed.
    optional: `X?` in the source: the position may be absent.
    where: all must hold for the op to match.
    """

    label: str
    ops: tuple[str, ...]
    optional: bool
    where: tuple[Predicate, ...]
    loc: SourceLoc


@dataclass(frozen=True)
class FusionPattern:
    """`fusion NAME { ... }`: which op chain becomes which kernel, and what its forward saves.

    direction: "forward" — the chain's forward runs as one kernel; "backward" — the chain's backward
    (the last GEMM's dgrad plus the backward of the elementwise ops before it) runs as one kernel.
    save: forward patterns: the interior values the training kernel writes for the backward ("act.in"), at
          most what the kernel template writes (the loader checks); a backward pattern has none (its kernel
          reads what its chain's gradients need).
    export: interior results that may be used outside the match ("act.out"...).
    priority: higher wins overlaps; None means "number of ops covered".
    gemm_index: the GEMM element's position in the chain (the loader sets it; None: first for a forward
          pattern, last for a backward one).
    """

    name: str
    kernel: str
    direction: str
    chain: tuple[ChainElement, ...]
    loc: SourceLoc
    arch_min: int = 90
    arch_max: int | None = None
    dtypes: tuple[str, ...] = ("bfloat16", "float16")
    priority: int | None = None
    save: tuple[str, ...] = ()
    export: tuple[str, ...] = ()
    gemm_index: int | None = None

    @property
    def epilogue(self) -> tuple[str, ...]:
        """Labels of the elements the kernel's epilogue applies, in the order it applies them: forward, every
        element after the GEMM in chain order; backward, every element before it in reverse (the gradient
        flows back from the GEMM). Derived from the chain, so nothing can disagree with it: elements before a
        forward GEMM (Gather) are the kernel's A loads, not its epilogue."""
        k = self.gemm_index
        if k is None:
            k = len(self.chain) - 1 if self.direction == "backward" else 0
        if self.direction == "backward":
            return tuple(e.label for e in reversed(self.chain[:k]))
        return tuple(e.label for e in self.chain[k + 1:])


# ---------------------------------------------------------------------------------------------------------
# Activation declarations: `activation NAME(args; params) { let ... forward = ... grad(arg) = ... }`


@dataclass(frozen=True)
class ArgDecl:
    name: str
    loc: SourceLoc


@dataclass(frozen=True)
class ParamDecl:
    name: str
    type: str
    default: Any  # expression AST or None
    loc: SourceLoc
    type_loc: SourceLoc | None = None


@dataclass(frozen=True)
class LetStmt:
    name: str
    expr: Any
    loc: SourceLoc


@dataclass(frozen=True)
class ForwardStmt:
    expr: Any
    loc: SourceLoc


@dataclass(frozen=True)
class GradStmt:
    arg: str
    expr: Any
    loc: SourceLoc
    arg_loc: SourceLoc | None = None


@dataclass(frozen=True)
class ActivationDecl:
    name: str
    args: tuple[ArgDecl, ...]
    params: tuple[ParamDecl, ...]
    body: tuple  # LetStmt | ForwardStmt | GradStmt, in source order
    loc: SourceLoc
    name_loc: SourceLoc | None = None


# ---------------------------------------------------------------------------------------------------------
# Fusion declarations as written; the loader validates them into FusionPattern.


@dataclass(frozen=True)
class Value:
    """A field value: kind is "name", "ref" (label.port), "number", "string" or "bool"."""

    kind: str
    value: Any
    loc: SourceLoc


@dataclass(frozen=True)
class FieldItem:
    """`key = v1, v2` (op "=") or `key >= v` (a comparison, used by `arch`)."""

    key: str
    op: str
    values: tuple[Value, ...]
    loc: SourceLoc


@dataclass(frozen=True)
class ChainDecl:
    elements: tuple[ChainElement, ...]
    loc: SourceLoc
    #: per element: the location of each op name (parallel to element.ops), for "unknown op" errors
    op_locs: tuple[tuple[SourceLoc, ...], ...] = ()


@dataclass(frozen=True)
class FusionDecl:
    name: str
    items: tuple  # FieldItem | ChainDecl
    loc: SourceLoc
    name_loc: SourceLoc | None = None


@dataclass(frozen=True)
class PatternFile:
    path: str
    source: str
    decls: tuple  # ActivationDecl | FusionDecl
