"""An fp8_block (Group)Linear on the GPU: the FP8 block-scaled grouped GEMM kernel in place of the recipe's reference.

A device method of the fused runtime (fusion.op_table.DEVICE_METHODS, variant "gemm:fp8_block"): `takes(op, x)`
says whether the kernels run this op on this input, `run(op, x, ctx)` is the forward, `dgrad(op, dy, ctx)` and
`wgrad(op, x, dy, ctx)` the two backward steps (the plan gives every GEMM those two, so a pattern can fuse the
dgrad: patterns/fp8.fpat). The fused FP8 kernels of those patterns read their operands from `operand` and
`weight_operand` here. The math is the recipe of fusion/quant/fp8_linear.py (docs/quantization.md, "FP8-block training
recipe"), which stays the specification and what backend="emulate" and the CPU run:

* fprop ``Y[g] = X_g @ W[g].T``: X quantized 1x128 rowwise (an fp8_block QuantizedTensor input is used as is),
  the weight's cached 128x128 blocks; the FP8 kernel promotes each 128-wide k-block into a float32 accumulator
  with both scales, as the reference's float32 product of the dequantized operands does (summation order aside).
* dgrad ``dX_g = dY_g @ W[g]``: dY quantized 1x128 rowwise (E4M3), the weight's transposed blocks.
* wgrad ``dW[g] = dY_g.T @ X_g``: where ``fp8_linear.wgrad_in_bf16`` says so (read here when the backward runs:
  by default narrow GEMMs and short groups) the high-precision dY and X on our bf16/fp16 varlen-K kernel
  (fusion/runtime/wgrad_gemm.py: every group in one launch, the bf16 block's weight-gradient kernel; measured
  0.77-1.08x torch._grouped_mm's time on MoE shapes), torch._grouped_mm where that does not take the op (a
  Linear); otherwise the recipe's FP8 operands,
  i.e. the columnwise 128-row-block quantizations of dY and X: for a GroupLinear on Hopper (`fp8_wgrad_takes`)
  both quantized by the quantize kernel into the slot layout and multiplied by the FP8 varlen-K kernel
  (kernels/fp8_wgrad.py, every group in one launch, each 128-row block promoted with both scales), elsewhere
  dequantized exactly into the GEMM's dtype (E4M3 times a power of two is exact in bf16/fp16 unless it
  underflows their subnormals) and multiplied in float32 by torch._grouped_mm. Where only the weight gradient
  reads dY after the dgrad (FC1's d(pre-activation)), the dgrad makes both copies and the program keeps only the
  slot copy (`SlotGradient`): dY is freed before the dgrad's GEMM, not after the weight gradient.

The quantizations run on the device with no host sync (group sizes stay on the device), so a call can be
captured in a CUDA graph.
"""
from __future__ import annotations

import os
import sys
from typing import NamedTuple

import torch

from fusion.grouped import group_offsets, grouped_wgrad
from fusion.op_table import device_method_refusal, dtype_name
from fusion.runtime.bounds import row_bounds
from fusion.runtime import kernel as runtime_kernel
from fusion.runtime.kernel import ShapeCache
from fusion.quant import QuantizedTensor, fp8_linear, fp8_weight
from fusion.run_context import RunContext

_COMPILED: dict = {}

#: run and dgrad take `counter`: the address of a zeroed int32 tile counter for the kernel's dynamic scheduler, a
#: slot of the call's bounds buffer that the program gives the step (fusion/runtime/program.py), so a lone FP8
#: GEMM allocates and zeroes none per launch.
TILE_COUNTER = True


def quantize_weight_device(weight, out=None):
    """The FP8-block weight quantize kernel's buffers of `weight` (kernels/fp8_weight_quantize.py: one launch, the
    reference's bits; written into `out`'s, an FP8BlockWeight that fits, where given), or None where it does not
    take it: fusion.quant's device quantizer, so every fp8_block weight cache re-quantizes on the GPU after an
    optimizer step (the torch reference loops over the groups with float32 temporaries: 50-310 ms a weight at MoE
    scale on an H200). ``WEIGHT_KERNEL = False`` leaves it to the reference."""
    if not WEIGHT_KERNEL or type(weight) not in _PLAIN or not weight.is_cuda:   # (a DTensor: the reference's ops)
        return None
    from fusion.kernels.fp8_weight_quantize_api import try_quantize_weight_fp8_block_device

    return try_quantize_weight_fp8_block_device(weight, out)


_PLAIN = (torch.Tensor, torch.nn.Parameter)

#: Read per call: False quantizes FP8-block weights with the torch reference (the A/B switch;
#: FUSION_FP8_WEIGHT_KERNEL=0 at import).
WEIGHT_KERNEL = os.environ.get("FUSION_FP8_WEIGHT_KERNEL", "1") != "0"
if quantize_weight_device not in fp8_weight.DEVICE_QUANTIZERS:
    fp8_weight.DEVICE_QUANTIZERS.append(quantize_weight_device)


def takes(op, x) -> bool:
    """Whether the FP8 kernels run `op` on `x`: a CUDA input in bf16/fp16 (or an fp8_block QuantizedTensor of
    one), no bias, and widths the kernel's 16-byte rows take (in_features % 16, out_features % 16)."""
    if getattr(op, "bias", None) is not None or not x.is_cuda or x.dim() != 2:
        return False
    if type(x) is not torch.Tensor and isinstance(x, QuantizedTensor) and x.format != "fp8_block":
        return False
    if op._parameters["weight"].dtype != x.dtype:
        return False
    # the limits the plan states (fusion.op_table.DEVICE_METHOD_LIMITS), so explain() says what runs; kept per
    # (widths, dtype): every FP8 forward, dgrad and weight gradient asks on every call
    key = (op.in_features, op.out_features, x.dtype)
    refused = _REFUSALS.get(key)
    if refused is None:
        refused = _REFUSALS[key] = device_method_refusal("gemm", "fp8_block", dtype_name(x.dtype),
                                                         key[:2]) is not None
    return not refused


_REFUSALS: dict = {}


def identity_job(N: int, K: int, G: int, dtype: torch.dtype, what: str = "fprop"):
    """The KernelJob of the FP8 GEMM ``(M, K) x (G, N, K) -> (M, N)`` with the identity epilogue (`what` names
    the step in the kernel's name only: the cache key is the same)."""
    from fusion.runtime.kernel import IDENTITY_SOURCE, make_job

    return make_job(IDENTITY_SOURCE, dtype, N, K, G, False, "K", False, f"fp8_{what}", "identity",
                    mainloop="fp8_block")


def _kernel(N: int, K: int, G: int, dtype: torch.dtype, what: str, rows: int):
    """The compiled FP8 GEMM (memory, the disk cache, or compiled now), per shape and per the configuration a call
    over `rows` rows takes (fusion/runtime/kernel.py `for_rows`; `what` only names it)."""
    from fusion.kernels.tile_policy import fp8_single_at, fp8_switches

    key = (N, K, G, dtype, fp8_single_at(rows, G), fp8_single_at(rows, G, two_ctas=True), fp8_switches())
    hit = _COMPILED.get(key)
    if hit is None:
        from fusion.runtime.compile import load_compiled
        from fusion.runtime.kernel import for_rows

        hit = _COMPILED[key] = load_compiled(for_rows(identity_job(N, K, G, dtype, what), rows))
    return hit


def kernel_jobs(op, part: str, dtype: torch.dtype) -> list:
    """The KernelJobs `part` of `op` launches ("forward": fprop, "dgrad"; "wgrad": the bf16/fp16 varlen-K kernel's,
    see `wgrad`; none where the kernel does not take the op at `dtype`, as `takes` decides): what
    Sequential.compile() builds ahead of time (fusion/runtime/aot.py)."""
    w = op.weight
    if device_method_refusal("gemm", "fp8_block", str(dtype).removeprefix("torch."),
                             (op.in_features, op.out_features)) is not None:
        return []
    if part == "wgrad":
        from fusion.quant import fp8_linear
        from fusion.runtime import wgrad_gemm

        jobs = [] if fp8_linear.WGRAD_IN_BF16 is False else wgrad_gemm.kernel_jobs(op, part, dtype)
        # the FP8 kernel where the recipe may take it at some row count (fp8_linear.wgrad_in_bf16)
        fp8 = not fp8_linear.wgrad_in_bf16(w.shape[-2], w.shape[-1], 1 << 40)
        if fp8 and w.dim() == 3 and fp8_wgrad_refusal(op, dtype) is None:
            jobs.append(fp8_wgrad_job(op, dtype))
        return jobs
    from fusion.runtime.kernel import row_variants

    G, N, K = tuple(w.shape) if w.dim() == 3 else (1, *w.shape)
    if part == "forward":
        return row_variants(identity_job(N, K, G, dtype, "fprop"))
    if part == "dgrad":
        return row_variants(identity_job(K, N, G, dtype, "dgrad"))
    return []


def _quantized(x: torch.Tensor, columnwise: bool = False, groups=None):
    """(data, scale, cw_data, cw_scale) of a high-precision 2-D tensor: the quantize kernel
    (fusion/kernels/fp8_quantize.py), bit for bit the reference, which runs where the kernel does not take x."""
    from fusion.kernels.fp8_quantize_api import try_quantize_fp8_block_device

    buffers = try_quantize_fp8_block_device(x, columnwise, groups)
    if buffers is not None:
        return buffers
    from fusion.quant.fp8_block import fp8_block_quantize_2d, fp8_block_quantize_columnwise

    cw = fp8_block_quantize_columnwise(x, groups) if columnwise else (None, None)
    return fp8_block_quantize_2d(x) + cw


def _rowwise(x: torch.Tensor):
    """(data (M, K) uint8 E4M3, scale (ceil(K/128), M) float32) of a high-precision 2-D tensor: the quantize
    kernel's launch bound per call shape (three a training step), else the reference."""
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_rowwise_bound

    buffers = quantize_fp8_block_rowwise_bound(x)
    if buffers is not None:
        return buffers
    from fusion.quant.fp8_block import fp8_block_quantize_2d   # (the kernel declined x: its checks ran already)

    return fp8_block_quantize_2d(x)


#: The lone FP8 GEMMs' launches bound per kernel, rows and device (kernels.fp8_api.BoundFp8Gemm): checked once per
#: call shape, not at every call.
_BOUND = ShapeCache(256)


def _gemm(a, b, bounds, dtype, what: str, counter=None):
    """``out[r] = A[r] @ B[g(r)].T`` for BlockScaled operands, B (G, N, K); `counter`: TILE_COUNTER's address, or
    None (a zeroed one is allocated for the launch)."""
    G, N, K = b.data.shape
    rows, device = a.data.shape[0], a.data.device
    compiled = _kernel(N, K, G, dtype, what, rows)
    out = torch.empty(rows, N, dtype=dtype, device=device)
    if not runtime_kernel.FP8_BOUND_LAUNCHES:   # the A/B switch
        from fusion.kernels.fp8_api import run_fp8_grouped_gemm

        run_fp8_grouped_gemm(compiled, a.data, a.scale, b.data, b.scale, bounds, {"out": out}, counter_ptr=counter)
        return out
    key = (id(compiled), rows, device.index)
    bound = _BOUND.get(key)
    if bound is None or bound.compiled is not compiled:
        from fusion.kernels.fp8_api import bind_fp8_grouped_gemm

        bound = _BOUND.keep(key, bind_fp8_grouped_gemm(compiled, a.data, a.scale, b.data, b.scale, bounds))
    bound(a.data, a.scale, b.data, b.scale, bounds, {"out": out}, counter)
    return out


class Fp8Launch(NamedTuple):
    """An FP8 GEMM step's launch as a call made it (a fused FP8 kernel: fusion/runtime/steps.py FusedForward; or a
    lone FP8 GEMM's: :func:`replay_launch`), bound at that call's shape: what the forward's replay repeats
    (fusion/runtime/replay.py). A is `input`'s FP8 copy: where `quantize`
    is set (the rowwise quantize kernel's launch as kernels.fp8_quantize_api.rowwise_launch bound it) the replay
    quantizes the high-precision input first; else `input` is the FP8-block output of the step before. B is `op`'s
    cached FP8 weight (fusion.quant.fp8_weight), read at each call. `tensors`: the epilogue's tensors in pointer
    order, each ("out", None) for the step's output (its E4M3 codes where `quantized`), ("scale", None) and
    ("amax", None) for a quantized output's scales and amax, ("saved", None) for the value a training kernel
    saves, or ("extra", name) for an extra input of the call."""

    bound: object          # kernels.fp8_api.BoundFp8Gemm
    job: object            # its KernelJob, counted in LAUNCHES as the step's launch; None for a lone GEMM
    input: str
    output: str
    width: int
    op: object             # the fp8_block GEMM op whose quantized weight is B
    tensors: tuple
    slot: int              # its tile counter in the call's buffer
    quantize: tuple | None  # (launch, grid, k_blocks) of the rowwise quantize, or None: A is already FP8
    saved: str | None = None
    saved_width: int = 0
    quantized: bool = False  # the output is FP8-block: codes (M, width), scales (ceil(width / 128), M), amax


def replay_launch(op, x, ctx: RunContext, input: str, output: str):
    """What :func:`run` launched for `x` in the call that just ran, for the forward's replay
    (fusion/runtime/replay.py): an Fp8Launch of the FP8 GEMM bound at x's rows (its tile counter's slot the
    step's to fill in), quantizing a high-precision x first by the rowwise launch bound for its shape; or None where
    a replay cannot repeat it (bounds other than the call's buffer, a launch not bound at these rows, an x that is
    neither plain nor FP8-block)."""
    quantize = None
    if type(x) is torch.Tensor:
        from fusion.kernels.fp8_quantize_api import rowwise_launch

        quantize = rowwise_launch(x)
        if quantize is None:
            return None
    elif not isinstance(x, QuantizedTensor) or x.format != "fp8_block" or x.dim() != 2:
        return None
    bound = _bound_in_call(op, "fprop", x.shape[0], x.dtype, x.device, ctx)
    if bound is None:
        return None
    return Fp8Launch(bound, None, input, output, bound.b_shape[1], op, (("out", None),), 0, quantize)


def _bound_in_call(op, what: str, rows: int, dtype: torch.dtype, device, ctx: RunContext):
    """The launch `_gemm` bound for `op`'s `what` ("fprop" or "dgrad") at `rows`, where a replay can repeat it: the
    bound launches on, the call's bounds buffer as its row bounds, the kernel the policy gives these rows now, the
    plain output alone; else None."""
    if (not runtime_kernel.FP8_BOUND_LAUNCHES or ctx.counters is None
            or row_bounds(op, rows, ctx, device) is not ctx.counters):
        return None
    w = op._parameters["weight"]
    G, out_f, in_f = tuple(w.shape) if w.dim() == 3 else (1, *w.shape)
    N, K = (out_f, in_f) if what == "fprop" else (in_f, out_f)
    compiled = _kernel(N, K, G, dtype, what, rows)
    bound = _BOUND.get((id(compiled), rows, device.index))
    if bound is None or bound.compiled is not compiled or bound.names != ("out",) or not bound.M:
        return None
    return bound


def operand(x):
    """x as an FP8 kernel's A, a BlockScaled (E4M3 codes (M, K), scales (ceil(K/128), M)): an fp8_block
    QuantizedTensor's own rowwise buffers, else its 1x128 rowwise quantization (the kernel on the GPU, the
    reference elsewhere): what the recipe's forward multiplies (fusion/quant/fp8_linear.py)."""
    from fusion.runtime.kernel import BlockScaled

    if isinstance(x, QuantizedTensor):
        if x.format == "fp8_block":
            return BlockScaled(x._data, x.scale)
        x = x.dequantize(torch.float32)  # another format: requantized from its value, as the recipe does
    return BlockScaled(*_rowwise(x if x.is_contiguous() else x.contiguous()))


def weight_operand(op, transposed: bool = False):
    """An fp8_block GEMM's weight as an FP8 kernel's B, a BlockScaled (G, N, K), K-major: its cached 128x128
    blocks (re-quantized only when the parameter changed), transposed (G, in, out) for a dgrad; a Linear's as
    one group."""
    from fusion.runtime.kernel import BlockScaled

    wq = op.quantized_weight()
    data, scale = (wq.data_t, wq.scale_t) if transposed else (wq.data, wq.scale)
    if data.dim() == 2:
        data, scale = data.unsqueeze(0), scale.unsqueeze(0)
    return BlockScaled(data, scale)


def run(op, x, ctx: RunContext, counter: int | None = None) -> torch.Tensor:
    """Y = X @ W[g].T per group, in x's dtype."""
    return _gemm(operand(x), weight_operand(op), row_bounds(op, x.shape[0], ctx, x.device), x.dtype, "fprop",
                 counter)


def dgrad(op, dy: torch.Tensor, ctx: RunContext, counter: int | None = None, quantized=None) -> torch.Tensor:
    """``dX_g = dY_g @ W[g]``: dY quantized 1x128 rowwise (E4M3) times the weight's transposed blocks. `quantized`:
    dY's quantization already made (a BlockScaled: the fused dgrad before wrote it), else this quantizes dY."""
    return dgrad_quantized(op, operand(dy) if quantized is None else quantized, dy.dtype, ctx, counter)


def dgrad_quantized(op, a, dtype: torch.dtype, ctx: RunContext, counter: int | None = None) -> torch.Tensor:
    """`dgrad` from dY's rowwise copy `a` (a BlockScaled) alone, in `dtype` (dY's): the high-precision dY may be
    gone (`quantize_for_backward`)."""
    rows = a.data.shape[0]
    return _gemm(a, weight_operand(op, transposed=True), row_bounds(op, rows, ctx, a.data.device), dtype, "dgrad",
                 counter)


def dgrad_launches(op, dy: torch.Tensor, ctx: RunContext):
    """What :func:`dgrad` launched for a plain `dy` in the call that just ran, for the backward's replay
    (fusion/runtime/backward_replay.py): ``((quantize launch, grid, k_blocks), BoundFp8Gemm)``, dY's rowwise
    quantization as kernels.fp8_quantize_api.rowwise_launch bound it and the FP8 GEMM bound at dY's rows reading
    the call's bounds buffer; or None where either is not bound."""
    from fusion.kernels.fp8_quantize_api import rowwise_launch

    quantize = rowwise_launch(dy)
    bound = None if quantize is None else _bound_in_call(op, "dgrad", dy.shape[0], dy.dtype, dy.device, ctx)
    return None if bound is None else (quantize, bound)


def wgrad_in_bf16_kernel(op, x, dy):
    """fusion/runtime/wgrad_gemm.py's `bound_launch` where :func:`wgrad` hands this call (plain x and dY) to that
    bf16/fp16 varlen-K kernel, as ``fp8_linear.wgrad_in_bf16`` says at dY's rows; else None (the FP8 kernels, or
    torch's GEMM, ran it)."""
    from fusion.runtime import wgrad_gemm

    if type(x) is not torch.Tensor or type(dy) is not torch.Tensor:
        return None
    w = op._parameters["weight"]
    if not fp8_linear.wgrad_in_bf16(w.shape[-2], w.shape[-1], dy.shape[0], w.shape[0] if w.dim() == 3 else 1):
        return None
    return wgrad_gemm.bound_launch if wgrad_gemm.takes(op, x) else None


def replay_switch_sources() -> tuple:
    """The switches read per call that this module's choices in a backward depend on (the weight gradient's
    precision rule, the dgrad's copy of dY for it), as (module, attribute) pairs: a replayed FP8 backward holds for
    these only (fusion/runtime/launch_code.py `LaunchCode.switches`)."""
    here = sys.modules[__name__]
    return ((fp8_linear, "WGRAD_IN_BF16"), (fp8_linear, "FP8_WGRAD_MIN_WIDTH"), (fp8_linear, "FP8_WGRAD_MIN_ROWS"),
            (here, "WGRAD_COPY_IN_DGRAD"), (here, "ONE_PASS_DY_CTAS"))


class SlotGradient(NamedTuple):
    """A GEMM's output gradient dY as its FP8 weight gradient reads it, and nothing more: the columnwise FP8-block
    copy in the slot layout (`data` (N, 128 * capacity) uint8, `scale` (capacity, N) float32; fusion.kernels.
    fp8_quantize_api.quantize_fp8_block_slots), with dY's `rows` and `dtype`. The backward program holds it in
    place of dY once the FP8 dgrad has made both GEMMs' copies (`quantize_for_backward`): the high-precision dY
    (2 bytes an element) is freed before the dgrad's GEMM instead of living through the weight gradient."""

    data: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype


#: An FP8 dgrad whose dY only its op's FP8 weight gradient reads after it makes that GEMM's slot copy of dY too and
#: lets dY go (`quantizes_for_wgrad`); False: each GEMM quantizes dY itself (the A/B's other side, read per call).
WGRAD_COPY_IN_DGRAD = True


def quantizes_for_wgrad(op, x, dy: torch.Tensor, ctx: RunContext) -> bool:
    """Whether this call's FP8 dgrad of `op` should make the weight gradient's copy of dY too and let dY go
    (`quantize_for_backward`): the weight wants a gradient, `fp8_linear.wgrad_in_bf16` takes FP8 at
    this call's rows per group, and the FP8 varlen-K kernel takes the op and its saved input `x` (None: not at
    hand yet, so no)."""
    from fusion.quant import fp8_linear

    w = op.weight
    if not WGRAD_COPY_IN_DGRAD or x is None or not w.requires_grad or w.dim() != 3:
        return False
    if getattr(op, "bias", None) is not None:
        return False
    if fp8_linear.wgrad_in_bf16(w.shape[-2], w.shape[-1], dy.shape[0], w.shape[0]):
        return False
    return fp8_wgrad_takes(op, x, dy, ctx.group_sizes)


#: CTAs an SM of the quantize kernel's rowwise + slots build, which `quantize_for_backward` launches once (a bf16
#: dY read once for both copies) where this is set; 0: two launches, the rowwise-only and the slots-only builds
#: (FUSION_FP8_ONE_PASS_DY_CTAS, read at import; read per call, so bench/ab_switch.py can flip it). Value at a time
#: that build needed up to 138 registers a thread, so its no-spill rule built it for one CTA an SM and 2 (the
#: default) forced two, spilling 16 bytes; tested a bf16 pair at a time (kernels/fp8_quantize.py COLUMN_PAIRS,
#: session ah) the rule gives it two with no spill, the kernel that forcing two builds. Measured on an H200 (session ag, bench/probes/quantize_one_pass_ab.py, the same bytes): Mixtral's
#: FC1 dY (16384 x 28672) 0.778 ms against 0.880 for the two launches (1.111 at one CTA an SM), Llama-3-70B's
#: (8192 x 57344) 0.749 against 0.859; the FP8 steps (bench/ab_switch.py, three rounds of 100 steps) -0.8% Mixtral-8x7B,
#: -0.4% Llama-3-70B, -0.4% Llama-3-8B.
ONE_PASS_DY_CTAS = int(os.environ.get("FUSION_FP8_ONE_PASS_DY_CTAS", "2"))


def quantize_for_backward(dy: torch.Tensor, ctx: RunContext):
    """``(rowwise BlockScaled, SlotGradient)`` of a GEMM's output gradient: the dgrad's 1x128 rowwise copy
    (`operand`) and the weight gradient's per-group columnwise copy in the slot layout, each bit for bit what the
    two GEMMs quantize from dY on their own: one launch of the quantize kernel's rowwise + slots build, which reads
    a bf16 dY once, at :data:`ONE_PASS_DY_CTAS` CTAs an SM (11-13% faster than the two launches of the rowwise-only
    and slots-only builds, which other dtypes and ``ONE_PASS_DY_CTAS = 0`` take)."""
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_rowwise_slots, quantize_fp8_block_slots
    from fusion.runtime.kernel import BlockScaled

    if ONE_PASS_DY_CTAS and dy.dtype == torch.bfloat16 and dy.is_contiguous():
        data, scale, cw_data, cw_scale = quantize_fp8_block_rowwise_slots(dy, ctx.group_sizes, ONE_PASS_DY_CTAS)
        return BlockScaled(data, scale), SlotGradient(cw_data, cw_scale, dy.shape[0], dy.dtype)
    rowwise = operand(dy)
    cw_data, cw_scale = quantize_fp8_block_slots(dy, ctx.group_sizes)
    return rowwise, SlotGradient(cw_data, cw_scale, dy.shape[0], dy.dtype)


def wgrad(op, x, dy: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """``dW[g] = dY_g.T @ X_g`` at the saved input `x` (what the forward saw), in the weight's dtype: with
    ``fp8_linear.wgrad_in_bf16`` (read now) the high-precision operands, else the recipe's columnwise FP8 copies:
    the FP8 varlen-K kernel (`fp8_wgrad_takes`), or dequantized exactly into torch._grouped_mm."""
    from fusion.quant import fp8_linear

    if isinstance(dy, SlotGradient):   # the FP8 dgrad quantized dY for this GEMM too (`quantize_for_backward`)
        return _fp8_weight_gradient(op, x, dy, ctx).to(op.weight.dtype)
    dy = dy if dy.is_contiguous() else dy.contiguous()
    dtype = dy.dtype
    w = op.weight
    if fp8_linear.wgrad_in_bf16(w.shape[-2], w.shape[-1], dy.shape[0], w.shape[0] if w.dim() == 3 else 1):
        from fusion.runtime import wgrad_gemm

        a, b = dy, (_dequantize_rowwise(x, dtype) if isinstance(x, QuantizedTensor) else x.contiguous())
        if wgrad_gemm.takes(op, b):
            return wgrad_gemm.wgrad(op, b, a, ctx)
    else:
        groups = None if op.weight.dim() == 2 else ctx.group_sizes
        if fp8_wgrad_takes(op, x, dy, groups):
            return _fp8_weight_gradient(op, x, dy, ctx).to(op.weight.dtype)
        a, b = _columnwise_operand(dy, groups, dtype), _columnwise_operand(x, groups, dtype)
    return _weight_gradient(op, a, b, ctx).to(op.weight.dtype)


def fp8_wgrad_refusal(op, dtype: torch.dtype) -> str | None:
    """Why the FP8 varlen-K kernel cannot compute `op`'s weight gradient at `dtype` (a reason), or None: a
    GroupLinear in bf16/fp16, widths that are multiples of 8, at most 1024 groups (the quantize kernel's)."""
    w = op._parameters["weight"]
    if w.dim() != 3:
        return "a Linear (one group): torch's matmul of the dequantized columnwise copies"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}: the kernel stores bfloat16 or float16"
    G, out_f, in_f = w.shape
    if out_f % 8 or in_f % 8:
        return f"widths ({out_f}, {in_f}): the kernel takes multiples of 8"
    if G > 1024:
        return f"{G} groups: the quantize kernel takes at most 1024"
    return None


def fp8_wgrad_takes(op, x, dy: torch.Tensor, groups) -> bool:
    """Whether the FP8 varlen-K kernel computes this call's weight gradient: a CUDA dY and x (high precision or
    fp8_block) on a Hopper GPU, group sizes on the device, and `fp8_wgrad_refusal` None."""
    from fusion.targets import cuda_major

    if not dy.is_cuda or dy.dim() != 2 or groups is None or cuda_major(dy.device) != 9:
        return False
    if isinstance(x, QuantizedTensor) and x.format != "fp8_block":
        return False
    return fp8_wgrad_refusal(op, dy.dtype) is None


def fp8_wgrad_job(op, dtype: torch.dtype):
    """The KernelJob of the FP8 varlen-K kernel for `op`'s weight gradient dW (G, out, in) at `dtype`."""
    import dataclasses

    from fusion.kernels.tile_policy import choose_fp8_wgrad_config
    from fusion.runtime.compile import KernelJob

    G, out_f, in_f = op._parameters["weight"].shape
    return KernelJob(step="wgrad", variant="wgrad", source="",
                     config=dataclasses.astuple(choose_fp8_wgrad_config(out_f, in_f, G)),
                     dtype=str(dtype).removeprefix("torch."), N=in_f, K=out_f, G=G, target="sm_90a",
                     mainloop="fp8_varlen_k")


def _fp8_weight_gradient(op, x, dy, ctx: RunContext) -> torch.Tensor:
    """``dW[g] = dY_g.T @ X_g`` from the columnwise FP8-block copies of dY and X in the slot layout (the quantize
    kernel, no rowwise copy; dY's already made where `dy` is a SlotGradient), by the FP8 varlen-K kernel:
    (G, out, in) in dY's dtype. An fp8_block x gives its own columnwise copy where it has one for these groups
    (moved into the slot layout), else it is requantized from its value (its rowwise copy dequantized exactly), as
    the recipe does."""
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_slots
    from fusion.kernels.fp8_wgrad_api import run_fp8_varlen_k_gemm
    from fusion.runtime.compile import load_compiled

    from fusion.kernels.tile_policy import choose_fp8_wgrad_config

    dtype = dy.dtype
    G, out_f, in_f = op.weight.shape
    # the policy's tile is in the key: a switch may change it (the job is built only on a miss)
    key = ("fp8_wgrad", (G, out_f, in_f), dtype, choose_fp8_wgrad_config(out_f, in_f, G))
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _COMPILED[key] = load_compiled(fp8_wgrad_job(op, dtype))
    groups = ctx.group_sizes
    if isinstance(dy, SlotGradient):
        a_data, a_scale, rows, device = dy.data, dy.scale, dy.rows, dy.data.device
    else:
        (a_data, a_scale), rows, device = quantize_fp8_block_slots(dy, groups), dy.shape[0], dy.device
    if isinstance(x, QuantizedTensor) and x.columnwise_data is not None and x.group_sizes is groups:
        from fusion.quant.fp8_block import fp8_block_columnwise_slots

        b_data, b_scale = fp8_block_columnwise_slots(x.columnwise_data, groups), x.columnwise_scale
    else:
        xv = _dequantize_rowwise(x, dtype) if isinstance(x, QuantizedTensor) else x
        b_data, b_scale = quantize_fp8_block_slots(xv if xv.is_contiguous() else xv.contiguous(), groups)
    dw = torch.empty(op.weight.shape, dtype=dtype, device=device)
    run_fp8_varlen_k_gemm(compiled, a_data, a_scale, b_data, b_scale, row_bounds(op, rows, ctx, device), dw)
    return dw


def _dequantize_rowwise(q: QuantizedTensor, dtype) -> torch.Tensor:
    """``q.dequantize(dtype)`` in two passes: the codes cast to `dtype` (exact: E4M3 is in bf16/fp16) and one
    broadcast multiply by the block scales (a partial last block's scale repeated over its columns). In bf16
    (float32's exponent range, so every power-of-two scale is exact) torch multiplies in float32 and rounds once,
    which is what the reference's float32 decode followed by its cast does: the same bits. fp16 takes the
    reference (a scale past fp16's range is not exact there)."""
    data, scale = q._data, q.scale
    if dtype != torch.bfloat16 or data.dim() != 2:
        return q.dequantize(dtype)
    M, K = data.shape
    codes = data.view(torch.float8_e4m3fn).to(dtype)
    s = scale.t().to(dtype)
    if K % 128 == 0:
        return (codes.view(M, K // 128, 128) * s[:, :, None]).view(M, K)
    return codes * s.repeat_interleave(128, dim=1)[:, :K]


def _columnwise_operand(t, groups, dtype) -> torch.Tensor:
    """The value the FP8 wgrad multiplies: t's columnwise FP8-block quantization (128-row blocks per group),
    dequantized exactly into `dtype`; a QuantizedTensor's own columnwise copy when it has one for these groups."""
    from fusion.quant.fp8_block import fp8_block_dequantize_columnwise

    # row-major (M, K): torch._grouped_mm reads a column-major operand only with 16-byte aligned group starts
    if isinstance(t, QuantizedTensor):
        if t.columnwise_data is not None and t.group_sizes is groups:
            return t.dequantize(dtype, columnwise=True).contiguous()
        t = t.dequantize(torch.float32)  # exact (the reference requantizes the float32 rowwise value)
    _, _, data, scale = _quantized(t, True, groups)
    return fp8_block_dequantize_columnwise(data, scale, groups, dtype).contiguous()


def _weight_gradient(op, dy: torch.Tensor, x: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """``dW[g] = dy_g.T @ x_g`` ((G, N, K); (N, K) for a Linear) by torch._grouped_mm (float32 accumulation)."""
    if op.weight.dim() == 2:
        return dy.t() @ x
    ends = ctx.offsets if ctx.offsets is not None else group_offsets(ctx.group_sizes)
    return grouped_wgrad(dy, x, ends, op.weight.shape)
