"""Sequential.compile: every fused kernel a block's plan can launch, compiled ahead of time.

    plan_jobs(seq, dtype, target)         -> the KernelJobs of the plan (fusion/runtime/compile.py)
    compile_jobs(jobs, parallel=None)     -> CompiledKernels; what the disk cache lacks is compiled first
    compile_plan(seq, dtype, target)      -> both: what Sequential.compile returns

Above the executor: the jobs are the ones the block's program (fusion/runtime/program.py) would launch, so a
kernel compiled here is the kernel a run loads from the disk cache. Several kernels compile in parallel worker
programs (fusion/runtime/compile_worker.py).
"""
from __future__ import annotations

import os
import warnings
import threading

import torch

from fusion.codegen.cache import writable_cache_dir
from fusion.planner import plan_for
from fusion.runtime.compile import CompiledKernel, KernelJob, artifact, compile_to_disk, is_cached
from fusion.runtime.compile_worker import compile_in_workers
from fusion.runtime.kernel import row_variants
from fusion.runtime.program import BlockProgram
from fusion.runtime.steps import FusedForward
from fusion.targets import kernel_target


#: What compiling a backend="reference" block does: nothing (Sequential.compile and compile_plan say so).
REFERENCE_COMPILES_NOTHING = ("fusion: compile() of a block built with backend='reference' compiles nothing: every "
                              "op runs its reference (unfused) path; build it with backend='auto' to run fused "
                              "kernels")


def plan_jobs(seq, dtype: torch.dtype, target: str = "sm_90a") -> list[KernelJob]:
    """One job per fused kernel the block's plan can launch: a forward step's training variant (which also
    writes the value the backward reads) and inference variant, each fused backward step's kernel, and the
    kernels of unfused steps whose device method has cached kernels (an fp8_block GEMM's fprop and dgrad:
    fusion/runtime/fp8_gemm.py `kernel_jobs`); an FP8 kernel at each configuration a call's rows may pick
    (fusion/runtime/kernel.py `row_variants`). The plan honours the block's backend: a backend="reference"
    block launches no kernel, so it has no job."""
    plan = plan_for(seq, dtype=dtype, target=target, backend=getattr(seq, "backend", None))
    program = BlockProgram(seq, plan, "cute")
    on_device = getattr(seq, "backend", "auto") in ("auto", "fused")
    jobs = []
    for runner in program.fused_runners():
        if isinstance(runner, FusedForward):
            variants = ("train", "inference") if runner.writes_saved else ("inference",)
        else:
            variants = runner.variants()
        # (on the device an FP8 kernel also at the configuration a call with many rows per group takes:
        # kernel.row_variants)
        for variant in variants:
            job = runner.job(dtype, variant)
            jobs.extend(row_variants(job) if on_device else [job])
    if not on_device:
        return jobs  # device methods run under these backends only (fusion/runtime/__init__.py, BlockRunner)
    for runner in program.forward_steps + program.backward_steps:
        device = getattr(runner, "device", None)
        if device is not None and hasattr(device, "kernel_jobs"):
            # a weight gradient after a Gather may read the tokens through the index, one before a Combine the
            # tokens' gradient: those kernels too
            gathered = {"gathered": True} if getattr(runner, "tokens", None) else {}
            if getattr(runner, "dy_tokens", None):
                gathered["dy_gathered"] = True
            jobs.extend(device.kernel_jobs(runner.op, runner.part, dtype, **gathered))
    return jobs


def compile_jobs(jobs: list[KernelJob], parallel: int | None = None, progress: bool = True) -> list[CompiledKernel]:
    """Compile what the disk cache lacks (in `parallel` worker programs), then describe every job's kernel."""
    todo = [j for j in {j.key: j for j in jobs}.values() if not is_cached(j)]
    workers = min(len(todo), parallel or os.cpu_count() or 1)
    if todo:
        root = writable_cache_dir()  # an unusable folder is one CompileError here, not one per worker
        bar = _progress(len(todo), progress)
        if workers > 1:
            bar_lock = threading.Lock()

            def done(key: str) -> None:
                with bar_lock:
                    bar.update(1)

            try:
                compile_in_workers(todo, workers, root, done)
            finally:
                bar.close()
        else:
            for job in todo:
                compile_to_disk(job)
                bar.update(1)
            bar.close()
    return [artifact(j) for j in jobs]


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="fusion: compiling fused kernels", unit="kernel", disable=not enabled)


def compile_plan(seq, dtype: torch.dtype = torch.bfloat16, target: str = "sm_90a", parallel: int | None = None,
                 progress: bool = True) -> list[CompiledKernel]:
    """Sequential.compile: every fused kernel of the plan for (dtype, target), compiled ahead of time.
    `target` is read by fusion.targets (one parser for every entry point): "sm_90a" or "sm_90"."""
    target = kernel_target(target)
    if getattr(seq, "backend", None) == "reference":
        warnings.warn(REFERENCE_COMPILES_NOTHING, stacklevel=2)
        return []
    return compile_jobs(plan_jobs(seq, dtype, target), parallel=parallel, progress=progress)
