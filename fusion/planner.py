"""Plans: which ops of a block run in which fused kernel, forward and backward, and why the rest do not.

    plan_for(seq, dtype=torch.bfloat16, target="sm_90", patterns=None) -> Plan   (any machine)
    plan_for_run(seq, x) -> Plan                                                  (the runtime, per call)

Plans are cached per (op signatures, dtype, target, pattern library); the library is identified by the
identities of its FusionPattern objects (the cache holds them, so identities are never reused while cached),
so loading patterns (which changes `fusion_patterns()`) gives new plans. `clear_cache()` empties it.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Sequence

import torch

from fusion.dataflow import annotate, g, hands_dy_to_wgrad, out_grad, row_symbols
from fusion.errors import FallbackError
from fusion.graph import build_graph, op_nodes
from fusion.grouped import HOST_SYNC_NOTE
from fusion.op_table import device_method, device_method_refusal
from fusion.matcher import (DEFAULT_WEIGHT_FORMAT, Attempt, Match, arch_of, dtype_name, format_loc, match_all,
                            resolve)
from fusion.plan import Fallback, OpAttempt, OpInfo, Plan, Step
from fusion.targets import device_target, plan_target

_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_CACHE_SIZE = 256
_LOCK = threading.Lock()
_GEMM_PARTS = ("dgrad", "wgrad")
#: The target whose plan backend="emulate" runs.
EMULATED_TARGET = "sm_90"
#: The plan's reason (no pattern tried) for a block built with backend="reference".
REFERENCE_REASON = "backend='reference'"


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()


# -- the pattern library -----------------------------------------------------------------------------------------
def default_patterns() -> tuple[tuple, str | None]:
    """(patterns, note): the registry's library (built-ins, then user files in load order). When the registry
    cannot be imported the library is empty and the note says why."""
    try:
        from fusion.patterns.registry import fusion_patterns
    except ImportError as err:
        return (), f"no pattern library: fusion.patterns.registry is unavailable ({err})"
    return tuple(fusion_patterns()), None


def _library(patterns) -> tuple[tuple, str | None]:
    if patterns is None:
        return default_patterns()
    return tuple(patterns), None


def normalize_target(target) -> str | None:
    """The planning target in canonical form (fusion/targets.py): None for None or "cpu"."""
    return plan_target(target)


# -- public entry points ------------------------------------------------------------------------------------------
def plan_for(seq, dtype=torch.bfloat16, target: str | None = "sm_90", patterns: Sequence | None = None,
             backend: str | None = None) -> Plan:
    """The plan of `seq` at `dtype` on `target` ("sm_90", "sm_90a"...; None/"cpu": nothing fused), computed on
    any machine. `patterns`: a list of FusionPattern to use instead of the registry's library. `backend`: the
    block's backend when the plan is to describe what the block will run (explain(), Sequential.plan()): with
    "reference" every op runs unfused wherever the block runs, and the plan says so rather than promise
    kernels that never launch. None (the default) plans for the target whatever the block's backend."""
    target = normalize_target(target)
    lib, note = _library(patterns)
    if backend == "reference":
        reason = REFERENCE_REASON
    else:
        reason = "no fused kernels on cpu" if target is None else None
    return _cached(seq, dtype_name(dtype), target, lib, note, reason)


def plan_for_run(seq, x: torch.Tensor, patterns: Sequence | None = None) -> Plan:
    """The plan for running `seq` on x (its device's target and x's dtype), honouring `seq.backend`:
    "reference" -> every op unfused; "fused" -> FallbackError listing every op that would fall back, with
    every pattern tried and why; "auto" -> fused where a pattern matches."""
    target = device_target(x.device)
    dtype = dtype_name(x.dtype)
    backend = getattr(seq, "backend", "auto")
    if backend == "emulate":
        # The plan a Hopper GPU would run for this block; the emulation runs it in x's dtype on x's device.
        target = EMULATED_TARGET
        dtype = dtype if dtype in ("bfloat16", "float16") else "bfloat16"
    lib, note = _library(patterns)
    if backend == "reference":
        plan = _cached(seq, dtype, target, lib, note, REFERENCE_REASON)
    elif target is None:
        plan = _cached(seq, dtype, None, lib, note, f"no fused kernels on {x.device.type}")
    else:
        plan = _cached(seq, dtype, target, lib, note, None)
    if backend == "fused" and not plan.fully_fused:
        raise FallbackError(plan.fallback_report())
    return plan


def _cached(seq, dtype: str, target: str | None, lib: tuple, note: str | None, reason: str | None) -> Plan:
    ops = list(seq.ops if hasattr(seq, "ops") else seq)
    key = (tuple(op.spec.signature() for op in ops), dtype, target, reason,
           tuple(id(p) for p in lib))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit[1]
    plan = build_plan(seq, dtype, target, lib, note=note, reason=reason)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:  # planned concurrently: keep the first, so callers share one object
            return hit[1]
        _CACHE[key] = (lib, plan)  # keep the patterns alive: their ids stay unique while cached
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return plan


# -- building a plan -------------------------------------------------------------------------------------------------
#: Bytes per element of each quantized format, rowwise data + scales (the columnwise copy doubles it).
_QUANT_BYTES = {"mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16, "fp8_block": 1 + 4 / 128}
_ELEM_BYTES = {"float64": 8, "float32": 4}


def _out_bytes(spec, elem: float) -> float | None:
    if spec.kind != "quantize":
        return elem
    per = _QUANT_BYTES.get(spec.attrs.get("format"))
    if per is None:
        return None
    return per * (2 if spec.attrs.get("columnwise") else 1)


def _ops_info(g, dtype: str = "bfloat16") -> tuple[OpInfo, ...]:
    elem = _ELEM_BYTES.get(dtype, 2)
    nodes = op_nodes(g)
    rows = row_symbols(g.nodes[n]["spec"].kind for n in nodes)
    out = []
    for k, n in enumerate(nodes):
        d = g.nodes[n]
        spec = d["spec"]
        fmt = spec.attrs.get("weight_format", DEFAULT_WEIGHT_FORMAT) if spec.kind == "gemm" else None
        out.append(OpInfo(d["index"], spec.name, spec.kind, d["label"], d["in_features"], d["out_features"],
                          grad_reads_input=spec.grad_reads_input, in_bytes=elem,
                          out_bytes=_out_bytes(spec, elem), weight_format=fmt, in_rows=rows[k],
                          out_rows=rows[k + 1], format=spec.attrs.get("format") if spec.kind == "quantize" else None,
                          columnwise=spec.kind == "quantize" and bool(spec.attrs.get("columnwise")),
                          gated=spec.kind == "activation" and bool(spec.attrs.get("gated")),
                          groups=spec.attrs.get("num_groups") if spec.kind == "gemm" else None))
    return tuple(out)


def build_plan(seq, dtype: str, target: str | None, patterns: tuple, note: str | None = None,
               reason: str | None = None) -> Plan:
    """Uncached planning. `reason` set: nothing is tried, every op runs unfused for that reason."""
    g = build_graph(seq)
    infos = _ops_info(g, dtype)
    lib_info = tuple((p.name, format_loc(p.loc), p.direction) for p in patterns)
    notes = (note,) if note else ()
    if reason is not None:
        attempts: list[Attempt] = []
        chosen_f, chosen_b, losses = [], [], []
    else:
        attempts = match_all(g, patterns, dtype, target)
        ok = [a.match for a in attempts if a.ok]
        chosen_f, loss_f = resolve(m for m in ok if m.direction != "backward")
        chosen_b, loss_b = resolve(m for m in ok if m.direction == "backward")
        losses = loss_f + loss_b
    forward = _forward_steps(infos, chosen_f, dtype, target)
    backward = _backward_steps(infos, chosen_b, dtype, target)
    forward, backward, saves, recomputed = annotate(infos, forward, backward, dtype=dtype)
    backward = _note_dy_handoff(infos, backward)
    per_op = _per_op_attempts(infos, patterns, attempts, chosen_f + chosen_b, losses)
    fallbacks = _fallbacks(infos, forward, backward, per_op, patterns, reason, target, dtype)
    return Plan(target=target, dtype=dtype, ops=infos, forward=tuple(forward), backward=tuple(backward),
                attempts=per_op, fallbacks=tuple(fallbacks), fully_fused=not fallbacks, patterns=lib_info,
                reason=reason, notes=notes, saves=saves, recomputed=recomputed)


DY_HANDOFF_NOTE = ("where op {i}'s weight gradient takes FP8 (fp8_linear.wgrad_in_bf16), this step makes both FP8 "
                   "copies of dY (1x128 rowwise for itself, the slot layout for the weight gradient) and frees dY "
                   "before its GEMM (fusion/runtime/fp8_gemm.py WGRAD_COPY_IN_DGRAD)")


def _note_dy_handoff(infos, backward: list[Step]) -> list[Step]:
    """The backward steps, an fp8_block GEMM's dgrad on its FP8 kernel noted where it hands dY to the GEMM's weight
    gradient (fusion.dataflow.hands_dy_to_wgrad: the rule the runtime marks the step by)."""
    from fusion.quant import fp8_linear

    out = list(backward)
    for n, step in enumerate(out):
        if step.fused or len(step.parts) != 1 or step.parts[0][1] != "dgrad":
            continue
        i = step.parts[0][0]
        info = infos[i]
        on_kernel = (step.method or "").endswith(EMULATE_NOTE) and not any(r.startswith("qg") for r in step.reads)
        # (the rule read now, as fp8_wgrad_note does: FP8 at some row count)
        fp8_wgrad = not fp8_linear.wgrad_in_bf16(info.out_features or 0, info.in_features or 0, 1 << 40)
        if info.weight_format == "fp8_block" and on_kernel and fp8_wgrad and \
                hands_dy_to_wgrad(out, n, out_grad(infos, i), g(len(infos))):
            out[n] = dataclasses.replace(step, notes=step.notes + (DY_HANDOFF_NOTE.format(i=i),))
    return out


def _fused_step(m: Match, infos, direction: str) -> Step:
    p = m.pattern
    label_to_op = dict(m.bindings)
    parts = tuple(sorted(m.covers, key=lambda u: (-u[0], u[1]) if direction == "backward" else u))
    saves = tuple(ref for ref in (p.save or ()) if ref.partition(".")[0] in label_to_op)  # bound elements only
    return Step(direction=direction, fused=True, ops=m.ops, descriptions=tuple(infos[i].description for i in m.ops),
                parts=parts, pattern=p.name, pattern_loc=format_loc(p.loc), kernel=p.kernel,
                epilogue=tuple((lab, label_to_op[lab]) for lab in (p.epilogue or ()) if lab in label_to_op),
                saves=saves, labels=m.bindings)


def _forward_steps(infos, chosen: list[Match], dtype: str, target: str | None) -> list[Step]:
    owner = {i: m for m in chosen for i in m.ops}
    steps = []
    for info in infos:
        m = owner.get(info.index)
        if m is not None:
            if info.index == m.ops[0]:
                steps.append(_fused_step(m, infos, "forward"))
            continue
        method, notes = reference_method(info, "forward", dtype, target)
        steps.append(Step("forward", False, (info.index,), (info.description,), ((info.index, "forward"),),
                          method=method, notes=notes))
    return steps


def backward_parts(info: OpInfo) -> tuple[str, ...]:
    """What autograd computes for one op, in the order it runs: a GEMM's dgrad then wgrad (whatever its weight
    format: an fp8_block GEMM's are its recipe's, each a step of its own, so a pattern can fuse its dgrad), any
    other op's backward; a quantize op passes gradients straight through (no computation, no step)."""
    if info.kind == "gemm":
        return _GEMM_PARTS
    if info.kind == "quantize":
        return ()
    return ("backward",)


def _backward_steps(infos, chosen: list[Match], dtype: str, target: str | None) -> list[Step]:
    owner = {u: m for m in chosen for u in m.covers}
    emitted: set[int] = set()
    steps = []
    for info in reversed(infos):
        for part in backward_parts(info):
            m = owner.get((info.index, part))
            if m is not None:
                if id(m) not in emitted:
                    emitted.add(id(m))
                    steps.append(_fused_step(m, infos, "backward"))
                continue
            method, notes = reference_method(info, part, dtype, target)
            steps.append(Step("backward", False, (info.index,), (info.description,), ((info.index, part),),
                              method=method, notes=notes))
    return steps


#: How a device method's line in the plan ends (the emulated plan runs the reference instead).
EMULATE_NOTE = "; backend 'emulate' runs the reference"


def fp8_wgrad_note(info: OpInfo) -> str:
    """Which operands an fp8_block GEMM's weight gradient reads, by the recipe's rule (fusion/quant/fp8_linear.py
    `wgrad_in_bf16`, read now: it is a process-wide switch)."""
    from fusion.quant import fp8_linear

    out_f, in_f = info.out_features or 0, info.in_features or 0
    width = out_f * in_f / max(out_f + in_f, 1)
    if fp8_linear.WGRAD_IN_BF16 != "auto":
        return ("weight gradient: " + ("the high-precision dY and X (bf16 varlen-K kernel)" if fp8_linear.WGRAD_IN_BF16
                                       else "FP8 columnwise copies of dY and X (FP8 varlen-K kernel)")
                + f": fp8_linear.WGRAD_IN_BF16 = {fp8_linear.WGRAD_IN_BF16!r}")
    if fp8_linear.wgrad_in_bf16(out_f, in_f, 1 << 40):
        return (f"weight gradient on the high-precision dY and X (bf16 varlen-K kernel): its harmonic width "
                f"{width:.0f} < {fp8_linear.FP8_WGRAD_MIN_WIDTH}, so quantizing dY and X columnwise would cost more "
                f"than the FP8 GEMM saves (fp8_linear.wgrad_in_bf16)")
    return (f"weight gradient on FP8 columnwise copies of dY and X (FP8 varlen-K kernel) from "
            f"{fp8_linear.FP8_WGRAD_MIN_ROWS} rows per group (harmonic width {width:.0f} >= "
            f"{fp8_linear.FP8_WGRAD_MIN_WIDTH}), below that on the high-precision ones (fp8_linear.wgrad_in_bf16)")


#: What runs a one-group GroupLinear's GEMMs that our kernels do not (fusion.grouped.DENSE_MM, op_table.WGRAD_RULE)
ONE_GROUP_NOTE = ("one group: a dense GEMM, so where our kernel does not run it (always for the weight gradient) "
                  "torch's dense matmul (cuBLAS) does, not torch._grouped_mm")


def reference_method(info: OpInfo, part: str, dtype: str, target: str | None) -> tuple[str, tuple[str, ...]]:
    """Which reference implementation an unfused (op, part) runs, and notes worth telling the user
    (mirrors fusion.grouped.grouped_mm_method, decided from the plan's dtype and target)."""
    grad = {"forward": "", "dgrad": " (input gradient)", "wgrad": " (weight gradient)", "backward": ""}[part]
    fmt = info.weight_format or info.format
    device = device_method(info.kind, part, fmt)
    refusal = None
    if device is not None and (arch_of(target) or 0) >= 90:
        refusal = device_method_refusal(info.kind, fmt, dtype, (info.in_features, info.out_features), info.name)
        if refusal is None:
            notes = (fp8_wgrad_note(info),) if fmt == "fp8_block" and part == "wgrad" else ()
            if info.name == "GroupLinear" and info.groups == 1 and fmt in (None, "bf16"):
                notes += (ONE_GROUP_NOTE,)
            return f"{device[1]}{EMULATE_NOTE}", notes
    if info.gemm_by_reference:
        recipe = {"forward": f"{info.name}.reference: the {fmt} recipe",
                  "dgrad": f"the {fmt} recipe's input gradient (dY quantized 1x128)",
                  "wgrad": f"the {fmt} recipe's weight gradient"}[part]
        why = (f"the FP8 kernel does not take it: {refusal}" if refusal else "no kernel on this target runs this "
               "GEMM")
        note = (f"weight_format={info.weight_format!r}: {why}; it runs its recipe's reference (dequantized FP8 "
                f"operands, float32 matmul)")
        return f"{recipe} (fusion/quant/fp8_linear.py, torch)", (note,)
    if info.name == "GroupLinear":
        why = None
        arch = arch_of(target)
        if arch is None:
            return (f"per-group matmul loop{grad}", ("on the CPU the loop reads group sizes on the host, which is "
                                                    "free there",))
        elem = {"float32": 4, "float64": 8}.get(dtype, 2)
        if not hasattr(torch, "_grouped_mm"):
            why = "this torch has no torch._grouped_mm"
        elif dtype not in ("bfloat16", "float16"):
            why = f"torch._grouped_mm needs bfloat16/float16, the dtype is {dtype}"
        elif arch < 90:
            why = f"torch._grouped_mm needs sm_90 or newer, the target is {target}"
        elif ((info.in_features or 0) * elem) % 16 or ((info.out_features or 0) * elem) % 16:
            why = (f"rows are not 16-byte aligned for torch._grouped_mm (in_features={info.in_features}, "
                   f"out_features={info.out_features})")
        if why:
            return f"per-group matmul loop{grad}", (f"{HOST_SYNC_NOTE}: {why}",)
        return f"torch._grouped_mm{grad}", ()
    if info.name == "Linear":
        return f"torch.nn.functional.linear{grad}", ()
    if part == "forward":
        return f"{info.name}.reference (torch)", ()
    if info.kind in _DIRECT_GRADS:
        return _DIRECT_GRADS[info.kind], ()
    return f"autograd of {info.name}.reference (torch)", ()


#: Ops whose input gradient runs directly (their `input_grad`), not by autograd through the reference, by kind.
_DIRECT_GRADS = {"combine": "Combine.input_grad: each routed row takes its token's gradient (torch index_select)",
                 "gather": "Gather.input_grad: the rows' gradients combined into tokens (torch)"}


def _per_op_attempts(infos, patterns, attempts: list[Attempt], chosen: list[Match], losses) -> dict:
    """For every op and every pattern: applied / not chosen / failed, with the most telling reason.

    failed: the reason of the attempt whose span (the ops the pattern would cover) contains the op, so the
    SwiGLU after a misaligned GEMM says why the GEMM's pattern failed; where no span contains the op, the
    structural reason of the attempt anchored at the op ("op 2 Clamp(...) is not Scale")."""
    chosen_by_pattern: dict[int, list[Match]] = {}
    for m in chosen:
        chosen_by_pattern.setdefault(m.pattern_index, []).append(m)
    lost_by_pattern: dict[int, list] = {}
    for loss in losses:
        lost_by_pattern.setdefault(loss.match.pattern_index, []).append(loss)
    by_pattern: dict[int, list[Attempt]] = {}
    for a in attempts:
        by_pattern.setdefault(a.pattern_index, []).append(a)
    out = {}
    for info in infos:
        i = info.index
        rows = []
        for pi, p in enumerate(patterns):
            tried = by_pattern.get(pi)
            if not tried:
                continue
            base = dict(pattern=p.name, loc=format_loc(p.loc), direction=p.direction)
            hit = next((m for m in chosen_by_pattern.get(pi, ()) if i in m.ops), None)
            if hit is not None:
                rows.append(OpAttempt(outcome="applied", reason=None, ops=hit.ops, **base))
                continue
            loss = next((lo for lo in lost_by_pattern.get(pi, ()) if i in lo.match.ops), None)
            if loss is not None:
                rows.append(OpAttempt(outcome="not chosen", reason=loss.reason(), ops=loss.match.ops, **base))
                continue
            spanning = next((a for a in tried if i in a.ops and not a.ok), None)
            longer = next((a for a in tried if a.ok and a.longer and i in a.longer[0]
                           and i not in a.match.ops), None)
            if spanning is None and longer is not None:
                m = longer.match
                span = f"op {m.ops[0]}" if len(m.ops) == 1 else f"ops {m.ops[0]}-{m.ops[-1]}"
                rows.append(OpAttempt(outcome="failed", reason=f"its match on {span} leaves op {i} out: "
                                      f"{longer.longer[1]}", ops=longer.longer[0], **base))
                continue
            stopped = _stopped_before(i, p, [a.match for a in tried if a.ok], infos)
            if spanning is None and stopped is not None:
                rows.append(OpAttempt(outcome="failed", reason=stopped[1], ops=stopped[0].ops, **base))
                continue
            if spanning is None:
                spanning = next((a for a in tried if a.anchor == i), None)
            if spanning is None or spanning.ok:
                # matched only as a part that covers nothing (e.g. a backward match of quantize ops only)
                rows.append(OpAttempt(outcome="failed", reason="the match computes nothing for this op",
                                      ops=spanning.ops if spanning else (), **base))
                continue
            rows.append(OpAttempt(outcome="failed", reason=spanning.reason, ops=spanning.ops, **base))
        out[i] = tuple(rows)
    return out


def _stopped_before(i: int, pattern, matches: list[Match], infos):
    """(match, reason) when a match of `pattern` ends right before op i with chain elements left that op i
    does not fit: "its match on ops 0-1 stops before op 2: Clamp(...) is not Scale|QuantizeMXFP8"."""
    chain = pattern.chain
    for m in matches:
        if m.ops[-1] != i - 1:
            continue
        last_label = m.bindings[-1][0]
        k = next(j for j, e in enumerate(chain) if e.label == last_label)
        rest = chain[k + 1:]
        if not rest:
            continue
        wanted = []
        for e in rest:
            wanted.extend(o for o in e.ops if o not in wanted)
        names = ", ".join(e.label + ("?" if e.optional else "") for e in rest)
        span = f"op {m.ops[0]}" if len(m.ops) == 1 else f"ops {m.ops[0]}-{m.ops[-1]}"
        return m, (f"its match on {span} stops before op {i}: {infos[i].description} is not "
                   f"{'|'.join(wanted)} (the elements left: {names})")
    return None


def _fallbacks(infos, forward, backward, per_op: dict, patterns, reason: str | None,
               target: str | None = None, dtype: str = "") -> list[Fallback]:
    out = []
    # A GEMM is not a fallback: unfused it runs the vendor grouped GEMM; what falls back is elementwise work
    # that a pattern could have put in its epilogue (and that op is listed, with the reasons). A GEMM run by its
    # reference (fp8_block weights where no device kernel runs them: not Hopper) is one, forward, dgrad and wgrad.
    def by_reference(i, part):
        info = infos[i]
        return info.gemm_by_reference and not reference_method(info, part, dtype, target)[0].endswith(EMULATE_NOTE)

    units = [(s.parts[0], "forward") for s in forward
             if not s.fused and (infos[s.parts[0][0]].kind != "gemm" or by_reference(s.parts[0][0], "forward"))]
    units += [(s.parts[0], "backward") for s in backward if not s.fused
              and (s.parts[0][1] == "backward" if infos[s.parts[0][0]].kind != "gemm"
                   else by_reference(*s.parts[0]))]
    for (i, part), direction in units:
        info = infos[i]
        if reason is not None:
            reasons = (reason,)
        else:
            rows = [a for a in per_op.get(i, ()) if _direction(a.direction) == direction]
            reasons = tuple(f"{a.pattern} [{a.loc}]: {a.reason or a.outcome}" for a in rows)
            if not reasons:
                reasons = (f"no {direction} fusion patterns are loaded",)
        if info.gemm_by_reference:  # first what it runs instead, then every pattern tried
            reasons = reference_method(info, part, dtype, target)[1] + reasons
        out.append(Fallback(op=i, description=info.description, direction=direction, part=part, reasons=reasons))
    return out


def _direction(d: str) -> str:
    return "backward" if d == "backward" else "forward"
