"""The kernel templates this build can run, by the name pattern files use (`kernel = NAME`).

Data, read by the matcher: a pattern whose template is not runnable here fails with the template's reason,
so a plan never promises a kernel the runtime cannot launch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelTemplate:
    name: str
    direction: str
    available: bool
    summary: str
    unavailable_reason: str = ""


TEMPLATES: dict[str, KernelTemplate] = {
    t.name: t for t in (
        KernelTemplate("grouped_gemm", "forward", True,
                       "persistent warp-specialized grouped GEMM (sm_90a, TMA + wgmma) with a generated epilogue "
                       "(kernels/grouped_gemm.py)"),
        KernelTemplate("grouped_gemm_dgrad", "backward", True,
                       "the grouped GEMM template computing a dgrad (dy @ W[g]) whose generated epilogue applies "
                       "the backward of the elementwise ops before the GEMM (fusion/runtime/steps.py)"),
    )
}


def unavailable(kernel: str) -> str | None:
    """Why `kernel` cannot run in this build, or None when it can."""
    template = TEMPLATES.get(kernel)
    if template is None:
        known = ", ".join(sorted(TEMPLATES))
        return f"kernel template {kernel!r} does not exist (templates: {known})"
    if not template.available:
        return f"kernel template {kernel!r} is not available: {template.unavailable_reason}"
    return None
