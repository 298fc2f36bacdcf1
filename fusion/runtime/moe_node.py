"""An MoE layer's router GEMM, routing and experts block as one autograd node: the router Linear's GEMM, route's
kernels, then the block's program.

fusion.MoE would otherwise record, per training step, the router Linear's node, route's node
(fusion/runtime/route.py) and the experts block's node (fusion/runtime/autograd.py), and the engine would sum x's
two gradients (the router's and the block's) in a buffer of its own. Each node costs host time twice: its creation
in the forward, and in the backward the engine's dispatch to it on autograd's device thread, where every Python
call runs slower than on the calling thread (docs/benchmarks.md, "Host time: where autograd runs the backward"). In
a host-bound step (an MoE layer at a small batch) the GPU waits for that. Here the node's forward runs the router's
GEMM (F.linear, the same call as the Linear module's), routes, then runs the block (its replay, where one was
built); its backward runs the block's backward, whose probs gradient goes straight into route's backward kernel,
then the router's two GEMMs as autograd runs them for F.linear, adding the router's part of x's gradient into the
block's. The same kernels in the same order on the same values as the layered nodes: the same bits
(tests/test_moe_node_gpu.py).

`takes` says where it applies: a training call on a Hopper GPU where route's kernels run (no token rounding), the
experts block runs fused with its device prologue and the router is a plain Linear without a bias in the tokens'
dtype, outside autocast, torch.compile and functorch transforms, with no module hooks the node would skip.
Everywhere else fusion.MoE records the nodes one by one. ENABLED is the A/B switch (read per call).

On by default (FUSION_MOE_NODE=0 turns it off) since its GPU test (tests/test_moe_node_gpu.py: the same bits as the
layered nodes, with and without the expert bias and x's gradient, over four routings) passed on an H200 in session
ad. One-process A/Bs on an H200 measured the Qwen3-30B-A3B and OLMoE layers' training steps at T = 1024 14.6% and
9.4% faster (session ac), then -0.1% and -7.7% on another machine start (session ad: host 975 against 1175 and 800
against 1263 µs a step; Qwen3-30B-A3B's step was GPU-bound there). The router's GEMM joined the node in session ap.
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
    """(router weight, x, *block parameters) -> the experts block's output over route(x @ router_weight.T)'s rows."""

    @staticmethod
    def forward(fctx, runner, spec, router_weight, x, *params):
        k, score, bias32, normalize, probs_name, validate = spec
        # the router Linear inside the node: F.linear's one GEMM (the same call, so the same bits, as the module's),
        # and no autograd node of its own for the engine to run
        logits = torch.nn.functional.linear(x, router_weight)
        validate(logits)
        index, sizes, probs, _expert, slots, layout = route.forward(logits, k, score, bias32, normalize)
        runner.check(x)
        ctx = runner.seq.inputs.context(x, {"index": index, "group_sizes": sizes, probs_name: probs},
                                        check_sum=runner.check_sum, device_checked=runner.device_checked)
        # the index never leaves this node: its token layout goes straight into the call's context (what the
        # Combine and the Gather's backward read: fusion.ops.routing.call_layout), not through the weak table
        ctx.derived["token_layout"] = layout
        y = autograd.forward_node(fctx, runner, ctx, x)
        # held as plain attributes: the logits (the router's output, which nothing else holds), the router weight
        # (x's gradient reads it) and x where the weight's gradient reads it, as the router Linear's node would save
        # them, without its saved-tensor version checks (nothing between a training step's forward and backward
        # changes a parameter or the layer's input in place)
        keep_x = x if fctx.needs_input_grad[2] else None
        fctx.route = (logits, slots, k, score, normalize, bias32, router_weight, keep_x)
        return y

    @staticmethod
    def backward(fctx, dy):
        box = [dy]
        del dy
        needs = fctx.needs_input_grad   # (runner, spec, router weight, x, *params)
        need_logits = needs[2] or needs[3]
        # the block's inputs: x, its parameters, then its one float input (the probs), wanted where the logits are
        made = autograd.backward_node(fctx, box, (needs[3], *needs[4:], need_logits))
        logits, slots, k, score, normalize, bias32, weight, x = fctx.route
        fctx.route = None
        if made is None:
            return (None,) * len(needs)
        dx, grads = made
        dprobs = grads[-1]
        dweight = None
        if dprobs is not None and need_logits:
            dlogits = route.backward(logits, slots, dprobs, k, score, normalize, bias32)
            del logits, slots
            # the router Linear's backward as autograd runs it for F.linear (mm's backward for x @ W.T): the same
            # two GEMMs, and x's two gradients summed as the engine sums them
            if needs[2]:
                dweight = dlogits.t().mm(x)
            if needs[3]:
                dx_router = dlogits.mm(weight)
                dx = dx_router if dx is None else dx.add_(dx_router)
        return (None, None, dweight, dx, *grads[:-1])


_APPLY = super(torch.autograd.Function, _RoutedBlockFunction).apply


def takes(moe, tokens: torch.Tensor):
    """The experts block's runner where the merged node runs this call of `moe` (a fusion.MoE), else None: a
    training call whose router is a plain Linear without a bias in the tokens' dtype (its GEMM then runs inside the
    node, as F.linear), outside autocast, with no hooks on the layer's modules that the node would skip."""
    router = moe.router
    weight = router.weight
    if (not ENABLED or moe.round_to is not None or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()
            or not (moe.expert_bias is None or isinstance(moe.expert_bias, torch.Tensor))
            or type(router) is not torch.nn.Linear or router.bias is not None
            or type(weight) not in _PLAIN or weight.dtype != tokens.dtype or weight.device != tokens.device
            or torch.is_autocast_enabled(tokens.device.type)
            or not route.takes_call(tokens.device, tokens.dtype, tokens.shape[0], weight.shape[0], moe.k,
                                    moe.expert_bias)):
        return None
    # (the merged node calls neither module: their hooks would not run)
    if _hooked(moe.experts) or _hooked(router) or _global_hooks():
        return None
    from fusion.runtime import runner_for

    runner = runner_for(moe.experts, tokens)
    if runner.program is None or runner.train_replays is None or not runner.device_checked:
        return None
    if not (weight.requires_grad or tokens.requires_grad or any(p.requires_grad for p in runner.params)):
        return None
    return runner


#: The router weight's types the node takes (a tensor subclass, e.g. a sharded DTensor parameter, goes the layered
#: way: F.linear dispatches it through its own rules).
_PLAIN = (torch.nn.Parameter, torch.Tensor)


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def run(moe, runner, tokens: torch.Tensor, validate) -> torch.Tensor:
    """The layer's experts output for `tokens`, routed by the layer's router, through the merged node; `validate`
    checks the logits as route() does (fusion.moe.routing's rules: the layer is above this module)."""
    spec = (moe.k, moe.score, route.kernel_bias(moe.expert_bias), moe.normalize, moe.probs_input, validate)
    CALLS["n"] += 1
    return autograd.free_output_grad(_APPLY(runner, spec, moe.router.weight, tokens, *runner.params))
