"""Epilogue math as symbolic expressions, from the same EpilogueSpec and the activation's declaration in the
pattern registry, so the code that runs in the kernel is derived from the expressions the reference evaluates.

    forward_math(spec)   -> the chain's output (before any quantization) as an expression of the accumulator
    saved_math(spec)     -> the value the backward reads, as expressions of the accumulator
    backward_math(spec)  -> the gradient of the chain's input and the row-scale terms, as expressions of the
                            incoming gradient `dy` and the saved value; and the chain's output recomputed from
                            the saved value

Variable names are the typed slots' `values` (codegen/slots.py): the accumulator is `x` or (`gate`, `up`),
biases `bias<position>` (paired: `_gate`/`_up`), row scales `scale_<name>`, the backward's saved value `x` or
(`gate`, `up`).
"""
from __future__ import annotations

from fusion.symbolic import Expr, Num, Param, Var, call, cmp, postorder, simplify, substitute, where

from fusion.codegen import slots
from fusion.codegen.spec import EpilogueSpec, Stage
from fusion.patterns.registry import get_activation

#: Stages with no elementwise math: quantization happens in the kernel's store and passes gradients through.
PASS_THROUGH = ("quant_mxfp8", "quant_fp8_block", "quant_pass")


def _activation(stage: Stage):
    name, params = stage.args
    return get_activation(name), dict(params)


def _bind_params(expr: Expr, values: dict) -> Expr:
    """Replace each Param by its value (the op's parameter, else the declaration's default)."""
    mapping = {n: Num(float(values.get(n.name, n.default))) for n in postorder([expr]) if isinstance(n, Param)}
    return substitute(expr, mapping) if mapping else expr


def _bias_vars(spec: EpilogueSpec, stage: Stage) -> tuple[Var, ...]:
    return tuple(Var(v) for v in slots.GroupBias(stage.position, spec.bias_paired(stage)).values)


def _apply(spec: EpilogueSpec, stage: Stage, state: tuple[Expr, ...]) -> tuple[Expr, ...]:
    """One stage forward. `state` is the (gate, up) halves before a gated activation, else one value."""
    kind = stage.kind
    if kind in PASS_THROUGH:
        return state
    if kind in ("gemm_bias", "bias"):
        return tuple(v + b for v, b in zip(state, _bias_vars(spec, stage)))
    if kind == "act":
        definition, params = _activation(stage)
        mapping = {Var(a): v for a, v in zip(definition.args, state)}
        return (_bind_params(substitute(definition.forward_expr, mapping), params),)
    (y,) = state
    if kind == "clamp":
        lo, hi = stage.args
        if lo is not None and hi is not None:
            return (call("clamp", y, Num(lo), Num(hi)),)
        return (call("max", y, Num(lo)) if lo is not None else call("min", y, Num(hi)),)
    if kind == "scale_row":
        return (y * Var(slots.RowScale(stage.args[0]).kernel_name),)
    if kind == "scale_const":
        return (y * Num(stage.args[0]),)
    raise ValueError(f"no forward for stage {kind}")  # pragma: no cover


def _accumulator(spec: EpilogueSpec) -> tuple[Expr, ...]:
    return (Var("gate"), Var("up")) if spec.gated else (Var("x"),)


def _forward_states(spec: EpilogueSpec, state: tuple[Expr, ...], start: int = 0) -> list[tuple[Expr, ...]]:
    """The value entering each stage from `start` on, and the chain's output last."""
    states = [state]
    for stage in spec.stages[start:]:
        state = _apply(spec, stage, state)
        states.append(state)
    return states


def forward_math(spec: EpilogueSpec) -> Expr:
    """The chain's output (before any quantization) as one expression of the accumulator."""
    (y,) = _forward_states(spec, _accumulator(spec))[-1]
    return simplify(y)


def saved_math(spec: EpilogueSpec) -> tuple[Expr, ...]:
    """The value entering the saved stage (two halves when paired), as expressions of the accumulator."""
    if spec.saved is None:
        return ()
    return tuple(simplify(v) for v in _forward_states(spec, _accumulator(spec))[spec.saved])


def _saved_vars(spec: EpilogueSpec) -> tuple[Expr, ...]:
    return tuple(Var(v) for v in slots.SavedIn(spec.saved_paired).values)


def postact_math(spec: EpilogueSpec) -> Expr:
    """The chain's output recomputed from the saved value (the backward kernel's optional output)."""
    (y,) = _forward_states(spec, _saved_vars(spec), spec.saved)[-1]
    return simplify(y)


def backward_math(spec: EpilogueSpec, dy: Expr = Var("dy")) -> tuple[tuple[Expr, ...], dict[str, Expr]]:
    """(d(chain input) for each half, {row scale name: per-element term}) walking the stages backwards from the
    incoming gradient `dy`. Values entering stages at or after the saved one are recomputed from the saved
    value; stages before it have gradients that need no value (biases, constant scales: spec.py checks).

    The activation's gradient is its declaration's (`grad(arg) = ...` when the file gives one, else derived),
    so a user-written derivative is what the kernel runs. Quantization passes gradients straight through; a
    clamp passes them where the value was inside its bounds (torch.clamp's convention). A per-row scale's
    gradient is the row sum of its term (dy at the scale times the value it scaled), reduced by the caller.
    """
    start = spec.saved if spec.saved is not None else len(spec.stages)
    states = _forward_states(spec, _saved_vars(spec), start) if spec.saved is not None else []
    grads: tuple[Expr, ...] = (dy,)
    terms: dict[str, Expr] = {}
    for k in reversed(range(len(spec.stages))):
        stage = spec.stages[k]
        before = states[k - start] if k >= start else None
        if stage.kind in PASS_THROUGH or stage.kind in ("gemm_bias", "bias"):
            continue
        if stage.kind == "scale_const":
            grads = tuple(g * Num(stage.args[0]) for g in grads)
        elif stage.kind == "clamp":
            lo, hi = stage.args
            inside = Num(1.0)
            if lo is not None:
                inside = where(cmp(">=", before[0], Num(lo)), inside, Num(0.0))
            if hi is not None:
                inside = where(cmp("<=", before[0], Num(hi)), inside, Num(0.0))
            grads = (grads[0] * inside,)
        elif stage.kind == "scale_row":
            terms[stage.args[0]] = simplify(grads[0] * before[0])
            grads = (grads[0] * Var(slots.RowScale(stage.args[0]).kernel_name),)
        elif stage.kind == "act":
            definition, params = _activation(stage)
            mapping = {Var(a): v for a, v in zip(definition.args, before)}
            mapping[Var("dy")] = grads[0]
            grads = tuple(_bind_params(substitute(definition.grad_exprs[a], mapping), params)
                          for a in definition.args)
    if spec.gated and len(grads) == 1:  # pragma: no cover - a gated chain always passes its activation
        raise ValueError("gated chain without an activation")
    return tuple(simplify(g) for g in grads), terms
