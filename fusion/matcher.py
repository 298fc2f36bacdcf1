"""Match FusionPatterns (patterns/ast.py) against an op graph (fusion/graph.py).

A pattern's chain is matched by a direct walk along data edges (operand 0) from an anchor op: each chain
element binds the next op if the op's name or kind is listed (`optional` elements may be skipped); where an
op has several data consumers (a DAG), the walk branches. Every structurally possible binding is then
checked, largest first, against:

  0. kernel template  the pattern's kernel template runs in this build (fusion/kernel_templates.py)
  1. dtype            the pattern's `dtypes` contains the plan's dtype
  2. arch             the target's arch number lies in [arch_min, arch_max]
  3. predicates       every `where` of every bound element holds on the op's attrs (+ dtype, op, kind,
                      in_features / out_features where the op's attrs lack them, and weight_format "bf16" for
                      a GEMM whose attrs lack it)
  4. interior results the output of every bound op but the last has no consumer outside the match, unless
                      the pattern exports it (`label.out`)
  5. weight formats   the template's mainloop runs every bound GEMM's weight_format (a pattern that forgot
                      `weight_format == "bf16"` still never puts an fp8_block GEMM into a bf16 kernel)
  6. saves            every value a forward pattern's `save` names is read by the gradient of the bound op it
                      enters (the kernel would otherwise write it for nothing: a Scale by a constant)

The first binding passing all checks is the match of that (pattern, anchor); otherwise the attempt records
the first failing check of the largest binding, in words (Attempt.reason). Everything is deterministic:
patterns in library order, anchors in op order, bindings largest first then earliest.

Overlaps are resolved by `resolve`: candidates sorted by priority (explicit, else number of ops covered),
then library order, then position; greedily taken when they cover nothing already taken. Forward and
backward patterns are resolved separately (see `Match.covers`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import networkx as nx

import fusion.kernel_templates as templates
from fusion.graph import consumers, data_successors, node_text, op_nodes
from fusion.patterns.files import BUILTIN_DIR
from fusion.targets import arch as target_arch


# -- normalisation ----------------------------------------------------------------------------------------
def dtype_name(dtype) -> str:
    """torch.bfloat16 -> "bfloat16"; a string is returned as is."""
    if dtype is None:
        return "bfloat16"
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    return str(dtype).removeprefix("torch.")


def arch_of(target: str | None) -> int | None:
    """"sm_90" / "sm_90a" / "sm90" -> 90; None or "cpu" -> None. Raises TargetError (a ValueError) on anything
    else (fusion/targets.py is the one parser)."""
    return target_arch(target)


def format_loc(loc: Any) -> str:
    """`patterns/moe.fpat:12` for a SourceLoc: built-in files relative to the repository, user files relative
    to the working directory where they lie under it, else absolute. Column omitted (lines are enough)."""
    if loc is None:
        return "?"
    file = str(getattr(loc, "file", loc))
    line = getattr(loc, "line", None)
    file = _short_path(file)
    return f"{file}:{line}" if line is not None else file


def _short_path(file: str) -> str:
    if not os.path.isabs(file):
        return file
    # Built-in pattern files are shown as patterns/NAME.fpat wherever the package lives (repo or install).
    pat_dir = str(BUILTIN_DIR)
    if file.startswith(pat_dir + os.sep):
        return "patterns/" + os.path.relpath(file, pat_dir).replace(os.sep, "/")
    try:
        rel = os.path.relpath(file)
        if not rel.startswith(".."):
            return rel.replace(os.sep, "/")
    except ValueError:
        pass
    return file


def _span_text(ops: Sequence[int]) -> str:
    if not ops:
        return "no ops"
    if len(ops) == 1:
        return f"op {ops[0]}"
    if list(ops) == list(range(ops[0], ops[-1] + 1)):
        return f"ops {ops[0]}-{ops[-1]}"
    return "ops " + ", ".join(map(str, ops))


# -- results ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Match:
    """A pattern bound to ops: `bindings` are (label, op index) of the bound chain elements, in chain order."""

    pattern: Any
    pattern_index: int
    bindings: tuple[tuple[str, int], ...]
    kinds: tuple[str, ...] = ()  # OpSpec.kind of each bound op, in chain order

    @property
    def ops(self) -> tuple[int, ...]:
        return tuple(i for _, i in self.bindings)

    @property
    def direction(self) -> str:
        return self.pattern.direction

    @property
    def priority(self) -> int:
        p = getattr(self.pattern, "priority", None)
        return len(self.ops) if p is None else int(p)

    @property
    def start(self) -> int:
        return min(self.ops)

    @property
    def covers(self) -> frozenset:
        """The (op, part) units this match computes. Forward: (i, "forward") for every bound op. Backward:
        (last, "dgrad") when the last bound op is a GEMM, and (i, "backward") for every bound op that is not a
        GEMM and has a backward computation (quantize ops pass gradients straight through: nothing to cover)."""
        if self.direction != "backward":
            return frozenset((i, "forward") for i in self.ops)
        out = set()
        for pos, (i, kind) in enumerate(zip(self.ops, self.kinds)):
            if kind == "gemm":
                if pos == len(self.ops) - 1:
                    out.add((i, "dgrad"))
            elif kind != "quantize":
                out.add((i, "backward"))
        return frozenset(out)

    def label_of(self, i: int) -> str | None:
        for label, j in self.bindings:
            if j == i:
                return label
        return None

    def describe(self) -> str:
        return f"{self.pattern.name} on {_span_text(self.ops)}"


@dataclass(frozen=True)
class Attempt:
    """One (pattern, anchor op) try. `ops`: the ops the pattern would cover there (empty when the chain's
    shape does not fit); `reason`: the first failing check, None when it matched."""

    pattern_index: int
    pattern: str
    loc: str
    direction: str
    anchor: int
    ops: tuple[int, ...]
    reason: str | None
    match: Match | None = None
    #: when it matched, but a longer binding was tried first and failed: (its ops, the failing check)
    longer: tuple | None = None

    @property
    def ok(self) -> bool:
        return self.match is not None


# -- the walk -------------------------------------------------------------------------------------------------
def _type_ok(spec, element) -> bool:
    return spec.name in element.ops or spec.kind in element.ops


def _bindings(g: nx.DiGraph, chain, anchor: tuple):
    """Yield every structural binding [(element index, node), ...] anchored at `anchor` (its first bound op
    is the anchor); return (via the `failures` list passed around) the deepest structural failure."""
    results: list[list[tuple[int, tuple]]] = []
    failures: list[tuple[int, str]] = []  # (depth, reason)

    def walk(k: int, node: tuple | None, bound: list, prev: tuple | None):
        if k == len(chain):
            if bound:
                results.append(list(bound))
            return
        el = chain[k]
        progressed = False
        if node is not None:
            spec = g.nodes[node]["spec"]
            if _type_ok(spec, el):
                progressed = True
                nxt = data_successors(g, node)
                bound.append((k, node))
                for s in (nxt or [None]):
                    walk(k + 1, s, bound, node)
                bound.pop()
        if el.optional and (bound or node is not None):
            walk(k + 1, node, bound, prev)
        elif not el.optional and not progressed:
            wanted = "|".join(el.ops)
            if node is None:
                reason = f"nothing after {node_text(g, prev)}: the pattern needs {wanted} ({el.label})"
            else:
                reason = f"{node_text(g, node)} is not {wanted}"
                if bound:
                    reason += f" ({el.label}, after {node_text(g, prev)})"
            failures.append((len(bound), reason))

    walk(0, anchor, [], None)
    # A binding whose first bound op is not the anchor cannot happen (the anchor is offered to element 0
    # and skipped elements keep it), so every result starts at the anchor.
    results.sort(key=lambda b: -len(b))  # stable: among equal sizes, take-before-skip order (earliest)
    deepest = max(failures, key=lambda f: f[0], default=(0, None))
    # among equally deep failures keep the first recorded
    for depth, reason in failures:
        if depth == deepest[0]:
            deepest = (depth, reason)
            break
    return results, deepest[1]


def _env(g: nx.DiGraph, node: tuple, dtype: str) -> dict:
    d = g.nodes[node]
    spec = d["spec"]
    env = dict(spec.attrs)
    for key in ("in_features", "out_features"):
        if env.get(key) is None and d.get(key) is not None:
            env[key] = d[key]
    if spec.kind == "gemm":
        env.setdefault("weight_format", DEFAULT_WEIGHT_FORMAT)
    env.update(dtype=dtype, op=spec.name, kind=spec.kind)
    return env


#: The weight_format of a GEMM whose attrs do not say (specs built by hand): the parameter as is.
DEFAULT_WEIGHT_FORMAT = "bf16"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _predicate_failure(pred, env: dict, g: nx.DiGraph, node: tuple) -> str | None:
    loc = format_loc(getattr(pred, "loc", None))
    try:
        ok = bool(pred.holds(env))
    except Exception as err:  # noqa: BLE001 - a predicate that cannot be evaluated is a reason, not a crash
        return (f"predicate `{pred.text}` could not be evaluated on {node_text(g, node)}: "
                f"{type(err).__name__}: {err} [{loc}]")
    if ok:
        return None
    names = []
    for name in _IDENT.findall(pred.text):
        if name in env and name not in names:
            names.append(name)
    values = ", ".join(f"{n}={env[n]!r}" if isinstance(env[n], str) else f"{n}={env[n]}" for n in names)
    shown = f" ({values})" if values else ""
    return f"predicate `{pred.text}` is false{shown} on {node_text(g, node)} [{loc}]"


def _check(g: nx.DiGraph, pattern, binding, dtype: str, target: str | None, arch: int | None) -> str | None:
    """The first failing check of one structural binding, or None."""
    missing = templates.unavailable(pattern.kernel)
    if missing:
        return missing
    dtypes = tuple(getattr(pattern, "dtypes", ()) or ())
    if dtype not in dtypes:
        return f"dtype {dtype} not in ({', '.join(dtypes)})"
    arch_min = getattr(pattern, "arch_min", None)
    arch_max = getattr(pattern, "arch_max", None)
    if arch is None:
        return "no fused kernels without a GPU target (target is cpu)"
    if arch_min is not None and arch < arch_min:
        return f"arch {target} < sm_{arch_min}"
    if arch_max is not None and arch > arch_max:
        return f"arch {target} > sm_{arch_max} (the pattern's arch_max)"
    chain = pattern.chain
    for k, node in binding:
        env = _env(g, node, dtype)
        for pred in chain[k].where:
            why = _predicate_failure(pred, env, g, node)
            if why:
                return why
    inside = {node for _, node in binding}
    exports = set(getattr(pattern, "export", ()) or ())
    for k, node in binding[:-1]:
        outside = [c for c in consumers(g, node) if c not in inside]
        label = chain[k].label
        if outside and f"{label}.out" not in exports:
            users = ", ".join(node_text(g, c) for c in outside)
            spec = g.nodes[node]["spec"]
            return (f"op {g.nodes[node]['index']} {spec.name}'s output ({label}.out) is also used by {users} "
                    f"(not exported)")
    for _, node in binding:
        spec = g.nodes[node]["spec"]
        if spec.kind == "gemm":
            fmt = spec.attrs.get("weight_format", DEFAULT_WEIGHT_FORMAT)
            why = templates.weight_format_refused(pattern.kernel, fmt)
            if why:
                return f"{node_text(g, node)}: {why}"
    return _unread_save(g, pattern, binding)


def _unread_save(g: nx.DiGraph, pattern, binding) -> str | None:
    """Why a forward pattern's `save` does not fit this binding: a named value enters a bound op whose gradient
    reads no value. A reference to an element left out (optional) saves nothing; one that lands on the match's
    output names what the kernel writes anyway."""
    if pattern.direction == "backward":
        return None
    bound = [(pattern.chain[k].label, node) for k, node in binding]
    for ref in getattr(pattern, "save", ()) or ():
        label, _, port = ref.partition(".")
        at = next((n for n, (lab, _) in enumerate(bound) if lab == label), None)
        if at is None:
            continue
        reader = at if port == "in" else at + 1
        if reader >= len(bound):
            continue
        node = bound[reader][1]
        if not g.nodes[node]["spec"].grad_reads_input:
            return (f"save = {ref}: the value enters {node_text(g, node)}, whose gradient reads no value, so the "
                    f"kernel would write it for nothing [{format_loc(pattern.loc)}]; a pattern without `save` "
                    f"covers such an op")
    return None


def attempt(g: nx.DiGraph, pattern, pattern_index: int, anchor: tuple, dtype: str,
            target: str | None) -> Attempt:
    """Try one pattern at one anchor op."""
    arch = arch_of(target)
    index = g.nodes[anchor]["index"]
    base = dict(pattern_index=pattern_index, pattern=pattern.name, loc=format_loc(pattern.loc),
                direction=pattern.direction, anchor=index)
    bindings, structural = _bindings(g, pattern.chain, anchor)
    if not bindings:
        return Attempt(ops=(), reason=structural or "the pattern's chain is empty", **base)
    first_reason = None
    for b in bindings:
        why = _check(g, pattern, b, dtype, target, arch)
        if why is None:
            chain = pattern.chain
            m = Match(pattern=pattern, pattern_index=pattern_index,
                      bindings=tuple((chain[k].label, g.nodes[n]["index"]) for k, n in b),
                      kinds=tuple(g.nodes[n]["spec"].kind for _, n in b))
            longer = None
            if first_reason is not None:
                longer = (tuple(g.nodes[n]["index"] for _, n in bindings[0]), first_reason)
            return Attempt(ops=m.ops, reason=None, match=m, longer=longer, **base)
        if first_reason is None:
            first_reason = why
    span = tuple(g.nodes[n]["index"] for _, n in bindings[0])
    return Attempt(ops=span, reason=first_reason, **base)


def match_all(g: nx.DiGraph, patterns: Sequence, dtype, target: str | None) -> list[Attempt]:
    """Every (pattern, anchor op) attempt, patterns in library order, anchors in op order."""
    dtype = dtype_name(dtype)
    arch_of(target)  # validate early
    out = []
    nodes = op_nodes(g)
    for pi, pattern in enumerate(patterns):
        for node in nodes:
            out.append(attempt(g, pattern, pi, node, dtype, target))
    return out


# -- overlaps -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loss:
    """A match not taken, and the match that took (part of) its ops."""

    match: Match
    winner: Match

    def reason(self) -> str:
        w, m = self.winner, self.match
        why = ("higher priority" if w.priority > m.priority else
               "same priority, earlier in the pattern library" if w.pattern_index < m.pattern_index else
               "same priority and pattern, earlier position")
        return (f"matched {_span_text(m.ops)} but overlaps {w.pattern.name} on {_span_text(w.ops)} "
                f"[{format_loc(w.pattern.loc)}] (priority {w.priority} vs {m.priority}: {why})")


def sort_key(m: Match):
    return (-m.priority, m.pattern_index, m.start, m.ops)


def resolve(matches: Iterable[Match]) -> tuple[list[Match], list[Loss]]:
    """Greedy non-overlapping selection (see module docstring); returns (chosen, losses)."""
    chosen: list[Match] = []
    losses: list[Loss] = []
    taken: dict = {}
    for m in sorted(matches, key=sort_key):
        clash = [taken[u] for u in sorted(m.covers) if u in taken]
        if clash or not m.covers:
            if clash:
                losses.append(Loss(m, clash[0]))
            continue
        chosen.append(m)
        for u in m.covers:
            taken[u] = m
    chosen.sort(key=lambda m: m.start)
    return chosen, losses
