"""A bf16/fp16 GroupLinear's weight gradient on Hopper: the varlen-K grouped GEMM in place of torch._grouped_mm.

A device method of the fused runtime (fusion.op_table.DEVICE_METHODS, variant "gemm", part "wgrad"):
``dW[g] = dY_g.T @ X_g`` for every group at once, the group row bounds read on the device (no host sync), an empty
group's gradient zeros. The kernel (kernels/varlen_k_gemm.py) loads both operands by TMA, a CTA pair sharing X's
tile by multicast; its tile comes from kernels/tile_policy.py `choose_wgrad_config`, by the call's rows per group
(128x192 pingpong tiles where each group's rows make only a few k-steps, wide tiles elsewhere).

Why ours and not torch's: measured on an H100 (bench/bench_wgrad.py, bench/results/H100-2026-11-24-wgrad.json) at
0.77-1.08x torch._grouped_mm's time on the expert GEMMs of eight MoE models (faster on 9 of 16, within 3% on 5,
slower by 8% at worst, Qwen3-30B-A3B's FC1), and 0.88-0.90x at a small batch; one launch with integer arguments
costs less host time than torch's grouped GEMM. torch._grouped_mm stays the reference (backend="emulate", the
CPU), and runs wherever `takes` refuses the op.
"""
from __future__ import annotations

import torch

from fusion.kernels.tile_policy import choose_wgrad_config, wgrad_configs
from fusion.op_table import gemm_refusal
from fusion.run_context import RunContext
from fusion.runtime.bounds import row_bounds
from fusion.targets import cuda_major

#: The kernel's static schedule reads no tile counter.
TILE_COUNTER = False

_COMPILED: dict = {}


def takes(op, x) -> bool:
    """Whether the kernel computes `op`'s weight gradient at input `x`: a CUDA bf16/fp16 tensor of the weight's
    dtype (or a QuantizedTensor of one: it reads the dequantized values, as torch's path does) on a Hopper GPU, a
    GroupLinear (a bias gradient is the wgrad step's per-group sum either way), widths the kernel's 16-byte rows
    take (multiples of 8)."""
    if not x.is_cuda or x.dim() != 2 or op.weight.dtype != x.dtype:
        return False
    if cuda_major(x.device) != 9:
        return False
    # the limits the plan states (fusion.op_table.DEVICE_METHOD_LIMITS), so explain() says what runs
    return gemm_refusal(op, str(x.dtype).removeprefix("torch.")) is None


def _job(op, dtype: torch.dtype, config):
    from fusion.runtime.kernel import make_wgrad_job

    G, out_f, in_f = op.weight.shape
    return make_wgrad_job(dtype, out_f, in_f, G, "", "wgrad", config=config)


def _config(op, rows: int | None):
    """The tile policy's configuration for `op`'s weight gradient over `rows` routed rows (its choice depends on
    rows per group: kernels/tile_policy.py WGRAD_PINGPONG_ROWS)."""
    G, out_f, in_f = op.weight.shape
    return choose_wgrad_config(out_f, in_f, G, rows=rows)


def kernel_jobs(op, part: str, dtype: torch.dtype) -> list:
    """The KernelJobs of `op`'s weight gradient ("wgrad"; none for other parts or where the kernel does not take
    the op at `dtype`), one per configuration the tile policy may choose at some row count: what
    Sequential.compile() builds ahead of time (fusion/runtime/aot.py)."""
    if part != "wgrad" or gemm_refusal(op, str(dtype).removeprefix("torch.")) is not None:
        return []
    G, out_f, in_f = op.weight.shape
    return [_job(op, dtype, config) for config in wgrad_configs(out_f, in_f, G)]


def wgrad(op, x: torch.Tensor, dy: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """dW (G, out, in) in the weight's dtype: one launch over every group, at the tile for this call's rows per
    group (the routed row count is known on the host; the group sizes are not read)."""
    from fusion.kernels.wgrad_api import run_varlen_k_gemm
    from fusion.quant import dequantize

    # kept per row count: the tile policy (about 5 µs) runs once per (shape, dtype, rows), not per call; the kernel
    # of a tile is loaded once (load_compiled keeps it by its key)
    key = (tuple(op.weight.shape), x.dtype, x.shape[0])
    compiled = _COMPILED.get(key)
    if compiled is None:
        from fusion.runtime.compile import load_compiled

        compiled = _COMPILED[key] = load_compiled(_job(op, x.dtype, _config(op, x.shape[0])))
    x = dequantize(x)
    x = x if x.is_contiguous() else x.contiguous()
    dy = dy if dy.is_contiguous() else dy.contiguous()
    dw = torch.empty(op.weight.shape, dtype=x.dtype, device=x.device)
    run_varlen_k_gemm(compiled, dy, x, row_bounds(op, x.shape[0], ctx, x.device), dw)
    return dw
