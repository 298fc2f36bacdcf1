"""A fusion declaration's AST -> FusionPattern: its fields, the shape of its chain, and what it saves.

Why its own module: these are the rules that make a pattern mean what it says, each reported at its source
location. The chain alone decides the kernel's epilogue (every element after the GEMM in chain order; in a
backward pattern every element before it, applied in reverse), so there is no `epilogue` field that could
disagree with it. `save` decides what a forward kernel writes for the backward: it must name values inside the
chain, no more than the kernel template writes. Activations are checked in activation_semantics.py; loader.py
puts a file's declarations together.

    fusion_pattern(decl, ctx) -> FusionPattern
"""
from __future__ import annotations

import re

from fusion.kernel_templates import TEMPLATES  # a data table of the kernels, read where `save` is checked
from fusion.op_table import OP_KINDS, OP_TABLE
from fusion.patterns import ast as A
from fusion.patterns.diagnostics import SourceContext, did_you_mean
from fusion.patterns.predicates import check_predicate

DTYPES = ("bfloat16", "float16", "float32")
DIRECTIONS = ("forward", "backward")
PORTS = ("in", "out")
FIELDS = ("kernel", "direction", "arch", "dtype", "priority", "save", "export")
#: Fields the language no longer has, and why (a file that still uses one gets this, not "unknown field").
RETIRED_FIELDS = {
    "epilogue": "`epilogue` is not a field: the epilogue is the chain itself (every element after the GEMM, in "
                "chain order; in a backward pattern every element before it, applied in reverse): remove the line",
}
_ARCH_RE = re.compile(r"^sm_(\d+)a?$")
_ARCH_OPS = {"=": (True, True), "==": (True, True), ">=": (True, False), ">": (True, False),
             "<=": (False, True), "<": (False, True)}


def op_names() -> tuple[str, ...]:
    """The op names a chain element may list: the op table of fusion.ops (every op class defined so far)."""
    return tuple(OP_TABLE)


def ops_of_kind(kind: str) -> tuple[str, ...]:
    """The op names of one kind, and the kind itself (a chain element may list either)."""
    return tuple(name for name, k in OP_TABLE.items() if k == kind) + (kind,)


def template_saves(kernel: str) -> int | None:
    """How many values kernel template `kernel` writes for the backward; None for a template this build does
    not know (the matcher refuses such a pattern and says why)."""
    template = TEMPLATES.get(kernel)
    return None if template is None else template.saves


def _arch(item: A.FieldItem, ctx: SourceContext) -> tuple[int | None, int | None]:
    v = item.values[0]
    m = _ARCH_RE.match(str(v.value)) if v.kind == "name" else None
    if len(item.values) != 1 or not m:
        raise ctx.error(v.loc, f"arch takes one architecture like sm_90, got {v.value!r}", expected="sm_<number>")
    if item.op not in _ARCH_OPS:
        raise ctx.error(item.loc, "arch supports == >= > <= < (not !=)")
    n = int(m.group(1))
    n = n + 1 if item.op == ">" else n - 1 if item.op == "<" else n
    low, high = _ARCH_OPS[item.op]
    return (n if low else None), (n if high else None)


def _arch_range(items: list[A.FieldItem], ctx: SourceContext) -> tuple[int, int | None]:
    if not items:
        return 90, None
    arch_min, arch_max = None, None
    for item in items:
        lo, hi = _arch(item, ctx)
        if lo is not None:
            arch_min = lo if arch_min is None else max(arch_min, lo)
        if hi is not None:
            arch_max = hi if arch_max is None else min(arch_max, hi)
    arch_min = 0 if arch_min is None else arch_min
    if arch_max is not None and arch_max < arch_min:
        raise ctx.error(items[-1].loc, f"the arch constraints leave no architecture (sm_{arch_min} .. sm_{arch_max})")
    return arch_min, arch_max


def _names(item: A.FieldItem, ctx: SourceContext, what: str) -> tuple[str, ...]:
    out = []
    for v in item.values:
        if v.kind not in ("name", "string"):
            raise ctx.error(v.loc, f"{item.key} takes {what}, got {v.value!r}")
        out.append(str(v.value))
    return tuple(out)


def _items(decl: A.FusionDecl, ctx: SourceContext):
    """(fields by key, arch constraints, the chain) of a declaration, each field given once and known."""
    seen: dict[str, A.SourceLoc] = {}
    fields: dict[str, A.FieldItem] = {}
    arch_items: list[A.FieldItem] = []
    chain_decl: A.ChainDecl | None = None
    for item in decl.items:
        if isinstance(item, A.ChainDecl):
            if chain_decl is not None:
                raise ctx.error(item.loc, f"fusion '{decl.name}' has a second chain (the first is at line "
                                          f"{chain_decl.loc.line})")
            chain_decl = item
            continue
        if item.key in RETIRED_FIELDS:
            raise ctx.error(item.loc, RETIRED_FIELDS[item.key])
        if item.key not in FIELDS:
            raise ctx.error(item.loc, f"unknown field '{item.key}'{did_you_mean(item.key, FIELDS)}",
                            expected="one of: " + ", ".join(FIELDS) + ", chain { ... }")
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
    return fields, arch_items, chain_decl


def _chain_labels(chain_decl: A.ChainDecl, ctx: SourceContext) -> dict[str, A.ChainElement]:
    """Labels -> elements, every label unique, every op known, every predicate well formed."""
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
    return labels


def _direction(fields: dict, ctx: SourceContext) -> str:
    if "direction" not in fields:
        return "forward"
    (direction,) = _names(fields["direction"], ctx, "forward or backward")[:1] or ("",)
    if direction not in DIRECTIONS or len(fields["direction"].values) != 1:
        raise ctx.error(fields["direction"].values[0].loc, f"direction must be forward or backward, got "
                                                           f"{direction!r}", expected="forward, backward")
    return direction


def _gemm_position(elements, direction: str, ctx: SourceContext) -> int:
    """Where the chain's one GEMM element is: first in a forward chain (after Gather elements, which load its A
    rows through their index), last in a backward one."""
    gemm_ops, gather_ops = set(ops_of_kind("gemm")), set(ops_of_kind("gather"))
    gemm_positions = [k for k, el in enumerate(elements) if set(el.ops) <= gemm_ops]
    any_gemm = [k for k, el in enumerate(elements) if set(el.ops) & gemm_ops]
    lead = 0
    while (direction == "forward" and lead < len(elements) - 1 and set(elements[lead].ops) <= gather_ops
           and not elements[lead].optional):
        lead += 1
    want = lead if direction == "forward" else len(elements) - 1
    if gemm_positions != [want] or any_gemm != [want] or elements[want].optional:
        where_ = ("first (only Gather elements may precede it: the GEMM loads its A rows through their index)"
                  if direction == "forward" else "last")
        raise ctx.error(elements[want].loc, f"a {direction} fusion's chain has exactly one GEMM element ("
                                            f"{', '.join(sorted(gemm_ops - {'gemm'}))} or gemm), not optional, and "
                                            f"it comes {where_}: the kernel is a GEMM with an epilogue")
    return want


def _refs(item: A.FieldItem | None, labels: dict, ctx: SourceContext) -> list[tuple[str, str, A.Value]]:
    """The (label, port, value) of each `label.in` / `label.out` of a save or export field."""
    out = []
    for v in (item.values if item is not None else ()):
        if v.kind != "ref":
            raise ctx.error(v.loc, f"{item.key} takes label.in or label.out, got {v.value!r}",
                            expected="label.in or label.out, e.g. gemm.out")
        lab, port = str(v.value).split(".", 1)
        if lab not in labels:
            raise ctx.error(v.loc, f"{item.key}: '{lab}' is not a label of the chain{did_you_mean(lab, labels)}",
                            expected="one of: " + ", ".join(labels))
        if port not in PORTS:
            raise ctx.error(v.loc, f"{item.key}: '{lab}.{port}': a port is 'in' or 'out'", expected="in, out")
        out.append((lab, port, v))
    return out


def _saves(item: A.FieldItem | None, labels: dict, elements, gemm: int, direction: str, kernel: str,
           ctx: SourceContext) -> tuple[str, ...]:
    """`save`, checked: a forward kernel writes values computed inside its chain, at most as many as its
    template writes; a backward kernel reads what its chain's gradients need, so it has no `save`."""
    refs = _refs(item, labels, ctx)
    if not refs:
        return ()
    if direction == "backward":
        raise ctx.error(item.loc, "a backward pattern has no `save`: its kernel reads the value its chain's "
                                  "gradients need (the input of the first op whose gradient reads it), which the "
                                  "forward pattern's `save` keeps: remove the line")
    position = {el.label: k for k, el in enumerate(elements)}
    seen = set()
    for lab, port, v in refs:
        ref, k = f"{lab}.{port}", position[lab]
        if k < gemm or (k == gemm and port == "in"):
            raise ctx.error(v.loc, f"save: '{ref}' is the kernel's input, not a value it computes (the plan keeps "
                                   f"the step's input by itself when the backward reads it): remove it")
        if k == len(elements) - 1 and port == "out":
            raise ctx.error(v.loc, f"save: '{ref}' is the chain's output, which the kernel writes anyway (and the "
                                   f"plan keeps when the backward reads it): remove it")
        if ref in seen:
            raise ctx.error(v.loc, f"save: '{ref}' is named twice")
        seen.add(ref)
    capacity = template_saves(kernel)
    if capacity is not None and len(refs) > capacity:
        v = refs[capacity][2]
        raise ctx.error(v.loc, f"save names {len(refs)} values but kernel template '{kernel}' writes "
                               f"{capacity or 'none'} for the backward: keep the one the backward reads (the input "
                               f"of the first op whose gradient needs it, e.g. act.in)")
    return tuple(f"{lab}.{port}" for lab, port, _ in refs)


def fusion_pattern(decl: A.FusionDecl, ctx: SourceContext) -> A.FusionPattern:
    """The FusionPattern a `fusion NAME { ... }` declaration means, or a PatternError at the first mistake."""
    fields, arch_items, chain_decl = _items(decl, ctx)
    labels = _chain_labels(chain_decl, ctx)
    direction = _direction(fields, ctx)
    gemm = _gemm_position(chain_decl.elements, direction, ctx)
    kernel = _names(fields["kernel"], ctx, "a kernel template name")
    if len(kernel) != 1:
        raise ctx.error(fields["kernel"].loc, "kernel takes one name")
    arch_min, arch_max = _arch_range(arch_items, ctx)
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
    save = _saves(fields.get("save"), labels, chain_decl.elements, gemm, direction, kernel[0], ctx)
    export = tuple(f"{lab}.{port}" for lab, port, _ in _refs(fields.get("export"), labels, ctx))
    return A.FusionPattern(name=decl.name, kernel=kernel[0], direction=direction, chain=chain_decl.elements,
                           loc=decl.loc, arch_min=arch_min, arch_max=arch_max, dtypes=dtypes, priority=priority,
                           save=save, export=export, gemm_index=gemm)
