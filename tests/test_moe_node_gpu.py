"""fusion/runtime/moe_node.py on the GPU: an MoE layer's routing and experts block as one autograd node give the
same bits as route's node and the block's node recorded one by one (the A/B switch off), over steps with new
tokens (new routing) and the replays engaged; the node really runs (counted); a hooked experts module, no_grad and
token rounding go the layered way; a second backward through it raises the block's error."""
import copy

import pytest
import torch

from fusion import Combine, Gather, GroupLinear, MoE, Scale, Sequential, SwiGLU
from fusion.errors import SecondBackwardError
from fusion.runtime import moe_node

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
T, D, F, E, K = 512, 256, 128, 16, 4   # (test_moe_graph_gpu.py's layer: the same kernels)


def make_moe(bias=False, round_to=None):
    torch.manual_seed(0)
    experts = Sequential(Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), Combine())
    moe = MoE(D, E, k=K, experts=experts, bias=bias, round_to=round_to).to("cuda", torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    if bias:
        moe.expert_bias.copy_(torch.linspace(-0.5, 0.5, E, device="cuda"))
    return moe


def step(moe, x, dy, merged: bool, monkeypatch):
    monkeypatch.setattr(moe_node, "ENABLED", merged)
    for p in moe.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(x.requires_grad)   # a leaf of its own: x.grad is its gradient
    before = moe_node.CALLS["n"]
    y = moe(x)
    ran = moe_node.CALLS["n"] - before
    y.backward(dy)
    return y.detach(), x.grad, {name: p.grad for name, p in moe.named_parameters()}, ran


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_grad", [True, False])
def test_the_merged_node_gives_the_layered_bits(bias, x_grad, monkeypatch):
    merged_moe = make_moe(bias)
    layered_moe = copy.deepcopy(merged_moe)
    for seed in range(4):   # new tokens each step: new routing; from the second step the replays run
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(x_grad)
        dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        y1, dx1, g1, ran1 = step(merged_moe, x, dy, True, monkeypatch)
        y2, dx2, g2, ran2 = step(layered_moe, x, dy, False, monkeypatch)
        assert (ran1, ran2) == (1, 0)
        assert torch.equal(y1, y2), f"step {seed}: outputs differ"
        assert (dx1 is None) == (not x_grad) and (dx1 is None or torch.equal(dx1, dx2))
        assert g1.keys() == g2.keys() and all(torch.equal(g1[n], g2[n]) for n in g1), f"step {seed}: gradients differ"
        assert g1["router.weight"].abs().sum() > 0


def test_hooks_no_grad_and_token_rounding_go_the_layered_way(monkeypatch):
    monkeypatch.setattr(moe_node, "ENABLED", True)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for moe, context in ((make_moe(round_to=128), torch.enable_grad()), (make_moe(), torch.no_grad())):
        before = moe_node.CALLS["n"]
        with context:
            moe(x)
        assert moe_node.CALLS["n"] == before
    moe = make_moe()
    seen = []
    moe.experts.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    before = moe_node.CALLS["n"]
    moe(x).sum().backward()
    assert moe_node.CALLS["n"] == before and seen == [(T, D)]


def test_a_second_backward_raises_the_blocks_error(monkeypatch):
    monkeypatch.setattr(moe_node, "ENABLED", True)
    moe = make_moe()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = moe(x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(SecondBackwardError):
        y.sum().backward()


def test_the_merged_node_builds_its_context_without_the_host_checks(monkeypatch):
    """Route's outputs go into the block's context by BlockInputs.routed_context (valid by construction; the device
    prologue checks the values), not through context()'s per-call checks; the bits are the test above's."""
    from fusion.inputs import BlockInputs

    monkeypatch.setattr(moe_node, "ENABLED", True)
    made, checked = [], []
    routed, full = BlockInputs.routed_context, BlockInputs.context
    monkeypatch.setattr(BlockInputs, "routed_context", lambda self, *a: made.append(routed(self, *a)) or made[-1])
    monkeypatch.setattr(BlockInputs, "context", lambda self, *a, **kw: checked.append(1) or full(self, *a, **kw))
    moe = make_moe()
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        moe(x).sum().backward()
    assert len(made) == 2 and all(ctx is not None for ctx in made) and not checked
