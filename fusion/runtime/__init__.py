"""Executes a Sequential by its plan: fused steps through generated kernels, every other op through its
reference implementation."""
from __future__ import annotations

import weakref

import torch

from fusion.sequential import make_context

#: Run-time objects of fused steps per block, outside the module so copies and state_dicts never carry them.
_FUSED_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def device_target(device: torch.device) -> str | None:
    """The fused-kernel target of a device ("sm_90" on Hopper), or None where no fused kernel can run."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def fused_step(seq, step):
    """The run-time object of a fused plan step, built once per block and step (it holds compiled kernels
    and the repacked weight)."""
    from fusion.runtime.fused import FusedForwardStep

    cache = _FUSED_STEPS.setdefault(seq, {})
    if step not in cache:
        cache[step] = FusedForwardStep(seq, step)
    return cache[step]


def _needs_backward(seq, x, ctx) -> bool:
    if not torch.is_grad_enabled():
        return False
    return (x.requires_grad or any(p.requires_grad for p in seq.parameters())
            or any(t.requires_grad for t in ctx.extra.values()))


def execute(seq, x: torch.Tensor, extra: dict):
    """Run `seq` on x by the plan for x's device and dtype (see fusion.planner.plan_for_run)."""
    from fusion.planner import plan_for_run

    plan = plan_for_run(seq, x)
    fused = any(step.fused for step in plan.forward)
    # The sum check reads the sizes on the host: free on the CPU, asked for by backend="reference"; elsewhere
    # it is an asynchronous device assert, so a whole forward can be captured in a CUDA graph.
    ctx = make_context(seq.ops, x, extra, check_sum=x.device.type == "cpu" or seq.backend == "reference")
    if not fused:
        for op in seq.ops:
            x = op.reference(x, ctx)
        return x
    if _needs_backward(seq, x, ctx) and any(step.fused for step in plan.backward):
        from fusion.runtime.backward import run_block

        return run_block(seq, plan, x, ctx)
    from fusion.runtime.fused import run_fused_forward

    for step in plan.forward:
        if step.fused:
            x = run_fused_forward(fused_step(seq, step), x, ctx)
        else:
            (index,) = step.ops
            x = seq[index].reference(x, ctx)
    return x
