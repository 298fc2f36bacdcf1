"""One fused grouped-GEMM launch, whatever executes it: the CuTe DSL kernel on Hopper, or its torch emulation.

A `KernelJob` (fusion/runtime/compile.py) describes a kernel as plain data: the generated epilogue source, the
tile configuration, dtype and weight shape. `kernel_for(job, backend)` returns an object with
`run(A, B, bounds, tensors)`: the compiled kernel's launch for backend "cute", the emulation for "emulate".
Both read the same operands by the same names (the epilogue's declared slots), so the runtime that binds them
is the same code either way.
"""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import torch

from fusion.kernels.tile_policy import (GemmConfig, choose_fp8_config, choose_wgrad_config, fp8_for_rows,
                                        fp8_row_configs, tile_config)
from fusion.runtime.compile import KernelJob


class BlockScaled(NamedTuple):
    """An FP8-block operand of a "fp8_block" job's kernel: E4M3 codes (uint8) and their float32 scales, in the
    layouts kernels/fp8_gemm.py reads (A: (M, K) with (ceil(K/128), M) scales; B: (G, N, K) with (G, ceil(N/128),
    ceil(K/128)) scales)."""

    data: torch.Tensor
    scale: torch.Tensor


def _kernels():
    import fusion.kernels as kernels  # imports cutlass: only where a kernel is configured or compiled

    return kernels


#: The identity epilogue as a KernelJob's source: a GEMM alone (the lone bf16 GEMMs of fusion/runtime/lone_gemm.py,
#: the FP8 GEMMs of fusion/runtime/fp8_gemm.py), compiled and cached on disk like a fused kernel, so
#: Sequential.compile() builds it ahead of time.
IDENTITY_SOURCE = "from fusion.kernels.epilogue import IdentityEpilogue as GeneratedEpilogue\n"


#: FUSION_TILE_BAND=B (read at import): every fused, lone and FP8 GEMM job walks bands of B m-tiles (1: m fastest
#: over each group, the order before bands) instead of the tile policy's (GemmConfig.band_m = 0: tile_policy.band_for).
#: The A/B switch of the banded tile order; it changes the jobs' keys, so both orders live in one kernel cache.
TILE_BAND = os.environ.get("FUSION_TILE_BAND")


def _with_band(config):
    return config if TILE_BAND is None else dataclasses.replace(config, band_m=int(TILE_BAND))


def make_job(source: str, dtype: torch.dtype, N: int, K: int, G: int, gated: bool, b_major: str,
             reads_aux: bool, step: str, variant: str, target: str = "sm_90a", tiles: bool = True,
             gather: bool = False, mainloop: str = "bf16", col_block: int = 8) -> KernelJob:
    """A kernel's job; `tiles=False` leaves the tile configuration out (the emulation needs none). `gather`: the
    kernel reads A's rows through an index (GemmConfig.gather_a; its run takes `index=`). `mainloop`
    "fp8_block": the FP8 block-scaled kernel (its operands are BlockScaled; B K-major; its configuration for a
    call's rows: :func:`for_rows`). `col_block`: the logical columns the epilogue's block-wise outputs need whole
    in a tile (MXFP8: 32, FP8-block: 128; tile_policy.gated_tile and choose_fp8_config read it)."""
    if not tiles:
        config = ()
    elif mainloop == "fp8_block":
        # (the fused kernels of a training step, variants "train" and "backward", keep single CTAs where 128 x 192
        # pairs would replace them: tile_policy.FP8_WIDE_ODD; a lone GEMM's "identity" and an "inference" take them)
        wide_odd = None if variant in ("inference", "identity") else False
        config = dataclasses.astuple(_with_band(choose_fp8_config(N, K, G, gated, wide_odd=wide_odd,
                                                                  col_block=col_block,
                                                                  plain_epilogue=variant == "identity")))
    else:
        config = dataclasses.astuple(_with_band(GemmConfig(*tile_config(N, K, G, gated, b_major, reads_aux, gather,
                                                                         col_block))))
    return KernelJob(step=step, variant=variant, source=source, config=config,
                     dtype=str(dtype).removeprefix("torch."), N=N, K=K, G=G, target=target, mainloop=mainloop)


def for_rows(job: KernelJob, rows: int) -> KernelJob:
    """An FP8 job at its configuration for a call over `rows` routed rows (tile_policy.fp8_for_rows: single CTAs
    at many rows per group), `job` itself where that is its own (and for every other mainloop)."""
    if job.mainloop != "fp8_block" or not job.config:
        return job
    config = GemmConfig(*job.config)
    by_rows = fp8_for_rows(config, rows, job.G)
    return job if by_rows is config else dataclasses.replace(job, config=dataclasses.astuple(by_rows))


def row_variants(job: KernelJob) -> list[KernelJob]:
    """`job` and every job :func:`for_rows` can make of it: what Sequential.compile builds ahead of time."""
    if job.mainloop != "fp8_block" or not job.config:
        return [job]
    return [dataclasses.replace(job, config=dataclasses.astuple(c)) for c in fp8_row_configs(GemmConfig(*job.config),
                                                                                              job.G)]


def make_wgrad_job(dtype: torch.dtype, out_features: int, in_features: int, G: int, gather: str, step: str,
                   target: str = "sm_90a", config=None) -> KernelJob:
    """The varlen-K kernel's job for a GroupLinear's weight gradient dW (G, out, in) = dY_g.T @ X_g at `config`
    (None: the tile policy's choice for unknown rows; fusion/runtime/wgrad_gemm.py passes the one for a call's rows
    per group); `gather`: which operands ("a": dY, "b": X, "ab") are token matrices read through the routing index."""
    if config is None:
        config = choose_wgrad_config(out_features, in_features, G, "a" in gather, "b" in gather)
    return KernelJob(step=step, variant="wgrad", source="", config=dataclasses.astuple(config),
                     dtype=str(dtype).removeprefix("torch."), N=in_features, K=out_features, G=G, target=target,
                     mainloop="varlen_k")


#: Read per call: False launches every FP8 GEMM (fused here, lone in fusion/runtime/fp8_gemm.py) through
#: kernels.fp8_api.run_fp8_grouped_gemm's full checks, as before the bound launches (the A/B switch).
FP8_BOUND_LAUNCHES = True


class ShapeCache(dict):
    """What the runtime works out once per call shape (bound launches, a rule's answer), at most `limit` shapes; past
    that it starts again, so rows that change at every call cost a rebuild each (what a call cost before binding),
    never memory without bound. A dict: the per-call lookup is `get`."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def keep(self, key, value):
        """Store `value` under `key` (emptied first when full) and return it."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


class CuteKernel:
    """The compiled kernel of a job (memory, disk cache or compiled now), launched on the current stream. In
    autotune mode (fusion/runtime/autotune.py) the first launch picks the tile configuration on the real inputs."""

    def __init__(self, job: KernelJob):
        from fusion.runtime import autotune
        from fusion.runtime.compile import load_compiled

        self.job = job
        self.fp8 = job.mainloop == "fp8_block"
        # autotune times the bf16 template's candidates; the FP8 kernel has one tile (tile_policy.choose_fp8_config)
        # and, where a call's rows per group change it, another (for_rows)
        self.compiled = None if autotune.enabled() and not self.fp8 else load_compiled(job)
        self._config = GemmConfig(*job.config) if self.fp8 else None
        self._by_rows: dict = {self._config: self.compiled}
        self._run = _kernels().run_grouped_gemm
        #: the launch bound per call shape: the bf16 kernel's by (A's rows, the routed rows), kernels.api.BoundGemm;
        #: the FP8 kernel's by A's rows, kernels.fp8_api.BoundFp8Gemm
        self._bound = ShapeCache(64)

    def run(self, A, B, bounds, tensors: dict, counter_ptr: int | None = None, index=None) -> None:
        """`counter_ptr`: a zeroed int32 for a dynamic schedule's tile counter (RunState.counter_ptr). `index`: a
        gathering kernel's int32 (M,) token row of every routed row (A is then the (T, K) tokens). A "fp8_block"
        job's A and B are BlockScaled; its kernel is the one for A's rows (for_rows)."""
        if self.fp8:
            rows = A.data.shape[0]
            compiled = self._for_rows(rows)
            if not FP8_BOUND_LAUNCHES:
                _kernels().run_fp8_grouped_gemm(compiled, A.data, A.scale, B.data, B.scale, bounds, tensors, tensors,
                                                counter_ptr=counter_ptr)
                LAUNCHES.count(self.job)
                return
            bound = self._bound.get(rows)
            if bound is None or bound.compiled is not compiled:   # (a switch may give these rows another tile)
                bound = self._bound.keep(rows, _kernels().bind_fp8_grouped_gemm(compiled, A.data, A.scale, B.data,
                                                                               B.scale, bounds))
            bound(A.data, A.scale, B.data, B.scale, bounds, tensors, counter_ptr)
            LAUNCHES.count(self.job)
            return
        key = (A.shape[0], -1 if index is None else index.numel())
        bound = self._bound.get(key)
        if bound is None:
            if self.compiled is None:
                self.compiled = self._tuned(A, B, bounds, tensors, index)
            bound = self._bound.keep(key, _kernels().bind_grouped_gemm(self.compiled, A, B, bounds, index))
        bound(A, B, bounds, tensors, counter_ptr, index)
        LAUNCHES.count(self.job)

    def bound_fp8(self, rows: int):
        """The FP8 kernel's launch as a call at `rows` bound it (kernels.fp8_api.BoundFp8Gemm), or None where none
        was bound there, or a switch has given those rows another tile since: what the forward's replay repeats."""
        bound = self._bound.get(rows) if self.fp8 else None
        return bound if bound is not None and bound.compiled is self._for_rows(rows) else None

    def _for_rows(self, rows: int):
        """The compiled FP8 kernel for a call over `rows` rows (for_rows; loaded on first use)."""
        config = fp8_for_rows(self._config, rows, self.job.G)
        compiled = self._by_rows.get(config)
        if compiled is None:
            from fusion.runtime.compile import load_compiled

            compiled = self._by_rows[config] = load_compiled(for_rows(self.job, rows))
        return compiled

    def _tuned(self, A, B, bounds, tensors, index=None):
        from fusion.runtime import autotune
        from fusion.runtime.compile import load_compiled

        device = torch.cuda.get_device_name(A.device)
        config = autotune.recorded(self.job, device)
        if config is None:
            def time_config(cfg) -> float:
                compiled = load_compiled(dataclasses.replace(self.job, config=dataclasses.astuple(cfg)))
                self._run(compiled, A, B, bounds, tensors, tensors, index=index)  # warm up (module load)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    self._run(compiled, A, B, bounds, tensors, tensors, index=index)
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 5e3

            config = autotune.tune(self.job, device, time_config)
        return load_compiled(dataclasses.replace(self.job, config=dataclasses.astuple(config)))


class LaunchCounter:
    """How many fused kernels launched, per step label: GPU tests assert that the fused path really ran."""

    def __init__(self):
        self.by_step: dict[str, int] = {}

    def count(self, job) -> None:
        self.by_step[job.step] = self.by_step.get(job.step, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.by_step.values())

    def reset(self) -> None:
        self.by_step.clear()


LAUNCHES = LaunchCounter()


class EmulatedLaunch:
    """The emulation of a job's kernel (fusion/runtime/emulate.py), counted like a real launch."""

    def __init__(self, job: KernelJob, gated: bool, b_major: str):
        from fusion.runtime.emulate import EmulatedKernel

        self.job = job
        self.kernel = EmulatedKernel(job.source, gated, b_major)

    def run(self, A, B, bounds, tensors: dict, counter_ptr: int | None = None, index=None) -> None:
        """`bounds`: a buffer headed by the G+1 row bounds (the runtime passes the call's whole buffer); `index`:
        a gathering kernel's (M,) int32 row index into A (T, K). BlockScaled operands (a "fp8_block" job) are
        dequantized exactly into float32 first: the kernel's product of the dequantized operands with a float32
        accumulator, which is the FP8-block recipe's reference (fusion/quant/fp8_linear.py)."""
        out_dtype = None
        if isinstance(A, BlockScaled):
            from fusion.quant.fp8_block import fp8_block_dequantize_2d
            from fusion.quant.fp8_weight import _dequantize_blocks

            A, B = fp8_block_dequantize_2d(A.data, A.scale), _dequantize_blocks(B.data, B.scale)
            out_dtype = getattr(torch, self.job.dtype)
        self.kernel.run(A, B, bounds[:B.shape[0] + 1], tensors, index, out_dtype)
        LAUNCHES.count(self.job)


class CuteLauncher:
    """Kernels of backend "cute": compiled (or loaded from the disk cache) on first use."""

    name = "cute"

    def make(self, runner, dtype, variant):
        return CuteKernel(runner.job(dtype, variant))


class EmulateLauncher:
    """Kernels of backend "emulate": the same generated source, executed in torch."""

    name = "emulate"

    def make(self, runner, dtype, variant):
        return EmulatedLaunch(runner.job(dtype, variant, tiles=False), runner.gated, runner.b_major)


LAUNCHERS = {"cute": CuteLauncher(), "emulate": EmulateLauncher()}
