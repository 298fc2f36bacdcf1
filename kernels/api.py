"""Host-side API: config, compile (no GPU needed), run on torch CUDA tensors."""
from __future__ import annotations

import glob
import logging
import os
import re
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
from typing import Optional

import torch

# Kernels launch through TVM-FFI with plain integer arguments (pointers as ints, torch's stream as an int): about
# 1 us of host time per launch instead of ~33 us through the DSL's argument conversion. Passing ints never uses
# DLPack, so the tensor-exchange add-on that tvm_ffi would otherwise try to build at import is not needed.
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

from fusion.errors import DeviceError, DTypeError, KernelConfigError, ShapeError

from .epilogue import Epilogue, FP8BlockOutput, MXFP8Output, RowSumOutput, extra_tensors, is_fp8_block
from .grouped_gemm import GroupedGemmKernel, cutlass_dtype
from .tile_policy import (GemmConfig, band_problem, choose_config, cluster_m_problems, for_gather, n_tile_count,
                          resolved_band, spill_fallback)

__all__ = [
    "GemmConfig", "CompiledGroupedGemm", "compile_grouped_gemm", "run_grouped_gemm", "bind_grouped_gemm",
    "BoundGemm", "grouped_gemm",
    "choose_config", "check_config", "offsets_from_group_sizes", "sass_text", "sass_opcodes",
]

log = logging.getLogger("fusion.kernels")


def offsets_from_group_sizes(group_sizes: torch.Tensor) -> torch.Tensor:
    """(G,) sizes -> (G+1,) int32 cumulative offsets, on the same device (no host sync)."""
    offs = torch.zeros(group_sizes.numel() + 1, dtype=torch.int32, device=group_sizes.device)
    torch.cumsum(group_sizes.to(torch.int32), 0, out=offs[1:])
    return offs


_TORCH_DT = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8,
}


def _dtype_name(dt) -> str:
    if isinstance(dt, str):
        return dt
    return str(dt).replace("torch.", "")


def _cubin_nv_info(cubin: bytes) -> dict:
    """Parse the cubin's global .nv.info section: {'registers': EIATTR_REGCOUNT (0x2f),
    'frame_size': EIATTR_FRAME_SIZE (0x11), 'max_stack_size': EIATTR_MAX_STACK_SIZE (0x12)} (max over
    functions)."""
    out = {}
    try:
        if not cubin or cubin[:4] != b"\x7fELF":
            return out
        shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
        stroff = secs[shstrndx][4]
        names = {0x2F: "registers", 0x11: "frame_size", 0x12: "max_stack_size"}
        for sec in secs:
            nm = cubin[stroff + sec[0]:cubin.index(b"\0", stroff + sec[0])].decode()
            if nm != ".nv.info":
                continue
            d = cubin[sec[4]:sec[4] + sec[5]]
            i = 0
            while i + 4 <= len(d):
                fmt, attr = d[i], d[i + 1]
                if fmt == 4:
                    sz = struct.unpack_from("<H", d, i + 2)[0]
                    if attr in names and sz == 8:
                        val = struct.unpack_from("<I", d, i + 8)[0]
                        out[names[attr]] = max(out.get(names[attr], 0), val)
                    i += 4 + sz
                else:
                    i += 4
    except Exception:
        pass
    return out


def _nvdisasm() -> Optional[str]:
    p = shutil.which("nvdisasm")
    if p:
        return p
    try:
        import nvidia.cu13 as _c  # type: ignore
        cand = os.path.join(list(_c.__path__)[0], "bin", "nvdisasm")
        if os.path.exists(cand):
            return cand
    except Exception:
        pass
    for c in glob.glob("/usr/local/cuda*/bin/nvdisasm"):
        return c
    return None


def sass_text(cubin: bytes) -> str:
    """Disassemble a cubin with nvdisasm (raises if nvdisasm is unavailable)."""
    tool = _nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, "-c", path], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)


_SASS_OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", re.M)


def sass_opcodes(sass: str) -> list[str]:
    """The opcodes (with their modifiers, e.g. ``LDG.E.128``) of nvdisasm's listing, in order, predicates
    dropped: what SASS checks look for (HGMMA, LDGSTS, UTMALDG, no LDL/STL spills)."""
    return _SASS_OPCODE.findall(sass)


class CompiledArtifact:
    """What every compiled kernel of this package exposes: ``.fn`` (what cute.compile returned, or the loaded
    module's function), ``.launch`` (the raw TVM-FFI function: positional ints), ``.ptx`` ``.cubin``
    ``.shared_memory_bytes`` ``.registers`` ``.frame_size`` (0 = no spills) ``.max_stack_size`` and ``.sass``
    (nvdisasm's listing, made when first read)."""

    def __init__(self, fn, ptx, cubin, smem):
        self.fn = fn
        #: fn.__tvm_ffi_object__() for a kernel compiled in this process, or what load_module(...,
        #: enable_tvm_ffi=True) returned (already raw).
        self.launch = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else fn
        self.ptx = ptx
        self.cubin = cubin
        self.shared_memory_bytes = smem
        info = _cubin_nv_info(cubin)
        self.registers = info.get("registers")
        self.frame_size = info.get("frame_size", 0)
        self.max_stack_size = info.get("max_stack_size", 0)
        self._sass = None

    @property
    def sass(self) -> str:
        if self._sass is None:
            self._sass = sass_text(self.cubin)
        return self._sass


class CompiledGroupedGemm(CompiledArtifact):
    """A compiled kernel: call through :func:`run_grouped_gemm`.  Exposes .ptx, .cubin, .registers,
    .shared_memory_bytes, .sass (lazy), .name, .config, .requested_config, .epilogue, .dtype, .N, .K, .G.
    ``.config`` is the tile configuration the kernel was built with, ``.requested_config`` the one asked for: they
    differ where the tile policy's spill fallback rebuilt it (:func:`fusion.kernels.tile_policy.spill_fallback`)."""

    def __init__(self, fn, kernel: GroupedGemmKernel, config, epilogue, dtype, N, K, G, ptx, cubin, smem):
        super().__init__(fn, ptx, cubin, smem)
        self.kernel = kernel
        self.config = config
        self.requested_config = config
        self.epilogue = epilogue
        self.dtype = dtype
        self.N, self.K, self.G = N, K, G
        self.name = f"grouped_gemm_{type(epilogue).__name__}_{dtype}_N{N}_K{K}_G{G}_" \
                    f"{config.tile_m}x{config.tile_n}x{config.tile_k}s{config.stages}" + \
                    (f"_band{resolved_band(config)}" if resolved_band(config) > 1 else "") + \
                    ("_dyn" if config.dynamic else "") + ("_pp" if getattr(config, "pingpong", False) else "") + \
                    ("_bmn" if getattr(config, "b_major", "K") == "MN" else "") + \
                    ("_gA" if getattr(config, "gather_a", False) else "") + \
                    ("T" if getattr(config, "gather_tma", False) else "") + \
                    ("_c2" if getattr(config, "cluster_n", 1) > 1 else "") + \
                    ("_cm2" if getattr(config, "cluster_m", 1) > 1 else "")
        self.slots = [(s.name, tuple(sfx for sfx, _ in extra_tensors(s))) for s in epilogue.inputs + epilogue.outputs]
        self.b_shape = (G, N, K) if config.b_major == "K" else (G, K, N)
        self.n_tiles = n_tile_count(N, config.tile_n)  # per m-tile row (a gated tile holds both halves)

    def __repr__(self):
        return f"<CompiledGroupedGemm {self.name} regs={self.registers} smem={self.shared_memory_bytes}>"


_CACHE: dict = {}
_LOCK = threading.Lock()


def _fake_ptr(dt_name, align=16):
    return make_ptr(cutlass_dtype(dt_name), 0, cute.AddressSpace.gmem, assumed_align=align)


def _slot_dtypes(epilogue: Epilogue, dtype: str):
    """dtype names of the epilogue's tensor slots: inputs..., outputs... (a quantized output: data, then its
    extra tensors: scales, amax)."""
    out = []
    for s in epilogue.inputs:
        out.append(s.dtype if getattr(s, "dtype", None) is not None else dtype)
    for s in epilogue.outputs:
        out.append(s.dtype if s.dtype is not None else dtype)
        out += [dt for _, dt in extra_tensors(s)]
    return out


def output_problems(epilogue: Epilogue, tile_log: int) -> list[str]:
    """What the epilogue's block-wise outputs need of a logical tile ``tile_log`` columns wide (MXFP8's 32-column
    scale blocks, a row sum's partial blocks): the checks both kernels' config validations share."""
    problems = []
    if any(isinstance(s, MXFP8Output) for s in epilogue.outputs) and tile_log % 32:
        problems.append(f"MXFP8 output: the logical tile ({tile_log} columns) must hold whole 32-column blocks")
    if any(is_fp8_block(s) for s in epilogue.outputs) and tile_log != FP8BlockOutput.block:
        problems.append(f"FP8-block output: the logical tile ({tile_log} columns) must be one 128-column block "
                        f"(a gated FP8 tile 128 x 256, a plain one 128 columns wide)")
    for s in epilogue.outputs:
        if isinstance(s, RowSumOutput) and (tile_log % s.block or s.block % 8):
            problems.append(f"row-sum output {s.name!r}: its blocks ({s.block} columns) must be whole 8-column "
                            f"chunks and tile the logical tile ({tile_log} columns)")
    return problems


def check_config(config: GemmConfig, epilogue: Epilogue, dtype, N: int, K: int, target: str = "sm_90a"):
    """Raise :class:`fusion.errors.KernelConfigError` naming the constraint when the template cannot build
    this kernel (reads no data: cheap)."""
    dtype = _dtype_name(dtype)
    problems = []
    if target != "sm_90a":
        problems.append(f"target {target!r}: only sm_90a is supported")
    if dtype not in ("bfloat16", "float16"):
        problems.append(f"dtype {dtype}: A and B must be bfloat16 or float16")
    problems += cluster_m_problems(config, epilogue.gated)
    if (why := band_problem(config)) is not None:
        problems.append(why)
    if getattr(config, "gather_tma", False):
        if not config.gather_a:
            problems.append("gather_tma loads a gathered A by one TMA box per row: set gather_a=True too")
        if config.cluster_m != 1:
            problems.append("gather_tma shares a gathered A tile along n: use cluster_m = 1 (cluster_n = 1 or 2)")
        if config.tile_m != 128:
            problems.append(f"gather_tma: tile_m = {config.tile_m}: the producer's four warps issue 32 rows each, "
                            "use tile_m = 128")
        if config.tile_k * (2 if dtype in ("bfloat16", "float16") else 1) != 128:
            problems.append(f"gather_tma: tile_k = {config.tile_k} must span one 128-byte swizzle row (64)")
    if config.cluster_n not in (1, 2):
        problems.append(f"cluster_n = {config.cluster_n}: use 1, or 2 (a CTA pair multicasting A)")
    elif config.cluster_n == 2:
        n_tiles = n_tile_count(N, config.tile_n)
        if (config.gather_a and not getattr(config, "gather_tma", False)) or not config.persistent:
            problems.append("cluster_n = 2 multicasts a TMA-loaded A in a persistent kernel: use gather_a=False (or "
                            "gather_tma=True), persistent=True")
        if n_tiles % 2:
            problems.append(f"cluster_n = 2 needs an even number of n-tiles ({n_tiles} at tile_n = {config.tile_n}): "
                            "pick a tile_n that splits N into an even count, or cluster_n = 1")
    if config.tile_m not in (64, 128) or config.tile_n % 16 or not 16 <= config.tile_n <= 256:
        problems.append(f"tile {config.tile_m}x{config.tile_n}: tile_m is 64 or 128, tile_n a multiple of 16 "
                        "up to 256")
    if config.b_major not in ("K", "MN"):
        problems.append(f"b_major {config.b_major!r}: use 'K' (B is (G, N, K)) or 'MN' (B is (G, K, N))")
    if K % 8 != 0:
        problems.append(f"K = {K}: must be a multiple of 8 (16-byte TMA rows of A; gather_a: 16-byte cp.async "
                        "chunks)")
    if config.b_major == "MN" and N % 8 != 0:
        problems.append(f"N = {N}: b_major='MN' needs N % 8 == 0 (16-byte TMA rows of B (G, K, N))")
    paired = any(getattr(s, "paired", False) for s in (*epilogue.inputs, *epilogue.outputs))
    if epilogue.gated:
        if N % 16 != 0:
            problems.append(f"N = {N}: a gated GEMM needs N % 16 == 0 (gate and up halves of 8-column chunks)")
        if config.b_major != "K":
            problems.append("a gated GEMM reads the canonical (G, N, K) weight: use b_major='K' (gated epilogues "
                            "are forward-only; the dgrad of a gated layer is a plain GEMM with b_major='MN')")
        if config.tile_k != 64:
            problems.append(f"tile_k = {config.tile_k}: a gated GEMM loads half B tiles of one 128-byte swizzle "
                            "atom, so tile_k must be 64")
        tile_log = config.tile_n // 2
    else:
        if paired and N % 8 != 0:
            problems.append(f"N = {N}: paired epilogue tensors (M, 2N) need N % 8 == 0 (aligned up half)")
        tile_log = config.tile_n
    problems += output_problems(epilogue, tile_log)
    if problems:
        raise KernelConfigError(f"cannot build the grouped GEMM ({type(epilogue).__name__}, {dtype}, N={N}, "
                                f"K={K}, {config}): " + "; ".join(problems))


def compile_grouped_gemm(config: GemmConfig, epilogue: Epilogue, dtype, N: int, K: int, G: int,
                         target: str = "sm_90a") -> CompiledGroupedGemm:
    """Compile (cached in memory); M (rows) stays dynamic.  B is (G, N, K) for ``config.b_major == "K"``,
    (G, K, N) for ``"MN"``.  A kernel that spills registers at ``config`` is rebuilt at the tile policy's
    fallback when that one does not spill (:func:`fusion.kernels.tile_policy.spill_fallback`): the returned
    kernel's ``.config`` is the one it was built with, ``.requested_config`` is ``config`` (logged at INFO on
    the "fusion.kernels" logger when they differ)."""
    dtype = _dtype_name(dtype)
    check_config(config, epilogue, dtype, N, K, target)
    key = (config, epilogue.cache_key(), dtype, N, K, G, target)
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    res = _compile(config, epilogue, dtype, N, K, G)
    # a spilling kernel: the policy's fallbacks in turn, until one does not spill (else the first is kept)
    tried = config
    while res.frame_size and (fallback := spill_fallback(tried)) is not None:
        tried = fallback
        try:
            check_config(fallback, epilogue, dtype, N, K, target)   # e.g. a CTA pair needs an even n-tile count
        except KernelConfigError:
            continue
        alt_res = _compile(fallback, epilogue, dtype, N, K, G)
        if not alt_res.frame_size:
            log.info("fusion.kernels: %s spills; built at tile_n=%d, stages=%d, cluster_n=%d instead", res.name,
                     fallback.tile_n, fallback.stages, fallback.cluster_n)
            res = alt_res
    res.requested_config = config
    with _LOCK:
        _CACHE[key] = res
    return res


def _compile(config, epilogue, dtype, N, K, G):
    kern = GroupedGemmKernel(config, epilogue, dtype)
    ptrs = tuple(_fake_ptr(d, 4 if d not in ("uint8",) else 1) for d in _slot_dtypes(epilogue, dtype))
    from cutlass.runtime import make_fake_stream
    int_ptr = make_ptr(cutlass.Int32, 0, cute.AddressSpace.gmem, assumed_align=4)
    # (A, B, offsets, tile counter, index, epilogue tensors, M, A's rows, N, K, G, CTAs, stream)
    args = (
        _fake_ptr(dtype), _fake_ptr(dtype), int_ptr, int_ptr, int_ptr,
        ptrs, cutlass.Int32(1), cutlass.Int32(1), N, K, G, cutlass.Int32(1), make_fake_stream(),
    )
    fn, ptx, cubin = compile_kernel(kern, args)
    smem = kern.shared_storage.size_in_bytes() if hasattr(kern, "shared_storage") else None
    return CompiledGroupedGemm(fn, kern, config, epilogue, dtype, N, K, G, ptx, cubin, smem)


def compile_kernel(kern, args: tuple):
    """cute.compile of a kernel object with its (fake) arguments: (function, PTX text, cubin bytes).
    --keep-ptx/--keep-cubin write files, into the working directory unless told otherwise: a temporary folder
    here (the DSL reads both back into memory before returning; the disk cache stores its own copies)."""
    with tempfile.TemporaryDirectory(prefix="fusion-cute-") as dump:
        fn = cute.compile(kern, *args, options=f"{COMPILE_OPTIONS} --dump-dir={shlex.quote(dump)}")
        ptx = getattr(fn, "__ptx__", None)
        cubin = getattr(fn, "__cubin__", None)
    return fn, ptx.decode() if isinstance(ptx, bytes) else ptx, cubin


#: Kernels keep their PTX and cubin (Sequential.compile returns them); TVM-FFI is the launch path. _compile adds
#: a temporary --dump-dir, so that the files never land in the working directory.
COMPILE_OPTIONS = "--enable-tvm-ffi --keep-ptx --keep-cubin"

_SM_COUNT = {}


def _num_sms(idx: int) -> int:
    """SMs of CUDA device `idx` (asked once per device)."""
    count = _SM_COUNT.get(idx)
    if count is None:
        count = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return count


def run_grouped_gemm(compiled: CompiledGroupedGemm, A: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor,
                     outputs: dict, extras: Optional[dict] = None, num_ctas: Optional[int] = None,
                     counter_ptr: Optional[int] = None, index: Optional[torch.Tensor] = None):
    """Launch on torch's current stream.  ``A`` (M, K); ``B`` (G, N, K) when the kernel was built with
    ``b_major="K"``, (G, K, N) with ``"MN"`` (a GroupLinear weight W (G, out, in) is B of the dgrad
    dX = dY @ W[g] as is: K = out, N = in); ``offsets`` (G+1,) int32.  ``outputs``/``extras`` map the
    epilogue's declared names to tensors (MXFP8 outputs: the e4m3 data under its name and the uint8 scales
    under ``name + '_scale'``); paired tensors (M, 2n) / (G, 2n) hold the gate half in columns [0, n) and the
    up half in [n, 2n).  Every tensor must be contiguous on A's device (checked: shapes, 16-byte A/B
    alignment, contiguity; cheap).  No host sync.  ``counter_ptr``: the address of a zeroed int32 that a
    dynamic schedule's tile counter may use (the runtime keeps one per launch in the spare tail of the bounds
    tensor: no extra memset, and nothing allocated outside the call, so CUDA-graph pools stay clean); without
    it a fresh zeroed counter is allocated for the launch.

    A kernel built with ``gather_a`` reads A's rows through ``index`` (required: int32, contiguous, on A's
    device): ``A`` is the (T, K) token matrix, routed row r (the rows ``offsets`` cover) multiplies
    ``A[index[r]]``, M = ``index.numel()`` is every epilogue tensor's row count, and T is independent of M.
    Entries of ``index`` past ``offsets[G]`` are never read; a row whose entry is negative (-1: padding) reads
    zeros, as a gathered copy with zero padding rows would give.

    A caller that launches the same kernel at the same shapes again keeps :func:`bind_grouped_gemm`'s BoundGemm
    instead (the runtime does): this function is that binding and its call."""
    tensors = outputs if not extras else {**outputs, **extras}
    bind_grouped_gemm(compiled, A, B, offsets, index, num_ctas)(A, B, offsets, tensors, counter_ptr, index)


class BoundGemm:
    """A compiled kernel's launch at one call shape (A's and B's shapes, the routed rows M): the shape checks, the
    launch grid and the epilogue's pointer order worked out once by :func:`bind_grouped_gemm`, so that a call only
    checks what reads no data and may change between calls (contiguity, 16-byte alignment, the shapes it was bound
    at), reads the pointers and launches: a few microseconds of host time instead of tens. The runtime keeps one per
    kernel and call shape (fusion/runtime/kernel.py)."""

    __slots__ = ("compiled", "launch", "a_shape", "b_shape", "M", "T", "num_ctas", "names", "dynamic", "gather",
                 "min_offsets")
    # (bound per device too: the runtime's kernels belong to one device's block runner, so no per-call device check)

    def __init__(self, compiled, a_shape, b_shape, M: int, num_ctas: int):
        self.compiled, self.launch = compiled, compiled.launch
        self.a_shape, self.b_shape, self.M, self.T = a_shape, b_shape, M, a_shape[0]
        self.num_ctas = num_ctas
        # the epilogue's tensors in slot order: each slot's tensor, then its extra tensors (scales, amax)
        self.names = tuple(n for name, suffixes in compiled.slots for n in (name, *(name + s for s in suffixes)))
        self.dynamic = compiled.config.dynamic
        self.gather = compiled.config.gather_a
        self.min_offsets = compiled.G + 1

    def __call__(self, A: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor, tensors: dict,
                 counter_ptr: Optional[int] = None, index: Optional[torch.Tensor] = None) -> None:
        """Launch on torch's current stream (see :func:`run_grouped_gemm`); `tensors` maps every epilogue name (and
        a quantized output's suffixed names) to its tensor."""
        a_ptr, b_ptr = A.data_ptr(), B.data_ptr()
        if ((a_ptr | b_ptr) & 15 or A.shape != self.a_shape or B.shape != self.b_shape or not A.is_contiguous()
                or not B.is_contiguous() or offsets.numel() < self.min_offsets):
            _check_operands(self.compiled, A, B, offsets, index)   # raises, naming the problem
            raise ShapeError(f"grouped GEMM {self.compiled.name}: bound at A {tuple(self.a_shape)}, B "
                             f"{tuple(self.b_shape)}, got A {tuple(A.shape)}: bind the kernel at this call's shapes")
        if self.gather:
            if index is None or index.dtype != torch.int32 or not index.is_contiguous() or index.numel() != self.M:
                _gather_index(self.compiled, A, index)   # raises on a missing or bad index
                raise ShapeError(f"grouped GEMM {self.compiled.name}: bound at {self.M} routed rows, got an index "
                                 f"of {index.numel()}: bind the kernel at this call's rows")
            idx_ptr = index.data_ptr()
        elif index is not None:
            _check_operands(self.compiled, A, B, offsets, index)
        else:
            idx_ptr = offsets.data_ptr()  # (the index slot is never read)
        ptrs = bound_epilogue_pointers(f"grouped GEMM {self.compiled.name}", self.names, tensors)
        if self.M == 0:
            return
        counter_ptr, counter = tile_counter(self.dynamic, offsets, A.device, counter_ptr)
        self.launch(a_ptr, b_ptr, offsets.data_ptr(), counter_ptr, idx_ptr, ptrs, self.M, self.T,
                    self.num_ctas, _raw_stream(A.get_device()))
        del counter   # (a fresh counter is freed stream-ordered, after the launch)


def bound_epilogue_pointers(label: str, names: tuple, tensors: dict) -> tuple:
    """A bound launch's epilogue addresses: each of `names` (its slot order) looked up in `tensors`, contiguous
    (else a ShapeError naming `label` and the tensor)."""
    ptrs = []
    for name in names:
        t = tensors[name]
        if not t.is_contiguous():
            raise ShapeError(f"{label}: epilogue tensor {name!r} must be contiguous")
        ptrs.append(t.data_ptr())
    return tuple(ptrs)


def tile_counter(dynamic: bool, offsets: torch.Tensor, device, counter_ptr=None):
    """(address, the tensor behind it) of a launch's tile counter: `counter_ptr` where the caller gives one (None
    behind it), else a fresh zero for a dynamic schedule, which the caller keeps alive until after the launch (its
    memory is then freed stream-ordered); a static schedule reads none (the offsets' address stands in)."""
    if counter_ptr is not None:
        return counter_ptr, None
    counter = torch.zeros(1, dtype=torch.int32, device=device) if dynamic else offsets
    return counter.data_ptr(), counter


def bind_grouped_gemm(compiled: CompiledGroupedGemm, A: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor,
                      index: Optional[torch.Tensor] = None, num_ctas: Optional[int] = None) -> BoundGemm:
    """The launch of `compiled` at A's and B's shapes (and a gathering kernel's index rows), checked once: a
    BoundGemm to call with each call's tensors of those shapes (see :func:`run_grouped_gemm`)."""
    _check_operands(compiled, A, B, offsets, index)
    M = _gather_index(compiled, A, index) if compiled.config.gather_a else A.shape[0]
    num_ctas, _, _ = launch_grid(compiled, M, A.device, offsets, num_ctas, counter_ptr=0)
    return BoundGemm(compiled, tuple(A.shape), tuple(B.shape), M, num_ctas)


def _check_operands(compiled, A: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor,
                    index: Optional[torch.Tensor] = None) -> None:
    """What reads no data: A 2-D of K columns, B of the kernel's shape, both contiguous and 16-byte aligned, G+1
    offsets, and an index exactly where the kernel gathers."""
    cfg = compiled.config
    if A.dim() != 2 or B.shape != compiled.b_shape or A.shape[1] != compiled.K:
        raise ShapeError(f"grouped GEMM {compiled.name}: A must be ({'T' if cfg.gather_a else 'M'}, {compiled.K}) "
                         f"and B {compiled.b_shape} (b_major={cfg.b_major!r}: dims {cfg.b_shape_order}), got "
                         f"A {tuple(A.shape)}, B {tuple(B.shape)}")
    if ((A.data_ptr() | B.data_ptr()) & 15 or not (A.is_contiguous() and B.is_contiguous())
            or offsets.numel() < compiled.G + 1):
        raise ShapeError(f"grouped GEMM {compiled.name}: A and B must be contiguous and 16-byte aligned, and "
                         f"offsets must hold G+1 = {compiled.G + 1} int32 bounds")
    if cfg.gather_a:
        _gather_index(compiled, A, index)
    elif index is not None:
        raise ShapeError(f"grouped GEMM {compiled.name}: got an index, but the kernel reads A's rows in order; "
                         f"build it with GemmConfig(gather_a=True) to gather them")


def _gather_index(compiled, A: torch.Tensor, index: Optional[torch.Tensor]) -> int:
    """The routed row count M of a gather_a launch, after checking its index."""
    if index is None:
        raise ShapeError(f"grouped GEMM {compiled.name} gathers A's rows: pass index= (int32 (M,), the token row "
                         f"of every routed row)")
    if index.dtype != torch.int32:
        raise DTypeError(f"grouped GEMM {compiled.name}: index must be int32, got {index.dtype}: pass "
                         f"index.to(torch.int32)")
    if index.device != A.device:
        raise DeviceError(f"grouped GEMM {compiled.name}: index is on {index.device}, A on {A.device}: move it")
    if not index.is_contiguous():
        raise ShapeError(f"grouped GEMM {compiled.name}: index must be contiguous: pass index.contiguous()")
    return index.numel()


def epilogue_pointers(compiled, outputs: dict, extras: dict) -> tuple:
    """The addresses of the epilogue's tensors in its slot order (a quantized output: data, then its extra
    tensors: scales, amax)."""
    ptrs = []
    for name, suffixes in compiled.slots:
        t = extras[name] if extras is not None and name in extras else outputs[name]
        if not t.is_contiguous():
            raise ShapeError(f"grouped GEMM {compiled.name}: epilogue tensor {name!r} must be contiguous")
        ptrs.append(t.data_ptr())
        for sfx in suffixes:
            ptrs.append(outputs[name + sfx].data_ptr())
    return tuple(ptrs)


def launch_grid(compiled, M: int, dev, offsets, num_ctas=None, counter_ptr=None):
    """(CTAs, tile-counter address, the tensor behind it) of a launch over M rows: persistent kernels get at
    most one CTA per SM (less ``sm_margin``) and per tile. A static schedule reads no counter; a dynamic
    one without ``counter_ptr`` gets a fresh zero, freed (stream-ordered) after the launch: the caller keeps
    the returned tensor alive until then."""
    cfg = compiled.config
    if num_ctas is None:
        n_tiles = ((M + cfg.tile_m - 1) // cfg.tile_m + compiled.G) * compiled.n_tiles
        per_sm = getattr(cfg, "ctas_per_sm", 1)
        num_ctas = max(1, min(per_sm * (_num_sms(dev.index) - cfg.sm_margin), n_tiles)) if cfg.persistent else n_tiles
    pair = cfg.cluster_n * cfg.cluster_m
    num_ctas = max(pair, num_ctas - num_ctas % pair)   # whole CTA pairs
    counter_ptr, counter = tile_counter(cfg.dynamic, offsets, dev, counter_ptr)
    return num_ctas, counter_ptr, counter


#: torch's current raw stream of a device index (a bound launch passes A.get_device(): no torch.device object);
#: absent from a CPU-only torch, where nothing launches
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(dev) -> int:
    """torch's current raw stream on ``dev``, as the integer the TVM-FFI launch takes."""
    return torch._C._cuda_getCurrentRawStream(dev.index if dev.index is not None else torch.cuda.current_device())


def grouped_gemm(A, B, group_sizes=None, offsets=None, epilogue: Optional[Epilogue] = None,
                 extras: Optional[dict] = None, config: Optional[GemmConfig] = None,
                 index: Optional[torch.Tensor] = None):
    """Convenience: allocate outputs, compile (cached) and run.  Returns a dict name -> tensor.  B's layout
    follows ``config.b_major`` (default "K": (G, N, K)).  With ``index`` (int32 (M,)) A is the (T, K) token
    matrix and routed row r multiplies ``A[index[r]]`` (the default config then gathers: :func:`for_gather`)."""
    epilogue = epilogue or IdentityEpilogueDefault
    if offsets is None:
        offsets = offsets_from_group_sizes(group_sizes)
    M = A.shape[0] if index is None else index.numel()
    K = A.shape[1]
    b_major = config.b_major if config is not None else "K"
    G, N = B.shape[0], (B.shape[1] if b_major == "K" else B.shape[2])
    dtype = _dtype_name(A.dtype)
    if config is None:
        config = choose_config(M, N, K, G, epilogue.gated)
        config = for_gather(config) if index is not None else config
    comp = compile_grouped_gemm(config, epilogue, dtype, N, K, G)
    outs = allocate_outputs(epilogue, M, N, dtype, A.device)
    run_grouped_gemm(comp, A, B, offsets, outs, extras, index=index)
    return outs


def allocate_outputs(epilogue: Epilogue, M: int, N: int, dtype: str, device) -> dict:
    """Empty tensors for the epilogue's outputs of a GEMM N wide (logical width N/2 when gated): name ->
    tensor, an MXFP8 output as e4m3 data plus uint8 scales under ``name + '_scale'``; ``dtype`` is what an
    Output without its own dtype stores."""
    n_log = N // 2 if epilogue.gated else N
    outs = {}
    for s in epilogue.outputs:
        w = 2 * n_log if s.paired else n_log
        if isinstance(s, MXFP8Output):
            outs[s.name] = torch.empty(M, w, dtype=torch.float8_e4m3fn, device=device)
            outs[s.scale_name] = torch.empty(M, w // 32, dtype=torch.uint8, device=device)
        elif isinstance(s, FP8BlockOutput):
            outs.update(fp8_block_outputs(s, M, w, device))
        elif isinstance(s, RowSumOutput):
            outs[s.name] = torch.empty(M, s.parts(n_log), dtype=torch.float32, device=device)
        else:
            outs[s.name] = torch.empty(M, w, dtype=_TORCH_DT[s.dtype or dtype], device=device)
    return outs


def fp8_block_outputs(spec: FP8BlockOutput, M: int, n: int, device) -> dict:
    """An FP8-block output's tensors: e4m3 data (M, n), float32 scales (ceil(n / 128), M) k-block-major, and the
    zeroed int32 the kernel's atomic max of the finite amax bits lands in."""
    return {spec.name: torch.empty(M, n, dtype=torch.float8_e4m3fn, device=device),
            spec.scale_name: torch.empty(-(-n // spec.block), M, dtype=torch.float32, device=device),
            spec.amax_name: torch.zeros((), dtype=torch.int32, device=device)}


from .epilogue import IdentityEpilogue as _IE  # noqa: E402

IdentityEpilogueDefault = _IE()
