"""The kernel templates this build can run, by the name pattern files use (`kernel = NAME`).

Data, read by the matcher: a pattern whose template is not runnable here fails with the template's reason,
so a plan never promises a kernel the runtime cannot launch.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelTemplate:
    name: str
    direction: str
    available: bool
    summary: str
    unavailable_reason: str = ""
    #: the GEMM weight formats (GroupLinear/Linear `weight_format`) its mainloop runs
    weight_formats: tuple[str, ...] = ("bf16",)
    #: how many values inside its chain its training variant writes for the backward: the most a pattern's
    #: `save` may name (patterns/fusion_semantics.py checks it when the file loads). The grouped GEMM's epilogue
    #: has one such output (codegen/slots.py: SavedOut); a dgrad kernel writes none, it reads.
    saves: int = 1
    #: a dgrad template: the quantize formats (rowwise, columnwise=False) whose output its epilogue can recompute
    #: dequantized, so that the next GEMM's weight gradient reads it without the forward keeping the quantized
    #: tensor (fusion/dataflow.py; kernels.epilogue.FP8BlockDequantOutput)
    dequantizes: tuple[str, ...] = ()
    #: a dgrad template: the weight formats of a GEMM before its chain whose dgrad operand (the gradient of the
    #: chain's input, quantized as that GEMM's dgrad reads it) its epilogue can write besides the gradient itself,
    #: so that dgrad runs no quantize pass (fusion/dataflow.py `quantizes_dgrad_operand`)
    quantizes_dinput: tuple[str, ...] = ()


TEMPLATES: dict[str, KernelTemplate] = {
    t.name: t for t in (
        KernelTemplate("grouped_gemm", "forward", True,
                       "persistent warp-specialized grouped GEMM (sm_90a, TMA + wgmma) with a generated epilogue "
                       "(kernels/grouped_gemm.py)"),
        KernelTemplate("grouped_gemm_dgrad", "backward", True,
                       "the grouped GEMM template computing a dgrad (dy @ W[g]) whose generated epilogue applies "
                       "the backward of the elementwise ops before the GEMM (fusion/runtime/steps.py)", saves=0),
        KernelTemplate("grouped_gemm_gather", "forward", True,
                       "the grouped GEMM loading its A rows through the routing index (an MoE block's Gather): "
                       "per-row cp.async by the producer warpgroup, B by TMA (kernels/mainloop.py)"),
        KernelTemplate("grouped_gemm_fp8", "forward", True,
                       "the FP8 block-scaled grouped GEMM (sm_90a, E4M3 wgmma; 1x128 activation and 128x128 weight "
                       "scales promoted into an fp32 accumulator per 128 of K; kernels/fp8_gemm.py) with a generated "
                       "epilogue; A is quantized 1x128 rowwise first unless it already is",
                       weight_formats=("fp8_block",)),
        KernelTemplate("grouped_gemm_fp8_dgrad", "backward", True,
                       "the FP8 block-scaled grouped GEMM computing a dgrad (dY quantized 1x128 rowwise, E4M3, times "
                       "the weight's transposed 128x128 blocks) whose generated epilogue applies the backward of the "
                       "elementwise ops before the GEMM; after a QuantizeFP8Block(columnwise=False) it also "
                       "recomputes that op's output, dequantized, for the next GEMM's weight gradient; before an "
                       "fp8_block GEMM it also writes the gradient quantized 1x128 rowwise, that GEMM's FP8 dgrad "
                       "operand",
                       weight_formats=("fp8_block",), saves=0, dequantizes=("fp8_block",),
                       quantizes_dinput=("fp8_block",)),
        KernelTemplate("grouped_gemm_combine", "forward", False,
                       "the grouped GEMM summing each token's routed rows in its epilogue (an MoE block's Combine)",
                       "no kernel on this target fuses a combine into the GEMM's epilogue yet (a token's rows lie "
                       "in different tiles: a deterministic sum needs an aggregation pass); Combine runs its "
                       "reference"),
    )
}


#: The environment variable naming templates to decline, comma-separated (read at import).
DISABLE_ENV = "FUSION_DISABLE_TEMPLATES"


def _disabled_from_env() -> frozenset:
    """FUSION_DISABLE_TEMPLATES=name1,name2: templates the matcher declines as if this build could not run them, so
    a plan can be measured against the same plan without one fusion (an A/B; explain() names the variable). Unknown
    names are warned about, not ignored silently."""
    names = frozenset(n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip())
    unknown = sorted(names - set(TEMPLATES))
    if unknown:
        warnings.warn(f"{DISABLE_ENV}: unknown kernel template(s) {unknown}; the templates are "
                      f"{sorted(TEMPLATES)}", stacklevel=2)
    return names


DISABLED: frozenset = _disabled_from_env()


def weight_format_refused(kernel: str, weight_format: str) -> str | None:
    """Why `kernel` cannot run a GEMM whose weight has `weight_format`, or None when it can."""
    template = TEMPLATES.get(kernel)
    if template is None or weight_format in template.weight_formats:
        return None
    return (f"kernel template {kernel!r} runs weight_format {', '.join(map(repr, template.weight_formats))} "
            f"only, not {weight_format!r}")


def unavailable(kernel: str) -> str | None:
    """Why `kernel` cannot run in this build, or None when it can."""
    template = TEMPLATES.get(kernel)
    if template is None:
        known = ", ".join(sorted(TEMPLATES))
        return f"kernel template {kernel!r} does not exist (templates: {known})"
    if not template.available:
        return f"kernel template {kernel!r} is not available: {template.unavailable_reason}"
    if kernel in DISABLED:
        return f"kernel template {kernel!r} is disabled by {DISABLE_ENV} (unset it to fuse here)"
    return None
