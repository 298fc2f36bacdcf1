"""FP8-block weights: 128x128 blocks, and a cache that re-quantizes only when the parameter changes.

A weight ``W`` of a (Group)Linear, ``(G, N, K)`` (or ``(N, K)``), is quantized in 128x128 blocks of its
last two dims with the FP8-block scale rule (``fusion/quant/fp8_block.py``): one FP32 power-of-two scale
per block, E4M3 elements; edge blocks are partial. The forward GEMM reads ``data`` (``N x K``, K-major);
the input-gradient (dgrad) GEMM needs the weight K-major along N, i.e. the transpose (FP8 wgmma reads both
operands K-major), so the transposed codes are stored too. A 128x128 block maps onto itself under
transposition, so ``data_t`` is exactly ``data`` transposed and ``scale_t`` is ``scale`` transposed.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ._common import SUPPORTED_DTYPES
from .errors import QuantizationError
from .formats import decode_e4m3, encode_e4m3, pow2_f32
from .fp8_block import FP8_BLOCK, fp8_block_scale_exponent

__all__ = ["FP8BlockWeight", "quantize_weight_fp8_block", "quantize_weight_fp8_block_reference", "FP8BlockWeightCache",
           "invalidate_weight_caches", "DEVICE_QUANTIZERS"]

#: Device quantizers tried in order before the torch reference: each ``fn(weight, out)`` returns the four buffers of
#: :class:`FP8BlockWeight` bit for bit (written into ``out``'s where ``out``, an FP8BlockWeight of the weight's
#: shapes, is given), or None where it does not take the weight. The runtime registers the CUDA kernel's
#: (kernels/fp8_weight_quantize_api.py; this layer imports no kernel). Not used inside torch.compile, which traces the
#: reference into its graph.
DEVICE_QUANTIZERS: list = []


class FP8BlockWeight(NamedTuple):
    """The FP8-block buffers of a weight ``(G, N, K)``; for an ``(N, K)`` weight the ``G`` dim is absent.

    data    uint8 E4M3 ``(G, N, K)``, row-major (K-major): the forward GEMM's B operand
    scale   float32 ``(G, ceil(N/128), ceil(K/128))``: ``scale[g, i, j]`` scales
            ``W[g, 128i:128i+128, 128j:128j+128]``
    data_t  uint8 E4M3 ``(G, K, N)``: ``data`` transposed, contiguous (the dgrad GEMM's B operand)
    scale_t float32 ``(G, ceil(K/128), ceil(N/128))``: ``scale`` transposed, contiguous
    """

    data: torch.Tensor
    scale: torch.Tensor
    data_t: torch.Tensor
    scale_t: torch.Tensor

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The ``(G, N, K)`` (or ``(N, K)``) value, exact in float32, then cast."""
        return _dequantize_blocks(self.data, self.scale).to(dtype)

    def dequantize_t(self, dtype=torch.float32) -> torch.Tensor:
        """The transposed ``(G, K, N)`` value from ``data_t`` / ``scale_t`` (equal to ``dequantize().mT``)."""
        return _dequantize_blocks(self.data_t, self.scale_t).to(dtype)


def _spread(per_block: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``(..., nb, kb)`` block values to ``(..., rows, cols)``: each repeated over its (partial) block."""
    *lead, nb, kb = per_block.shape
    b = FP8_BLOCK
    full = per_block[..., :, None, :, None].expand(*lead, nb, b, kb, b).reshape(*lead, nb * b, kb * b)
    return full[..., :rows, :cols]


def _dequantize_blocks(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = data.shape[-2:]
    return decode_e4m3(data) * _spread(scale, rows, cols)


def quantize_weight_fp8_block(weight: torch.Tensor, out: FP8BlockWeight | None = None) -> FP8BlockWeight:
    """Quantize a ``(G, N, K)`` or ``(N, K)`` weight in 128x128 FP8 blocks (see :class:`FP8BlockWeight`): a device
    quantizer's buffers where one takes the weight (:data:`DEVICE_QUANTIZERS`: on a GPU, one launch), else
    :func:`quantize_weight_fp8_block_reference`'s; the same bits either way. ``out``: an earlier quantization of a
    weight of these shapes on this device, whose buffers are rewritten and returned (what a cache keeps: the
    buffers' addresses stay, so a captured CUDA graph reads the new blocks); ignored where it does not fit."""
    if out is not None and not _fits(out, weight):
        out = None
    if DEVICE_QUANTIZERS and isinstance(weight, torch.Tensor) and not torch.compiler.is_compiling():
        for quantizer in DEVICE_QUANTIZERS:
            buffers = quantizer(weight, out)
            if buffers is not None:
                return out if out is not None and buffers[0] is out.data else FP8BlockWeight(*buffers)
    value = quantize_weight_fp8_block_reference(weight)
    if out is None:
        return value
    with torch.no_grad():
        for dst, src in zip(out, value):
            dst.copy_(src)
    return out


def _fits(value: FP8BlockWeight, weight) -> bool:
    """Whether `value`'s buffers can hold `weight`'s quantization: the same shapes, on its device, contiguous."""
    return (isinstance(weight, torch.Tensor) and value.data.shape == weight.shape
            and value.data.device == weight.device and all(t.is_contiguous() for t in value))


def quantize_weight_fp8_block_reference(weight: torch.Tensor) -> FP8BlockWeight:
    """The specification of :func:`quantize_weight_fp8_block`, in torch.

    Scale rule as FP8-block activations: ``2^ceil(log2(block_amax / 448))`` over the block's finite
    elements, 1 for an all-zero block; NaN / Inf elements encode as E4M3 NaN ``0x7F``. Not differentiable
    (the recipe's autograd function gives the weight its gradient).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        what = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise QuantizationError(f"quantize_weight_fp8_block: expected a (G, N, K) or (N, K) weight, got {what}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise QuantizationError(f"quantize_weight_fp8_block: weight dtype {weight.dtype} is not supported; "
                                f"use float32, bfloat16, float16 or float64")
    if weight.dim() == 3 and weight.shape[0] > 1 and not torch.compiler.is_compiling():
        # group by group: the encode's integer temporaries are several times the weight's size, which at MoE
        # scale (e.g. 32 x 4096 x 7168) would not fit next to the weight itself (a compiled graph fuses them)
        G, N, K = weight.shape
        data = torch.empty(G, N, K, dtype=torch.uint8, device=weight.device)
        scale = torch.empty(G, -(-N // FP8_BLOCK), -(-K // FP8_BLOCK), dtype=torch.float32, device=weight.device)
        for g in range(G):
            data[g], scale[g] = _quantize_2d_blocks(weight[g])
    else:
        data, scale = _quantize_2d_blocks(weight)
    return FP8BlockWeight(data, scale, data.mT.contiguous(), scale.mT.contiguous())


def _quantize_2d_blocks(weight: torch.Tensor):
    """``(data, scale)`` of a ``(..., N, K)`` weight: 128x128 blocks of its last two dims."""
    w = weight.detach().to(torch.float32)
    rows, cols = w.shape[-2:]
    nb, kb = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    mag = torch.where(torch.isfinite(w), w.abs(), torch.zeros_like(w))
    padded = torch.nn.functional.pad(mag, (0, kb * FP8_BLOCK - cols, 0, nb * FP8_BLOCK - rows))
    lead = w.shape[:-2]
    block_amax = padded.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK).amax(dim=(-3, -1))
    e = fp8_block_scale_exponent(block_amax)
    return encode_e4m3(w * _spread(pow2_f32(-e), rows, cols)), pow2_f32(e)


# ------------------------------------------------------------------------------------------------------------
# the cache
# ------------------------------------------------------------------------------------------------------------

#: Bumped by invalidate_weight_caches(): every cache re-quantizes.
_GENERATION = [0]
#: Bumped after every optimizer step (a global optimizer hook, installed with the first cache): the caches of
#: parameters that require grad re-quantize. Fused optimizers (``fused=True``) update parameters without bumping
#: their ``_version``, so the version counter alone would let a cache go stale; a parameter that does not require
#: grad gets no gradient, which every optimizer skips, so a frozen weight (a frozen expert, the base weights under
#: an adapter) is quantized once, not after every step of the parameters that train.
_STEPS = [0]
_HOOK = []


def invalidate_weight_caches() -> None:
    """Make every FP8 weight cache re-quantize on its next use. Needed only after writing a parameter in a
    way that bumps neither its version counter nor an optimizer step (e.g. through ``param.data``), or after an
    optimizer updated a parameter that does not require grad (given a gradient by hand)."""
    _GENERATION[0] += 1


#: Every live cache (the optimizer hook re-quantizes those of the parameters it stepped)
_CACHES: "weakref.WeakSet[FP8BlockWeightCache]" = weakref.WeakSet()


def _optimizer_stepped(optimizer=None, *_) -> None:
    """After ``optimizer.step()``: the caches of parameters that require grad go stale (:data:`_STEPS`), and those of
    the parameters this optimizer holds are quantized again now, in place (FP8BlockWeightCache.refresh), so a CUDA
    graph captured over them reads the stepped weights; a cache whose parameter it does not hold as such (a view of
    a flat parameter) is quantized again at its next use, in place too."""
    _STEPS[0] += 1
    groups = getattr(optimizer, "param_groups", None)
    if not groups or not _CACHES or torch.compiler.is_compiling():   # (a compiled step: each cache at its next use)
        return
    held = {id(p) for group in groups for p in group["params"]}
    for cache in list(_CACHES):
        param = cache.param()
        if param is not None and id(param) in held:
            cache.refresh(param)


def _install_optimizer_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_optimizer_stepped))


class FP8BlockWeightCache:
    """The FP8-block quantization of one parameter, recomputed only when the parameter changed.

    The key is the parameter's identity, ``data_ptr``, ``_version`` (moved by every in-place update under
    autograd's version counter, e.g. ``optimizer.step()`` of the for-loop and foreach optimizers), shape,
    strides, dtype, device, a global generation (:func:`invalidate_weight_caches`) and, for a parameter that
    requires grad, the count of optimizer steps (fused optimizers do not move ``_version``; a frozen parameter
    gets no gradient, so no optimizer step changes it). The cache keeps a reference to the storage it quantized, so
    a replaced ``param.data`` cannot hand its address to a new tensor while the entry lives. It is a plain attribute,
    never a buffer: nothing shows up in ``state_dict()``; copies and pickles start empty.
    Inside ``torch.compile`` the weight is quantized in the graph (no Python-side cache there).

    The same parameter is quantized again into the same buffers (its shapes unchanged): their addresses stay, so a
    CUDA graph captured over the block (``torch.cuda.graph``, ``make_graphed_callables``, ``mode="reduce-overhead"``)
    reads the new blocks, and no second copy is allocated beside the stale one. After ``optimizer.step()`` the hook
    quantizes the caches of the parameters that optimizer holds at once (:meth:`refresh`): a replayed graph runs no
    Python, so the next forward could not.
    """

    def __init__(self):
        _install_optimizer_hook()
        _CACHES.add(self)
        self._param = None      # weakref to the parameter
        self._source = None     # the storage quantized (kept alive: see above)
        self._key = None
        self._value = None
        self.misses = 0         # how many times it quantized (tests, explain)

    def get(self, param: torch.Tensor) -> FP8BlockWeight:
        if torch.compiler.is_compiling():
            return quantize_weight_fp8_block(param)
        key = (param.data_ptr(), param._version, param.shape, param.stride(), param.dtype, param.device,
               _GENERATION[0], _STEPS[0] if param.requires_grad else -1)
        if self._value is None or self._param is None or self._param() is not param or self._key != key:
            self._quantize(param, key)
        return self._value

    def param(self):
        """The parameter quantized last, or None (none yet, or gone)."""
        return None if self._param is None else self._param()

    def refresh(self, param: torch.Tensor) -> None:
        """Quantize `param` again now if the cache holds a stale value of it (the optimizer hook's call)."""
        if self._value is not None and param.requires_grad:
            self.get(param)

    def _quantize(self, param: torch.Tensor, key) -> None:
        old = self._value if self.param() is param else None
        if old is None or not _fits(old, param):
            # the stale buffers go first: the new ones can take their memory (a weight's FP8 copies are the size of
            # the bf16 weight itself; held through the quantization they would add that to the step's peak)
            self._value = self._source = old = None
        self._value = quantize_weight_fp8_block(param, out=old)
        self._param, self._source, self._key = weakref.ref(param), param.detach(), key
        self.misses += 1

    def clear(self) -> None:
        self._param = self._source = self._key = self._value = None

    def __deepcopy__(self, memo):
        return FP8BlockWeightCache()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def __repr__(self):
        return f"FP8BlockWeightCache(cached={self._value is not None}, misses={self.misses})"
