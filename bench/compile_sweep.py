"""Compile, without a GPU, every kernel the plans of MoE blocks of models bench/ does not hold would launch, and
report failures and what their SASS shows: no wgmma (HGMMA, FP8's QGMMA), register spills (LDL/STL), and kernels
the tile policy's spill fallback rebuilt at another tile: a check that the policy's choices build on shapes no rule
was tuned on (the SASS reading of tests/test_compile_plans.py; nvdisasm from the "sass" extra).

    FUSION_CACHE_DIR=/tmp/kc python bench/compile_sweep.py [name ...]      # default: every shape below

Each shape (E experts, hidden d, expert width f) as three blocks: bf16 `GroupLinear -> SwiGLU -> Scale ->
GroupLinear`, the same with fp8_block weights, and the whole MoE experts block (Gather first, Combine last), bf16,
for sm_90a. Kernels shared with an earlier block come from the disk cache.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from fusion import Combine, Gather, GroupLinear, Scale, Sequential, SwiGLU  # noqa: E402
from fusion.runtime.aot import compile_jobs, plan_jobs  # noqa: E402

#: name: (E, d, f), from the models' public configurations
SHAPES = {
    "deepseek-v2": (160, 5120, 1536),
    "deepseek-v3-full": (256, 7168, 2048),
    "kimi-k2": (384, 7168, 2048),
    "qwen3-next-80b": (512, 2048, 512),
    "mixtral-8x22b": (8, 6144, 16384),
    "llama4-maverick": (128, 5120, 8192),
    "jamba": (16, 4096, 14336),
    "tiny-moe": (64, 768, 256),
    "odd-f-1408": (64, 2048, 1408),
    "odd-f-1344": (32, 2560, 1344),
}


def block(kind: str, E: int, d: int, f: int) -> Sequential:
    with torch.device("meta"):
        if kind == "moe":
            return Sequential(Gather(), GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d), Combine())
        wf = {"weight_format": "fp8_block"} if kind == "fp8" else {}
        return Sequential(GroupLinear(E, d, 2 * f, **wf), SwiGLU(), Scale(), GroupLinear(E, f, d, **wf))


def sass_problems(kernel) -> list[str]:
    """What the kernel's SASS and configuration show that should not be there."""
    from fusion.kernels import sass_text

    sass = sass_text(kernel.cubin)
    gmma = "QGMMA" if "_fp8_" in kernel.name else "HGMMA"
    problems = [] if re.search(rf"\b{gmma}\.", sass) else [f"no {gmma}"]
    spills = len(re.findall(r"\b(LDL|STL)\b", sass))
    problems += [f"{spills} local loads/stores"] if spills else []
    if kernel.requested_config is not None and kernel.config != kernel.requested_config:
        problems.append("rebuilt at the spill fallback's tile")
    return problems


def main(names: list[str]) -> int:
    failed = 0
    for name in names or list(SHAPES):
        E, d, f = SHAPES[name]
        for kind in ("bf16", "fp8", "moe"):
            start = time.time()
            try:
                jobs = plan_jobs(block(kind, E, d, f), torch.bfloat16)
                kernels = compile_jobs(jobs, parallel=2, progress=False)
            except Exception as err:  # report every shape, then fail
                failed += 1
                print(f"{name:18s} {kind:5s} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            bad = {k.name: p for k in {k.key: k for k in kernels}.values() if (p := sass_problems(k))}
            failed += bool(bad)
            print(f"{name:18s} {kind:5s} {len(jobs):2d} kernels, {time.time() - start:4.0f} s, "
                  f"SASS: {bad or 'wgmma, no spills'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
