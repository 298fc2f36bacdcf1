"""What a fused kernel's epilogue must compute, as data, derived from the ops a plan step covers.

The spec is the bridge between the planner's world (ops, OpSpecs) and the kernel's world (an Epilogue class
with declared inputs and outputs). Building it is where unsupported combinations are detected, so the
planner can show the reason instead of failing at compile time.

Two specs exist per fused chain:
  * a forward spec (`forward_spec`): the GEMM's accumulator -> the chain's output (and, for training, the
    value the pattern's `save` names, "saved": the caller says which; the spec never guesses it);
  * a backward spec (`backward_spec`): the gradient of the chain's output (a dgrad GEMM's accumulator) -> the
    gradient of the chain's input, reading that saved value, with per-row scale gradients as side outputs
    and, on request, the chain's output recomputed from the saved value (the next GEMM's wgrad input).

The kernel operands each spec needs are typed slots (codegen/slots.py); the runtime binds tensors to them.
"""
from __future__ import annotations

from dataclasses import dataclass

from fusion.errors import CompileError
from fusion.quant.fp8_block import FP8_BLOCK   # a rowwise block's columns: whole in the kernel's logical tile

from fusion.codegen import slots


class Unsupported(CompileError):
    """The kernel template cannot run this epilogue; the message says which op and why."""


@dataclass(frozen=True)
class Stage:
    """One epilogue stage.

    kind: gemm_bias (the GEMM's own bias) | bias (a Bias op) | act | clamp | scale_row | scale_const |
    quant_mxfp8, quant_fp8_block (forward: the kernel's store quantizes) | quant_pass (backward: straight
    through).
    position: the op's position in the step's op list (0 = the GEMM of a forward step).
    args: kind-specific data (the activation name and parameters, clamp bounds, the scale's input name...).
    """

    kind: str
    position: int
    args: tuple = ()

    @property
    def needs_input(self) -> bool:
        """Whether this stage's gradient depends on the value entering it (so the backward must read it)."""
        return self.kind in ("act", "clamp", "scale_row")


@dataclass(frozen=True)
class EpilogueSpec:
    """An epilogue as a list of stages applied to the accumulator, in chain order.

    gated: the value entering the activation is (gate, up) halves; the chain's GEMM output has 2x the width.
    out_features: width of the chain's output. in_features: width entering the first stage (the GEMM output).
    saved: index into `stages` of the stage whose input is saved (None: nothing). Forward: the value the training
    kernel writes for the backward (the pattern's `save`); backward: the value the kernel reads, the input of
    the first stage that needs its input (stages after it are recomputed from it).
    """

    gated: bool
    stages: tuple[Stage, ...]
    out_features: int
    in_features: int
    saved: int | None

    @property
    def quantized(self) -> bool:
        """The kernel stores its output quantized (forward)."""
        return self.quant_format is not None

    @property
    def quant_format(self) -> str | None:
        """The format the forward kernel's store quantizes to ("mxfp8", "fp8_block"), None when it does not."""
        return next((fmt for fmt, kind in _QUANT_STAGES.items() for s in self.stages if s.kind == kind), None)

    @property
    def col_block(self) -> int:
        """The logical columns the kernel's block-wise output needs whole in a tile (8: none)."""
        return {"mxfp8": 32, "fp8_block": FP8_BLOCK}.get(self.quant_format, 8)

    @property
    def passed_format(self) -> str | None:
        """The format of the quantize op a backward chain passes its gradient through (None: none)."""
        return next((s.args[0] for s in self.stages if s.kind == "quant_pass"), None)

    def dequantizes(self, postact: bool) -> bool:
        """Whether the dgrad kernel writes the recomputed output FP8-block dequantized (a 1 x 128 block per row)."""
        return postact and self.passed_format == "fp8_block"

    @property
    def has_quantize(self) -> bool:
        """A quantize op lies in the chain (forward: quantized store; backward: passed straight through)."""
        return any(s.kind.startswith("quant") for s in self.stages)

    @property
    def saved_paired(self) -> bool:
        """The saved value holds (gate, up) halves: it enters a gated activation or a bias before it."""
        act = self._act_index()
        return self.saved is not None and self.gated and act is not None and self.saved <= act

    def _act_index(self) -> int | None:
        return next((i for i, s in enumerate(self.stages) if s.kind == "act"), None)

    def width_at(self, k: int) -> int:
        """Features of the value entering stage k (k == len(stages): the chain's output)."""
        act = self._act_index()
        return self.in_features if act is None or k <= act else self.out_features

    @property
    def saved_position(self) -> int | None:
        return None if self.saved is None else self.stages[self.saved].position

    def bias_paired(self, stage: Stage) -> bool:
        """Biases added before a gated activation cover both halves: (gate, up) in the canonical layout."""
        return self.gated and stage.kind in ("gemm_bias", "bias") and any(
            s.kind == "act" for s in self.stages[self.stages.index(stage):])

    def row_scales(self) -> tuple[slots.RowScale, ...]:
        return tuple(slots.RowScale(s.args[0]) for s in self.stages if s.kind == "scale_row")

    def group_biases(self, stages=None) -> tuple[slots.GroupBias, ...]:
        stages = self.stages if stages is None else stages
        return tuple(slots.GroupBias(s.position, self.bias_paired(s)) for s in stages
                     if s.kind in ("gemm_bias", "bias"))

    # -- the kernels' operands -------------------------------------------------------------------------------
    def forward_slots(self, train: bool) -> tuple[tuple, tuple]:
        """(inputs, outputs) of the forward kernel. Training adds the saved value as an output."""
        inputs = self.group_biases() + self.row_scales()
        if self.quant_format == "fp8_block":
            # rowwise codes, scales and the amax from the kernel; nothing in high precision (the pattern fuses
            # QuantizeFP8Block(columnwise=False) only)
            outputs: tuple = (slots.QuantizedFP8Block(),)
        elif self.quantized:
            outputs = (slots.Quantized(), slots.HighPrecision())
        else:
            outputs = (slots.Out(),)
        if train and self.saved is not None:
            outputs += (slots.SavedOut(self.saved_paired),)
        return inputs, outputs

    def quantizable_dinput(self, fmt: str) -> bool:
        """Whether the dgrad kernel can write the input gradient quantized to `fmt` as a GEMM's FP8 dgrad reads
        it: FP8-block's 1 x 128 rowwise blocks of the (in_features)-wide gradient, whole in the kernel's
        128-column logical tile; gated, each half a whole number of blocks (no block straddles gate and up)."""
        half = self.in_features // 2 if self.gated else self.in_features
        return fmt == "fp8_block" and (not self.gated or half % FP8_BLOCK == 0)

    def backward_slots(self, postact: bool, quantized_dinput: str | None = None) -> tuple[tuple, tuple]:
        """(inputs, outputs) of the dgrad kernel: reads the saved value (when a stage needs it), the row
        scales and, to recompute the output, the biases after the saved stage; writes the input gradient,
        optionally also quantized to `quantized_dinput` ("fp8_block": the FP8 dgrad operand of the GEMM before
        the chain), each row scale's gradient as per-block row sums of its terms (slots.DScale), and optionally
        the recomputed output (after a quantize op in the chain: its output dequantized, as the next GEMM's
        weight gradient reads it)."""
        inputs: tuple = ()
        if self.saved is not None:
            inputs += (slots.SavedIn(self.saved_paired),)
            if postact:
                inputs += self.group_biases(self.stages[self.saved:])
        inputs += self.row_scales()
        outputs: tuple = (slots.DInput(self.gated),)
        if quantized_dinput is not None:
            if not self.quantizable_dinput(quantized_dinput):
                raise Unsupported(f"the dgrad epilogue writes its input gradient quantized to FP8-block only, each "
                                  f"gated half a multiple of {FP8_BLOCK} columns; not {quantized_dinput} at "
                                  f"{self.in_features} columns")
            outputs += (slots.QuantizedDInput(self.gated),)
        outputs += tuple(slots.DScale(s.name) for s in self.row_scales())
        if postact:
            fmt = self.passed_format
            if fmt not in (None, "fp8_block"):
                raise Unsupported(f"the dgrad epilogue recomputes a quantize op's output only dequantized from "
                                  f"FP8-block, not {fmt}")
            outputs += (slots.PostAct(dequantized=fmt),)
        return inputs, outputs


#: The formats a forward kernel's store quantizes to, and their stage kinds: MXFP8 on the bf16 kernel
#: (patterns/moe.fpat), FP8-block rowwise on the FP8 kernel's 128-column logical tile (patterns/fp8.fpat).
_QUANT_STAGES = {"mxfp8": "quant_mxfp8", "fp8_block": "quant_fp8_block"}


def _elementwise_stage(op, position: int, backward: bool = False) -> Stage:
    spec = op.spec
    if backward and spec.kind == "quantize":  # straight-through in the backward, whatever the format
        return Stage("quant_pass", position, (spec.attrs["format"],))
    if spec.kind == "activation":
        params = tuple(sorted((k, v) for k, v in spec.attrs.items() if k not in ("activation", "gated")))
        return Stage("act", position, (spec.attrs["activation"], params))
    if spec.name == "Clamp":
        return Stage("clamp", position, (spec.attrs["min"], spec.attrs["max"]))
    if spec.name == "Scale":
        if spec.attrs["per_row"]:
            return Stage("scale_row", position, (spec.attrs["name"],))
        return Stage("scale_const", position, (spec.attrs["value"],))
    if spec.name == "Bias":
        return Stage("bias", position, (spec.attrs["per_group"],))
    if spec.kind == "quantize":
        kind = _QUANT_STAGES.get(spec.attrs["format"])
        if kind is None:
            raise Unsupported(f"{op.describe()}: the sm_90 epilogue quantizes to MXFP8 or FP8-block only")
        return Stage(kind, position, (spec.attrs["columnwise"],))
    raise Unsupported(f"{op.describe()}: no epilogue stage for a {spec.kind} op")


def _spec(stages: list[Stage], ops, width: int, gated: bool, saved: int | None) -> EpilogueSpec:
    feats = width
    seen_act = False
    for stage, op in zip(stages, ops):
        if stage.kind == "act":
            if seen_act or any(s.kind in ("clamp", "scale_row", "scale_const") for s in stages[:stages.index(stage)]):
                raise Unsupported(f"{op.describe()}: only a bias may come before the activation in the epilogue")
            seen_act = True
            feats = op.output_features(feats)
        elif stage.kind.startswith("quant") and stage is not stages[-1]:
            raise Unsupported(f"{op.describe()}: quantization must be the last epilogue stage")
    if gated and feats % 8:
        raise Unsupported(f"gated output width {feats} is not a multiple of 8 (16-byte aligned halves)")
    return EpilogueSpec(gated=gated, stages=tuple(stages), out_features=feats, in_features=width, saved=saved)


def forward_spec(ops, saved_position: int | None = None) -> EpilogueSpec:
    """The epilogue of a forward step whose first op is the GEMM and the rest are its epilogue ops.

    saved_position: the position in `ops` of the op whose input the training kernel writes for the backward
    (what the pattern's `save` names, fusion/dataflow.py); None: it writes nothing. The GEMM's input (0) is the
    kernel's own input and the chain's output (len(ops)) its output: neither is a value to save."""
    gemm, rest = ops[0], list(ops[1:])
    if gemm.spec.kind != "gemm":
        raise Unsupported(f"a fused step starts with a GEMM, not {gemm.describe()}")
    stages: list[Stage] = []
    owners = []
    if gemm.spec.attrs.get("bias"):
        stages.append(Stage("gemm_bias", 0))
        owners.append(gemm)
    for i, op in enumerate(rest, start=1):
        stages.append(_elementwise_stage(op, i))
        owners.append(op)
    gated = any(op.spec.kind == "activation" and op.spec.gated for op in rest)
    saved = None
    if saved_position is not None:
        if not 0 < saved_position < len(ops):
            raise Unsupported(f"a forward kernel saves a value inside its chain (positions 1..{len(ops) - 1}), "
                              f"not position {saved_position}: the GEMM's input and the chain's output are the "
                              f"kernel's own input and output")
        saved = next(k for k, s in enumerate(stages) if s.position == saved_position)
    return _spec(stages, owners, gemm.spec.attrs["out_features"], gated, saved)


def backward_spec(ops, width: int) -> EpilogueSpec:
    """The epilogue of a dgrad step: `ops` are the elementwise ops between the value the chain starts from (of
    `width` features) and the GEMM whose dgrad the kernel computes, in forward order; positions count from 0."""
    stages = [_elementwise_stage(op, i, backward=True) for i, op in enumerate(ops)]
    gated = any(op.spec.kind == "activation" and op.spec.gated for op in ops)
    spec = _spec(stages, list(ops), width, gated, next((k for k, s in enumerate(stages) if s.needs_input), None))
    if spec.saved is not None:
        for stage in stages[:spec.saved]:
            if stage.kind not in ("bias", "scale_const"):
                raise Unsupported(f"stage {stage.kind} before the saved value has an input-dependent gradient")
    return spec
