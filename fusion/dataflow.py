"""What each plan step reads and writes, and what the forward must keep for the backward.

Values are named by position in the block: `v<i>` is the input of op i (`v0` = x, `v<n>` = the block output),
`g<i>` its gradient. A forward step reads the value entering its first op and writes the value leaving its
last; a fused forward step also writes the interior values its pattern saves (`save = act.in`). A backward
step reads the gradient of its last op's output and whatever values its gradient needs, and writes the
gradient of its first op's input:

    fused dgrad (ops a..j):  reads g<j+1>, v<k> (k: the first op whose gradient reads its input)
                             writes g<a>, and v<j> (the next GEMM's wgrad input, recomputed from v<k> by the
                             kernel) when no quantize op lies between, or one whose output the kernel
                             template recomputes dequantized (`recomputes_dequantized`); and qg<a>, g<a>
                             quantized as the FP8 dgrad of the GEMM before the chain reads it
                             (`quantizes_dgrad_operand`)
    GEMM j dgrad:            reads g<j+1>                  writes g<j>
                             (and qg<j+1> where a fused step wrote it: its FP8 operand, no quantize pass)
    GEMM j wgrad:            reads g<j+1>, v<j>            writes the weight (and bias) gradient
    op k backward:           reads g<k+1> (+ v<k> when its gradient reads its input)   writes g<k>
                             (a GEMM run by its reference, e.g. fp8_block weights: also its weight gradient)
    quantize op k:           no step: g<k> is g<k+1> (straight through)

The values the backward reads that no earlier backward step wrote are the forward's saves. A saved value the
forward does not produce (interior to a fused step whose pattern does not save it) is recomputed from the
nearest value before it that the forward produces, which is then saved too (a Gather fused into FC1's A loads
leaves the gathered rows unwritten: FC1's wgrad regathers them from x, unless its kernel reads x through the
routing index, fusion/runtime/steps.py GemmWgrad); the plan lists those, and explain() says so.

Rows: every value of a dense block has the rows of x (M). An MoE block's Gather turns token rows (T) into
routed rows (M, one per (token, expert) pair: k per token without token rounding) and its Combine turns them
back; `row_symbols` names the rows of each value so sizes can be given per token.
"""
from __future__ import annotations

import dataclasses
import os

from fusion.kernel_templates import TEMPLATES  # a data table: what each kernel template can write
from fusion.quant.fp8_block import FP8_BLOCK     # the 1 x 128 rowwise block a quantized gradient's rows hold


def v(i: int) -> str:
    return f"v{i}"


def g(i: int) -> str:
    return f"g{i}"


def index_of(name: str) -> int:
    return int(name[1:])


def _label_value(label_ref: str, labels: dict) -> str | None:
    """`act.in` -> v<op of act>; `gemm.out` -> v<op of gemm + 1>; None when the label is not bound."""
    label, _, side = label_ref.partition(".")
    if label not in labels:
        return None
    return v(labels[label] + (1 if side == "out" else 0))


def out_grad(infos, i: int) -> str:
    """The name of the gradient of op i's output: g<i+1>, or past straight-through quantize ops after op i
    (the gradient of a quantize op's input is the gradient of its output)."""
    while i + 1 < len(infos) and infos[i + 1].kind == "quantize":
        i += 1
    return g(i + 1)


def forward_io(infos, step, train: bool = True) -> tuple[tuple[str, ...], tuple[str, ...]]:
    first, last = step.ops[0], step.ops[-1]
    writes = [v(last + 1)]
    if step.fused and train:
        labels = {lab: i for lab, i in step.labels}
        for ref in step.saves:
            name = _label_value(ref, labels)
            if name is not None and name not in writes:
                writes.append(name)
    return (v(first),), tuple(writes)


#: The plan dtypes in which a dgrad kernel recomputes a quantize op's output dequantized. In bfloat16 (float32's
#: exponent range) the kernel's value is, bit for bit, what the next GEMM's bf16 weight gradient reads of the saved
#: quantized tensor (fusion/runtime/fp8_gemm.py `_dequantize_rowwise`), and what the FP8 weight gradient
#: requantizes differs only in blocks whose amax is below about 2^-116 (their dequantized values are under bf16's
#: subnormals). In float16 a block whose amax is below about 0.007 has dequantized values that are not float16
#: numbers: the forward keeps the quantized tensor there.
DEQUANTIZED_RECOMPUTE_DTYPES = ("bfloat16",)


def recomputes_dequantized(infos, step, dtype: str) -> bool:
    """Whether fused backward `step` recomputes its chain's output after the quantize op that ends the chain's
    elementwise ops, dequantized: the kernel template can (KernelTemplate.dequantizes), the op writes no
    columnwise copy (a different quantization, which the value's rowwise blocks cannot give), and `dtype` holds
    the dequantized values (:data:`DEQUANTIZED_RECOMPUTE_DTYPES`)."""
    quantizes = [infos[i] for i in step.ops[:-1] if infos[i].kind == "quantize"]
    template = TEMPLATES.get(step.kernel)
    return (len(quantizes) == 1 and quantizes[0].index == step.ops[-2] and template is not None
            and quantizes[0].format in template.dequantizes and not quantizes[0].columnwise
            and dtype in DEQUANTIZED_RECOMPUTE_DTYPES)


def qg(i: int) -> str:
    """The name of g<i> quantized as an FP8 GEMM's dgrad reads it (a fused dgrad's second copy of its output)."""
    return f"qg{i}"


#: Whether a fused dgrad whose template can (KernelTemplate.quantizes_dinput) also writes its input gradient
#: quantized for the FP8 dgrad of the GEMM before its chain (read when a block is planned; bench/ab_switch.py --plan
#: flips it). Off by default (FUSION_QUANTIZED_DGRAD_OPERAND=1, read at import, turns it on): measured on an H200
#: (bench/ab_switch.py --plan, three rounds; docs/benchmarks.md "FC1's dgrad operand from FC2's dgrad"), the
#: dgrad's epilogue, which does not overlap its mainloop, spent more on the quantization than the quantize kernel it
#: replaces: Qwen3-30B-A3B's FC2 dgrad +0.111 ms against the 0.089 ms kernel, DeepSeek-V2-Lite's +0.174 against
#: 0.120; training steps -0.3..+2.5% with QuantizeFP8Block(columnwise=False), -0.0..+3.9% without it.
QUANTIZES_DGRAD_OPERAND = os.environ.get("FUSION_QUANTIZED_DGRAD_OPERAND", "0") == "1"


def quantizes_dgrad_operand(infos, step) -> int | None:
    """The GEMM whose dgrad reads fused backward `step`'s input gradient g<a> quantized by the step's epilogue, or
    None: the GEMM before the chain (past straight-through quantize ops) has a weight format the template quantizes
    for (KernelTemplate.quantizes_dinput: fp8_block, whose dgrad reads its dY 1x128 rowwise), and the blocks fit the
    kernel's 128-column logical tile (a gated chain: each half a multiple of 128, so no block straddles gate and
    up; codegen/spec.py `quantizable_dinput`)."""
    template = TEMPLATES.get(step.kernel)
    a = step.ops[0]
    p = a - 1
    while p >= 0 and infos[p].kind == "quantize":
        p -= 1
    if not QUANTIZES_DGRAD_OPERAND or template is None or p < 0 or infos[p].kind != "gemm":
        return None
    if infos[p].weight_format not in template.quantizes_dinput or infos[a].in_features is None:
        return None
    gated = any(infos[i].gated for i in step.ops[:-1])
    if gated and (infos[a].in_features // 2) % FP8_BLOCK:
        return None
    return p


def backward_io(infos, step, dtype: str = "bfloat16") -> tuple[tuple[str, ...], tuple[str, ...]]:
    if step.fused:
        ops = step.ops
        j = ops[-1]
        elementwise = ops[:-1]
        reads = [out_grad(infos, j)]
        k = next((i for i in elementwise if infos[i].grad_reads_input), None)
        if k is not None:
            reads.append(v(k))
        writes = [g(ops[0])]
        if k is not None and (not any(infos[i].kind == "quantize" for i in elementwise)
                              or recomputes_dequantized(infos, step, dtype)):
            writes.append(v(j))
        return tuple(reads), tuple(writes)
    (i, part) = step.parts[0]
    grad = out_grad(infos, i)
    if part == "dgrad":
        return (grad,), (g(i),)
    if part == "wgrad":
        return (grad, v(i)), (f"dW{i}",)
    reads = (grad, v(i)) if infos[i].grad_reads_input else (grad,)
    if infos[i].kind == "gemm":
        return reads, (g(i), f"dW{i}")
    return reads, (g(i),)


def annotate(infos, forward, backward, train: bool = True, dtype: str = "bfloat16"):
    """(forward steps, backward steps) with reads/writes filled in, the saved values in first-use order, and the
    values the backward needs that the forward does not produce (recomputed)."""
    forward = [dataclasses.replace(s, **dict(zip(("reads", "writes"), forward_io(infos, s, train))))
               for s in forward]
    backward = [dataclasses.replace(s, **dict(zip(("reads", "writes"), backward_io(infos, s, dtype))))
                for s in backward]
    backward = _link_quantized_operands(infos, backward)
    produced = {name for s in forward for name in s.writes} | {v(0)}
    written: set[str] = set()
    saves: list[str] = []
    for s in backward:
        for name in s.reads:
            if name.startswith("v") and name not in written and name not in saves:
                saves.append(name)
        written.update(s.writes)
    recomputed = tuple(name for name in saves if name not in produced)
    for name in recomputed:  # the value each is recomputed from must be kept
        base = v(max(index_of(p) for p in produced if p.startswith("v") and index_of(p) < index_of(name)))
        if base not in saves:
            saves.append(base)
    return forward, backward, tuple(saves), recomputed


def _link_quantized_operands(infos, backward):
    """The fused dgrads that also write their input gradient quantized (`quantizes_dgrad_operand`), each where the
    GEMM's own dgrad step follows and reads it: the fused step writes qg<a> and the dgrad reads it too."""
    backward = list(backward)
    for n, step in enumerate(backward):
        p = quantizes_dgrad_operand(infos, step) if step.fused else None
        if p is None:
            continue
        grad = g(step.ops[0])
        reader = next((k for k in range(n + 1, len(backward)) if backward[k].parts == ((p, "dgrad"),)
                       and backward[k].reads == (grad,)), None)
        if reader is None:
            continue
        backward[n] = dataclasses.replace(step, writes=step.writes + (qg(step.ops[0]),))
        backward[reader] = dataclasses.replace(backward[reader], reads=(grad, qg(step.ops[0])))
    return backward


def hands_dy_to_wgrad(backward, n: int, grad: str, output_grad: str) -> bool:
    """Whether backward step `n`, a GEMM's unfused dgrad reading its output gradient `grad`, is the first of exactly
    two readers of `grad` and the other is the same GEMM's weight gradient after it (and `grad` is not the block's
    output gradient `output_grad`, the caller's tensor). Such a dgrad may make the weight gradient's copy of dY and
    let dY go before its own GEMM (an fp8_block GEMM on the GPU: fusion/runtime/fp8_gemm.py `SlotGradient`); the
    runtime marks the step and explain() says so, both from this rule."""
    step = backward[n]
    if step.fused or len(step.parts) != 1 or step.parts[0][1] != "dgrad" or grad == output_grad:
        return False
    readers = [m for m, s in enumerate(backward) if grad in s.reads]
    if readers[:1] != [n] or len(readers) != 2:
        return False
    other = backward[readers[1]]
    return not other.fused and other.parts == ((step.parts[0][0], "wgrad"),)


def bytes_per_row(infos, name: str) -> float | None:
    """Bytes one row of a saved value takes (None where unknown)."""
    i = index_of(name)
    if i == 0:
        return None if infos[0].in_features is None else infos[0].in_features * infos[0].in_bytes
    info = infos[i - 1]
    if info.out_features is None or info.out_bytes is None:
        return None
    return info.out_features * info.out_bytes


#: What an op of each kind does to the rows: a gather makes routed rows, a combine token rows; others keep them.
_ROWS_AFTER = {"gather": "M", "combine": "T"}
#: The rows before the first row-changing op, by that op's kind.
_ROWS_BEFORE = {"gather": "T", "combine": "M"}


def row_symbols(kinds) -> tuple[str, ...]:
    """The rows of each value v0..vn of a block whose ops have `kinds`: "M" everywhere in a dense block; in an
    MoE block "T" (tokens) before a gather and after a combine, "M" (routed rows) between."""
    kinds = list(kinds)
    first = next((k for k in kinds if k in _ROWS_AFTER), None)
    rows = [_ROWS_BEFORE.get(first, "M")]
    for k in kinds:
        rows.append(_ROWS_AFTER.get(k, rows[-1]))
    return tuple(rows)


def rows_of(infos, name: str) -> str:
    """"M" or "T": what one row of value `name` (v<i>) is."""
    i = index_of(name)
    return infos[i].in_rows if i < len(infos) else infos[-1].out_rows


def saved_bytes(infos, names) -> tuple[dict[str, float], list[str]]:
    """({rows symbol: bytes per such row}, names of unknown size) summed over the values `names`."""
    out: dict[str, float] = {}
    unknown = []
    for name in names:
        size = bytes_per_row(infos, name)
        if size is None:
            unknown.append(name)
            continue
        key = rows_of(infos, name)
        out[key] = out.get(key, 0.0) + size
    return out, unknown
