"""``QuantizedTensor``: a ``torch.Tensor`` wrapper subclass holding MXFP8 / NVFP4 / FP8-block buffers.

Used as an ordinary tensor it behaves as its (rowwise) dequantized value: every torch op other than
the few handled here (``detach``/``alias``, ``clone``, a device-only ``to``) receives the dequantized
tensor and returns a plain tensor. In-place ops on a ``QuantizedTensor`` raise ``TypeError``.
It is a traceable wrapper subclass (``__tensor_flatten__`` / ``__tensor_unflatten__``): torch.compile
traces through it, and a compiled function may take or return one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import tree_map

from .blocks import columnwise_capacity
from .errors import QuantizationError
from .fp8_block import FP8_BLOCK, dequantize_fp8_block_buffers, quantize_fp8_block_buffers
from .mxfp8 import MXFP8_BLOCK, dequantize_mxfp8_buffers, quantize_mxfp8_buffers
from .nvfp4 import NVFP4_BLOCK, dequantize_nvfp4_buffers, nvfp4_global_scale, quantize_nvfp4_buffers

__all__ = ["QuantizedTensor", "quantize", "dequantize", "FORMATS", "FormatSpec"]


@dataclass(frozen=True)
class FormatSpec:
    """What the generic code needs to know about one format."""

    op_name: str
    display: str
    block: int
    #: (x, columnwise, group_sizes, op_name) -> dict of buffers
    quantize_buffers: Callable
    #: (data, scale, amax, M, K, columnwise, group_sizes) -> float32 (M, K)
    dequantize_buffers: Callable
    #: (M, K) -> the rowwise scale's shape
    rowwise_scale_shape: Callable


FORMATS = {
    "mxfp8": FormatSpec("QuantizeMXFP8", "MXFP8", MXFP8_BLOCK, quantize_mxfp8_buffers, dequantize_mxfp8_buffers,
                        lambda M, K: (M, K // MXFP8_BLOCK)),
    "nvfp4": FormatSpec("QuantizeNVFP4", "NVFP4", NVFP4_BLOCK, quantize_nvfp4_buffers, dequantize_nvfp4_buffers,
                        lambda M, K: (M, K // NVFP4_BLOCK)),
    "fp8_block": FormatSpec("QuantizeFP8Block", "FP8-block", FP8_BLOCK, quantize_fp8_block_buffers,
                            dequantize_fp8_block_buffers, lambda M, K: (-(-K // FP8_BLOCK), M)),
}

aten = torch.ops.aten


def _rebuild(format, data, scale, amax, shape, dtype, columnwise_data, columnwise_scale, group_sizes=None):
    return QuantizedTensor(format, data, scale, amax, shape, dtype, columnwise_data=columnwise_data,
                           columnwise_scale=columnwise_scale, group_sizes=group_sizes)


def _rows_and_features(shape) -> tuple:
    K = shape[-1] if len(shape) else 1
    M = 1
    for d in shape[:-1]:
        M *= d
    return M, K


class QuantizedTensor(torch.Tensor):
    """A quantized tensor (``format`` ``"mxfp8"``, ``"nvfp4"`` or ``"fp8_block"``).

    Attributes (buffers; layouts in ``docs/quantization.md``):

    * ``format``: ``"mxfp8"``, ``"nvfp4"`` or ``"fp8_block"``.
    * ``data``: rowwise elements of the 2-D view ``(M, K)`` (leading dims flattened), uint8:
      MXFP8 / FP8-block E4M3 codes ``(M, K)``; NVFP4 packed E2M1 ``(M, K // 2)``.
    * ``scale``: rowwise block scales: MXFP8 uint8 E8M0 ``(M, K // 32)``; NVFP4 uint8 E4M3 ``(M, K // 16)``;
      FP8-block float32 ``(ceil(K / 128), M)`` (k-block-major).
    * ``amax``: float32 0-dim tensor, max ``|x|`` over the finite elements. (This attribute shadows
      the ``Tensor.amax`` method; ``torch.amax(qt, dim)`` still works.)
    * ``global_scale``: NVFP4 only (``None`` otherwise): ``amax / 2688``, or 1 when that is 0.
    * ``columnwise_data``, ``columnwise_scale``: the copy whose blocks run down the rows of each group, or
      ``None``: data ``(K, M)`` (NVFP4 ``(K, ceil(M / 2))``), scales k-block-major
      ``(ceil(M / block) + G, K)``.
    * ``group_sizes``: the row groups of the columnwise blocks (on the device), or ``None`` (one group).
    * ``shape`` / ``dtype``: the logical shape and the high-precision dtype it dequantizes to.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, format, data, scale, amax, shape, dtype, columnwise_data=None,
                columnwise_scale=None, requires_grad=False, group_sizes=None):
        if format not in FORMATS:
            raise QuantizationError(
                f"QuantizedTensor: unknown format {format!r}; expected one of {tuple(FORMATS)}")
        _check_layout(format, tuple(shape), scale, columnwise_data, columnwise_scale, group_sizes)
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=data.device, requires_grad=requires_grad)
        # Plain instance attributes, not properties: torch.compile (dynamo) reads instance attributes of a
        # traceable subclass but cannot wrap what a property getter returns. `data` alone is a property
        # (it must shadow Tensor.data); inside a compiled function read `_data` (dynamo resolves `.data` to
        # the wrapper's own Tensor.data).
        self._data = data
        self.format = format
        self.scale = scale
        self.amax = amax  # shadows the Tensor.amax method (API contract); torch.amax(qt, dim) still works
        self.columnwise_data = columnwise_data
        self.columnwise_scale = columnwise_scale
        self.group_sizes = group_sizes if columnwise_data is not None else None
        self.block_size = FORMATS[format].block
        self.global_scale = nvfp4_global_scale(amax) if format == "nvfp4" else None
        return self

    def __init__(self, *args, **kwargs):  # everything is done in __new__
        pass

    @property
    def data(self) -> torch.Tensor:  # noqa: D401 -- shadows Tensor.data on purpose (API contract)
        return self._data

    _BUFFER_NAMES = ("_data", "scale", "amax", "columnwise_data", "columnwise_scale", "group_sizes")

    def _with_buffers(self, fn, requires_grad=False):
        data, scale, amax, cwd, cws, gs = (None if getattr(self, n) is None else fn(getattr(self, n))
                                           for n in self._BUFFER_NAMES)
        return QuantizedTensor(self.format, data, scale, amax, self.shape, self.dtype, columnwise_data=cwd,
                               columnwise_scale=cws, requires_grad=requires_grad, group_sizes=gs)

    # ------------------------------------------------------------------ values
    def dequantize(self, dtype=None, *, columnwise: bool = False) -> torch.Tensor:
        """The value as a plain tensor of ``dtype`` (default: ``self.dtype``), logical shape.

        Computed exactly in float32, then cast. ``columnwise=True`` reads the columnwise copy
        (its blocks run down the rows of each group, so values can differ from the rowwise ones).
        """
        dtype = self.dtype if dtype is None else dtype
        if columnwise:
            if self.columnwise_data is None:
                raise QuantizationError(
                    "QuantizedTensor.dequantize: this tensor has no columnwise copy; quantize with "
                    "columnwise=True")
            data, scale = self.columnwise_data, self.columnwise_scale
        else:
            data, scale = self._data, self.scale
        M, K = _rows_and_features(tuple(self.shape))
        out = FORMATS[self.format].dequantize_buffers(data, scale, self.amax, M, K, columnwise,
                                                       self.group_sizes)
        return out.reshape(self.shape).to(dtype)

    def __repr__(self, *, tensor_contents=None):
        cw = self.columnwise_data is not None
        grad = ""
        if self.grad_fn is not None:
            grad = f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            grad = ", requires_grad=True"
        return (f"QuantizedTensor(format={self.format!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device}, columnwise={cw}{grad},\n"
                f"  value={self.dequantize()!r})")

    __str__ = __repr__

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._with_buffers(lambda b: b)
        if func is aten.clone.default:
            return args[0]._with_buffers(lambda b: b.clone())
        if func is aten._to_copy.default:
            src = args[0]
            dtype = kwargs.get("dtype")
            device = kwargs.get("device")
            if dtype is None or dtype == src.dtype:
                nb = kwargs.get("non_blocking", False)
                return src._with_buffers(
                    lambda b: b.to(device if device is not None else b.device, non_blocking=nb))
            return src.dequantize(dtype).to(device if device is not None else src.device)
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(value, QuantizedTensor):
                    raise TypeError(
                        f"QuantizedTensor is immutable: {func} would write into it; dequantize() "
                        f"first to get a plain tensor")

        def unwrap(t):
            return t.dequantize() if isinstance(t, QuantizedTensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    # ------------------------------------------------------------------ copying / pickling
    def __deepcopy__(self, memo):
        out = self._with_buffers(lambda b: b.clone(), requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self.format, self._data, self.scale, self.amax, tuple(self.shape),
                           self.dtype, self.columnwise_data, self.columnwise_scale, self.group_sizes))

    # torch.compile / FakeTensor support: the inner tensors are the buffers that are present; the rest is
    # constant metadata (format, dtype).
    def __tensor_flatten__(self):
        names = [n for n in self._BUFFER_NAMES if getattr(self, n) is not None]
        return names, (self.format, self.dtype)

    def _stable_hash_for_caching(self) -> str:
        """The compile cache key of this subclass's metadata (torch's AOT autograd cache)."""
        inner = [(n, tuple(t.shape), tuple(t.stride()), t.dtype) for n in self._BUFFER_NAMES
                 if (t := getattr(self, n)) is not None]
        return repr(("QuantizedTensor", self.format, self.dtype, tuple(self.shape), self.requires_grad, inner))

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        format, dtype = meta
        return QuantizedTensor(format, inner["_data"], inner["scale"], inner["amax"], outer_size, dtype,
                               columnwise_data=inner.get("columnwise_data"),
                               columnwise_scale=inner.get("columnwise_scale"),
                               group_sizes=inner.get("group_sizes"))


def _check_layout(format, shape, scale, columnwise_data, columnwise_scale, group_sizes):
    """Refuse buffers whose scale shapes do not match the documented layouts (e.g. the columnwise scales
    of an older, ungrouped layout), instead of dequantizing them wrongly."""
    spec = FORMATS[format]
    M, K = _rows_and_features(shape)
    want = spec.rowwise_scale_shape(M, K)
    if tuple(scale.shape) != tuple(want):
        raise QuantizationError(f"QuantizedTensor: {format} rowwise scale has shape {tuple(scale.shape)}, "
                                f"expected {tuple(want)} for a logical ({M}, {K}) tensor (docs/quantization.md)")
    if (columnwise_data is None) != (columnwise_scale is None):
        raise QuantizationError("QuantizedTensor: columnwise_data and columnwise_scale come together")
    if columnwise_scale is not None:
        G = 1 if group_sizes is None else group_sizes.shape[0]
        want = (columnwise_capacity(M, spec.block, G), K)
        if tuple(columnwise_scale.shape) != want:
            raise QuantizationError(
                f"QuantizedTensor: {format} columnwise scale has shape {tuple(columnwise_scale.shape)}, "
                f"expected {want}: k-block-major, capacity ceil(M/{spec.block}) + G blocks per feature, "
                f"blocks per group of group_sizes (docs/quantization.md)")


class _Quantize(torch.autograd.Function):
    """Quantize in forward; straight-through (identity) gradient in backward."""

    @staticmethod
    def forward(ctx, x, format, columnwise, group_sizes):
        spec = FORMATS[format]
        bufs = spec.quantize_buffers(x, columnwise, group_sizes, spec.op_name)
        return QuantizedTensor(format, bufs["data"], bufs["scale"], bufs["amax"], x.shape, x.dtype,
                               columnwise_data=bufs["columnwise_data"],
                               columnwise_scale=bufs["columnwise_scale"], group_sizes=group_sizes)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, QuantizedTensor):
            grad = grad.dequantize()
        return grad, None, None, None


def quantize(x: torch.Tensor, format: str, columnwise: bool = True, group_sizes=None) -> QuantizedTensor:
    """Quantize ``x`` (float32/bf16/fp16/float64, N-D) to ``format`` (``"mxfp8"``, ``"nvfp4"``,
    ``"fp8_block"``).

    Differentiable: the gradient of ``x`` is the incoming gradient unchanged (straight through).
    A ``QuantizedTensor`` input is dequantized first. ``group_sizes`` (an int tensor on x's device, summing
    to the rows of the 2-D view) splits the rows into groups for the columnwise blocks; ``None`` is one
    group. Raises :class:`QuantizationError` if the last dim is not a multiple of the block size (MXFP8,
    NVFP4), or the dtype is unsupported.
    """
    if format not in FORMATS:
        raise QuantizationError(f"quantize: unknown format {format!r}; expected one of {tuple(FORMATS)}")
    if isinstance(x, QuantizedTensor):
        x = _Dequantize.apply(x)
    # validate eagerly (outside autograd) so errors carry the op's message
    from ._common import check_group_sizes, check_input

    spec = FORMATS[format]
    check_input(x, spec.op_name, spec.display, spec.block, whole_blocks=format != "fp8_block")
    check_group_sizes(group_sizes, x, spec.op_name)
    return _Quantize.apply(x, format, bool(columnwise), group_sizes)


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q):
        return q.dequantize()

    @staticmethod
    def backward(ctx, grad):
        return grad


def dequantize(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """``x.dequantize(dtype)`` for a :class:`QuantizedTensor` (differentiable, straight through);
    any other tensor is returned as is (cast to ``dtype`` when given)."""
    if isinstance(x, QuantizedTensor):
        out = _Dequantize.apply(x)
        return out if dtype is None else out.to(dtype)
    return x if dtype is None else x.to(dtype)


# The per-format entry points: thin wrappers of quantize(), here so the format modules need not import this one.
def quantize_mxfp8(x: torch.Tensor, columnwise: bool = True, group_sizes=None):
    """Quantize ``x`` to MXFP8; returns a :class:`~fusion.quant.QuantizedTensor` (straight-through
    gradient). ``group_sizes`` splits the rows into groups for the columnwise blocks. Raises
    :class:`~fusion.quant.QuantizationError` on a bad shape or dtype."""
    return quantize(x, "mxfp8", columnwise=columnwise, group_sizes=group_sizes)


def quantize_nvfp4(x: torch.Tensor, columnwise: bool = True, group_sizes=None):
    """Quantize ``x`` to NVFP4; returns a :class:`~fusion.quant.QuantizedTensor` (straight-through
    gradient). ``group_sizes`` splits the rows into groups for the columnwise blocks. Raises
    :class:`~fusion.quant.QuantizationError` on a bad shape or dtype."""
    return quantize(x, "nvfp4", columnwise=columnwise, group_sizes=group_sizes)


def quantize_fp8_block(x: torch.Tensor, columnwise: bool = True, group_sizes=None):
    """Quantize ``x`` to FP8-block (1x128 blocks, FP32 power-of-two scales); returns a
    :class:`~fusion.quant.QuantizedTensor` (straight-through gradient). ``group_sizes`` splits the rows into
    groups for the columnwise blocks."""
    return quantize(x, "fp8_block", columnwise=columnwise, group_sizes=group_sizes)
