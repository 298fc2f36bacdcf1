"""Epilogue math as symbolic expressions: forward (acc -> output) and backward (dy -> d pre-activation).

Both are built from the same EpilogueSpec and the activation's declaration in the pattern registry, so the
code that runs in the kernel is derived from the same expressions the reference path evaluates.
"""
from __future__ import annotations

from dataclasses import dataclass

from fusion.symbolic import Expr, Num, Param, Var, call, cmp, simplify, substitute, where

from fusion.codegen.spec import PRE_ACTIVATION, EpilogueSpec, Stage, bias_name

#: Stages with no elementwise math of their own here: pre-activation biases are folded into the
#: accumulator arguments, and quantization happens in the kernel's store.
SKIPPED = PRE_ACTIVATION + ("quant_mxfp8",)


def _activation(stage: Stage):
    from fusion.patterns.registry import get_activation

    name, params = stage.args
    return get_activation(name), dict(params)


def _bind_params(expr: Expr, values: dict) -> Expr:
    """Replace each Param by its value (the op's parameter, else the declaration's default)."""
    mapping = {}
    for node in _params_of(expr):
        value = values.get(node.name, node.default)
        mapping[node] = Num(float(value))
    return substitute(expr, mapping) if mapping else expr


def _params_of(expr: Expr):
    from fusion.symbolic import postorder

    return {n for n in postorder([expr]) if isinstance(n, Param)}


@dataclass(frozen=True)
class EpilogueMath:
    """Argument names the kernel passes to `apply`, and output expressions in its output order."""

    args: tuple[str, ...]
    outputs: tuple[Expr, ...]


def accumulator_args(spec: EpilogueSpec) -> tuple[Expr, ...]:
    """The GEMM result as the activation sees it: (gate, up) or (x,), with the GEMM's own bias added."""
    if spec.gated:
        gate, up = Var("gate"), Var("up")
        for name in spec.pre_activation_biases:
            gate, up = gate + Var(f"{name}_gate"), up + Var(f"{name}_up")
        return gate, up
    x = Var("x")
    for name in spec.pre_activation_biases:
        x = x + Var(name)
    return (x,)


def stage_forward(stage: Stage, y: Expr | None, acts: tuple[Expr, ...]) -> Expr:
    """Apply one stage to the running value `y` (None before the activation)."""
    if stage.kind == "act":
        definition, params = _activation(stage)
        mapping = {Var(a): v for a, v in zip(definition.args, acts)}
        return _bind_params(substitute(definition.forward_expr, mapping), params)
    if y is None:  # no activation: the stage applies to the accumulator itself
        y = acts[0]
    if stage.kind == "clamp":
        lo, hi = stage.args
        if lo is not None and hi is not None:
            return call("clamp", y, Num(lo), Num(hi))
        return call("max", y, Num(lo)) if lo is not None else call("min", y, Num(hi))
    if stage.kind == "scale_row":
        return y * Var(f"scale_{stage.args[0]}")
    if stage.kind == "scale_const":
        return y * Num(stage.args[0])
    if stage.kind == "bias":
        return y + Var(bias_name(stage))
    raise ValueError(f"no forward for stage {stage.kind}")  # pragma: no cover


def forward_math(spec: EpilogueSpec) -> Expr:
    """The epilogue's output value (before any quantization) as one expression of the accumulator."""
    acts = accumulator_args(spec)
    y = None
    for stage in spec.stages:
        if stage.kind in SKIPPED:
            continue
        y = stage_forward(stage, y, acts)
    return simplify(y if y is not None else acts[0])


def backward_math(spec: EpilogueSpec, dy: Expr = Var("dy")) -> tuple[tuple[Expr, ...], dict[str, Expr]]:
    """(d(output)/d(pre-activation) * dy for each accumulator half, {row scale name: per-element term}),
    walking the stages backwards. A per-row scale's gradient is the row sum of its term (dy at the scale
    times the value it scaled), which the caller reduces.

    The activation's gradient is its declaration's (`grad(arg) = ...` when the file gives one, else
    derived), so a user-written derivative is what the kernel runs. Quantization passes gradients straight
    through; a clamp passes them where the value was inside its bounds (torch.clamp's convention).
    """
    acts = accumulator_args(spec)
    # Forward values entering each stage, needed by clamp (the mask) and the activation (its arguments).
    values, y = [], None
    for stage in spec.stages:
        values.append(y)
        if stage.kind not in SKIPPED:
            y = stage_forward(stage, y, acts)
    g, terms = dy, {}
    for stage, before in reversed(list(zip(spec.stages, values))):
        before = before if before is not None else acts[0]
        if stage.kind == "clamp":
            lo, hi = stage.args
            inside = Num(1.0)
            if lo is not None:
                inside = where(cmp(">=", before, Num(lo)), inside, Num(0.0))
            if hi is not None:
                inside = where(cmp("<=", before, Num(hi)), inside, Num(0.0))
            g = g * inside
        elif stage.kind == "scale_row":
            terms[stage.args[0]] = simplify(g * before)
            g = g * Var(f"scale_{stage.args[0]}")
        elif stage.kind == "scale_const":
            g = g * Num(stage.args[0])
        elif stage.kind == "act":
            definition, params = _activation(stage)
            mapping = {Var(a): v for a, v in zip(definition.args, acts)}
            mapping[Var("dy")] = g
            grads = tuple(simplify(_bind_params(substitute(definition.grad_exprs[a], mapping), params))
                          for a in definition.args)
            return grads, terms
    return tuple(simplify(g) for _ in acts), terms
