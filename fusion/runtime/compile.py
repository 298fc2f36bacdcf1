"""Ahead-of-time compilation of a plan's fused kernels, with a disk cache that survives processes.

A kernel is identified by a hash of everything that determines its code: the generated epilogue source, the
tile configuration, dtype, weight shape (N, K, groups), target and DSL version. Compiling exports the
kernel's host launcher + cubin as an object file (`dump_to_object`) next to its PTX, cubin and a metadata
file; a later process loads the object (`cute.runtime.load_module`) instead of compiling again. Compiling
needs no GPU (`CUTE_DSL_ARCH=sm_90a`), so plans can be compiled on any machine, in parallel processes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fusion.codegen.cache import cache_dir, dsl_version, load_generated, source_key

log = logging.getLogger("fusion.compile")

_LOADED: dict[str, object] = {}
_LOCK = threading.Lock()
CLASS_NAME = "GeneratedEpilogue"


@dataclass(frozen=True)
class KernelJob:
    """Everything needed to compile one kernel in any process (plain data: picklable)."""

    step: str
    variant: str  # "train" (also writes the pre-activation for the backward) or "inference"
    source: str
    config: tuple  # GemmConfig fields, in order
    dtype: str
    N: int
    K: int
    G: int
    target: str

    @property
    def key(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.source, list(self.config), self.dtype, self.N, self.K, self.G, self.target,
                             dsl_version()]).encode())
        return h.hexdigest()[:24]

    @property
    def name(self) -> str:
        return f"fused_{self.step}_{self.variant}_{self.dtype}_N{self.N}_K{self.K}_G{self.G}"


@dataclass(frozen=True)
class CompiledKernel:
    """What Sequential.compile returns per kernel (API.md: name, registers, shared_memory_bytes, ptx, cubin)."""

    name: str
    key: str
    registers: int | None
    shared_memory_bytes: int | None
    ptx: str
    cubin: bytes
    path: str

    def __repr__(self) -> str:
        return (f"CompiledKernel({self.name}, registers={self.registers}, "
                f"shared_memory_bytes={self.shared_memory_bytes}, cubin={len(self.cubin)} B)")


def _kernel_dir(key: str) -> Path:
    return cache_dir() / "kernels" / key


def _epilogue(job: KernelJob):
    return load_generated(job.source, CLASS_NAME, source_key(job.source, job.target))()


def _config(job: KernelJob):
    from fusion.kernels import GemmConfig

    return GemmConfig(*job.config)


def compile_to_disk(job: KernelJob) -> str:
    """Compile `job` and write its object file, PTX, cubin and metadata to the cache. Runs in workers."""
    from fusion.kernels import compile_grouped_gemm

    folder = _kernel_dir(job.key)
    if (folder / "meta.json").exists():
        return job.key
    compiled = compile_grouped_gemm(_config(job), _epilogue(job), job.dtype, job.N, job.K, job.G, target=job.target)
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    compiled.fn.export_to_c(str(tmp / "kernel.o"), function_name=f"k{job.key}")
    (tmp / "kernel.ptx").write_text(compiled.ptx or "")
    (tmp / "kernel.cubin").write_bytes(compiled.cubin or b"")
    meta = {"name": job.name, "job": asdict(job) | {"source": None}, "registers": compiled.registers,
            "shared_memory_bytes": compiled.shared_memory_bytes, "dsl": dsl_version()}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: its copy is the same kernel
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    with _LOCK:
        _LOADED.setdefault(job.key, compiled)
    return job.key


def load_compiled(job: KernelJob):
    """The runnable kernel for `job`: from memory, else from the disk cache, else compiled now."""
    with _LOCK:
        hit = _LOADED.get(job.key)
    if hit is not None:
        return hit
    folder = _kernel_dir(job.key)
    if not (folder / "meta.json").exists():
        compile_to_disk(job)
        with _LOCK:
            if job.key in _LOADED:
                return _LOADED[job.key]
    compiled = _load_from_disk(job, folder)
    with _LOCK:
        _LOADED[job.key] = compiled
    return compiled


def _load_from_disk(job: KernelJob, folder: Path):
    import cutlass.cute as cute
    from fusion.kernels import CompiledGroupedGemm

    meta = json.loads((folder / "meta.json").read_text())
    try:
        fn = cute.runtime.load_module(str(folder / "kernel.o"), enable_tvm_ffi=True)[f"k{job.key}"]
    except Exception as err:  # a cache from an incompatible build: compile again, and say so
        log.warning("fusion: cached kernel %s could not be loaded (%s); recompiling", job.name, err)
        from fusion.kernels import compile_grouped_gemm

        return compile_grouped_gemm(_config(job), _epilogue(job), job.dtype, job.N, job.K, job.G, target=job.target)
    return CompiledGroupedGemm(fn, None, _config(job), _epilogue(job), job.dtype, job.N, job.K, job.G,
                               (folder / "kernel.ptx").read_text(), (folder / "kernel.cubin").read_bytes(),
                               meta["shared_memory_bytes"])


def artifact(job: KernelJob) -> CompiledKernel:
    folder = _kernel_dir(job.key)
    meta = json.loads((folder / "meta.json").read_text())
    return CompiledKernel(name=job.name, key=job.key, registers=meta["registers"],
                          shared_memory_bytes=meta["shared_memory_bytes"],
                          ptx=(folder / "kernel.ptx").read_text(), cubin=(folder / "kernel.cubin").read_bytes(),
                          path=str(folder))


# -- plans ------------------------------------------------------------------------------------------------------
def plan_jobs(seq, dtype: torch.dtype, target: str = "sm_90a") -> list[KernelJob]:
    """One job per fused kernel the block's plan can launch: a forward step's training variant (which also
    writes the value the backward reads) and inference variant, and each fused backward step's kernel."""
    from fusion.planner import plan_for
    from fusion.runtime.program import BlockProgram
    from fusion.runtime.steps import FusedForward

    plan = plan_for(seq, dtype=dtype, target=target)
    program = BlockProgram(seq, plan, "cute")
    jobs = []
    for runner in program.fused_runners():
        if isinstance(runner, FusedForward):
            variants = ("train", "inference") if runner.writes_saved else ("inference",)
        else:
            variants = ("backward",)
        jobs.extend(runner.job(dtype, variant) for variant in variants)
    return jobs


def compile_jobs(jobs: list[KernelJob], parallel: int | None = None, progress: bool = True) -> list[CompiledKernel]:
    """Compile what the disk cache lacks (in `parallel` processes), then describe every job's kernel."""
    todo = [j for j in {j.key: j for j in jobs}.values() if not (_kernel_dir(j.key) / "meta.json").exists()]
    workers = min(len(todo), parallel or os.cpu_count() or 1)
    if todo:
        bar = _progress(len(todo), progress)
        if workers > 1:
            import multiprocessing

            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                for future in as_completed([pool.submit(compile_to_disk, j) for j in todo]):
                    future.result()
                    bar.update(1)
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
    """Sequential.compile: every fused kernel of the plan for (dtype, target), compiled ahead of time."""
    if target not in ("sm_90a",):
        from fusion.errors import CompileError

        raise CompileError(f"cannot compile for target {target!r}: the kernel templates are written for "
                           f"Hopper's sm_90a (wgmma, TMA); use target='sm_90a'")
    return compile_jobs(plan_jobs(seq, dtype, target), parallel=parallel, progress=progress)


def cli_compile(target: str = "sm_90a", dtype: str = "bfloat16", out: str | None = None) -> int:
    """`python -m fusion compile`: compile the demo blocks' kernels and print what was built."""
    from fusion.demo import DEEPSEEK_LIKE, GPT_OSS_LIKE, build_block

    dt = getattr(torch, dtype)
    print(f"{'kernel':<64} {'regs':>5} {'smem B':>8} {'cubin B':>8}")
    for shape in (GPT_OSS_LIKE, DEEPSEEK_LIKE):
        block = build_block(shape, dt, "meta")
        for k in compile_plan(block, dtype=dt, target=target):
            print(f"{k.name:<64} {k.registers or '?':>5} {k.shared_memory_bytes or '?':>8} {len(k.cubin):>8}")
            if out:
                folder = Path(out)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{k.name}.ptx").write_text(k.ptx)
                (folder / f"{k.name}.cubin").write_bytes(k.cubin)
    return 0
