"""``QuantizedTensor``: a ``torch.Tensor`` wrapper subclass holding MXFP8 / NVFP4 buffers.

Used as an ordinary tensor it behaves as its (rowwise) dequantized value: every torch op other than
the few handled here (``detach``/``alias``, ``clone``, a device-only ``to``) receives the dequantized
tensor and returns a plain tensor. In-place ops on a ``QuantizedTensor`` raise ``TypeError``.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .errors import QuantizationError
from .mxfp8 import MXFP8_BLOCK, mxfp8_dequantize_2d, quantize_mxfp8_buffers
from .nvfp4 import NVFP4_BLOCK, nvfp4_dequantize_2d, nvfp4_global_scale, quantize_nvfp4_buffers

__all__ = ["QuantizedTensor", "quantize", "dequantize", "FORMATS"]

FORMATS = ("mxfp8", "nvfp4")
_OP_NAMES = {"mxfp8": "QuantizeMXFP8", "nvfp4": "QuantizeNVFP4"}
_BLOCKS = {"mxfp8": MXFP8_BLOCK, "nvfp4": NVFP4_BLOCK}

aten = torch.ops.aten


def _rebuild(format, data, scale, amax, shape, dtype, columnwise_data, columnwise_scale):
    return QuantizedTensor(format, data, scale, amax, shape, dtype,
                           columnwise_data=columnwise_data, columnwise_scale=columnwise_scale)


class QuantizedTensor(torch.Tensor):
    """A quantized tensor (``format`` ``"mxfp8"`` or ``"nvfp4"``).

    Attributes (buffers; layouts in ``docs/quantization.md``):

    * ``format``: ``"mxfp8"`` or ``"nvfp4"``.
    * ``data``: rowwise elements of the 2-D view ``(M, K)`` (leading dims flattened), uint8:
      MXFP8 E4M3 codes ``(M, K)``; NVFP4 packed E2M1 ``(M, K // 2)``.
    * ``scale``: rowwise block scales, uint8: MXFP8 E8M0 ``(M, K // 32)``; NVFP4 E4M3 ``(M, K // 16)``.
    * ``amax``: float32 0-dim tensor, max ``|x|`` over the finite elements. (This attribute shadows
      the ``Tensor.amax`` method; ``torch.amax(qt, dim)`` still works.)
    * ``global_scale``: NVFP4 only (``None`` for MXFP8): ``amax / 2688``, or 1 when that is 0.
    * ``columnwise_data``, ``columnwise_scale``: the same for the transpose ``(K, M)``, or ``None``.
    * ``shape`` / ``dtype``: the logical shape and the high-precision dtype it dequantizes to.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, format, data, scale, amax, shape, dtype, columnwise_data=None,
                columnwise_scale=None, requires_grad=False):
        if format not in FORMATS:
            raise QuantizationError(f"QuantizedTensor: unknown format {format!r}; expected one of {FORMATS}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=data.device, requires_grad=requires_grad)
        self._format = format
        self._data = data
        self._scale = scale
        self._amax = amax
        self._columnwise_data = columnwise_data
        self._columnwise_scale = columnwise_scale
        return self

    def __init__(self, *args, **kwargs):  # everything is done in __new__
        pass

    # ------------------------------------------------------------------ buffers
    @property
    def format(self) -> str:
        return self._format

    @property
    def data(self) -> torch.Tensor:  # noqa: D401 -- shadows Tensor.data on purpose (API contract)
        return self._data

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def amax(self) -> torch.Tensor:
        return self._amax

    @property
    def global_scale(self):
        if self._format == "nvfp4":
            return nvfp4_global_scale(self._amax)
        return None

    @property
    def columnwise_data(self):
        return self._columnwise_data

    @property
    def columnwise_scale(self):
        return self._columnwise_scale

    @property
    def block_size(self) -> int:
        return _BLOCKS[self._format]

    def _buffers(self):
        return (self._data, self._scale, self._amax, self._columnwise_data, self._columnwise_scale)

    def _with_buffers(self, fn, requires_grad=False):
        data, scale, amax, cwd, cws = (None if b is None else fn(b) for b in self._buffers())
        return QuantizedTensor(self._format, data, scale, amax, self.shape, self.dtype,
                               columnwise_data=cwd, columnwise_scale=cws, requires_grad=requires_grad)

    # ------------------------------------------------------------------ values
    def dequantize(self, dtype=None, *, columnwise: bool = False) -> torch.Tensor:
        """The value as a plain tensor of ``dtype`` (default: ``self.dtype``), logical shape.

        Computed exactly in float32, then cast. ``columnwise=True`` reads the columnwise copy
        (its blocks run down the columns, so values can differ from the rowwise ones).
        """
        dtype = self.dtype if dtype is None else dtype
        if columnwise:
            if self._columnwise_data is None:
                raise QuantizationError(
                    "QuantizedTensor.dequantize: this tensor has no columnwise copy; quantize with "
                    "columnwise=True")
            data, scale = self._columnwise_data, self._columnwise_scale
        else:
            data, scale = self._data, self._scale
        if self._format == "mxfp8":
            out = mxfp8_dequantize_2d(data, scale, torch.float32)
        else:
            out = nvfp4_dequantize_2d(data, scale, nvfp4_global_scale(self._amax), torch.float32)
        if columnwise:
            out = out.t()
        return out.reshape(self.shape).to(dtype)

    def __repr__(self, *, tensor_contents=None):
        cw = self._columnwise_data is not None
        grad = ""
        if self.grad_fn is not None:
            grad = f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            grad = ", requires_grad=True"
        return (f"QuantizedTensor(format={self._format!r}, shape={tuple(self.shape)}, "
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
        return (_rebuild, (self._format, self._data, self._scale, self._amax, tuple(self.shape),
                           self.dtype, self._columnwise_data, self._columnwise_scale))

    # torch.compile / FakeTensor support
    def __tensor_flatten__(self):
        names = ["_data", "_scale", "_amax"]
        if self._columnwise_data is not None:
            names += ["_columnwise_data", "_columnwise_scale"]
        return names, {"format": self._format, "dtype": self.dtype, "shape": tuple(self.shape)}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return QuantizedTensor(ctx["format"], inner["_data"], inner["_scale"], inner["_amax"],
                               outer_size, ctx["dtype"],
                               columnwise_data=inner.get("_columnwise_data"),
                               columnwise_scale=inner.get("_columnwise_scale"))


class _Quantize(torch.autograd.Function):
    """Quantize in forward; straight-through (identity) gradient in backward."""

    @staticmethod
    def forward(ctx, x, format, columnwise):
        if format == "mxfp8":
            bufs = quantize_mxfp8_buffers(x, columnwise)
        else:
            bufs = quantize_nvfp4_buffers(x, columnwise)
        return QuantizedTensor(format, bufs["data"], bufs["scale"], bufs["amax"], x.shape, x.dtype,
                               columnwise_data=bufs["columnwise_data"],
                               columnwise_scale=bufs["columnwise_scale"])

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, QuantizedTensor):
            grad = grad.dequantize()
        return grad, None, None


def quantize(x: torch.Tensor, format: str, columnwise: bool = True) -> QuantizedTensor:
    """Quantize ``x`` (float32/bf16/fp16, N-D) to ``format`` (``"mxfp8"`` or ``"nvfp4"``).

    Differentiable: the gradient of ``x`` is the incoming gradient unchanged (straight through).
    A ``QuantizedTensor`` input is dequantized first. Raises :class:`QuantizationError` (a
    ``ValueError``) if the last dim (or, with ``columnwise``, the row count) is not a multiple of
    the block size, or the dtype is unsupported.
    """
    if format not in FORMATS:
        raise QuantizationError(f"quantize: unknown format {format!r}; expected one of {FORMATS}")
    if isinstance(x, QuantizedTensor):
        x = _Dequantize.apply(x)
    # validate eagerly (outside autograd) so errors carry the op's message
    from ._common import check_input
    check_input(x, _OP_NAMES[format], format.upper(), _BLOCKS[format], columnwise)
    return _Quantize.apply(x, format, columnwise)


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
