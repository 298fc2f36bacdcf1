"""The FP8-block GEMM recipe of a (Group)Linear with ``weight_format="fp8_block"``: the reference.

Forward, dgrad and wgrad each take FP8 operands (``docs/quantization.md``, "FP8-block training recipe"):

* fprop  ``Y[g] = X_g @ W[g].T``: X 1x128 rowwise FP8-block (a high-precision input is quantized first; an
  ``fp8_block`` QuantizedTensor is used as is), W in 128x128 blocks.
* dgrad  ``dX_g = dY_g @ W[g]``: dY quantized 1x128 rowwise (E4M3, as TE), the weight's transposed
  128x128 copy ``data_t`` (K-major along N).
* wgrad  ``dW[g] = dY_g.T @ X_g``: the columnwise copies of dY and X, 128-row blocks per group, so the
  reduction over the rows of one group reads whole blocks of that group only. Where :func:`wgrad_in_bf16`
  says so (:data:`WGRAD_IN_BF16`), the wgrad reads the high-precision dY and X instead.

The reference dequantizes every operand exactly and multiplies in float32 (float64 for float64 inputs),
then casts to the input's dtype: the FP8 kernels are tested against it.
"""

from __future__ import annotations

import torch

from .fp8_block import (fp8_block_dequantize_2d, fp8_block_dequantize_columnwise, fp8_block_quantize_2d,
                        fp8_block_quantize_columnwise)
from .fp8_weight import FP8BlockWeight, _dequantize_blocks, quantize_weight_fp8_block
from .tensor import QuantizedTensor, dequantize

__all__ = ["WGRAD_IN_BF16", "FP8_WGRAD_MIN_WIDTH", "FP8_WGRAD_MIN_ROWS", "wgrad_in_bf16", "fp8_block_linear",
           "fp8_block_dgrad", "fp8_block_wgrad"]

#: Module-level switch, read when the forward runs (the reference) or the backward (the GPU runtime): True computes
#: every weight gradient from the high-precision dY and X (a bf16 GEMM for bf16 blocks), False from their FP8
#: columnwise copies, "auto" (the default) chooses per GEMM and call by :func:`wgrad_in_bf16`'s cost rule.
WGRAD_IN_BF16 = "auto"
#: The rule's constants, measured on an H200 (docs/quantization.md, "FP8 weight gradients"; bench/bench_fp8_wgrad.py):
#: the two columnwise quantizations (dY's and X's, one pass each over M x width) cost about 360 / h of the bf16
#: weight gradient's time, h = out * in / (out + in) the GEMM's harmonic width (their bytes grow with out + in, the
#: GEMM's FLOPs with out * in); the FP8 varlen-K kernel takes 0.77-0.83 of its time from 2048 rows per group and
#: 0.85-0.94 below. FP8 wins where both terms leave a margin: h >= 2400 and 2048 rows per group or more.
FP8_WGRAD_MIN_WIDTH = 2400
FP8_WGRAD_MIN_ROWS = 2048


def wgrad_in_bf16(out_features: int, in_features: int, rows: int, groups: int = 1) -> bool:
    """Whether the weight gradient of an fp8_block GEMM (out_features x in_features, `rows` rows over `groups`
    groups) runs on the high-precision dY and X (True) or on their FP8 columnwise copies (False), per
    :data:`WGRAD_IN_BF16`: "auto" takes FP8 where the GEMM is wide enough for the two quantizations to pay off
    (harmonic width >= FP8_WGRAD_MIN_WIDTH) and its groups long enough for the FP8 kernel's tiles (rows per group
    >= FP8_WGRAD_MIN_ROWS)."""
    if WGRAD_IN_BF16 != "auto":
        return bool(WGRAD_IN_BF16)
    width = out_features * in_features / max(out_features + in_features, 1)
    return not (width >= FP8_WGRAD_MIN_WIDTH and rows >= FP8_WGRAD_MIN_ROWS * max(groups, 1))


# ------------------------------------------------------------------------------------------------------------
# grouped products over consecutive row groups
# ------------------------------------------------------------------------------------------------------------

def _group_of_rows(group_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    ends = torch.cumsum(group_sizes.to(torch.int64), 0)
    r = torch.arange(rows, dtype=torch.int64, device=group_sizes.device)
    return torch.searchsorted(ends, r, right=True)


def _sync_free(device: torch.device) -> bool:
    """Whether the grouped products must not read the sizes on the host: under torch.compile, and on any
    GPU (the contract: no op copies group_sizes to the host there, so CUDA graphs can capture it). On the
    CPU eager path reading them is free."""
    return torch.compiler.is_compiling() or device.type != "cpu"


def _rows_times(a: torch.Tensor, b: torch.Tensor, group_sizes) -> torch.Tensor:
    """``out[r] = a[r] @ b[g(r)].T`` for ``a (M, K)``, ``b (G, N, K)`` (or ``(N, K)`` without groups)."""
    if group_sizes is None:
        return a @ (b if b.dim() == 2 else b[0]).T
    M, G = a.shape[0], b.shape[0]
    if _sync_free(a.device):
        # One dense product per group, each masked to its rows with where() (a NaN/Inf row of another
        # group never leaks in): G times the work of the grouped GEMM, no host sync.
        g_of = _group_of_rows(group_sizes, M).unsqueeze(1)
        out = a.new_zeros(M, b.shape[1])
        for g in range(G):
            out = torch.where(g_of == g, a @ b[g].T, out)
        return out
    parts = [ag @ b[g].T for g, ag in enumerate(torch.split(a, group_sizes.tolist()))]
    return torch.cat(parts, 0) if parts else a.new_zeros(0, b.shape[1])


def _group_outer(dy: torch.Tensor, x: torch.Tensor, group_sizes, num_groups: int) -> torch.Tensor:
    """``dW[g] = dy_g.T @ x_g`` (zero for an empty group): ``(G, N, K)``; ``(N, K)`` without groups."""
    if group_sizes is None:
        return dy.T @ x
    M = dy.shape[0]
    if _sync_free(dy.device):
        g_of = _group_of_rows(group_sizes, M).unsqueeze(1)
        parts = []
        for g in range(num_groups):
            mask = g_of == g
            parts.append(torch.where(mask, dy, 0.0).T @ torch.where(mask, x, 0.0))
        return torch.stack(parts)
    out = dy.new_zeros(num_groups, dy.shape[1], x.shape[1])
    for g, (dg, xg) in enumerate(zip(torch.split(dy, group_sizes.tolist()), torch.split(x, group_sizes.tolist()))):
        if dg.shape[0]:
            out[g] = dg.T @ xg
    return out


# ------------------------------------------------------------------------------------------------------------
# the recipe
# ------------------------------------------------------------------------------------------------------------

def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _input_operand(x, group_sizes, want_columnwise: bool):
    """x's FP8-block buffers: ``(data, scale)`` rowwise and ``(cw_data, cw_scale)`` columnwise (None unless
    wanted). Computed outside the autograd function: the quantization is straight-through, and torch.compile
    traces a QuantizedTensor's attributes there (not inside an autograd.Function)."""
    if isinstance(x, QuantizedTensor) and x.format == "fp8_block":
        data, scale = x._data, x.scale
        if not want_columnwise:
            return data, scale, None, None
        if x.columnwise_data is not None and x.group_sizes is group_sizes:
            return data, scale, x.columnwise_data, x.columnwise_scale
        # no columnwise copy with these groups: quantize the only value there is, the rowwise one
        return (data, scale) + fp8_block_quantize_columnwise(fp8_block_dequantize_2d(data, scale), group_sizes)
    hp = x.dequantize(torch.float32) if isinstance(x, QuantizedTensor) else x.detach()
    hp = hp.reshape(-1, hp.shape[-1]).to(torch.float32)
    data, scale = fp8_block_quantize_2d(hp)
    if not want_columnwise:
        return data, scale, None, None
    return (data, scale) + fp8_block_quantize_columnwise(hp, group_sizes)


class _FP8BlockLinearFunction(torch.autograd.Function):
    """y = x @ W.T per group with FP8-block operands; the backward follows the recipe above.

    ``x`` is the plain high-precision input (it only routes the gradient, and feeds the bf16 wgrad); the
    FP8 operands come in as buffers.
    """

    @staticmethod
    def forward(ctx, x, weight, group_sizes, x_data, x_scale, x_cw_data, x_cw_scale,
                w_data, w_scale, w_data_t, w_scale_t, wgrad_bf16):
        out_dtype = x.dtype
        cdt = _compute_dtype(out_dtype)
        lead = tuple(x.shape[:-1])
        rowwise = fp8_block_dequantize_2d(x_data, x_scale).to(cdt)
        y = _rows_times(rowwise, _dequantize_blocks(w_data, w_scale).to(cdt), group_sizes).to(out_dtype)
        hp = x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] and wgrad_bf16 else None
        ctx.save_for_backward(group_sizes, w_data_t, w_scale_t, x_cw_data, x_cw_scale, hp)
        ctx.meta = (out_dtype, weight.dtype, tuple(weight.shape), lead, wgrad_bf16)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        group_sizes, w_data_t, w_scale_t, cw_data, cw_scale, hp = ctx.saved_tensors
        x_dtype, w_dtype, w_shape, lead, wgrad_bf16 = ctx.meta
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _dgrad(dy2d, w_data_t, w_scale_t, group_sizes, x_dtype)
            dx = dx.reshape(*lead, dx.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = _wgrad(dy2d, hp, cw_data, cw_scale, group_sizes, w_shape, x_dtype).to(w_dtype)
        return (dx, dw) + (None,) * 10


def _dgrad(dy2d, w_data_t, w_scale_t, group_sizes, dtype, quantized=None) -> torch.Tensor:
    """``dX_g = dY_g @ W[g]``: dY quantized 1x128 rowwise (E4M3), the weight's transposed blocks. `quantized`:
    (codes, scales) of that quantization already made (by a fused dgrad's epilogue), else made here."""
    cdt = _compute_dtype(dtype)
    dy_data, dy_scale = fp8_block_quantize_2d(dy2d.to(torch.float32)) if quantized is None else quantized
    dyq = fp8_block_dequantize_2d(dy_data, dy_scale).to(cdt)
    return _rows_times(dyq, _dequantize_blocks(w_data_t, w_scale_t).to(cdt), group_sizes).to(dtype)


def _wgrad(dy2d, hp, cw_data, cw_scale, group_sizes, w_shape, dtype) -> torch.Tensor:
    """``dW[g] = dY_g.T @ X_g`` (w_shape, float32/float64): from the high-precision X `hp` when given (the bf16
    wgrad), else from the columnwise copies of dY (quantized here) and X (`cw_data`, `cw_scale`)."""
    cdt = _compute_dtype(dtype)
    groups = w_shape[0] if len(w_shape) == 3 else 1
    if hp is not None:
        return _group_outer(dy2d.to(cdt), hp.to(cdt), group_sizes, groups).reshape(w_shape)
    dcw_data, dcw_scale = fp8_block_quantize_columnwise(dy2d.to(torch.float32), group_sizes)  # 128-row blocks
    dyc = fp8_block_dequantize_columnwise(dcw_data, dcw_scale, group_sizes).to(cdt)
    xc = fp8_block_dequantize_columnwise(cw_data, cw_scale, group_sizes).to(cdt)
    return _group_outer(dyc, xc, group_sizes, groups).reshape(w_shape)


def fp8_block_dgrad(dy: torch.Tensor, quantized_weight: FP8BlockWeight, group_sizes=None,
                    quantized=None) -> torch.Tensor:
    """The recipe's input gradient of ``x @ W[g].T`` for a 2-D ``dy`` (M, N), in dy's dtype: what the backward
    of :func:`fp8_block_linear` computes, for a runtime that runs the GEMM's dgrad as its own step. `quantized`:
    ``(codes, scales)`` of dY's 1x128 rowwise quantization where a fused dgrad's epilogue already made it (the
    recipe's own, bit for bit: fusion/dataflow.py `quantizes_dgrad_operand`)."""
    q = None if quantized is None else tuple(quantized)
    return _dgrad(dy, quantized_weight.data_t, quantized_weight.scale_t, group_sizes, dy.dtype, q)


def fp8_block_wgrad(dy: torch.Tensor, x, weight: torch.Tensor, group_sizes=None) -> torch.Tensor:
    """The recipe's weight gradient of ``x @ W[g].T`` (weight's shape and dtype) for 2-D ``dy`` and ``x`` (high
    precision or an fp8_block QuantizedTensor): the high-precision operands where :func:`wgrad_in_bf16` says so
    (read now), else their columnwise FP8-block copies (x's own when it carries them for these groups)."""
    if wgrad_in_bf16(weight.shape[-2], weight.shape[-1], dy.shape[0], weight.shape[0] if weight.dim() == 3 else 1):
        hp, cw_data, cw_scale = dequantize(x), None, None
    else:
        hp = None
        _, _, cw_data, cw_scale = _input_operand(x, group_sizes, True)
    return _wgrad(dy, hp, cw_data, cw_scale, group_sizes, tuple(weight.shape), dy.dtype).to(weight.dtype)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, group_sizes=None,
                     quantized_weight: FP8BlockWeight | None = None) -> torch.Tensor:
    """The FP8-block reference of ``x @ W[g].T`` per group (no bias).

    ``x``: ``(M, K)`` high precision or a QuantizedTensor (``(..., K)`` without groups); ``weight``:
    ``(G, N, K)`` with ``group_sizes`` (``(G,)`` on x's device), or ``(N, K)`` without;
    ``quantized_weight``: its :func:`quantize_weight_fp8_block` (from a cache), computed here if None.
    Differentiable in ``x`` (straight through a QuantizedTensor) and ``weight``; returns x's dtype.
    :data:`WGRAD_IN_BF16` is read here, when the forward runs (:func:`wgrad_in_bf16`).
    """
    wq = quantized_weight if quantized_weight is not None else quantize_weight_fp8_block(weight)
    rows = x.numel() // max(x.shape[-1], 1)
    wgrad_bf16 = wgrad_in_bf16(weight.shape[-2], weight.shape[-1], rows, weight.shape[0] if weight.dim() == 3 else 1)
    needs_wgrad = torch.is_grad_enabled() and weight.requires_grad
    x_data, x_scale, cw_data, cw_scale = _input_operand(x, group_sizes, needs_wgrad and not wgrad_bf16)
    x_in = dequantize(x) if isinstance(x, QuantizedTensor) else x
    return _FP8BlockLinearFunction.apply(x_in, weight, group_sizes, x_data, x_scale, cw_data, cw_scale,
                                         wq.data, wq.scale, wq.data_t, wq.scale_t, wgrad_bf16)
