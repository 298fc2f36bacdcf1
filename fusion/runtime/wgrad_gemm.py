"""A bf16/fp16 GroupLinear's weight gradient on Hopper: the varlen-K grouped GEMM in place of torch._grouped_mm.

A device method of the fused runtime (fusion.op_table.DEVICE_METHODS, variant "gemm", part "wgrad"):
``dW[g] = dY_g.T @ X_g`` for every group at once, the group row bounds read on the device (no host sync), an empty
group's gradient zeros. The kernel (kernels/varlen_k_gemm.py) loads both operands by TMA, a CTA pair sharing X's
tile by multicast; its tile comes from kernels/tile_policy.py `choose_wgrad_config`, by the call's rows per group
(128x192 pingpong tiles where each group's rows make only a few k-steps, wide tiles elsewhere).

After a Gather (an MoE FC1, whose input the forward does not keep: it is x's rows through the routing index), the
kernel reads x's rows through the index itself where kernels/tile_policy.py `gather_in_wgrad` says so (many rows per
group), so the regathered copy of x is never written; elsewhere the runtime regathers x first (fusion/runtime/
gather.py) and the kernel reads both operands by TMA.

Why ours and not torch's: measured on an H100 (bench/bench_wgrad.py, bench/results/H100-2026-11-24-wgrad.json) at
0.77-1.08x torch._grouped_mm's time on the expert GEMMs of eight MoE models (faster on 9 of 16, within 3% on 5,
slower by 8% at worst, Qwen3-30B-A3B's FC1), and 0.88-0.90x at a small batch; one launch with integer arguments
costs less host time than torch's grouped GEMM. torch._grouped_mm stays the reference (backend="emulate", the
CPU), and runs wherever `takes` refuses the op: a one-group GroupLinear (fusion.op_table.WGRAD_RULE; a dense GEMM,
torch's dense matmul through fusion.grouped.DENSE_MM, 1.8% faster on Llama-3-8B's step on an H200 with torch 2.11;
torch._grouped_mm on large grouped weights was 0.4-4.9% slower there: docs/benchmarks.md, session u).
"""
from __future__ import annotations

import torch

from fusion.kernels.tile_policy import (WGRAD_GATHER_ROWS, choose_wgrad_config, gather_dy, gather_in_wgrad,
                                        wgrad_configs, wgrad_switches)
from fusion.op_table import WGRAD_RULE, dtype_name, gemm_refusal
from fusion.quant import dequantize
from fusion.run_context import RunContext
from fusion.runtime.bounds import row_bounds
from fusion.runtime.kernel import ShapeCache
from fusion.targets import cuda_major

#: Fewer groups than this take torch's GEMM (fusion.op_table.WGRAD_RULE: one group is a dense GEMM, where cuBLAS
#: measured faster); 1: our kernel for every GroupLinear. Read per call (bench/ab_switch.py flips it).
MIN_GROUPS = WGRAD_RULE["min_groups"]

#: The kernel's static schedule reads no tile counter.
TILE_COUNTER = False

#: Bound launches (kernels.wgrad_api.BoundVarlenK) per call shape
_BOUND = ShapeCache(256)


def takes(op, x) -> bool:
    """Whether the kernel computes `op`'s weight gradient at input `x`: a CUDA bf16/fp16 tensor of the weight's
    dtype (or a QuantizedTensor of one: it reads the dequantized values, as torch's path does) on a Hopper GPU, a
    GroupLinear (a bias gradient is the wgrad step's per-group sum either way), widths the kernel's 16-byte rows
    take (multiples of 8), and at least :data:`MIN_GROUPS` groups."""
    weight = op._parameters["weight"]
    if not x.is_cuda or x.dim() != 2 or weight.dtype != x.dtype or vendor_runs(weight):
        return False
    if cuda_major(x.get_device()) != 9:
        return False
    # the limits the plan states (fusion.op_table.DEVICE_METHOD_LIMITS), so explain() says what runs
    return gemm_refusal(op, dtype_name(x.dtype)) is None


def vendor_runs(weight) -> bool:
    """Whether the weight's gradient goes to torch's GEMM: fewer groups than :data:`MIN_GROUPS`."""
    return weight.shape[0] < MIN_GROUPS


def _job(op, dtype: torch.dtype, config):
    from fusion.runtime.kernel import make_wgrad_job

    G, out_f, in_f = op.weight.shape
    gather = ("a" if config.gather_a else "") + ("b" if config.gather_b else "")
    return make_wgrad_job(dtype, out_f, in_f, G, gather, "wgrad", config=config)


def _config(op, rows: int | None, gathered: bool = False, dy_gathered: bool = False):
    """The tile policy's configuration for `op`'s weight gradient over `rows` routed rows (its choice depends on
    rows per group: kernels/tile_policy.py WGRAD_PINGPONG_ROWS); `gathered`: x read through the index;
    `dy_gathered`: dY read through it."""
    G, out_f, in_f = op.weight.shape
    return choose_wgrad_config(out_f, in_f, G, gather_a=dy_gathered, gather_b=gathered, rows=rows)


def kernel_jobs(op, part: str, dtype: torch.dtype, gathered: bool = False, dy_gathered: bool = False) -> list:
    """The KernelJobs of `op`'s weight gradient ("wgrad"; none for other parts or where the kernel does not take
    the op at `dtype`), one per configuration the tile policy may choose at some row count, and with `gathered`
    (the op follows a Gather) the one that reads x through the index (`gathers`), with `dy_gathered` (a Combine
    follows it) the one that reads dY through it (`gathers_dy`): what Sequential.compile() builds ahead of time
    (fusion/runtime/aot.py)."""
    if part != "wgrad" or gemm_refusal(op, str(dtype).removeprefix("torch.")) is not None or vendor_runs(op.weight):
        return []
    G, out_f, in_f = op.weight.shape
    jobs = [_job(op, dtype, config) for config in wgrad_configs(out_f, in_f, G)]
    many = WGRAD_GATHER_ROWS * G
    if gathered and gather_in_wgrad(in_f, G, many):
        jobs.append(_job(op, dtype, _config(op, many, gathered=True)))
    if dy_gathered and gather_dy(G, many, in_f):
        jobs.append(_job(op, dtype, _config(op, many, dy_gathered=True)))
    return jobs


def gathers(op, rows: int) -> bool:
    """Whether `op`'s weight gradient over `rows` routed rows reads x's rows through the routing index (a GroupLinear
    after a Gather: kernels/tile_policy.py `gather_in_wgrad`) instead of a regathered copy."""
    weight = op._parameters["weight"]
    return weight.dim() == 3 and gather_in_wgrad(weight.shape[2], weight.shape[0], rows)


def gathers_dy(op, rows: int) -> bool:
    """Whether `op`'s weight gradient over `rows` routed rows (a GroupLinear before a Combine) reads the tokens'
    gradient through the routing index (kernels/tile_policy.py `gather_dy`) instead of the Combine backward's copy."""
    weight = op._parameters["weight"]
    return weight.dim() == 3 and gather_dy(weight.shape[0], rows, weight.shape[2])


def wgrad(op, x: torch.Tensor, dy: torch.Tensor, ctx: RunContext, index: torch.Tensor | None = None,
          dy_index: torch.Tensor | None = None) -> torch.Tensor:
    """dW (G, out, in) in the weight's dtype: one launch over every group, at the tile for this call's rows per
    group (the routed row count is known on the host; the group sizes are not read). With `index` (int32, one
    token row per routed row: fusion/runtime/gather.py `gather_index`) x is the (T, in) token matrix, read through
    it; with `dy_index` (the same index) dY is the (T, out) tokens' gradient, read through it."""
    routing = index if index is not None else dy_index
    if type(x) is not torch.Tensor:
        x = dequantize(x)
    x = x if x.is_contiguous() else x.contiguous()
    dy = dy if dy.is_contiguous() else dy.contiguous()
    weight = op._parameters["weight"]
    dw = torch.empty(weight.shape, dtype=x.dtype, device=x.device)
    rows = dy.shape[0] if routing is None else routing.numel()
    bounds = row_bounds(op, rows, ctx, x.device)
    # the launch bound per call shape: the tile policy (about 5 µs) and the launch's checks run once per (shape,
    # dtype, rows, device), not per call; the kernel of a tile is loaded once (load_compiled keeps it by its key)
    key = _key(weight, x, dy, rows, index is not None, dy_index is not None)
    bound = _BOUND.get(key)
    if bound is None:
        from fusion.kernels.wgrad_api import bind_varlen_k_gemm
        from fusion.runtime.compile import load_compiled

        config = _config(op, rows, index is not None, dy_index is not None)
        bound = _BOUND.keep(key, bind_varlen_k_gemm(load_compiled(_job(op, x.dtype, config)), dy, x, bounds, dw,
                                                    index=routing))
    bound(dy, x, bounds, dw, routing)
    return dw


def _key(weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, rows: int, gathered: bool, dy_gathered: bool):
    return (weight.shape, x.dtype, rows, x.shape[0], dy.shape[0], gathered, dy_gathered, x.get_device(),
            wgrad_switches())


def bound_launch(op, x: torch.Tensor, dy: torch.Tensor, rows: int, gathered: bool, dy_gathered: bool):
    """The launch :func:`wgrad` bound at this call shape (kernels.wgrad_api.BoundVarlenK), or None: not bound yet.
    The backward's replay keeps it (fusion/runtime/backward_replay.py)."""
    return _BOUND.get(_key(op._parameters["weight"], x, dy, rows, gathered, dy_gathered))
