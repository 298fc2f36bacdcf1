"""An MoE layer's routing and experts block as one autograd node: route's kernels, then the block's program.

fusion.MoE records, per training step, the router Linear, route's node (fusion/runtime/route.py) and the experts
block's node (fusion/runtime/autograd.py). Each Python node costs host time twice: its Function.apply in the
forward, and in the backward the engine's dispatch to it on autograd's device thread, where every Python call runs
slower than on the calling thread (docs/benchmarks.md, "Host time: where autograd runs the backward"). In a
host-bound step (an MoE layer at a small batch) the GPU waits for that. Here route's launches run inside the block's
node: its forward routes, then runs the block (its replay, where one was built); its backward runs the block's
backward, whose probs gradient goes straight into route's backward kernel. The same kernels in the same order on the
same values as the two nodes: the same bits (tests/test_moe_node_gpu.py).

`takes` says where it applies: a training call on a Hopper GPU where route's kernels run (no token rounding) and
the experts block runs fused with its device prologue, outside torch.compile and functorch transforms. Everywhere
else fusion.MoE records the nodes one by one. ENABLED is the A/B switch (read per call).

On by default (FUSION_MOE_NODE=0 turns it off) since its GPU test (tests/test_moe_node_gpu.py: the same bits as the
layered nodes, with and without the expert bias and x's gradient, over four routings) passed on an H200 in session
ad. One-process A/Bs on an H200 measured the Qwen3-30B-A3B and OLMoE layers' training steps at T = 1024 14.6% and
9.4% faster (session ac), then -0.1% and -7.7% on another machine start (session ad: host 975 against 1175 and 800
against 1263 µs a step; Qwen3-30B-A3B's step was GPU-bound there).
"""
from __future__ import annotations

import os

import torch

from fusion.runtime import autograd, route

#: Read per call: False records route's node and the block's node separately (the A/B switch). FUSION_MOE_NODE=0
#: (read at import) turns it off.
ENABLED = os.environ.get("FUSION_MOE_NODE", "1") != "0"

#: Routed calls through the merged node (tests assert that it ran).
CALLS = {"n": 0}


class _RoutedBlockFunction(torch.autograd.Function):
    """(logits, x, *block parameters) -> the experts block's output over route(logits)'s rows."""

    @staticmethod
    def forward(fctx, runner, spec, logits, x, *params):
        k, score, bias32, normalize, probs_name = spec
        index, sizes, probs, _expert, slots, layout = route.forward(logits, k, score, bias32, normalize)
        runner.check(x)
        inputs = runner.seq.inputs
        ctx = None
        if runner.device_checked and not runner.check_sum:   # route's own outputs: valid by construction
            ctx = inputs.routed_context(x, index, sizes, probs_name, probs)
        if ctx is None:
            ctx = inputs.context(x, {"index": index, "group_sizes": sizes, probs_name: probs},
                                 check_sum=runner.check_sum, device_checked=runner.device_checked)
        # the index never leaves this node: its token layout goes straight into the call's context (what the
        # Combine and the Gather's backward read: fusion.ops.routing.call_layout), not through the weak table
        ctx.derived["token_layout"] = layout
        y = autograd.forward_node(fctx, runner, ctx, x)
        # logits held as a plain attribute: the router's output, which nothing else holds or changes in place
        fctx.route = (logits, slots, k, score, normalize, bias32)
        return y

    @staticmethod
    def backward(fctx, dy):
        box = [dy]
        del dy
        needs = fctx.needs_input_grad   # (runner, spec, logits, x, *params)
        # the block's inputs: x, its parameters, then its one float input (the probs) wanted where the logits are
        made = autograd.backward_node(fctx, box, (needs[3], *needs[4:], needs[2]))
        logits, slots, k, score, normalize, bias32 = fctx.route
        fctx.route = None
        if made is None:
            return (None,) * len(needs)
        dx, grads = made
        dprobs = grads[-1]
        dlogits = None if dprobs is None else route.backward(logits, slots, dprobs, k, score, normalize, bias32)
        return (None, None, dlogits, dx, *grads[:-1])


_APPLY = super(torch.autograd.Function, _RoutedBlockFunction).apply


def takes(moe, logits: torch.Tensor, tokens: torch.Tensor):
    """The experts block's runner where the merged node runs this call of `moe` (a fusion.MoE), else None."""
    if (not ENABLED or moe.round_to is not None or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()
            or not (moe.expert_bias is None or isinstance(moe.expert_bias, torch.Tensor))
            or not route.takes(logits, moe.k, moe.expert_bias)):
        return None
    if _hooked(moe.experts):   # (the merged node does not call the experts module: its hooks would not run)
        return None
    from fusion.runtime import runner_for

    runner = runner_for(moe.experts, tokens)
    if runner.program is None or runner.train_replays is None or not runner.device_checked:
        return None
    if not (logits.requires_grad or tokens.requires_grad or any(p.requires_grad for p in runner.params)):
        return None
    return runner


def _hooked(module: torch.nn.Module) -> bool:
    from torch.nn.modules import module as nn_module

    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or nn_module._global_forward_hooks
                or nn_module._global_forward_pre_hooks or nn_module._global_backward_hooks
                or nn_module._global_backward_pre_hooks)


def run(moe, runner, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The layer's experts output for `tokens`, routed by `logits`, through the merged node."""
    spec = (moe.k, moe.score, route.kernel_bias(moe.expert_bias), moe.normalize, moe.probs_input)
    CALLS["n"] += 1
    return autograd.free_output_grad(_APPLY(runner, spec, logits, tokens, *runner.params))
