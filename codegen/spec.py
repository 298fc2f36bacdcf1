"""What a fused kernel's epilogue must compute, as data, derived from the ops a plan step covers.

The spec is the bridge between the planner's world (ops, OpSpecs) and the kernel's world (an Epilogue
class with declared inputs and outputs). Building it is where unsupported combinations are detected, so the
planner can show the reason instead of failing at compile time.
"""
from __future__ import annotations

from dataclasses import dataclass

from fusion.errors import CompileError


class Unsupported(CompileError):
    """The kernel template cannot run this epilogue; the message says which op and why."""


@dataclass(frozen=True)
class Stage:
    """One epilogue stage.

    kind: gemm_bias (the GEMM's own bias) | pre_bias (a Bias op before the activation) | act | clamp |
    scale_row | scale_const | bias (a Bias op after the activation) | quant_mxfp8.
    """

    kind: str
    op_index: int
    args: tuple = ()


#: Stages that add a bias to the accumulator before the activation.
PRE_ACTIVATION = ("gemm_bias", "pre_bias")


def bias_name(stage: Stage) -> str:
    """The kernel input name of a bias stage: bias<op index> (op 0 is the GEMM's own bias)."""
    return f"bias{stage.op_index}"


@dataclass(frozen=True)
class EpilogueSpec:
    """A forward epilogue: acc -> (gemm bias) -> activation -> clamp -> scale -> bias -> output/quantize.

    gated: the GEMM's output is (gate, up) halves, interleaved in the weight so a tile holds both.
    save_preactivation: also write the GEMM output (interleaved) for the backward to read.
    """

    gated: bool
    stages: tuple[Stage, ...]
    out_features: int
    save_preactivation: bool = True

    @property
    def quantized(self) -> bool:
        return any(s.kind == "quant_mxfp8" for s in self.stages)

    @property
    def row_inputs(self) -> tuple[str, ...]:
        return tuple(s.args[0] for s in self.stages if s.kind == "scale_row")

    @property
    def group_inputs(self) -> tuple[tuple[str, bool], ...]:
        """(name, paired) of per-group column vectors (biases). Biases added before a gated activation are
        paired: interleaved like the weight, so each thread reads the gate and up halves it holds."""
        return tuple((bias_name(s), self.gated and s.kind in PRE_ACTIVATION)
                     for s in self.stages if s.kind in PRE_ACTIVATION + ("bias",))

    @property
    def pre_activation_biases(self) -> tuple[str, ...]:
        return tuple(bias_name(s) for s in self.stages if s.kind in PRE_ACTIVATION)


def spec_from_ops(ops) -> EpilogueSpec:
    """The epilogue of a forward step whose first op is the GEMM and the rest are its epilogue ops."""
    gemm, rest = ops[0], list(ops[1:])
    if gemm.spec.kind != "gemm":
        raise Unsupported(f"a fused step starts with a GEMM, not {gemm.describe()}")
    stages: list[Stage] = []
    gated = False
    feats = gemm.spec.attrs["out_features"]
    if gemm.spec.attrs.get("bias"):
        stages.append(Stage("gemm_bias", 0))
    for i, op in enumerate(rest, start=1):
        spec = op.spec
        if spec.kind == "activation":
            if any(s.kind in ("act", "clamp", "scale_row", "scale_const") for s in stages):
                raise Unsupported(f"{op.describe()}: only a bias may come before the activation in the epilogue")
            gated = spec.gated
            params = tuple(sorted((k, v) for k, v in spec.attrs.items() if k not in ("activation", "gated")))
            stages.append(Stage("act", i, (spec.attrs["activation"], params)))
            feats = op.output_features(feats)
        elif spec.name == "Clamp":
            stages.append(Stage("clamp", i, (spec.attrs["min"], spec.attrs["max"])))
        elif spec.name == "Scale":
            if spec.attrs["per_row"]:
                stages.append(Stage("scale_row", i, (spec.attrs["name"],)))
            else:
                stages.append(Stage("scale_const", i, (spec.attrs["value"],)))
        elif spec.name == "Bias":
            before_activation = any(op2.spec.kind == "activation" for op2 in rest[i:])
            stages.append(Stage("pre_bias" if before_activation else "bias", i, (spec.attrs["per_group"],)))
        elif spec.kind == "quantize":
            if spec.attrs["format"] != "mxfp8":
                raise Unsupported(f"{op.describe()}: the sm_90 epilogue quantizes to MXFP8 only")
            if i != len(rest):
                raise Unsupported(f"{op.describe()}: quantization must be the last epilogue stage")
            stages.append(Stage("quant_mxfp8", i, (spec.attrs["columnwise"],)))
        else:
            raise Unsupported(f"{op.describe()}: no epilogue stage for a {spec.kind} op")
    # The backward recomputes the epilogue from the GEMM output only when a stage's gradient depends on its
    # input (activation, clamp mask, d scale); a bias or a constant scale needs nothing saved.
    needs_input = any(s.kind in ("act", "clamp", "scale_row") for s in stages)
    if gated and feats % 8:
        raise Unsupported(f"gated output width {feats} is not a multiple of 8 (the gate/up interleave block)")
    return EpilogueSpec(gated=gated, stages=tuple(stages), out_features=feats, save_preactivation=needs_input)
