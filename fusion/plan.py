"""What the planner decides, as plain data: the kernels a block launches, forward and backward, and why.

Plans are shared (cached per op signatures, dtype, target and pattern library): treat them as read-only.
`Plan.to_dict()` is what explain(format="json") prints.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class OpInfo:
    """One op of the block as the plan saw it."""

    index: int
    name: str
    kind: str
    description: str  # op.describe()
    in_features: int | None
    out_features: int | None
    #: its gradient needs the value entering it (activations, clamps, per-row scales, GEMMs' wgrad)
    grad_reads_input: bool = False
    #: bytes per element of its input / output at the plan's dtype (quantized outputs: data and scales)
    in_bytes: float = 2.0
    out_bytes: float | None = 2.0
    #: GEMMs: the weight format ("bf16" | "fp8_block"); None for other ops
    weight_format: str | None = None
    #: quantize ops: the format they write ("mxfp8" | "nvfp4" | "fp8_block"); None for other ops
    format: str | None = None
    #: quantize ops: whether they also write the columnwise copy
    columnwise: bool = False
    #: activations: whether gated (the input is the gate and up halves, twice the output's width)
    gated: bool = False
    #: GEMMs: how many groups (a Linear's and a one-group GroupLinear's: 1); None for other ops
    groups: int | None = None
    #: what one row of its input / output is: "M" (the rows of x; in an MoE block the routed rows) or "T"
    #: (tokens: an MoE block's rows before its Gather and after its Combine) (fusion/dataflow.py)
    in_rows: str = "M"
    out_rows: str = "M"

    @property
    def gemm_by_reference(self) -> bool:
        """A GEMM that no vendor GEMM runs unfused: its weight format's recipe is its own reference (fp8_block:
        fusion/quant/fp8_linear.py), so forward and backward run the op's reference, not GEMM steps."""
        return self.kind == "gemm" and self.weight_format not in (None, "bf16")


@dataclass(frozen=True)
class Step:
    """One kernel launch (or one unfused op's reference computation).

    direction: "forward" | "backward".
    fused: True when a pattern matched.
    ops: the op indices involved, in block order; descriptions: their describe() texts.
    parts: the (op index, part) units computed, part in "forward" | "dgrad" | "wgrad" | "backward"
           (dgrad/wgrad: the input and weight gradients of a GEMM; backward: of any other op).
    Fused steps: pattern (name), pattern_loc ("file:line"), kernel (template name), epilogue ((label, op
           index) in epilogue order), saves (the pattern's `save` references whose elements are bound: what
           the forward kernel writes for the backward).
    Unfused steps: method (the reference implementation that runs) and notes (e.g. host syncs).
    """

    direction: str
    fused: bool
    ops: tuple[int, ...]
    descriptions: tuple[str, ...]
    parts: tuple[tuple[int, str], ...]
    pattern: str | None = None
    pattern_loc: str | None = None
    kernel: str | None = None
    epilogue: tuple[tuple[str, int], ...] = ()
    saves: tuple[str, ...] = ()
    labels: tuple[tuple[str, int], ...] = ()  # every bound chain element: (label, op index)
    method: str | None = None
    notes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()   # values (v<i>: input of op i) and gradients (g<i>) it reads (fusion/dataflow.py)
    writes: tuple[str, ...] = ()  # what it writes


@dataclass(frozen=True)
class OpAttempt:
    """Why one pattern did or did not apply to one op.

    outcome: "applied" (the op runs in this pattern's kernel), "not chosen" (the pattern matched here but an
    overlapping match won; reason says which), "failed" (reason: the first failing check).
    ops: the ops the pattern would have covered (empty when the chain's shape does not fit at this op).
    """

    pattern: str
    loc: str
    direction: str
    outcome: str
    reason: str | None
    ops: tuple[int, ...] = ()


@dataclass(frozen=True)
class Fallback:
    """An op (or the backward of an op) that runs its reference implementation although it could be fused.

    part: "forward" or "backward". reasons: one line per pattern tried ("name [file:line]: why"), or the
    single reason when no pattern was tried at all (cpu, backend='reference', no patterns loaded).
    """

    op: int
    description: str
    direction: str
    part: str
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """The plan of one block for (dtype, target).

    target: "sm_90"... or None (no fused kernels: cpu). dtype: "bfloat16"...
    forward: steps in launch order. backward: steps in the order autograd runs them.
    attempts: per op index, every pattern tried (both directions) and its outcome there.
    fallbacks: what runs unfused although a pattern could have covered it (forward ops, and the backward of
    non-GEMM ops); a GEMM's dgrad / wgrad outside a backward pattern is an ordinary unfused step, not a
    fallback (the pattern language fuses a dgrad only together with the elementwise backward before it); a
    GEMM run by its reference (OpInfo.gemm_by_reference: fp8_block weights) is one, forward and backward.
    fully_fused: no fallbacks. patterns: (name, file:line, direction) of the library the plan was made with.
    reason: set when no pattern was tried at all ("no fused kernels on cpu", "backend='reference'").
    """

    target: str | None
    dtype: str
    ops: tuple[OpInfo, ...]
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    attempts: dict
    fallbacks: tuple[Fallback, ...]
    fully_fused: bool
    patterns: tuple[tuple[str, str, str], ...] = ()
    reason: str | None = None
    notes: tuple[str, ...] = field(default=())
    saves: tuple[str, ...] = ()       # values the forward keeps for the backward, in first-use order
    recomputed: tuple[str, ...] = ()  # saved values the forward does not produce: recomputed for the backward

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.forward + self.backward

    @property
    def fused_steps(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.fused)

    def fallback_report(self) -> str:
        """The text FallbackError carries: every op that falls back with every pattern tried and why."""
        lines = [f"backend='fused' but {len(self.fallbacks)} op computation(s) would fall back to the reference "
                 f"implementation (dtype {self.dtype}, target {self.target or 'cpu'}):"]
        for fb in self.fallbacks:
            lines.append(f"  op {fb.op} {fb.description} ({fb.part}):")
            lines.extend(f"    - {r}" for r in fb.reasons)
        lines.append("use backend='auto' to run these ops unfused, or see mlp.explain() for the whole plan")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """json.dumps-able form (tuples become lists; attempts keyed by str(op index))."""
        d = asdict(self)
        d["attempts"] = {str(i): [asdict(a) for a in v] for i, v in self.attempts.items()}
        d["fused_kernels"] = len(self.fused_steps)
        return _lists(d)


def _lists(x):
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    return x
