"""fusion/runtime/moe_node.py without a GPU: the merged node's composition (route's forward, the block's program,
the block's backward, its probs gradient into route's backward, the gradients back to logits, x and the experts'
weights in their places) against fusion.MoE's layered nodes, bit for bit. Route's kernels are GPU-only, so their two
functions are stood in for by the torch routing that route() runs on the CPU (the same math); the experts block
runs its fused plan in torch (backend="emulate"). On the GPU, with the kernels: tests/test_moe_node_gpu.py."""
import copy
from types import SimpleNamespace

import pytest
import torch

import fusion
from fusion.moe import routing
from fusion.ops import routing as ops_routing
from fusion.ops.routing import token_layout
from fusion.runtime import moe_node, route, runner_for

T, D, F, E, K = 24, 16, 8, 4, 2


@pytest.fixture
def torch_route(monkeypatch):
    """route.forward / route.backward as the CPU's torch routing (fusion/moe/routing.py's _TopKRoute)."""
    kept = {}

    def forward(logits, k, score, bias32, normalize):
        index, sizes, probs, expert, saved = routing._top_k_route(logits, k, score, bias32, normalize,
                                                                   for_backward=True)
        slots = torch.empty(0)
        kept[id(slots)] = saved
        return index, sizes, probs, expert, slots, token_layout(index, logits.shape[0])

    def backward(logits, slots, dprobs, k, score, normalize, bias32):
        fctx = SimpleNamespace(saved_tensors=kept.pop(id(slots)), score=score, logits_dtype=logits.dtype)
        return routing._TopKRoute.backward(fctx, None, None, dprobs, None)[0]

    monkeypatch.setattr(route, "forward", forward)
    monkeypatch.setattr(route, "backward", backward)


def _step(moe, x, dy, merged: bool):
    for p in moe.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(x.requires_grad)
    if merged:
        logits = moe.router(x)
        y = moe_node.run(moe, runner_for(moe.experts, x), logits, x)
    else:
        y = moe(x)
    y.backward(dy)
    return y.detach(), x.grad, {name: p.grad for name, p in moe.named_parameters()}


@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("score,normalize", [("softmax", True), ("sigmoid", False)])
def test_the_merged_node_gives_the_layered_bits(torch_route, x_grad, score, normalize):
    torch.manual_seed(0)
    merged = fusion.MoE.swiglu(D, E, F, k=K, backend="emulate", score=score, normalize=normalize)
    layered = copy.deepcopy(merged)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(T, D, generator=g).requires_grad_(x_grad)
        dy = torch.randn(T, D, generator=g)
        before = moe_node.CALLS["n"]
        y1, dx1, g1 = _step(merged, x, dy, True)
        assert moe_node.CALLS["n"] == before + 1
        y2, dx2, g2 = _step(layered, x, dy, False)
        assert moe_node.CALLS["n"] == before + 1   # (the CPU layer records its nodes one by one)
        assert torch.equal(y1, y2)
        assert (dx1 is None) == (not x_grad) and (dx1 is None or torch.equal(dx1, dx2))
        assert g1.keys() == g2.keys() and all(torch.equal(g1[n], g2[n]) for n in g1)
        assert g1["router.weight"].abs().sum() > 0 and g1["experts.1.weight"].abs().sum() > 0


def test_a_frozen_router_gets_no_logits_gradient(torch_route):
    """With the router frozen and x not needing a gradient, the block computes no probs gradient and route's backward
    does not run; the experts' weights still get theirs."""
    torch.manual_seed(0)
    moe = fusion.MoE.swiglu(D, E, F, k=K, backend="emulate")
    moe.router.weight.requires_grad_(False)
    x = torch.randn(T, D)
    y = moe_node.run(moe, runner_for(moe.experts, x), moe.router(x), x)
    y.sum().backward()
    assert moe.router.weight.grad is None and moe.experts[1].weight.grad is not None


def test_route_hands_its_token_layout_to_the_block_context(torch_route, monkeypatch):
    """The merged node puts route's token layout into the block call's context (the index never leaves the node),
    so the Combine and the Gather's backward read it from there, not through the weak table of fusion.ops.routing."""
    layouts = []
    forward = route.forward

    def recording(*args):
        out = forward(*args)
        layouts.append(out[-1])
        return out

    monkeypatch.setattr(route, "forward", recording)

    def no_sort(*args):
        raise AssertionError("the block sorted its own token layout")

    monkeypatch.setattr(ops_routing, "layout_of", no_sort)   # (what call_layout runs where the context has none)
    torch.manual_seed(0)
    moe = fusion.MoE.swiglu(D, E, F, k=K, backend="emulate")
    x = torch.randn(T, D)
    y = moe_node.run(moe, runner_for(moe.experts, x), moe.router(x), x)
    assert y.grad_fn.ctx.derived["token_layout"] is layouts[-1]
    y.sum().backward()
