"""fusion.MoE end to end on the CPU reference path, against a plain PyTorch MoE written independently
(tests/moe_reference.py): forward, gradients of x, expert weights and router weight, determinism, errors."""
import pytest
import torch

import fusion
from fusion import Combine, Gather, GroupLinear, MoE, Scale, Sequential, ShapeError, SwiGLU
from moe_reference import plain_moe

D, F = 12, 8


def compare(moe, x, **route_kw):
    x = x.detach().requires_grad_()
    x_ref = x.detach().requires_grad_()
    w1, w2, wr = moe.experts[1].weight, moe.experts[4].weight, moe.router.weight
    y = moe(x)
    refs = [t.detach().clone().requires_grad_() for t in (wr, w1, w2)]
    y_ref = plain_moe(x_ref.reshape(-1, D), *refs, moe.k, bias=moe.expert_bias, **route_kw).reshape(x.shape)
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, wr, w1, w2), dy)
    want = torch.autograd.grad(y_ref, (x_ref, *refs), dy)
    for name, g, w in zip(("x", "router", "w1", "w2"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"grad of {name}: {m}")
    return got


@pytest.mark.parametrize("E,k,normalize", [(4, 1, False), (8, 2, True), (16, 8, True), (16, 8, False)])
def test_moe_matches_plain_pytorch(E, k, normalize):
    moe = MoE.swiglu(D, E, F, k, normalize=normalize, dtype=torch.float64)
    grads = compare(moe, torch.randn(40, D, dtype=torch.float64), normalize=normalize)
    assert grads[1].abs().sum() > 0  # the router learns through the probs


def test_moe_with_token_rounding_and_empty_experts():
    moe = MoE.swiglu(D, 16, F, 4, round_to=8, dtype=torch.float64)
    with torch.no_grad():
        moe.router.weight[12:] = -50 * moe.router.weight[12:].sign()  # some experts starve
    x = torch.randn(50, D, dtype=torch.float64)
    compare(moe, x, round_to=8)
    r = moe.route(x)
    assert int(r.group_sizes.sum()) < r.index.numel()  # padding rows were present


def test_moe_sigmoid_with_selection_bias_and_leading_dims():
    moe = MoE.swiglu(D, 8, F, 2, score="sigmoid", bias=True, dtype=torch.float64)
    moe.expert_bias[5] = 3.0
    assert "expert_bias" in dict(moe.named_buffers()) and moe.expert_bias.dtype == torch.float32
    compare(moe, torch.randn(3, 7, D, dtype=torch.float64), score="sigmoid")


def test_moe_is_bitwise_deterministic():
    moe = MoE.swiglu(D, 16, F, 4, round_to=4)
    x = torch.randn(300, D)

    def run():
        xx = x.clone().requires_grad_()
        y = moe(xx)
        grads = torch.autograd.grad(y.square().sum(), (xx, *moe.parameters()))
        return (y, *grads)

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_state_dict_holds_router_and_experts():
    moe = MoE.swiglu(D, 4, F, 2)
    keys = set(moe.state_dict())
    assert {"router.weight", "experts.1.weight", "experts.4.weight"} <= keys
    assert "round_to=None" in repr(moe)


def test_compiled_moe_matches_eager():
    moe = MoE.swiglu(D, 8, F, 2, dtype=torch.float64)
    x = torch.randn(20, D, dtype=torch.float64)
    compiled = torch.compile(moe, backend="aot_eager")
    torch.testing.assert_close(compiled(x), moe(x))


def test_malformed_experts_blocks_are_rejected():
    f64 = {"dtype": torch.float64}
    cases = [
        (Sequential(GroupLinear(4, D, 2 * F, **f64), SwiGLU(), Scale(), GroupLinear(4, F, D, **f64)),
         "start with Gather"),
        (Sequential(Gather(), GroupLinear(4, D, 2 * F, **f64), SwiGLU(), GroupLinear(4, F, D, **f64), Combine()),
         "per-row Scale"),
        (Sequential(Gather(), GroupLinear(5, D, 2 * F, **f64), SwiGLU(), Scale(), GroupLinear(5, F, D, **f64),
                    Combine()), "5 groups"),
        (Sequential(Gather(), GroupLinear(4, D, 2 * F, **f64), SwiGLU(), Scale(), GroupLinear(4, F, D + 1, **f64),
                    Combine()), "d to d"),
        (torch.nn.Linear(D, D), "fusion.Sequential"),
    ]
    for experts, message in cases:
        with pytest.raises(ShapeError, match=message):
            MoE(D, 4, 2, experts=experts)
    with pytest.raises(ShapeError, match="k must be"):
        MoE.swiglu(D, 4, F, 5)


def test_custom_probs_name():
    experts = Sequential(Gather(), GroupLinear(4, D, 2 * F), SwiGLU(), Scale(name="probs"), GroupLinear(4, F, D),
                         Combine())
    moe = MoE(D, 4, 2, experts=experts)
    assert moe.probs_input == "probs"
    assert moe(torch.randn(9, D)).shape == (9, D)
    assert isinstance(fusion.MoE.swiglu(D, 4, F, 2).experts[0], Gather)


def test_the_merged_routing_node_stays_off_the_cpu():
    """fusion/runtime/moe_node.py runs on a Hopper GPU only: on the CPU the layer records route's node and the
    experts block's node (its GPU tests: tests/test_moe_node_gpu.py)."""
    from fusion.runtime import moe_node

    moe = fusion.MoE.swiglu(16, 4, 8, k=2)
    x = torch.randn(6, 16, requires_grad=True)
    assert moe_node.takes(moe, moe.router(x), x) is None
    before = moe_node.CALLS["n"]
    moe(x).sum().backward()
    assert moe_node.CALLS["n"] == before and x.grad is not None
