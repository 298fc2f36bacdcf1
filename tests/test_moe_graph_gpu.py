"""fusion.MoE under CUDA graphs with dynamic routing (issue 12): every call routes differently (new x, so new
top-k, group sizes and token layout), and a captured graph replays it with no host sync.

* torch.cuda.CUDAGraph capture of the eager fused forward, replayed on new tokens: equal to the eager call.
* torch.compile(mode="reduce-overhead") training step (CUDA graphs inside): on new tokens each step, the output
  bitwise the eager fused layer's and every gradient equal to rounding.
"""
import copy

import pytest
import torch

from fusion import Combine, Gather, GroupLinear, MoE, Scale, Sequential, SwiGLU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
T, D, F, E, K = 512, 256, 128, 16, 4


def make_moe(round_to=None):
    torch.manual_seed(0)
    experts = Sequential(Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), Combine())
    moe = MoE(D, E, k=K, experts=experts, round_to=round_to).to("cuda", torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return moe


def tokens(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)


@pytest.mark.parametrize("round_to", [None, 128])
def test_captured_forward_replays_new_routing(round_to):
    moe = make_moe(round_to)
    static_x = tokens(0)
    with torch.no_grad():
        moe(static_x)                                   # compiles and caches outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        for seed in range(1, 4):
            x = tokens(seed)
            static_x.copy_(x)
            graph.replay()
            want = moe(x)
            assert torch.equal(static_y, want), f"replay {seed} differs from the eager call"


def test_reduce_overhead_training_step_with_new_routing_each_step():
    moe = make_moe()
    eager = copy.deepcopy(moe)
    compiled = torch.compile(moe, mode="reduce-overhead", fullgraph=True)

    def step(model, x, dy):
        for p in model.parameters():
            p.grad = None
        x = x.detach().requires_grad_()
        y = model(x)
        y.backward(dy)
        return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    for seed in range(4):  # the first calls record the graphs; later ones replay them with new routing
        x = tokens(seed)
        dy = torch.randn_like(x)
        got, want = step(compiled, x, dy), step(eager, x, dy)
        assert torch.equal(got[0], want[0]), f"seed {seed}: the output differs from the eager layer's"
        # x's gradient sums the router's and the experts' parts: inductor may add them in another order or
        # precision than eager autograd (one bf16 ulp here and there); the rest is the same kernels' output
        for i, (a, b) in enumerate(zip(got[1:], want[1:]), start=1):
            scale = b.abs().max().float().clamp_min(1e-30)
            torch.testing.assert_close(a.float() / scale, b.float() / scale, rtol=0, atol=2 ** -7,
                                       msg=lambda m: f"seed {seed}, tensor {i}: {m}")
