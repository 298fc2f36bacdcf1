"""Ahead-of-time compilation of a plan's fused kernels, with a disk cache that survives processes.

A kernel is identified by a hash of everything that determines its code: the generated epilogue source, the
tile configuration, dtype, weight shape (N, K, groups), target and DSL version. Compiling exports the
kernel's host launcher + cubin as an object file (`dump_to_object`) next to its PTX, cubin and a metadata
file; a later process loads the object (`cute.runtime.load_module`) instead of compiling again. Compiling
needs no GPU (`CUTE_DSL_ARCH=sm_90a`), so plans can be compiled on any machine, in parallel worker programs
(fusion/runtime/compile_worker.py: they never re-run the user's script).

Each kernel is one cache entry (fusion/codegen/cache.py): meta.json records every file's size and sha256 and
the tile configuration the kernel was really built with (a spill fallback may have changed the requested
one); an entry that fails the check is rebuilt with a warning, never served.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fusion.codegen.cache import (BadEntry, cache_dir, discard_entry, dsl_version, load_generated, read_entry,
                                  source_key, template_version, writable_cache_dir, write_entry)
from fusion.errors import CompileError

_LOADED: dict[str, object] = {}
_LOCK = threading.Lock()
CLASS_NAME = "GeneratedEpilogue"
#: The files of a kernel's cache entry, and the meta.json fields a load reads.
FILES = ("kernel.o", "kernel.ptx", "kernel.cubin")
META_KEYS = ("name", "registers", "shared_memory_bytes", "config")


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
                             dsl_version(), template_version()]).encode())
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


def _entry(job: KernelJob) -> tuple[dict, dict] | None:
    """The job's valid cache entry (meta, {file: bytes}), or None; a damaged entry is removed, with a warning,
    so that it is rebuilt."""
    folder = _kernel_dir(job.key)
    try:
        entry = read_entry(folder, FILES, META_KEYS)
        if entry is not None and not (isinstance(entry[0]["config"], list)
                                      and len(entry[0]["config"]) == len(job.config)):
            raise BadEntry(f"meta.json's config {entry[0]['config']!r} is not a tile configuration")
        return entry
    except BadEntry as bad:
        warnings.warn(f"fusion: the cached kernel {job.name} in {folder} is damaged ({bad}); rebuilding it",
                      RuntimeWarning, stacklevel=3)
        discard_entry(folder)
        return None


def _build(job: KernelJob):
    """Compile `job` now and write its cache entry: object file, PTX, cubin and meta.json."""
    from fusion.kernels import compile_grouped_gemm

    compiled = compile_grouped_gemm(_config(job), _epilogue(job), job.dtype, job.N, job.K, job.G, target=job.target)
    if not compiled.ptx or not compiled.cubin:
        raise CompileError(f"kernel {job.name}: the CuTe DSL returned no PTX or cubin; nothing can be cached")

    def fill(folder: Path) -> None:
        compiled.fn.export_to_c(str(folder / "kernel.o"), function_name=f"k{job.key}")
        (folder / "kernel.ptx").write_text(compiled.ptx)
        (folder / "kernel.cubin").write_bytes(compiled.cubin)

    meta = {"name": job.name, "job": asdict(job) | {"source": None}, "registers": compiled.registers,
            "shared_memory_bytes": compiled.shared_memory_bytes, "dsl": dsl_version(),
            "config": list(dataclasses.astuple(compiled.config))}
    write_entry(_kernel_dir(job.key), fill, meta, FILES)
    with _LOCK:
        _LOADED.setdefault(job.key, compiled)
    return compiled


def compile_to_disk(job: KernelJob) -> str:
    """Make sure the disk cache holds a valid entry for `job` (compiling it if not). Runs in workers."""
    if _entry(job) is None:
        _build(job)
    return job.key


def load_compiled(job: KernelJob):
    """The runnable kernel for `job`: from memory, else from the disk cache, else compiled now."""
    with _LOCK:
        hit = _LOADED.get(job.key)
    if hit is not None:
        return hit
    entry = _entry(job)
    compiled = _build(job) if entry is None else _load_from_disk(job, entry)
    with _LOCK:
        return _LOADED.setdefault(job.key, compiled)


def _load_from_disk(job: KernelJob, entry: tuple[dict, dict]):
    import cutlass.cute as cute
    from fusion.kernels import CompiledGroupedGemm, GemmConfig

    meta, files = entry
    folder = _kernel_dir(job.key)
    try:
        fn = cute.runtime.load_module(str(folder / "kernel.o"), enable_tvm_ffi=True)[f"k{job.key}"]
    except Exception as err:  # a cache from an incompatible build: compile again, and say so
        warnings.warn(f"fusion: the cached kernel {job.name} in {folder} could not be loaded ({err}); "
                      f"rebuilding it", RuntimeWarning, stacklevel=3)
        discard_entry(folder)
        return _build(job)
    # The configuration the kernel was built with, which the launch grid depends on: not the requested one
    # when compile_grouped_gemm fell back to a tile that does not spill.
    return CompiledGroupedGemm(fn, None, GemmConfig(*meta["config"]), _epilogue(job), job.dtype, job.N, job.K,
                               job.G, files["kernel.ptx"].decode(), files["kernel.cubin"],
                               meta["shared_memory_bytes"])


def artifact(job: KernelJob) -> CompiledKernel:
    """What compile() returns for `job`, read from its (valid) cache entry."""
    entry = _entry(job)
    if entry is None:
        _build(job)
        entry = _entry(job)
    if entry is None:
        raise CompileError(f"kernel {job.name}: its cache entry in {_kernel_dir(job.key)} vanished after it was "
                           f"written; is another process clearing FUSION_CACHE_DIR?")
    meta, files = entry
    return CompiledKernel(name=job.name, key=job.key, registers=meta["registers"],
                          shared_memory_bytes=meta["shared_memory_bytes"], ptx=files["kernel.ptx"].decode(),
                          cubin=files["kernel.cubin"], path=str(_kernel_dir(job.key)))


# -- plans ------------------------------------------------------------------------------------------------------
#: What compiling a backend="reference" block does: nothing (Sequential.compile and compile_plan say so).
REFERENCE_COMPILES_NOTHING = ("fusion: compile() of a block built with backend='reference' compiles nothing: every "
                              "op runs its reference (unfused) path; build it with backend='auto' to run fused "
                              "kernels")


def plan_jobs(seq, dtype: torch.dtype, target: str = "sm_90a") -> list[KernelJob]:
    """One job per fused kernel the block's plan can launch: a forward step's training variant (which also
    writes the value the backward reads) and inference variant, and each fused backward step's kernel. The plan
    honours the block's backend: a backend="reference" block launches no kernel, so it has no job."""
    from fusion.planner import plan_for
    from fusion.runtime.program import BlockProgram
    from fusion.runtime.steps import FusedForward

    plan = plan_for(seq, dtype=dtype, target=target, backend=getattr(seq, "backend", None))
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
    """Compile what the disk cache lacks (in `parallel` worker programs), then describe every job's kernel."""
    todo = [j for j in {j.key: j for j in jobs}.values() if _entry(j) is None]
    workers = min(len(todo), parallel or os.cpu_count() or 1)
    if todo:
        root = writable_cache_dir()  # an unusable folder is one CompileError here, not one per worker
        bar = _progress(len(todo), progress)
        if workers > 1:
            from fusion.runtime.compile_worker import compile_in_workers

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
    from fusion.targets import kernel_target

    target = kernel_target(target)
    if getattr(seq, "backend", None) == "reference":
        warnings.warn(REFERENCE_COMPILES_NOTHING, stacklevel=2)
        return []
    return compile_jobs(plan_jobs(seq, dtype, target), parallel=parallel, progress=progress)


def cli_compile(target: str = "sm_90a", dtype: str = "bfloat16", out: str | Path | None = None) -> int:
    """`python -m fusion compile`: compile the demo blocks' kernels and print what was built (and with `out`,
    write each kernel's .ptx and .cubin there)."""
    from fusion.demo import DEEPSEEK_LIKE, GPT_OSS_LIKE, build_block

    folder = Path(out) if out is not None else None
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CompileError(f"cannot create the --out folder {str(folder)!r} ({err.strerror or err}): pass a "
                               f"writable folder") from None
    dt = getattr(torch, dtype)
    print(f"{'kernel':<64} {'regs':>5} {'smem B':>8} {'cubin B':>8}")
    for shape in (GPT_OSS_LIKE, DEEPSEEK_LIKE):
        block = build_block(shape, dt, "meta")
        for k in compile_plan(block, dtype=dt, target=target):
            print(f"{k.name:<64} {k.registers or '?':>5} {k.shared_memory_bytes or '?':>8} {len(k.cubin):>8}")
            if folder is not None:
                (folder / f"{k.name}.ptx").write_text(k.ptx)
                (folder / f"{k.name}.cubin").write_bytes(k.cubin)
    return 0
