"""Host API of the FP8 block-scaled grouped GEMM (kernels/fp8_gemm.py): config, compile (no GPU needed), run.

The same shape as the bf16 kernel's (kernels/api.py): a frozen :class:`~kernels.api.GemmConfig`, an
in-memory compile cache keyed by everything that changes the generated code, and a launch through TVM-FFI
with plain integer arguments (pointers, M, the CTA count, torch's stream).
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

from fusion.errors import DeviceError, KernelConfigError, ShapeError

from .api import (CompiledGroupedGemm, compile_kernel, GemmConfig, _dtype_name, _fake_ptr, _raw_stream,
                  _slot_dtypes, allocate_outputs, bound_epilogue_pointers, launch_grid, offsets_from_group_sizes,
                  output_problems, tile_counter)
from .epilogue import Epilogue, IdentityEpilogue
from .fp8_gemm import N_WAVE_TILE, SCALE_MODES, Fp8DebugKnobs, Fp8GroupedGemmKernel
from .fp8_scales import SCALE_BLOCK, num_slots, plan_segments
from .tile_policy import (band_problem, choose_fp8_config, cluster_m_problems, fp8_smem_limit, fp8_stage_bytes,
                          n_tile_count, resolved_band)

__all__ = ["choose_fp8_config", "check_fp8_config", "compile_fp8_grouped_gemm", "run_fp8_grouped_gemm",
           "bind_fp8_grouped_gemm", "BoundFp8Gemm", "fp8_grouped_gemm", "CompiledFp8GroupedGemm"]

_OUT_DTYPES = ("bfloat16", "float16")
_MAX_TILE_N = 192
_FP8_TORCH = (torch.uint8, torch.float8_e4m3fn)


def check_fp8_config(config: GemmConfig, epilogue: Epilogue, N: int, K: int, out_dtype="bfloat16",
                     target: str = "sm_90a"):
    """Raise :class:`fusion.errors.KernelConfigError` listing every constraint the FP8 kernel cannot meet."""
    out_dtype = _dtype_name(out_dtype)
    problems = []
    if target != "sm_90a":
        problems.append(f"target {target!r}: only sm_90a is supported")
    if out_dtype not in _OUT_DTYPES:
        problems.append(f"out_dtype {out_dtype}: the epilogue works in bfloat16 or float16")
    if config.tile_m not in (64, 128, 256) or config.tile_k != SCALE_BLOCK:
        problems.append(f"tile {config.tile_m}x{config.tile_n}x{config.tile_k}: the FP8 kernel uses tile_m = 128 "
                        f"or 256 (64: a gated n-wave tile of two CTAs an SM) and tile_k = {SCALE_BLOCK} (one scale "
                        "block per k-tile)")
    if config.tile_m == 256 and config.tile_n > 128:
        problems.append(f"tile 256x{config.tile_n}: a 256-row tile holds two waves' accumulators and one scratch "
                        "fragment, 3 x tile_n / 2 registers a thread: use tile_n <= 128")
    gated_waves = epilogue.gated and config.tile_m in (64, 128) and config.tile_n == N_WAVE_TILE
    two_cta_waves = gated_waves and config.tile_m == 64   # one warpgroup's 64 rows of the gate and up n-waves
    if config.tile_n % 16 or not (16 <= config.tile_n <= _MAX_TILE_N or gated_waves):
        problems.append(f"tile_n = {config.tile_n}: a multiple of 16 up to {_MAX_TILE_N} (a consumer thread holds "
                        "the accumulator and the promotion's scratch fragment, tile_n registers in all: 256 "
                        f"spills), or {N_WAVE_TILE} for a gated 128-row tile (its gate and up halves as two "
                        "n-waves through one scratch fragment)")
    if config.ctas_per_sm not in (1, 2):
        problems.append(f"ctas_per_sm = {config.ctas_per_sm}: 1 (two cooperative consumer warpgroups a CTA), or 2 "
                        "(one consumer warpgroup a CTA, two CTAs an SM)")
    elif config.ctas_per_sm == 2 and not ((config.tile_m == 128 and config.tile_n <= 128) or two_cta_waves):
        problems.append(f"ctas_per_sm = 2 with a {config.tile_m}x{config.tile_n} tile: one consumer warpgroup holds "
                        "the whole tile's accumulator and a 64-row wave's scratch fragment, so the tile is 128 x "
                        "tile_n with tile_n <= 128, or a gated 64 x 256 one (gate and up n-waves)")
    elif config.tile_m == 64 and not (config.ctas_per_sm == 2 and two_cta_waves):
        problems.append(f"tile 64x{config.tile_n}: 64 rows are one warpgroup's, a gated n-wave tile (tile_n = "
                        f"{N_WAVE_TILE}) of two CTAs an SM (ctas_per_sm = 2)")
    if config.pingpong:
        problems.append("pingpong: the FP8 kernel is cooperative (each warpgroup holds an accumulator and the "
                        "promotion's scratch fragment); use pingpong=False")
    if config.b_major != "K":
        problems.append("b_major must be 'K': FP8 wgmma reads B K-major (the dgrad uses the weight's data_t)")
    problems += cluster_m_problems(config, epilogue.gated)
    if (why := band_problem(config)) is not None:
        problems.append(why)
    if config.cluster_n not in (1, 2):
        problems.append(f"cluster_n = {config.cluster_n}: 1, or 2 for CTA pairs sharing the A tile")
    elif config.cluster_n == 2:
        n_tiles = n_tile_count(N, config.tile_n)
        if n_tiles % 2:
            problems.append(f"cluster_n = 2 needs an even number of n-tiles; N = {N} makes {n_tiles} of "
                            f"{config.tile_n} columns (use cluster_n = 1)")
        if not config.persistent:
            problems.append("cluster_n = 2 needs the persistent kernel")
    if K % 16:
        problems.append(f"K = {K}: must be a multiple of 16 (16-byte TMA rows of the E4M3 A and B)")
    if N % (16 if epilogue.gated else 8):
        problems.append(f"N = {N}: must be a multiple of {16 if epilogue.gated else 8} (aligned output pairs"
                        + ("; gate and up halves of 8-column chunks)" if epilogue.gated else ")"))
    slots = 2
    if not problems:
        try:
            slots = num_slots(plan_segments(config.tile_n, N, epilogue.gated))
        except ValueError as e:
            problems.append(str(e))
    tile_log = config.tile_n // 2 if epilogue.gated else config.tile_n
    problems += output_problems(epilogue, tile_log)
    if config.stages < 2:
        problems.append(f"stages = {config.stages}: at least 2 (a consumer holds a stage while it waits for the "
                        "next)")
    smem = config.stages * (fp8_stage_bytes(config.tile_m, config.tile_n, slots) + 16)
    if smem > fp8_smem_limit(config):
        problems.append(f"{config.stages} stages need {smem} bytes of shared memory (at most "
                        f"{fp8_smem_limit(config)}" + (" for each of two CTAs an SM" if config.ctas_per_sm == 2 else "")
                        + "): use fewer stages")
    if problems:
        raise KernelConfigError(f"cannot build the FP8 grouped GEMM ({type(epilogue).__name__}, N={N}, K={K}, "
                                f"{config}): " + "; ".join(problems))


class CompiledFp8GroupedGemm(CompiledGroupedGemm):
    """A compiled FP8 kernel: call through :func:`run_fp8_grouped_gemm`. ``.dtype`` is the output dtype;
    ``.ptx .cubin .registers .shared_memory_bytes .frame_size .sass .name .config .N .K .G`` as the bf16
    kernel's."""

    def __init__(self, fn, kernel, config, epilogue, out_dtype, N, K, G, ptx, cubin, smem):
        """`kernel`: the traced Fp8GroupedGemmKernel, or None for a kernel loaded from fusion's disk cache (its
        launch needs only the configuration and the shapes)."""
        super().__init__(fn, kernel, config, epilogue, out_dtype, N, K, G, ptx, cubin, smem)
        debug = "" if kernel is None or kernel.debug.scales == "tma" else f"_scales-{kernel.debug.scales}"
        self.name = (f"fp8_grouped_gemm_{type(epilogue).__name__}_{out_dtype}_N{N}_K{K}_G{G}_"
                     f"{config.tile_m}x{config.tile_n}x{config.tile_k}s{config.stages}"
                     + (f"_band{resolved_band(config)}" if resolved_band(config) > 1 else "")
                     + ("_dyn" if config.dynamic else "") + ("_c2" if config.cluster_n == 2 else "")
                     + ("_cm2" if config.cluster_m == 2 else "")
                     + ("_2cta" if config.ctas_per_sm == 2 else "")
                     + ("_ord" if getattr(config, "ordered_waves", False) else "")
                     + debug
                     + ("" if kernel is None or kernel.debug.reg_realloc else "_noregs"))
        self.k_blocks = -(-K // SCALE_BLOCK)
        self.b_scale_shape = (G, -(-N // SCALE_BLOCK), self.k_blocks)

    def __repr__(self):
        return f"<CompiledFp8GroupedGemm {self.name} regs={self.registers} smem={self.shared_memory_bytes}>"


_CACHE: dict = {}
_LOCK = threading.Lock()


def compile_fp8_grouped_gemm(config: GemmConfig, epilogue: Epilogue, N: int, K: int, G: int,
                             out_dtype="bfloat16", target: str = "sm_90a",
                             debug: Optional[Fp8DebugKnobs] = None) -> CompiledFp8GroupedGemm:
    """Compile (cached in memory by config, epilogue code, out dtype, N, K, G, debug); M stays dynamic.

    ``debug``: :class:`kernels.fp8_gemm.Fp8DebugKnobs`, build variants that isolate a device fault
    (bench/fp8_bisect.py); None = the kernel."""
    out_dtype = _dtype_name(out_dtype)
    check_fp8_config(config, epilogue, N, K, out_dtype, target)
    debug = debug or Fp8DebugKnobs()
    if debug.scales not in SCALE_MODES:
        raise KernelConfigError(f"Fp8DebugKnobs.scales = {debug.scales!r}: one of {', '.join(SCALE_MODES)}")
    key = (config, epilogue.cache_key(), out_dtype, N, K, G, target, debug)
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    res = _build(config, epilogue, out_dtype, N, K, G, debug)
    with _LOCK:
        _CACHE[key] = res
    return res


def _build(config, epilogue, out_dtype, N, K, G, debug) -> CompiledFp8GroupedGemm:
    kern = Fp8GroupedGemmKernel(config, epilogue, out_dtype, debug)
    ptrs = tuple(_fake_ptr(d, 1 if d == "uint8" else 4) for d in _slot_dtypes(epilogue, out_dtype))
    i32 = make_ptr(cutlass.Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
    from cutlass.runtime import make_fake_stream
    args = (_fake_ptr("float8_e4m3fn"), _fake_ptr("float8_e4m3fn"), _fake_ptr("float32"), _fake_ptr("float32"),
            i32, i32, ptrs, cutlass.Int32(1), N, K, G, cutlass.Int32(1), make_fake_stream())
    fn, ptx, cubin = compile_kernel(kern, args)
    return CompiledFp8GroupedGemm(fn, kern, config, epilogue, out_dtype, N, K, G, ptx, cubin,
                                  kern.shared_storage.size_in_bytes())


def _check_operand(name, t, shape, dtypes, what):
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes or not t.is_contiguous() or t.data_ptr() & 15:
        raise ShapeError(f"FP8 grouped GEMM: {name} must be {what} of shape {tuple(shape)}, contiguous and "
                         f"16-byte aligned; got {tuple(t.shape)} {t.dtype}"
                         + ("" if t.is_contiguous() else " (not contiguous)"))


def run_fp8_grouped_gemm(compiled: CompiledFp8GroupedGemm, A: torch.Tensor, A_scale: torch.Tensor,
                         B: torch.Tensor, B_scale: torch.Tensor, offsets: torch.Tensor, outputs: dict,
                         extras: Optional[dict] = None, num_ctas: Optional[int] = None,
                         counter_ptr: Optional[int] = None):
    """Launch on torch's current stream, no host sync.

    ``A`` (M, K) E4M3 codes (``torch.uint8`` as ``fusion.quant`` stores them, or ``torch.float8_e4m3fn``),
    ``A_scale`` (ceil(K/128), M) float32 (``fp8_block_quantize_2d``'s layout); ``B`` (G, N, K) E4M3 codes and
    ``B_scale`` (G, ceil(N/128), ceil(K/128)) float32 (``FP8BlockWeight.data`` / ``.scale``); ``offsets``
    (G+1,) int32 group row bounds. ``outputs`` / ``extras``: the epilogue's tensors by name, as
    :func:`kernels.api.run_grouped_gemm`. ``counter_ptr``: a zeroed int32 for the dynamic scheduler (else one
    is allocated).

    A caller that launches the same kernel at the same shapes again keeps :func:`bind_fp8_grouped_gemm`'s
    BoundFp8Gemm instead (the runtime does): this function is that binding and its call."""
    tensors = outputs if not extras else {**outputs, **extras}
    bind_fp8_grouped_gemm(compiled, A, A_scale, B, B_scale, offsets, num_ctas)(A, A_scale, B, B_scale, offsets,
                                                                                tensors, counter_ptr)


def _check_fp8_operands(compiled: CompiledFp8GroupedGemm, A, A_scale, B, B_scale, offsets) -> None:
    """What reads no data: the operands' shapes, dtypes, contiguity, 16-byte alignment, G+1 int32 offsets, one
    CUDA device (raises, naming the problem)."""
    K, G = compiled.K, compiled.G
    if A.dim() != 2:
        raise ShapeError(f"FP8 grouped GEMM {compiled.name}: A must be 2-D (M, {K}), got {tuple(A.shape)}")
    M = A.shape[0]
    _check_operand("A", A, (M, K), _FP8_TORCH, "E4M3 codes (uint8 or float8_e4m3fn)")
    _check_operand("A_scale", A_scale, (compiled.k_blocks, M), (torch.float32,), "float32 k-block-major scales")
    _check_operand("B", B, (G, compiled.N, K), _FP8_TORCH, "E4M3 codes (uint8 or float8_e4m3fn)")
    _check_operand("B_scale", B_scale, compiled.b_scale_shape, (torch.float32,), "float32 128x128 block scales")
    if offsets.numel() < G + 1 or offsets.dtype != torch.int32:
        raise ShapeError(f"FP8 grouped GEMM {compiled.name}: offsets must hold G+1 = {G + 1} int32 bounds")
    if M and (not A.is_cuda or any(t.device != A.device for t in (A_scale, B, B_scale, offsets))):
        raise DeviceError(f"FP8 grouped GEMM {compiled.name}: A, the scales, B and offsets must be on one CUDA "
                          f"device; got A on {A.device}")


class BoundFp8Gemm:
    """A compiled FP8 kernel's launch at one call shape (A's rows; B, the scales and the epilogue's pointer order
    fixed by the kernel): :func:`_check_fp8_operands`, the launch grid and the epilogue's pointer order worked out once
    by :func:`bind_fp8_grouped_gemm`, so that a call checks only what may change between calls of that shape (the
    operands' shapes, dtypes, contiguity and 16-byte alignment; the epilogue tensors' contiguity), reads the pointers
    and launches, as the bf16 kernel's kernels.api.BoundGemm does: a training step launches up to four FP8 GEMMs, and
    run_fp8_grouped_gemm's full checks cost each of them tens of microseconds of host time. Bound per device: the
    runtime keeps one per kernel, call shape and device (fusion/runtime/kernel.py, fusion/runtime/fp8_gemm.py)."""

    __slots__ = ("compiled", "launch", "a_shape", "sa_shape", "b_shape", "sb_shape", "M", "num_ctas", "names",
                 "dynamic", "min_offsets")

    def __init__(self, compiled: CompiledFp8GroupedGemm, M: int, num_ctas: int):
        self.compiled, self.launch = compiled, compiled.launch
        self.M, self.num_ctas = M, num_ctas
        self.a_shape = torch.Size((M, compiled.K))
        self.sa_shape = torch.Size((compiled.k_blocks, M))
        self.b_shape = torch.Size((compiled.G, compiled.N, compiled.K))
        self.sb_shape = torch.Size(compiled.b_scale_shape)
        # the epilogue's tensors in slot order: each slot's tensor, then its extra tensors (scales, amax)
        self.names = tuple(n for name, suffixes in compiled.slots for n in (name, *(name + s for s in suffixes)))
        self.dynamic = compiled.config.dynamic
        self.min_offsets = compiled.G + 1

    def __call__(self, A: torch.Tensor, A_scale: torch.Tensor, B: torch.Tensor, B_scale: torch.Tensor,
                 offsets: torch.Tensor, tensors: dict, counter_ptr: Optional[int] = None) -> None:
        """Launch on torch's current stream (see :func:`run_fp8_grouped_gemm`); `tensors` maps every epilogue name
        (and a quantized output's suffixed names) to its tensor."""
        a_ptr, sa_ptr, b_ptr, sb_ptr = A.data_ptr(), A_scale.data_ptr(), B.data_ptr(), B_scale.data_ptr()
        if ((a_ptr | sa_ptr | b_ptr | sb_ptr) & 15 or A.shape != self.a_shape or A_scale.shape != self.sa_shape
                or B.shape != self.b_shape or B_scale.shape != self.sb_shape or A.dtype not in _FP8_TORCH
                or B.dtype not in _FP8_TORCH or A_scale.dtype != torch.float32 or B_scale.dtype != torch.float32
                or not (A.is_contiguous() and A_scale.is_contiguous() and B.is_contiguous()
                        and B_scale.is_contiguous())
                or offsets.numel() < self.min_offsets or offsets.dtype != torch.int32):
            if A.dim() != 2 or A.shape[0] == self.M:
                _check_fp8_operands(self.compiled, A, A_scale, B, B_scale, offsets)   # raises, naming the problem
            raise ShapeError(f"FP8 grouped GEMM {self.compiled.name}: bound at {self.M} rows, got A "
                             f"{tuple(A.shape)}: bind the kernel at this call's rows")
        ptrs = bound_epilogue_pointers(f"FP8 grouped GEMM {self.compiled.name}", self.names, tensors)
        if self.M == 0:
            return
        counter_ptr, counter = tile_counter(self.dynamic, offsets, A.device, counter_ptr)
        self.launch(a_ptr, b_ptr, sa_ptr, sb_ptr, offsets.data_ptr(), counter_ptr, ptrs, self.M,
                    self.num_ctas, _raw_stream(A.get_device()))
        del counter   # (a fresh counter is freed stream-ordered, after the launch)


def bind_fp8_grouped_gemm(compiled: CompiledFp8GroupedGemm, A: torch.Tensor, A_scale: torch.Tensor,
                          B: torch.Tensor, B_scale: torch.Tensor, offsets: torch.Tensor,
                          num_ctas: Optional[int] = None) -> BoundFp8Gemm:
    """The launch of `compiled` at A's rows, checked once: a BoundFp8Gemm to call with each call's tensors of
    those shapes (see :func:`run_fp8_grouped_gemm`)."""
    _check_fp8_operands(compiled, A, A_scale, B, B_scale, offsets)
    M = A.shape[0]
    num_ctas, _, _ = launch_grid(compiled, M, A.device, offsets, num_ctas, counter_ptr=0) if M else (1, 0, None)
    return BoundFp8Gemm(compiled, M, num_ctas)


def fp8_grouped_gemm(A, A_scale, B, B_scale, group_sizes=None, offsets=None, epilogue: Optional[Epilogue] = None,
                     extras: Optional[dict] = None, config: Optional[GemmConfig] = None, out_dtype="bfloat16"):
    """Convenience: allocate the outputs, compile (cached), run. Returns a dict name -> tensor."""
    epilogue = epilogue or IdentityEpilogue()
    if offsets is None:
        offsets = offsets_from_group_sizes(group_sizes)
    out_dtype = _dtype_name(out_dtype)
    M, K = A.shape
    G, N = B.shape[0], B.shape[1]
    config = config or choose_fp8_config(N, K, G, epilogue.gated, plain_epilogue=type(epilogue) is IdentityEpilogue)
    comp = compile_fp8_grouped_gemm(config, epilogue, N, K, G, out_dtype)
    outs = allocate_outputs(epilogue, M, N, out_dtype, A.device)
    run_fp8_grouped_gemm(comp, A, A_scale, B, B_scale, offsets, outs, extras)
    return outs
