"""explain(): the plan of a block in words (text), as data (json) or as a Graphviz graph (dot).

Format documented in docs/explain.md. Defaults: dtype = the parameters' dtype when it is bfloat16 or
float16, else bfloat16 (fused kernels run only in those); target = "sm_90". The header always says which
dtype and target the plan is for, and where they came from.
"""
from __future__ import annotations

import json
from typing import Sequence

import torch

from fusion.dataflow import bytes_per_row, index_of, rows_of, saved_bytes
from fusion.errors import OpArgumentError
from fusion.graph import build_graph, op_nodes
from fusion.kernels.tile_policy import FC1_COPY_MIN_N, gathers_in_kernel
from fusion.matcher import dtype_name
from fusion.plan import Plan, Step
from fusion.planner import EMULATE_NOTE, plan_for
from fusion.version import __version__

FORMATS = ("text", "json", "dot")
DEFAULT_TARGET = "sm_90"


def _version() -> str:
    return __version__


def default_dtype(seq) -> tuple[torch.dtype, str]:
    """(dtype, where it came from) for a plan when the caller gave none."""
    dtypes = {p.dtype for p in seq.parameters()} if hasattr(seq, "parameters") else set()
    if len(dtypes) == 1:
        (dt,) = dtypes
        name = dtype_name(dt)
        if dt in (torch.bfloat16, torch.float16):
            return dt, "the parameters' dtype"
        return torch.bfloat16, f"default: the parameters are {name}, fused kernels run in bfloat16/float16"
    if not dtypes:
        return torch.bfloat16, "default: the block has no parameters"
    return torch.bfloat16, "default: the parameters mix dtypes"


def explain(seq, format: str = "text", dtype: torch.dtype | None = None, target: str | None = None,
            patterns: Sequence | None = None) -> str:
    """The plan of `seq` for (dtype, target) as text, json or dot. `patterns` overrides the library."""
    if format not in FORMATS:
        raise OpArgumentError(f"explain: format must be one of {FORMATS}, got {format!r}")
    if dtype is None:
        dtype, dtype_src = default_dtype(seq)
    else:
        dtype_src = "given"
    if target is None:
        target, target_src = DEFAULT_TARGET, "default; pass target= to change"
    else:
        target_src = "given"
    backend = getattr(seq, "backend", "auto")
    plan = plan_for(seq, dtype=dtype, target=target, patterns=patterns, backend=backend)
    ctx = dict(dtype_src=dtype_src, target_src=target_src, backend=backend)
    if format == "json":
        return json.dumps(to_json(seq, plan, **ctx), indent=2)
    if format == "dot":
        return to_dot(seq, plan)
    return to_text(seq, plan, **ctx)


# -- text ------------------------------------------------------------------------------------------------------
def _shape(f, rows: str = "M") -> str:
    return f"({rows}, {f if f is not None else '?'})"


def _is_moe(plan: Plan) -> bool:
    """Whether the block's rows change (a Gather / Combine): sizes are then given per token and per routed row."""
    return any(o.in_rows != "M" or o.out_rows != "M" for o in plan.ops)


#: The ops table's header: what the row symbols mean.
_ROWS_HEADER = {False: "ops (M = rows of x):",
                True: "ops (T = tokens, the rows of x and of the block output; M = routed rows, one per (token, "
                      "expert) pair: index.numel(), k per token without token rounding):"}

#: What an op does inside a fused forward kernel, by kind (epilogue ops are named by the pattern).
_ROLE = {"gemm": "mainloop", "gather": "A loads"}


def _role(plan: Plan, step: Step, i: int, epilogue: set) -> str:
    """What op i does inside a fused forward kernel: epilogue, mainloop or A loads; a Gather before a wide GEMM is a
    copy the gather kernel writes first (the runtime's rule: kernels/tile_policy.py gathers_in_kernel)."""
    if i in epilogue:
        return "epilogue"
    op = plan.ops[i]
    if op.kind == "gather":
        n = next((plan.ops[j].out_features for j in step.ops if plan.ops[j].kind == "gemm"), None)
        if n is not None and not gathers_in_kernel(n):
            return (f"copied by the gather kernel, then read by the GEMM's TMA loads: N = {n} >= {FC1_COPY_MIN_N}, "
                    f"where the copy costs less than the CTA pairs save; fusion/kernels/tile_policy.py "
                    f"gathers_in_kernel")
    return _ROLE.get(op.kind, "in kernel")


def _span(ops) -> str:
    ops = list(ops)
    if len(ops) == 1:
        return f"op {ops[0]}"
    if ops == list(range(ops[0], ops[-1] + 1)):
        return f"ops {ops[0]}-{ops[-1]}"
    return "ops " + ", ".join(map(str, ops))


def _short(info) -> str:
    """The op's description, or just its name where that is long (the ops table has it in full)."""
    return info.description if len(info.description) <= 32 else info.name


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


_PART_TEXT = {"forward": "forward", "dgrad": "dgrad", "wgrad": "wgrad", "backward": "backward"}


def _step_lines(n: int, tag: str, step: Step, plan: Plan) -> list[str]:
    lines = []
    if step.fused:
        lines.append(f"  [{tag}{n}] fused    {step.kernel}  <- pattern {step.pattern} [{step.pattern_loc}]")
        labels = dict((i, lab) for lab, i in step.labels)
        epi = {i for _, i in step.epilogue}
        width = max(len(plan.ops[i].description) for i in step.ops)
        if step.direction == "forward":
            for i in step.ops:
                role = _role(plan, step, i, epi)
                lines.append(f"         op {i}  {plan.ops[i].description:<{width}}  {labels.get(i, '')} ({role})")
            if step.epilogue:
                lines.append("         epilogue: " + " -> ".join(f"{lab} (op {i})" for lab, i in step.epilogue))
            kept = [w for w in step.writes if w != step.writes[0]]
            if kept:
                lines.append("         saves for backward: " + ", ".join(
                    f"{ref} = {w}" + ("" if w in plan.saves else " (no backward step reads it: written, then dropped)")
                    for ref, w in zip(step.saves, kept)))
        else:
            parts = ", ".join(f"{_PART_TEXT[p]} of op {i}" for i, p in step.parts)
            lines.append(f"         computes: {parts}")
            passthrough = [i for i in step.ops if plan.ops[i].kind == "quantize"]
            if passthrough:
                lines.append("         straight-through: " + ", ".join(f"op {i} {plan.ops[i].description}"
                                                                    for i in passthrough))
            if step.epilogue:
                lines.append("         epilogue: " + " -> ".join(f"{lab} (op {i})" for lab, i in step.epilogue))
            for name in step.writes[1:]:
                if name.startswith("qg"):   # the input gradient quantized for the FP8 dgrad after (dataflow.py)
                    reader = next((r for r in plan.backward if name in r.reads), None)
                    gemm = "the next" if reader is None else f"op {reader.parts[0][0]}'s"
                    lines.append(f"         also writes {name} ({name[1:]} quantized 1x128 rowwise: E4M3 codes and "
                                 f"scales) as {gemm} FP8 dgrad reads it: that dgrad runs no quantize pass")
                    continue
                i = index_of(name)
                src = plan.ops[i - 1]
                what = (f"op {i - 1} {_short(src)}'s output dequantized: the kernel quantizes the recomputed value "
                        f"as the op does and writes it back" if src.kind == "quantize" else f"op {i - 1}'s output")
                lines.append(f"         recomputes {name} ({what}) for op {i}'s weight gradient: the forward does "
                             f"not keep it")
    else:
        i, part = step.parts[0]
        what = "" if part == "forward" else f" {part}"
        lines.append(f"  [{tag}{n}] unfused  op {i} {_short(plan.ops[i])}{what}: {step.method}")
        for note in step.notes:
            lines.append(f"         note: {note}")
    if step.direction == "backward" and step.reads:
        lines.append(f"         reads {', '.join(step.reads)}; writes {', '.join(step.writes)}")
    return lines


def to_text(seq, plan: Plan, dtype_src: str = "given", target_src: str = "given", backend: str = "auto") -> str:
    out = [f"fusion {_version()} plan of a Sequential of {_n(len(plan.ops), 'op')} (backend={backend!r})",
           f"planned for: dtype {plan.dtype} ({dtype_src}), target {plan.target or 'cpu'} ({target_src})"]
    if plan.patterns:
        files = []
        for _, loc, _ in plan.patterns:
            f = loc.rsplit(":", 1)[0]
            if f not in files:
                files.append(f)
        out.append(f"pattern library: {len(plan.patterns)} patterns from {', '.join(files)}")
    else:
        out.append("pattern library: empty")
    for note in plan.notes:
        out.append(f"note: {note}")
    if plan.reason:
        out.append(f"nothing fused: {plan.reason}")
    if backend == "reference":
        out.append("every op runs its reference (unfused) path, forward and backward, on every device: the block "
                   "was built with backend='reference' (backend='auto' runs matched patterns as fused kernels)")
    out.append("")
    out.append(_ROWS_HEADER[_is_moe(plan)])
    width = max(len(o.description) for o in plan.ops)
    g = build_graph(seq)
    for o in plan.ops:
        node = g.nodes[("op", o.index)]
        reads = [n for n in node["spec"].extra_inputs]
        extra = f"  reads {', '.join(reads)}" if reads else ""
        out.append(f"  op {o.index}  {o.description:<{width}}  {_shape(o.in_features, o.in_rows)} -> "
                   f"{_shape(o.out_features, o.out_rows)}{extra}")
    out.append("")
    nf = sum(s.fused for s in plan.forward)
    out.append(f"forward: {_n(len(plan.forward), 'step')} ({_n(nf, 'fused kernel')}, "
               f"{_n(len(plan.forward) - nf, 'unfused op')})")
    for n, s in enumerate(plan.forward, 1):
        out.extend(_step_lines(n, "F", s, plan))
    nb = sum(s.fused for s in plan.backward)
    out.append("")
    out.append(f"backward, in autograd order: {_n(len(plan.backward), 'step')} ({_n(nb, 'fused kernel')}, "
               f"{len(plan.backward) - nb} unfused)")
    for n, s in enumerate(plan.backward, 1):
        out.extend(_step_lines(n, "B", s, plan))
    out.extend(_saves_lines(plan))
    out.append("")
    if plan.fallbacks:
        out.append("left unfused, and why (every pattern tried):")
        for fb in plan.fallbacks:
            out.append(f"  op {fb.op} {fb.description} ({fb.part}):")
            out.extend(f"    - {r}" for r in fb.reasons)
    else:
        out.append("left unfused: no elementwise computation (every non-GEMM op, forward and backward, runs in a "
                   "fused kernel or passes gradients straight through)")
    out.append("")
    out.extend(_summary(plan))
    return "\n".join(out) + "\n"


def _kernel_text(tag: str, step: Step, plan: Plan) -> str:
    """One fused kernel in a few words: `F1 GEMM+SwiGLU+Scale (ops 0-2)`, `B1 dgrad+dScale+dSwiGLU (ops 1-3)`."""
    if step.direction == "forward":
        names = ["GEMM" if plan.ops[i].kind == "gemm" else plan.ops[i].name for i in step.ops]
    else:
        names = ["dgrad" if part == "dgrad" else f"d{plan.ops[i].name}" for i, part in step.parts]
    return f"{tag} {'+'.join(names)} ({_span(step.ops)})"


def _unfused_text(tag: str, step: Step, plan: Plan) -> str:
    i, part = step.parts[0]
    return f"{tag} op {i} {plan.ops[i].name} {part}"


def _summary(plan: Plan) -> list[str]:
    """What is fused, precisely: each fused kernel and what it computes, each GEMM computation that runs outside
    them, and each elementwise computation that falls back (section 6 of docs/explain.md)."""
    if plan.reason:
        return [f"summary: nothing fused ({plan.reason}): every op runs its reference, forward and backward"]
    tagged = [(f"F{n}", s) for n, s in enumerate(plan.forward, 1)] + \
             [(f"B{n}", s) for n, s in enumerate(plan.backward, 1)]
    kernels = [_kernel_text(tag, s, plan) for tag, s in tagged if s.fused]
    unfused = [(tag, s) for tag, s in tagged if not s.fused]
    unfused_gemms = [_unfused_text(tag, s, plan) for tag, s in unfused
                   if plan.ops[s.parts[0][0]].kind == "gemm" and not plan.ops[s.parts[0][0]].gemm_by_reference]
    by_format = [(tag, s) for tag, s in unfused if plan.ops[s.parts[0][0]].gemm_by_reference]
    # a device method's step names its kernel (fusion.planner.reference_method); the others run the recipe
    on_kernels = [_unfused_text(tag, s, plan) for tag, s in by_format if s.method.endswith(EMULATE_NOTE)]
    recipes = [_unfused_text(tag, s, plan) for tag, s in by_format if not s.method.endswith(EMULATE_NOTE)]
    fallbacks = [_unfused_text(tag, s, plan) for tag, s in unfused if plan.ops[s.parts[0][0]].kind != "gemm"]
    lines = ["summary:",
             f"  fused kernels ({len(kernels)}): {', '.join(kernels) or 'none'}",
             f"  unfused GEMMs ({len(unfused_gemms)}): {', '.join(unfused_gemms) or 'none'}"]
    if on_kernels:
        lines.append(f"  GEMMs by their weight format's device methods ({len(on_kernels)}): {', '.join(on_kernels)}")
    if recipes:
        lines.append(f"  GEMMs run by their weight format's recipe, in torch ({len(recipes)}): {', '.join(recipes)}")
    lines.append(f"  elementwise ops unfused ({len(fallbacks)}): {', '.join(fallbacks) or 'none'}")
    return lines


def _saves_lines(plan: Plan) -> list[str]:
    """The forward's saves for the backward, with bytes per row (fusion/dataflow.py); in an MoE block per routed
    row and per token, and in total per token (k routed rows per token)."""
    if not plan.saves:
        return []
    moe = _is_moe(plan)
    rows = []
    for name in plan.saves:
        i = index_of(name)
        what = "x (the block input)" if i == 0 else f"output of op {i - 1} {_short(plan.ops[i - 1])}"
        size = bytes_per_row(plan.ops, name)
        if i == 0 and size is None:  # an MoE block's x: its width is the caller's
            rows.append(f"  {name}: {what}")
            continue
        unit = f" B per {_ROW_WORDS[rows_of(plan.ops, name)]}" if moe else " B/row"
        extra = (" (recomputed in backward: the forward does not keep it; an MoE FC1's weight gradient reads x "
                 "through the index instead at many rows per group)" if name in plan.recomputed and i > 0
                 and plan.ops[i - 1].kind == "gather" else
                 " (recomputed in backward: the forward does not keep it)" if name in plan.recomputed else "")
        rows.append(f"  {name}: {what}, {'?' if size is None else f'{size:g}'}{unit}{extra}")
    kept, _ = saved_bytes(plan.ops, [n for n in plan.saves if n not in plan.recomputed and n != "v0"])
    if not moe:
        return ["", f"saved for backward (besides x): {kept.get('M', 0):g} B per row", *rows]
    routed, token = kept.get("M", 0), kept.get("T", 0)
    per_token = f"{routed:g}·k" if not token else f"{token:g} + {routed:g}·k"
    return ["", f"saved for backward (besides x): {routed:g} B per routed row + {token:g} B per token = "
                f"{per_token} B per token (k routed rows per token; the routing tensors index and probs come on "
                f"top)", *rows]


#: How the text names one row of each row symbol (MoE blocks).
_ROW_WORDS = {"M": "routed row", "T": "token"}


# -- json ---------------------------------------------------------------------------------------------------------
def to_json(seq, plan: Plan, dtype_src: str = "given", target_src: str = "given", backend: str = "auto") -> dict:
    g = build_graph(seq)
    data = {"fusion_version": _version(), "backend": backend, "dtype": plan.dtype, "dtype_source": dtype_src,
            "target": plan.target, "target_source": target_src,
            "extra_inputs": {o.index: list(g.nodes[("op", o.index)]["spec"].extra_inputs) for o in plan.ops}}
    data["extra_inputs"] = {str(k): v for k, v in data["extra_inputs"].items()}
    data["plan"] = plan.to_dict()
    return data


# -- dot -----------------------------------------------------------------------------------------------------------
def _q(s: str) -> str:
    """A quoted DOT string; backslash-n / backslash-l in s stay line breaks."""
    return '"' + str(s).replace('"', '\\"') + '"'


def _nid(node) -> str:
    kind, key = node
    return {"op": f"op{key}", "in": f"in_{key}", "out": f"out{key}"}[kind]


def to_dot(seq, plan: Plan) -> str:
    g = build_graph(seq)
    fallback_ops = {fb.op for fb in plan.fallbacks if fb.direction == "forward"}
    title = f"fusion {_version()} plan: dtype {plan.dtype}, target {plan.target or 'cpu'}"
    lines = ["digraph fusion_plan {",
             f"  label={_q(title)};",
             "  labelloc=t; rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fillcolor=white, fontname="monospace"];']
    for node, d in g.nodes(data=True):
        if d["type"] == "input":
            feats = g.graph["features"][0] if d["name"] == "x" else None
            label = f"x {_shape(feats, plan.ops[0].in_rows)}" if d["name"] == "x" else d["name"]
            lines.append(f"  {_nid(node)} [shape=ellipse, style=solid, label={_q(label)}];")
        elif d["type"] == "output":
            label = "y " + _shape(g.graph["features"][-1], plan.ops[-1].out_rows)
            lines.append(f"  {_nid(node)} [shape=ellipse, style=solid, label={_q(label)}];")
    for n, step in enumerate((s for s in plan.forward if s.fused), 1):
        lines.append(f"  subgraph cluster_fwd{n} {{")
        label = f"{step.pattern} [{step.pattern_loc}]: kernel {step.kernel}"
        lines.append(f"    label={_q(label)};")
        lines.append('    style="rounded,filled"; fillcolor="#e8f0fe"; color="#3367d6";')
        for i in step.ops:
            lines.append(f"    op{i};")
        lines.append("  }")
    for node in op_nodes(g):
        d = g.nodes[node]
        i = d["index"]
        color = "#fde2e1" if i in fallback_ops else "white"
        label = f"op {i}\\n{d['label']}"
        lines.append(f"  op{i} [label={_q(label)}, fillcolor={_q(color)}];")
    for u, v, d in sorted(g.edges(data=True), key=lambda e: (str(e[0]), str(e[1]))):
        if d.get("operand") == 0:
            feats = g.nodes[u].get("out_features") if u[0] == "op" else g.graph["features"][0]
            rows = plan.ops[u[1]].out_rows if u[0] == "op" else plan.ops[0].in_rows
            lines.append(f"  {_nid(u)} -> {_nid(v)} [label={_q(_shape(feats, rows))}];")
        else:
            lines.append(f"  {_nid(u)} -> {_nid(v)} [style=dashed, label={_q(d.get('operand'))}];")
    if plan.backward:
        rows = []
        for n, s in enumerate(plan.backward, 1):
            if s.fused:
                rows.append(f"B{n} fused {s.kernel} ({s.pattern}): "
                            + ", ".join(f"{p} op {i}" for i, p in s.parts))
            else:
                i, p = s.parts[0]
                rows.append(f"B{n} unfused {p} op {i}: {s.method}")
        text = "backward (autograd order)\\l" + "".join(r + "\\l" for r in rows)
        lines.append(f"  backward [shape=note, style=solid, label={_q(text)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
