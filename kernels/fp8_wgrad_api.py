"""Host API of the FP8 varlen-K grouped GEMM (kernels/fp8_wgrad.py): check, compile (no GPU needed), run.

    D[g] = dequant(A slots of g) @ dequant(B slots of g).T        A: (Ma, L)   B: (Nb, L)   D: (G, Ma, Nb)

An fp8_block GroupLinear's weight gradient from the recipe's FP8 operands is ``fp8_grouped_wgrad(dy_cw, x_cw,
offsets)``, each operand the quantize kernel's columnwise copy in the slot layout
(``fusion.kernels.fp8_quantize_api.quantize_fp8_block_slots``). As the other kernels' APIs: an in-memory compile
cache (the runtime's disk cache on top: fusion/runtime/compile.py), a launch through TVM-FFI with integer arguments.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

from fusion.errors import DeviceError, DTypeError, KernelConfigError, ShapeError

from .api import CompiledArtifact, _dtype_name, _fake_ptr, _num_sms, compile_kernel, current_stream
from .fp8_scales import SCALE_BLOCK
from .fp8_wgrad import Fp8VarlenKGemmKernel
from .tile_policy import WgradConfig, fp8_wgrad_stages

__all__ = ["check_fp8_wgrad_config", "CompiledFp8VarlenKGemm", "compile_fp8_varlen_k_gemm",
           "run_fp8_varlen_k_gemm"]

_OUT_DTYPES = ("bfloat16", "float16")
_FP8_TORCH = (torch.uint8, torch.float8_e4m3fn)


def check_fp8_wgrad_config(config: WgradConfig, Ma: int, Nb: int, out_dtype="bfloat16", target: str = "sm_90a"):
    """Raise :class:`fusion.errors.KernelConfigError` naming every constraint the kernel cannot meet (cheap)."""
    out_dtype = _dtype_name(out_dtype)
    problems = []
    if target != "sm_90a":
        problems.append(f"target {target!r}: only sm_90a is supported")
    if out_dtype not in _OUT_DTYPES:
        problems.append(f"out_dtype {out_dtype}: D is stored in bfloat16 or float16")
    if config.tile_m not in (128, 256) or config.tile_k != SCALE_BLOCK:
        problems.append(f"tile {config.tile_m}x{config.tile_n}x{config.tile_k}: tile_m is 128 or 256 and tile_k "
                        f"{SCALE_BLOCK} (one columnwise block slot per k-tile)")
    if config.tile_n % 16 or not 16 <= config.tile_n <= 128:
        problems.append(f"tile_n = {config.tile_n}: a multiple of 16 up to 128 (a consumer thread holds the "
                        "accumulator and the promotion's scratch fragment)")
    if config.pingpong or config.gather_a or config.gather_b or config.cluster_m != 1:
        problems.append("the FP8 wgrad kernel is cooperative, reads both operands by TMA and pairs CTAs along n "
                        "only: pingpong, gather_a, gather_b and cluster_m must keep their defaults")
    if config.cluster_n not in (1, 2):
        problems.append(f"cluster_n = {config.cluster_n}: 1, or 2 for CTA pairs sharing A's tile")
    if config.store_bytes not in (8, 16):
        problems.append(f"store_bytes = {config.store_bytes}: a lane stores 8 or 16 bytes of D")
    if config.ctas_per_sm not in (1, 2):
        problems.append(f"ctas_per_sm = {config.ctas_per_sm}: 1, or 2 (one consumer warpgroup a CTA)")
    elif config.ctas_per_sm == 2 and (config.tile_m != 128 or config.cluster_n != 1):
        problems.append(f"ctas_per_sm = 2 with a {config.tile_m}-row tile and cluster_n = {config.cluster_n}: two "
                        "CTAs an SM take 128-row tiles (one warpgroup's two 64-row waves) as single CTAs")
    if Ma % 8 or Nb % 8:
        problems.append(f"(Ma, Nb) = ({Ma}, {Nb}): both must be multiples of 8 (16-byte output pairs, 16-byte "
                        "scale rows for TMA)")
    two_ctas = config.ctas_per_sm == 2
    most = fp8_wgrad_stages(config.tile_m, config.tile_n, 2 if two_ctas else 1)
    if not 2 <= config.stages <= most:
        problems.append(f"stages = {config.stages}: 2 up to what fits in shared memory ({most} at this tile"
                        + (", for each of two CTAs an SM)" if two_ctas else ")"))
    if problems:
        raise KernelConfigError(f"cannot build the FP8 varlen-K grouped GEMM (Ma={Ma}, Nb={Nb}, {config}): "
                                + "; ".join(problems))


class CompiledFp8VarlenKGemm(CompiledArtifact):
    """A compiled FP8 varlen-K kernel: call through :func:`run_fp8_varlen_k_gemm`. ``.name .config .out_dtype .Ma
    .Nb .G .tiles``, and what every compiled kernel has (:class:`kernels.api.CompiledArtifact`)."""

    def __init__(self, fn, config, out_dtype, Ma, Nb, G, ptx, cubin, smem):
        super().__init__(fn, ptx, cubin, smem)
        self.config = config
        self.dtype = self.out_dtype = out_dtype
        self.Ma, self.Nb, self.G = Ma, Nb, G
        self.name = (f"fp8_varlen_k_gemm_{out_dtype}_Ma{Ma}_Nb{Nb}_G{G}_{config.tile_m}x{config.tile_n}x"
                     f"{config.tile_k}s{config.stages}" + (f"_c{config.cluster_n}" if config.cluster_n > 1 else "")
                     + ("_2cta" if config.ctas_per_sm == 2 else "") + ("_st16" if config.store_bytes == 16 else "")
                     + ("_ord" if config.ordered_waves else ""))
        c = config.cluster_n
        self.tiles = G * -(-Ma // config.tile_m) * c * -(-Nb // (config.tile_n * c))   # CTAs' tiles, per unit

    def __repr__(self):
        return f"<CompiledFp8VarlenKGemm {self.name} regs={self.registers} smem={self.shared_memory_bytes}>"


_CACHE: dict = {}
_LOCK = threading.Lock()


def compile_fp8_varlen_k_gemm(config: WgradConfig, Ma: int, Nb: int, G: int, out_dtype="bfloat16",
                              target: str = "sm_90a") -> CompiledFp8VarlenKGemm:
    """Compile (cached in memory by config, dtype and shapes); the rows (the slot capacity) stay dynamic."""
    out_dtype = _dtype_name(out_dtype)
    check_fp8_wgrad_config(config, Ma, Nb, out_dtype, target)
    key = (config, out_dtype, Ma, Nb, G, target)
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    kern = Fp8VarlenKGemmKernel(config, out_dtype)
    from cutlass.runtime import make_fake_stream

    codes = make_ptr(cutlass.Float8E4M3FN, 0, cute.AddressSpace.gmem, assumed_align=16)
    floats = make_ptr(cutlass.Float32, 0, cute.AddressSpace.gmem, assumed_align=16)
    int_ptr = make_ptr(cutlass.Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
    # (A, B, sa, sb, offsets, D, capacity, Ma, Nb, G, CTAs, stream)
    args = (codes, codes, floats, floats, int_ptr, _fake_ptr(out_dtype, 16), cutlass.Int32(1), Ma, Nb, G,
            cutlass.Int32(1), make_fake_stream())
    fn, ptx, cubin = compile_kernel(kern, args)
    res = CompiledFp8VarlenKGemm(fn, config, out_dtype, Ma, Nb, G, ptx, cubin, kern.shared_storage.size_in_bytes())
    with _LOCK:
        _CACHE[key] = res
    return res


def run_fp8_varlen_k_gemm(compiled: CompiledFp8VarlenKGemm, a_data: torch.Tensor, a_scale: torch.Tensor,
                          b_data: torch.Tensor, b_scale: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                          num_ctas: Optional[int] = None):
    """Launch on torch's current stream: ``out[g] = A_g @ B_g.T`` from the slot-layout columnwise copies of the two
    operands (``a_data`` (Ma, L), ``a_scale`` (L / 128, Ma); ``b_data`` (Nb, L), ``b_scale`` (L / 128, Nb); E4M3
    codes as uint8 or float8_e4m3fn, float32 scales), ``offsets`` (G+1,) int32 group row bounds on the device,
    ``out`` (G, Ma, Nb) contiguous (an empty group's is zeroed). Checks shapes, dtypes, devices and alignment (no
    data read, no host sync)."""
    G, Ma, Nb = compiled.G, compiled.Ma, compiled.Nb
    dev = a_data.device
    L = a_data.shape[1] if a_data.dim() == 2 else -1
    cap = L // SCALE_BLOCK
    if a_data.dim() != 2 or tuple(a_data.shape) != (Ma, L) or tuple(b_data.shape) != (Nb, L) or L % SCALE_BLOCK:
        raise ShapeError(f"{compiled.name}: A must be (Ma={Ma}, L) and B (Nb={Nb}, L) with L a multiple of "
                         f"{SCALE_BLOCK} (the slot layout), got A {tuple(a_data.shape)}, B {tuple(b_data.shape)}")
    if tuple(a_scale.shape) != (cap, Ma) or tuple(b_scale.shape) != (cap, Nb):
        raise ShapeError(f"{compiled.name}: the scales must be ({cap}, {Ma}) and ({cap}, {Nb}), got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    if tuple(out.shape) != (G, Ma, Nb) or not out.is_contiguous():
        raise ShapeError(f"{compiled.name}: out must be a contiguous ({G}, {Ma}, {Nb}), got {tuple(out.shape)}")
    for name, t, ok in (("A", a_data, _FP8_TORCH), ("B", b_data, _FP8_TORCH), ("a_scale", a_scale, (torch.float32,)),
                        ("b_scale", b_scale, (torch.float32,)),
                        ("out", out, (getattr(torch, compiled.out_dtype),))):
        if t.dtype not in ok:
            raise DTypeError(f"{compiled.name}: {name} must be {' or '.join(map(str, ok))}, got {t.dtype}")
        if t.device != dev:
            raise DeviceError(f"{compiled.name}: {name} is on {t.device}, A on {dev}: move it")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ShapeError(f"{compiled.name}: {name} must be contiguous and 16-byte aligned")
    if offsets.dtype != torch.int32 or offsets.numel() < G + 1 or offsets.device != dev:
        raise ShapeError(f"{compiled.name}: offsets must be G+1 = {G + 1} int32 bounds on {dev}")
    if num_ctas is None:   # a persistent grid: every SM (two CTAs on each with ctas_per_sm = 2), at most a CTA a tile
        num_ctas = max(1, min(compiled.config.ctas_per_sm * _num_sms(dev.index), compiled.tiles))
    c = compiled.config.cluster_n
    num_ctas = max(c, num_ctas - num_ctas % c)  # whole clusters
    compiled.launch(a_data.data_ptr(), b_data.data_ptr(), a_scale.data_ptr(), b_scale.data_ptr(),
                    offsets.data_ptr(), out.data_ptr(), cap, num_ctas, current_stream(dev))
