"""Host API of the varlen-K grouped GEMM (kernels/varlen_k_gemm.py): check, compile (no GPU needed), run.

    D[g] = A[rows of g].T @ B[rows of g]        A: (M or T, Ma)   B: (M or T, Nb)   D: (G, Ma, Nb)

A GroupLinear's weight gradient is ``grouped_wgrad(dy, x, offsets)`` (A = dY, B = X, D = dW (G, out, in));
with an index, the gathered operand is a token matrix read row by row through it (an MoE FC1's x). As the
varlen-M kernel's (kernels/api.py): an in-memory compile cache, a launch through TVM-FFI with integer arguments.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

from fusion.errors import DeviceError, DTypeError, KernelConfigError, ShapeError

from .api import _TORCH_DT, CompiledArtifact, compile_kernel, _dtype_name, _fake_ptr, _num_sms, _raw_stream
from .tile_policy import WgradConfig, _max_stages, choose_wgrad_config
from .varlen_k_gemm import VarlenKGemmKernel

__all__ = ["WgradConfig", "choose_wgrad_config", "check_wgrad_config", "CompiledVarlenKGemm",
           "compile_varlen_k_gemm", "run_varlen_k_gemm", "grouped_wgrad"]


def check_wgrad_config(config: WgradConfig, dtype, Ma: int, Nb: int, out_dtype=None, target: str = "sm_90a"):
    """Raise :class:`fusion.errors.KernelConfigError` naming every constraint the kernel cannot meet (cheap)."""
    dtype = _dtype_name(dtype)
    out_dtype = _dtype_name(out_dtype or dtype)
    problems = []
    if target != "sm_90a":
        problems.append(f"target {target!r}: only sm_90a is supported")
    if dtype not in ("bfloat16", "float16"):
        problems.append(f"dtype {dtype}: A and B must be bfloat16 or float16")
    if out_dtype not in ("bfloat16", "float16", "float32"):
        problems.append(f"out_dtype {out_dtype}: D is stored in bfloat16, float16 or float32")
    if config.tile_m not in (64, 128) or config.tile_n % 64 or not 64 <= config.tile_n <= 256:
        problems.append(f"tile {config.tile_m}x{config.tile_n}: tile_m is 64 or 128, tile_n a multiple of 64 (one "
                        "128-byte swizzle atom per 64 columns) up to 256")
    if config.pingpong and config.tile_n > 192:
        problems.append(f"pingpong with tile_n = {config.tile_n}: a warpgroup holds the whole fp32 tile, at most "
                        "192 columns")
    if config.cluster_m not in (1, 2):
        problems.append(f"cluster_m = {config.cluster_m}: 1, or 2 (a CTA pair sharing B's tile by TMA multicast)")
    if config.cluster_m > 1 and config.gather_b:
        problems.append("cluster_m = 2 multicasts B's tile by TMA: a gathered B is loaded by cp.async; use "
                        "cluster_m=1 with gather_b")
    if config.store_bytes not in (8, 16):
        problems.append(f"store_bytes = {config.store_bytes}: a lane stores 8 or 16 bytes of D per instruction")
    if config.tile_k != 64:
        problems.append(f"tile_k = {config.tile_k}: the producer copies 64 rows per k-step (16 per pass)")
    if Ma % 8 or Nb % 8:
        problems.append(f"(Ma, Nb) = ({Ma}, {Nb}): both must be multiples of 8 (16-byte cp.async chunks of a row)")
    if config.stages < 2 or config.stages > _max_stages(config.tile_m, config.tile_n, config.tile_k):
        problems.append(f"stages = {config.stages}: 2 up to what fits in shared memory "
                        f"({_max_stages(config.tile_m, config.tile_n, config.tile_k)} at this tile)")
    if problems:
        raise KernelConfigError(f"cannot build the varlen-K grouped GEMM ({dtype}, Ma={Ma}, Nb={Nb}, {config}): "
                                + "; ".join(problems))


class CompiledVarlenKGemm(CompiledArtifact):
    """A compiled varlen-K kernel: call through :func:`run_varlen_k_gemm`. ``.name .config .dtype .out_dtype .Ma .Nb
    .G``, and what every compiled kernel has (:class:`kernels.api.CompiledArtifact`)."""

    def __init__(self, fn, config, dtype, out_dtype, Ma, Nb, G, ptx, cubin, smem):
        super().__init__(fn, ptx, cubin, smem)
        self.config = config
        self.dtype, self.out_dtype = dtype, out_dtype
        self.Ma, self.Nb, self.G = Ma, Nb, G
        self.name = (f"varlen_k_gemm_{dtype}_{out_dtype}_Ma{Ma}_Nb{Nb}_G{G}_{config.tile_m}x{config.tile_n}x"
                     f"{config.tile_k}s{config.stages}" + ("_pp" if config.pingpong else "")
                     + ("_gA" if config.gather_a else "") + ("_gB" if config.gather_b else "")
                     + (f"_c{config.cluster_m}" if config.cluster_m > 1 else "")
                     + ("_nf" if config.n_fastest else "") + (f"_st{config.store_bytes}" if config.store_bytes != 8
                                                              else ""))
        c = config.cluster_m
        self.tiles = G * -(-Ma // (config.tile_m * c)) * c * -(-Nb // config.tile_n)  # CTAs' tiles, per unit

    def __repr__(self):
        return f"<CompiledVarlenKGemm {self.name} regs={self.registers} smem={self.shared_memory_bytes}>"


_CACHE: dict = {}
_LOCK = threading.Lock()


def compile_varlen_k_gemm(config: WgradConfig, dtype, Ma: int, Nb: int, G: int, out_dtype=None,
                          target: str = "sm_90a") -> CompiledVarlenKGemm:
    """Compile (cached in memory by config, dtypes and shapes); the rows (M, T) stay dynamic."""
    dtype = _dtype_name(dtype)
    out_dtype = _dtype_name(out_dtype or dtype)
    check_wgrad_config(config, dtype, Ma, Nb, out_dtype, target)
    key = (config, dtype, out_dtype, Ma, Nb, G, target)
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    kern = VarlenKGemmKernel(config, dtype, out_dtype)
    from cutlass.runtime import make_fake_stream
    int_ptr = make_ptr(cutlass.Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
    # (A, B, offsets, index, D, M, A's rows, B's rows, Ma, Nb, G, CTAs, stream)
    args = (_fake_ptr(dtype), _fake_ptr(dtype), int_ptr, int_ptr, _fake_ptr(out_dtype, 4),
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), Ma, Nb, G, cutlass.Int32(1), make_fake_stream())
    fn, ptx, cubin = compile_kernel(kern, args)
    res = CompiledVarlenKGemm(fn, config, dtype, out_dtype, Ma, Nb, G, ptx, cubin,
                              kern.shared_storage.size_in_bytes())
    with _LOCK:
        _CACHE[key] = res
    return res


def run_varlen_k_gemm(compiled: CompiledVarlenKGemm, A: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor,
                      out: torch.Tensor, index: Optional[torch.Tensor] = None, num_ctas: Optional[int] = None):
    """Launch on torch's current stream: ``out[g] = A[rows of g].T @ B[rows of g]`` for every group (an empty
    group's ``out[g]`` is zeroed). ``A`` (M, Ma) and ``B`` (M, Nb) row-major, or for a gathered operand (built
    with ``gather_a`` / ``gather_b``) a (T, ·) token matrix whose row ``index[r]`` routed row r reads; ``offsets``
    (G+1,) int32 row bounds on the device; ``out`` (G, Ma, Nb) contiguous. Checks shapes, dtypes, devices and
    alignment (no data read, no host sync). A caller launching the same kernel at the same shapes again keeps
    :func:`bind_varlen_k_gemm`'s BoundVarlenK instead (the runtime does)."""
    bind_varlen_k_gemm(compiled, A, B, offsets, out, index, num_ctas)(A, B, offsets, out, index)


class BoundVarlenK:
    """A varlen-K kernel's launch at one call shape (A's and B's shapes, the routed rows), checked once by
    :func:`bind_varlen_k_gemm`: a call checks only what may change between calls and reads no data (shapes and
    dtypes against the bound ones, contiguity, 16-byte alignment), reads the pointers and launches. Bound per device
    (the runtime keys its bindings by device)."""

    __slots__ = ("compiled", "launch", "a_shape", "b_shape", "out_shape", "M", "num_ctas", "gathers", "dtype",
                 "out_dtype", "out_align")

    def __init__(self, compiled, A, B, out, M: int, num_ctas: int):
        self.compiled, self.launch = compiled, compiled.launch
        self.a_shape, self.b_shape, self.out_shape = A.shape, B.shape, out.shape
        self.M, self.num_ctas = M, num_ctas
        self.gathers = compiled.config.gather_a or compiled.config.gather_b
        self.dtype, self.out_dtype = A.dtype, out.dtype
        self.out_align = _out_alignment(compiled) - 1   # (a mask)

    def __call__(self, A: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                 index: Optional[torch.Tensor] = None) -> None:
        a_ptr, b_ptr, out_ptr = A.data_ptr(), B.data_ptr(), out.data_ptr()
        if ((a_ptr | b_ptr) & 15 or out_ptr & self.out_align or A.shape != self.a_shape or B.shape != self.b_shape or out.shape != self.out_shape
                or A.dtype != self.dtype or B.dtype != self.dtype or out.dtype != self.out_dtype
                or not (A.is_contiguous() and B.is_contiguous() and out.is_contiguous())
                or offsets.dtype != torch.int32 or offsets.numel() <= self.compiled.G):
            bind_varlen_k_gemm(self.compiled, A, B, offsets, out, index, self.num_ctas)   # raises, naming the problem
            raise ShapeError(f"{self.compiled.name}: bound at A {tuple(self.a_shape)}, B {tuple(self.b_shape)}: bind "
                             f"the kernel at this call's shapes")
        if self.gathers:
            if (index is None or index.dtype != torch.int32 or not index.is_contiguous()
                    or index.numel() != self.M):
                bind_varlen_k_gemm(self.compiled, A, B, offsets, out, index, self.num_ctas)   # raises on a bad index
                raise ShapeError(f"{self.compiled.name}: bound at {self.M} routed rows: bind it at this call's")
            idx_ptr = index.data_ptr()
        elif index is not None:
            # raises: the kernel reads the rows in order
            bind_varlen_k_gemm(self.compiled, A, B, offsets, out, index, self.num_ctas)
        else:
            idx_ptr = offsets.data_ptr()  # (never read)
        self.launch(a_ptr, b_ptr, offsets.data_ptr(), idx_ptr, out_ptr, self.M, self.a_shape[0],
                    self.b_shape[0], self.num_ctas, _raw_stream(A.get_device()))


def _out_alignment(compiled: CompiledVarlenKGemm) -> int:
    """The byte alignment D's start needs: a 16-bit D is stored 8 or 16 bytes a lane (``store_bytes``), a 32-bit
    one 4 bytes at a time."""
    return compiled.config.store_bytes if compiled.out_dtype in ("bfloat16", "float16") else 4


def bind_varlen_k_gemm(compiled: CompiledVarlenKGemm, A: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor,
                       out: torch.Tensor, index: Optional[torch.Tensor] = None,
                       num_ctas: Optional[int] = None) -> BoundVarlenK:
    """The launch of `compiled` at these tensors' shapes, checked (see :func:`run_varlen_k_gemm`): a BoundVarlenK to
    call with each call's tensors of the same shapes."""
    cfg = compiled.config
    G, Ma, Nb = compiled.G, compiled.Ma, compiled.Nb
    if A.dim() != 2 or B.dim() != 2 or A.shape[1] != Ma or B.shape[1] != Nb:
        raise ShapeError(f"{compiled.name}: A must be (rows, {Ma}) and B (rows, {Nb}), got A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}")
    if tuple(out.shape) != (G, Ma, Nb) or not out.is_contiguous():
        raise ShapeError(f"{compiled.name}: out must be a contiguous ({G}, {Ma}, {Nb}), got {tuple(out.shape)}")
    for name, t, dt in (("A", A, compiled.dtype), ("B", B, compiled.dtype), ("out", out, compiled.out_dtype)):
        if t.dtype != _TORCH_DT[dt]:
            raise DTypeError(f"{compiled.name}: {name} must be {dt}, got {t.dtype}")
        if t.device != A.device:
            raise DeviceError(f"{compiled.name}: {name} is on {t.device}, A on {A.device}: move it")
    if not (A.is_contiguous() and B.is_contiguous()) or (A.data_ptr() | B.data_ptr()) & 15:
        raise ShapeError(f"{compiled.name}: A and B must be contiguous and 16-byte aligned")
    if out.data_ptr() % _out_alignment(compiled):
        raise ShapeError(f"{compiled.name}: out must be {_out_alignment(compiled)}-byte aligned (its epilogue stores "
                         f"{cfg.store_bytes} bytes a lane): pass a freshly allocated tensor")
    if offsets.dtype != torch.int32 or offsets.numel() < G + 1 or offsets.device != A.device:
        raise ShapeError(f"{compiled.name}: offsets must be G+1 = {G + 1} int32 bounds on {A.device}")
    gathers = cfg.gather_a or cfg.gather_b
    if gathers:
        if index is None or index.dtype != torch.int32 or not index.is_contiguous() or index.device != A.device:
            raise ShapeError(f"{compiled.name} gathers {'A' if cfg.gather_a else 'B'}'s rows: pass index= (int32, "
                             f"contiguous, on {A.device}: the token row of every routed row)")
        M = index.numel()
    elif index is not None:
        raise ShapeError(f"{compiled.name}: got an index, but the kernel reads the rows in order; build it with "
                         f"WgradConfig(gather_a=True) or gather_b=True")
    else:
        M = A.shape[0]
        if B.shape[0] != M:
            raise ShapeError(f"{compiled.name}: A and B must have the same rows, got {A.shape[0]} and {B.shape[0]}")
    if (not cfg.gather_a and A.shape[0] != M) or (not cfg.gather_b and B.shape[0] != M):
        raise ShapeError(f"{compiled.name}: the operand read in order must have the index's {M} rows")
    if num_ctas is None:
        num_ctas = max(1, min(_num_sms(A.device.index) - cfg.sm_margin, compiled.tiles))
    num_ctas = max(cfg.cluster_m, num_ctas - num_ctas % cfg.cluster_m)  # whole clusters
    return BoundVarlenK(compiled, A, B, out, M, num_ctas)


def grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, G: int,
                  index: Optional[torch.Tensor] = None, gather: str = "", config: Optional[WgradConfig] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dW[g] = dy[rows of g].T @ x[rows of g]`` as a (G, out, in) tensor in dy's dtype. ``gather``: which
    operands ("a": dy, "b": x, "ab": both) are token matrices read through ``index``."""
    Ma, Nb = dy.shape[1], x.shape[1]
    if config is None:
        config = choose_wgrad_config(Ma, Nb, G, "a" in gather, "b" in gather)
    comp = compile_varlen_k_gemm(config, dy.dtype, Ma, Nb, G)
    if out is None:
        out = torch.empty(G, Ma, Nb, dtype=dy.dtype, device=dy.device)
    run_varlen_k_gemm(comp, dy, x, offsets, out, index=index)
    return out
