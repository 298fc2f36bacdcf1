"""Host side of the FP8-block quantize kernel (kernels/fp8_quantize.py): checks, output buffers, the launch.

:func:`quantize_fp8_block_device` returns the buffers of ``fusion.quant.fp8_block_quantize_2d`` (and with
``columnwise``, of ``fp8_block_quantize_columnwise``), bit for bit, from one launch on torch's current stream,
with no host synchronisation (``group_sizes`` stays on the device: CUDA graphs capture the call).

Supported: a contiguous 2-D CUDA tensor of bfloat16, float16 or float32, 16-byte aligned, whose rows are whole
16-byte chunks (``K % 8 == 0`` for 16-bit types, ``K % 4 == 0`` for float32), any ``M`` (0 included, below
2^31 - 2^16); ``group_sizes`` a 1-D int32/int64 CUDA tensor of at most 1024 groups (their values are the
caller's contract, as for the reference: non-negative, summing to ``M``; bad values are clamped, never read
out of bounds). Anything else raises a FusionError that says what to change; :func:`unsupported_reason` asks
first, so that a caller can take the reference quantizer instead.
"""
from __future__ import annotations

import sys

import torch

from fusion.errors import DeviceError, DTypeError, GroupSizesError, ShapeError

__all__ = ["quantize_fp8_block_device", "try_quantize_fp8_block_device", "quantize_fp8_block_rowwise_bound",
           "quantize_fp8_block_slots",
           "quantize_fp8_block_rowwise_slots",
           "unsupported_reason", "FP8_BLOCK"]

#: Elements per block (rowwise: 1x128 of a row; columnwise: 128 rows of a group).
FP8_BLOCK = 128
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_SIZES_DTYPES = {torch.int32: "int32", torch.int64: "int64"}
_MAX_ROWS = 2 ** 31 - 2 ** 16
_ALIGN = 16


def _problem(x2d, columnwise: bool, group_sizes):
    """``(error class, message)`` of the first thing the kernel cannot take, or None."""
    from .fp8_quantize import MAX_GROUPS

    if not isinstance(x2d, torch.Tensor):
        return ShapeError, f"expected a torch.Tensor, got {type(x2d).__name__}"
    if x2d.dtype not in _DTYPES:
        return DTypeError, (f"input dtype {x2d.dtype} is not supported; the kernel reads bfloat16, float16 or "
                            f"float32 (cast the input, or quantize with fusion.quant.fp8_block_quantize_2d)")
    if x2d.dim() != 2:
        return ShapeError, f"expected a 2-D (M, K) tensor, got shape {tuple(x2d.shape)} (reshape it to (-1, K))"
    if not x2d.is_cuda:
        return DeviceError, f"the input is on {x2d.device}; the kernel runs on CUDA tensors (move it with .cuda())"
    M, K = x2d.shape
    vec = _ALIGN // x2d.element_size()
    if K % vec:
        return ShapeError, (f"K={K} is not a multiple of {vec} ({x2d.dtype}: rows of whole 16-byte chunks); pad "
                            f"the features or quantize with fusion.quant.fp8_block_quantize_2d")
    if not x2d.is_contiguous():
        return ShapeError, "the input is not contiguous (pass x.contiguous())"
    if x2d.data_ptr() % _ALIGN:
        return ShapeError, "the input does not start on a 16-byte boundary (a sliced view: pass x.clone())"
    if M >= _MAX_ROWS:
        return ShapeError, f"M={M} rows; the kernel indexes rows with 32-bit integers (split the tensor)"
    if columnwise and group_sizes is not None:
        if not isinstance(group_sizes, torch.Tensor) or group_sizes.dim() != 1 or \
                group_sizes.dtype not in _SIZES_DTYPES:
            return GroupSizesError, "group_sizes must be a 1-D int32/int64 tensor (one row count per group)"
        if group_sizes.device != x2d.device:
            return DeviceError, (f"group_sizes is on {group_sizes.device} but the input is on {x2d.device}; keep "
                                 f"the counts on the input's device")
        if not 1 <= group_sizes.numel() <= MAX_GROUPS:
            return GroupSizesError, (f"{group_sizes.numel()} groups; the kernel takes 1..{MAX_GROUPS} (quantize "
                                     f"with fusion.quant.fp8_block_quantize_columnwise)")
    return None


def unsupported_reason(x2d, columnwise: bool = False, group_sizes=None):
    """Why :func:`quantize_fp8_block_device` would refuse these arguments (a message), or None if it takes
    them. Reads shapes, dtypes and devices only (no host sync)."""
    problem = _problem(x2d, columnwise, group_sizes)
    return None if problem is None else problem[1]


def quantize_fp8_block_device(x2d: torch.Tensor, columnwise: bool = False, group_sizes=None):
    """FP8-block quantization of ``x2d`` ``(M, K)`` on its GPU: ``(data, scale, cw_data, cw_scale)``.

    ``data`` uint8 E4M3 ``(M, K)`` and ``scale`` float32 ``(ceil(K/128), M)`` are
    ``fusion.quant.fp8_block_quantize_2d(x2d)``; with ``columnwise``, ``cw_data`` uint8 ``(K, M)`` and
    ``cw_scale`` float32 ``(ceil(M/128) + G, K)`` are ``fp8_block_quantize_columnwise(x2d, group_sizes)``
    (``G = len(group_sizes)``, 1 without), else both are None. One launch on torch's current stream; the
    group offsets are computed on the device. Raises a FusionError for what it does not support (module
    docstring).
    """
    problem = _problem(x2d, columnwise, group_sizes)
    if problem is not None:
        cls, message = problem
        raise cls(f"quantize_fp8_block_device: {message}")
    return _launch(x2d, columnwise, group_sizes)


def try_quantize_fp8_block_device(x2d, columnwise: bool = False, group_sizes=None, amax_bits=None):
    """:func:`quantize_fp8_block_device`'s buffers, or None where the kernel does not take the arguments (the
    caller then quantizes with the reference): one check on a caller's hot path instead of asking first.
    ``amax_bits``: a zeroed int32 CUDA tensor of one element that receives the float32 bits of x's finite amax
    (``fusion.quant.finite_amax``) from the same pass; read it with ``.view(torch.float32)``."""
    if _problem(x2d, columnwise, group_sizes) is not None:
        return None
    return _launch(x2d, columnwise, group_sizes, amax_bits)


#: Read per call: False makes :func:`quantize_fp8_block_rowwise_bound` take the checked path every time (the A/B
#: switch of the launches bound per call shape).
BOUND_ROWWISE = True

#: (rows, K, dtype, device index, the build's switches) -> (launch, grid limit, k-blocks): what a rowwise launch at a
#: shape already checked needs, so a training step's quantizations of x, dY and dH skip the checks, the kernel's
#: compile-once key and the grid lookup (a few microseconds each, three times a step)
_ROWWISE: dict = {}


def quantize_fp8_block_rowwise_bound(x2d):
    """:func:`try_quantize_fp8_block_device`'s rowwise ``(data, scale)`` (no amax), or None where the kernel does
    not take `x2d`: after the first call at a shape, a call checks only that `x2d` is a plain contiguous 16-byte
    aligned 2-D tensor of that shape, dtype and device, allocates the two outputs and launches."""
    if type(x2d) is not torch.Tensor or x2d.dim() != 2 or not x2d.is_cuda:
        return _checked_rowwise(x2d)
    from .fp8_quantize import PAIRS, PIPELINED_ROWWISE

    M, K = x2d.shape
    key = (M, K, x2d.dtype, x2d.get_device(), PAIRS, PIPELINED_ROWWISE)
    bound = _ROWWISE.get(key) if BOUND_ROWWISE else None
    if bound is None or not x2d.is_contiguous() or x2d.data_ptr() & 15 or not M or not K:
        buffers = _checked_rowwise(x2d)
        if buffers is not None and BOUND_ROWWISE and M and K and len(_ROWWISE) < 1024:
            from .fp8_quantize import compile_fp8_quantize

            kernel = compile_fp8_quantize(_DTYPES[x2d.dtype], K, False)
            _ROWWISE[key] = (kernel.launch, _grid_limit(kernel, key[3]), -(-K // FP8_BLOCK))
        return buffers
    launch, grid, nkb = bound
    dev = x2d.device
    data = torch.empty(M, K, dtype=torch.uint8, device=dev)
    scale = torch.empty(nkb, M, dtype=torch.float32, device=dev)
    launch(x2d.data_ptr(), data.data_ptr(), scale.data_ptr(), 0, 0, 0, 0, M, grid,
           torch._C._cuda_getCurrentRawStream(key[3]))
    return data, scale


def rowwise_launch(x2d):
    """The launch :func:`quantize_fp8_block_rowwise_bound` bound for x2d's shape, dtype and device, as
    ``(launch, grid, k_blocks)``, or None where none is bound (no call at that shape yet, or BOUND_ROWWISE off): a
    replayed forward (fusion/runtime/replay.py) calls ``launch(x, data, scale, 0, 0, 0, 0, M, grid, stream)``
    itself, into buffers of its own (data (M, K) uint8, scale (k_blocks, M) float32)."""
    if not BOUND_ROWWISE or type(x2d) is not torch.Tensor or x2d.dim() != 2 or not x2d.is_cuda:
        return None
    from .fp8_quantize import PAIRS, PIPELINED_ROWWISE

    M, K = x2d.shape
    return _ROWWISE.get((M, K, x2d.dtype, x2d.get_device(), PAIRS, PIPELINED_ROWWISE))


def rowwise_switch_sources() -> tuple:
    """The switches that :func:`rowwise_launch`'s binding depends on, as (module, attribute) pairs a replay reads per
    call (it holds for these): the kernel module's where it is imported (any bound launch imported it, so a replay
    built over one always finds it), found without an import statement (a few microseconds each, per call)."""
    here = sys.modules[__name__]
    quantize = sys.modules.get(__package__ + ".fp8_quantize")
    return ((here, "BOUND_ROWWISE"),) + (() if quantize is None else ((quantize, "PAIRS"),
                                                                     (quantize, "PIPELINED_ROWWISE")))


def _checked_rowwise(x2d):
    buffers = try_quantize_fp8_block_device(x2d)
    return None if buffers is None else buffers[:2]


def _launch(x2d: torch.Tensor, columnwise: bool, group_sizes, amax_bits=None):
    """Output buffers and the launch, for checked arguments."""
    M, K = x2d.shape
    dev = x2d.device
    G = 1 if group_sizes is None else group_sizes.numel()
    data = torch.empty(M, K, dtype=torch.uint8, device=dev)
    scale = torch.empty(-(-K // FP8_BLOCK), M, dtype=torch.float32, device=dev)
    cw_data = cw_scale = None
    if columnwise:
        cw_data = torch.empty(K, M, dtype=torch.uint8, device=dev)
        capacity = -(-M // FP8_BLOCK) + G
        # every block is written by the kernel (unused capacity with 0.0); with no rows there is no launch
        cw_scale = (torch.zeros if M == 0 or K == 0 else torch.empty)(capacity, K, dtype=torch.float32, device=dev)
    if M == 0 or K == 0:
        return data, scale, cw_data, cw_scale
    from .fp8_quantize import compile_fp8_quantize

    sizes_dtype = None if group_sizes is None else _SIZES_DTYPES[group_sizes.dtype]
    kernel = compile_fp8_quantize(_DTYPES[x2d.dtype], K, columnwise, G, sizes_dtype, amax_bits is not None)
    index, stream = _device_and_stream(dev)
    kernel.launch(x2d.data_ptr(), data.data_ptr(), scale.data_ptr(),
                  cw_data.data_ptr() if columnwise else 0, cw_scale.data_ptr() if columnwise else 0,
                  group_sizes.data_ptr() if columnwise and group_sizes is not None else 0,
                  0 if amax_bits is None else amax_bits.data_ptr(), M, _grid_limit(kernel, index), stream)
    return data, scale, cw_data, cw_scale


def quantize_fp8_block_rowwise_slots(x2d: torch.Tensor, group_sizes=None, min_ctas: int = 0):
    """``(data, scale, cw_data, cw_scale)``: the rowwise FP8-block copy of ``x2d`` (as
    :func:`quantize_fp8_block_device`) and its columnwise copy in the slot layout (as
    :func:`quantize_fp8_block_slots`) in one launch that reads ``x2d`` once, bit for bit the two launches'.
    ``min_ctas``: the build's CTAs an SM (kernels/fp8_quantize.py ``build_kernel``; 0: its no-spill rule)."""
    return _slots_launch("quantize_fp8_block_rowwise_slots", x2d, group_sizes, True, min_ctas)


def quantize_fp8_block_slots(x2d: torch.Tensor, group_sizes=None):
    """The columnwise FP8-block copy of ``x2d`` ``(M, K)`` in the slot layout of the FP8 weight-gradient kernel
    (kernels/fp8_wgrad.py), and no rowwise copy: ``(cw_data, cw_scale)``, ``cw_data`` uint8 ``(K, 128 * capacity)``
    with block slot ``b`` of column ``k`` at ``cw_data[k, 128 b : 128 b + 128]`` (zeros past the block's rows and
    in unused slots), ``cw_scale`` float32 ``(capacity, K)`` = ``fp8_block_quantize_columnwise(x2d,
    group_sizes)[1]`` (``capacity = ceil(M/128) + G``). Block b's codes are those of the ``(K, M)`` copy's block b,
    bit for bit. One launch, no host sync; a FusionError for what the kernel does not take."""
    return _slots_launch("quantize_fp8_block_slots", x2d, group_sizes, False, 0)[2:]


def _device_and_stream(dev: torch.device):
    """``(device index, torch's current raw stream on it)``."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return index, torch._C._cuda_getCurrentRawStream(index)


_GRID_LIMITS: dict = {}


def _grid_limit(kernel, index: int) -> int:
    """A pipelined build's grid bound on device ``index`` (kernels/fp8_quantize.py ``grid_limit``), worked out once
    per kernel and device: a launch on a training step's hot path pays one dictionary lookup."""
    key = (id(kernel), index)
    limit = _GRID_LIMITS.get(key)
    if limit is None:
        from .api import _num_sms
        from .fp8_quantize import grid_limit

        limit = _GRID_LIMITS[key] = grid_limit(kernel, _num_sms(index))
    return limit


def _slots_launch(caller: str, x2d: torch.Tensor, group_sizes, rowwise: bool, min_ctas: int):
    """``(data, scale, cw_data, cw_scale)`` of one launch of the slot-layout build (``data`` and ``scale`` None
    without ``rowwise``); a FusionError named after ``caller`` for what the kernel does not take."""
    problem = _problem(x2d, True, group_sizes)
    if problem is not None:
        cls, message = problem
        raise cls(f"{caller}: {message}")
    M, K = x2d.shape
    dev = x2d.device
    G = 1 if group_sizes is None else group_sizes.numel()
    capacity = -(-M // FP8_BLOCK) + G
    empty = M == 0 or K == 0
    data = scale = None
    if rowwise:
        data = torch.empty(M, K, dtype=torch.uint8, device=dev)
        scale = torch.empty(-(-K // FP8_BLOCK), M, dtype=torch.float32, device=dev)
    cw_data = (torch.zeros if empty else torch.empty)(K, FP8_BLOCK * capacity, dtype=torch.uint8, device=dev)
    cw_scale = (torch.zeros if empty else torch.empty)(capacity, K, dtype=torch.float32, device=dev)
    if empty:
        return data, scale, cw_data, cw_scale
    from .fp8_quantize import compile_fp8_quantize

    sizes_dtype = None if group_sizes is None else _SIZES_DTYPES[group_sizes.dtype]
    kernel = compile_fp8_quantize(_DTYPES[x2d.dtype], K, True, G, sizes_dtype, False, slots=True, rowwise=rowwise,
                                  min_ctas=min_ctas)
    index, stream = _device_and_stream(dev)
    kernel.launch(x2d.data_ptr(), data.data_ptr() if rowwise else 0, scale.data_ptr() if rowwise else 0,
                  cw_data.data_ptr(), cw_scale.data_ptr(), group_sizes.data_ptr() if group_sizes is not None else 0,
                  0, M, _grid_limit(kernel, index), stream)
    return data, scale, cw_data, cw_scale
