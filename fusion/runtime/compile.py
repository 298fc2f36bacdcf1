"""One fused kernel compiled ahead of time, with a disk cache that survives processes.

A kernel is identified by a hash of everything that determines its code: the generated epilogue source, the
tile configuration, dtype, weight shape (N, K, groups), target and DSL version. Compiling exports the
kernel's host launcher + cubin as an object file (`dump_to_object`) next to its PTX, cubin and a metadata
file; a later process loads the object (`cute.runtime.load_module`) instead of compiling again. Compiling
needs no GPU (`CUTE_DSL_ARCH=sm_90a`), so kernels can be compiled on any machine, here or in worker programs
(fusion/runtime/compile_worker.py); a plan's kernels are compiled together by fusion/runtime/aot.py.

Each kernel is one cache entry (fusion/codegen/cache.py): meta.json records every file's size and sha256 and
the tile configuration the kernel was really built with (the tile policy's spill fallback may have changed the
requested one: fusion/kernels/tile_policy.py); an entry that fails the check is rebuilt with a warning, never
served.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from fusion.codegen.cache import (BadEntry, cache_dir, discard_entry, dsl_version, load_generated, read_entry,
                                  source_key, template_version, write_entry)
from fusion.errors import CompileError
from fusion.kernels.tile_policy import GemmConfig, WgradConfig

_LOADED: dict[str, object] = {}
_LOCK = threading.Lock()
CLASS_NAME = "GeneratedEpilogue"
#: The files of a kernel's cache entry, and the meta.json fields a load reads.
FILES = ("kernel.o", "kernel.ptx", "kernel.cubin")
META_KEYS = ("name", "registers", "shared_memory_bytes", "config")
#: The mainloops of weight-gradient kernels: configured by a WgradConfig, no epilogue source.
WGRAD_MAINLOOPS = ("varlen_k", "fp8_varlen_k")


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
    #: the GEMM's operands: "bf16" (the dtype's wgmma, kernels/grouped_gemm.py) or "fp8_block" (E4M3 codes with
    #: 1x128 / 128x128 block scales, kernels/fp8_gemm.py); the weight_format of the GEMM the pattern bound.
    #: "varlen_k": a weight gradient D[g] = A_g.T @ B_g (kernels/varlen_k_gemm.py; config: WgradConfig fields,
    #: N = B's columns, K = A's, no epilogue source); "fp8_varlen_k": the same from FP8-block columnwise copies in
    #: the slot layout (kernels/fp8_wgrad.py)
    mainloop: str = "bf16"

    @property
    def key(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.source, list(self.config), self.dtype, self.N, self.K, self.G, self.target,
                             self.mainloop, dsl_version(), template_version()]).encode())
        return h.hexdigest()[:24]

    @property
    def name(self) -> str:
        if self.mainloop in WGRAD_MAINLOOPS:
            cfg = WgradConfig(*self.config) if self.config else None
            tile = f"_{cfg.tile_m}x{cfg.tile_n}{'pp' if cfg.pingpong else ''}" if cfg else ""
            fp8 = "_fp8" if self.mainloop == "fp8_varlen_k" else ""
            return f"wgrad_{self.step}{fp8}_{self.dtype}_Ma{self.K}_Nb{self.N}_G{self.G}{tile}"
        fp8 = "_fp8" if self.mainloop == "fp8_block" else ""
        return f"fused_{self.step}_{self.variant}{fp8}_{self.dtype}_N{self.N}_K{self.K}_G{self.G}"


@dataclass(frozen=True)
class CompiledKernel:
    """What Sequential.compile returns per kernel (API.md: name, registers, shared_memory_bytes, ptx, cubin), and
    the tile configuration it was built with next to the one the tile policy asked for (they differ where the
    policy's spill fallback rebuilt it: fusion/kernels/tile_policy.py)."""

    name: str
    key: str
    registers: int | None
    shared_memory_bytes: int | None
    ptx: str
    cubin: bytes
    path: str
    config: GemmConfig | None = None
    requested_config: GemmConfig | None = None

    def __repr__(self) -> str:
        return (f"CompiledKernel({self.name}, registers={self.registers}, "
                f"shared_memory_bytes={self.shared_memory_bytes}, cubin={len(self.cubin)} B)")


def _kernel_dir(key: str) -> Path:
    return cache_dir() / "kernels" / key


def _epilogue(job: KernelJob):
    return load_generated(job.source, CLASS_NAME, source_key(job.source, job.target))()


def _config(job: KernelJob) -> GemmConfig | WgradConfig:
    return (WgradConfig if job.mainloop in WGRAD_MAINLOOPS else GemmConfig)(*job.config)


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


def _compile(job: KernelJob):
    """The job's kernel, compiled by its mainloop's template."""
    if job.mainloop == "varlen_k":
        from fusion.kernels.wgrad_api import compile_varlen_k_gemm

        return compile_varlen_k_gemm(_config(job), job.dtype, job.K, job.N, job.G, target=job.target)
    if job.mainloop == "fp8_varlen_k":
        from fusion.kernels.fp8_wgrad_api import compile_fp8_varlen_k_gemm

        return compile_fp8_varlen_k_gemm(_config(job), job.K, job.N, job.G, job.dtype, target=job.target)
    if job.mainloop == "fp8_block":
        from fusion.kernels import compile_fp8_grouped_gemm

        return compile_fp8_grouped_gemm(_config(job), _epilogue(job), job.N, job.K, job.G, job.dtype,
                                        target=job.target)
    from fusion.kernels import compile_grouped_gemm

    return compile_grouped_gemm(_config(job), _epilogue(job), job.dtype, job.N, job.K, job.G, target=job.target)


def _build(job: KernelJob):
    """Compile `job` now and write its cache entry: object file, PTX, cubin and meta.json."""
    compiled = _compile(job)
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


def is_cached(job: KernelJob) -> bool:
    """Whether the disk cache holds a valid entry for `job` (a damaged one is removed, with a warning)."""
    return _entry(job) is not None


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
    from fusion.kernels import CompiledFp8GroupedGemm, CompiledGroupedGemm

    meta, files = entry
    folder = _kernel_dir(job.key)
    try:
        fn = cute.runtime.load_module(str(folder / "kernel.o"), enable_tvm_ffi=True)[f"k{job.key}"]
    except Exception as err:  # a cache from an incompatible build: compile again, and say so
        warnings.warn(f"fusion: the cached kernel {job.name} in {folder} could not be loaded ({err}); "
                      f"rebuilding it", RuntimeWarning, stacklevel=3)
        discard_entry(folder)
        return _build(job)
    if job.mainloop == "varlen_k":
        from fusion.kernels.wgrad_api import CompiledVarlenKGemm

        return CompiledVarlenKGemm(fn, _config(job), job.dtype, job.dtype, job.K, job.N, job.G,
                                   files["kernel.ptx"].decode(), files["kernel.cubin"], meta["shared_memory_bytes"])
    if job.mainloop == "fp8_varlen_k":
        from fusion.kernels.fp8_wgrad_api import CompiledFp8VarlenKGemm

        return CompiledFp8VarlenKGemm(fn, _config(job), job.dtype, job.K, job.N, job.G, files["kernel.ptx"].decode(),
                                      files["kernel.cubin"], meta["shared_memory_bytes"])
    # The configuration the kernel was built with, which the launch grid depends on: not the requested one
    # when compile_grouped_gemm fell back to a tile that does not spill.
    cls = CompiledFp8GroupedGemm if job.mainloop == "fp8_block" else CompiledGroupedGemm
    compiled = cls(fn, None, GemmConfig(*meta["config"]), _epilogue(job), job.dtype, job.N, job.K, job.G,
                   files["kernel.ptx"].decode(), files["kernel.cubin"], meta["shared_memory_bytes"])
    compiled.requested_config = _config(job)
    return compiled


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
                          cubin=files["kernel.cubin"], path=str(_kernel_dir(job.key)),
                          config=type(_config(job))(*meta["config"]), requested_config=_config(job))
