"""The backward's replay on a Hopper GPU (fusion/runtime/backward_replay.py): after one interpretive backward of a call
shape, later backwards of that shape launch what it launched; every gradient is bit for bit the interpretive path's
(the same kernels on the same operands), for new inputs, group sizes and weights at each step, with the gradients
autograd wants varying (x without one, a frozen weight, the router scale without one), on a two-GEMM block and an
MoE layer's experts block; the fused dgrad really runs (counted); the step's peak memory is not above the
interpretive one's (each value freed after its last reader); a dY the replay cannot take (autograd's expanded dY of
a sum) goes the interpretive way. (The replay's pointers, without a GPU: tests/test_backward_replay.py.)"""
import pytest
import torch

import fusion
from fusion import GroupLinear, Scale, SwiGLU
from fusion.runtime import backward_replay as B
from fusion.runtime import runner_for
from fusion.runtime.kernel import LAUNCHES

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
    pytest.skip("fused kernels need a Hopper (sm_90) GPU", allow_module_level=True)

from test_replay_gpu import _sizes  # noqa: E402  (imbalanced group sizes with empty groups, on the GPU)


def _block(E, d, f):
    torch.manual_seed(0)
    block = fusion.Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d))
    return block.to("cuda", torch.bfloat16)


def _step(block, x, sizes, scale, dy, enabled, x_grad=True, scale_grad=True):
    """One training step's gradients (x, scale, then the parameters') with the backward's replay on or off."""
    B.ENABLED = enabled
    try:
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(x_grad)
        si = scale.clone().requires_grad_(scale_grad)
        y = block(xi, group_sizes=sizes, scale=si)
        y.backward(dy)
        return [xi.grad, si.grad] + [p.grad for p in block.parameters()]
    finally:
        B.ENABLED = True


def _same(a, b):
    assert len(a) == len(b)
    for u, w in zip(a, b):
        assert (u is None and w is None) or torch.equal(u, w)


@pytest.mark.parametrize("E,d,f,M", [(8, 256, 256, 1000), (16, 512, 384, 4099), (8, 2048, 1024, 4096),
                                     (4, 128, 256, 1)])
def test_replayed_backwards_give_the_interpretive_gradients(E, d, f, M):
    block = _block(E, d, f)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    sizes, scale = _sizes(E, M, 0), torch.rand(M, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    _step(block, x, sizes, scale, dy, True)                       # interpretive: records its launches
    replay = runner_for(block, x).backward_replays.get((M, -1, (True, True, True, True)))
    assert isinstance(replay, B.BackwardReplay), "the small block's backward must be replayable"
    for seed in range(1, 4):                                      # new inputs, sizes and weights at every step
        g = torch.Generator("cuda").manual_seed(seed)
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, generator=g)
        sizes, scale = _sizes(E, M, seed), torch.rand(M, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            for p in block.parameters():
                p.mul_(0.9 + 0.1 * seed)
        calls = replay.calls
        LAUNCHES.reset()
        replayed = _step(block, x, sizes, scale, dy, True)
        assert replay.calls == calls + 1
        assert LAUNCHES.by_step.get("B1") == 1                    # the fused dgrad really ran
        interpreted = _step(block, x, sizes, scale, dy, False)
        assert replay.calls == calls + 1
        _same(replayed, interpreted)
        assert all(t is not None for t in replayed)


@pytest.mark.parametrize("frozen", ["x", "fc1", "fc2", "scale"])
def test_the_gradients_autograd_wants_pick_the_replay(frozen):
    """Each set of wanted gradients is a call shape of its own (the program skips other steps for it)."""
    E, d, f, M = 8, 256, 256, 1024
    block = _block(E, d, f)
    params = list(block.parameters())
    if frozen in ("fc1", "fc2"):
        params[0 if frozen == "fc1" else 1].requires_grad_(False)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    sizes, scale = _sizes(E, M, 1), torch.rand(M, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    wants = dict(x_grad=frozen != "x", scale_grad=frozen != "scale")
    _step(block, x, sizes, scale, dy, True, **wants)
    (replay,) = [r for r in runner_for(block, x).backward_replays.values() if r]
    replayed = _step(block, x, sizes, scale, dy, True, **wants)
    assert replay.calls == 1
    interpreted = _step(block, x, sizes, scale, dy, False, **wants)
    _same(replayed, interpreted)
    expect_none = {"x": 0, "scale": 1, "fc1": 2, "fc2": 3}[frozen]
    assert replayed[expect_none] is None


def test_the_replayed_step_peaks_no_higher():
    E, d, f, M = 8, 1024, 1024, 2048
    block = _block(E, d, f)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    sizes, scale = _sizes(E, M, 2), torch.rand(M, device="cuda", dtype=torch.bfloat16)

    def peak(enabled):
        dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        B.ENABLED = enabled
        try:
            block.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = block(xi, group_sizes=sizes, scale=scale.clone().requires_grad_())
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            grad = dy.clone()
            del dy
            torch.autograd.backward(y, grad)   # (autograd holds `grad` until it returns, in both runs alike)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        finally:
            B.ENABLED = True

    peak(True)                     # records
    replayed = peak(True)
    assert runner_for(block, x).backward_replays.get((M, -1, (True, True, True, True))).calls == 1
    assert replayed <= peak(False)


def test_an_expanded_dy_goes_the_interpretive_way():
    """y.sum().backward() hands the block an expanded (stride 0) dY: the replay does not take it, the program makes
    it contiguous, as before."""
    E, d, f, M = 8, 256, 256, 512
    block = _block(E, d, f)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    sizes, scale = _sizes(E, M, 3), torch.rand(M, device="cuda", dtype=torch.bfloat16)

    def grads(enabled):
        B.ENABLED = enabled
        try:
            block.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            block(xi, group_sizes=sizes, scale=scale).sum().backward()
            return [xi.grad] + [p.grad for p in block.parameters()]
        finally:
            B.ENABLED = True

    first = grads(True)
    replay = runner_for(block, x).backward_replays.get((M, -1, (True, True, True, False)))
    assert isinstance(replay, B.BackwardReplay)   # built from the program's contiguous copy of dY
    second = grads(True)
    assert replay.calls == 0
    _same(first, second)
    _same(second, grads(False))


@pytest.mark.parametrize("T,E,K,D,F,round_to", [(512, 16, 4, 256, 128, None), (512, 16, 4, 256, 128, 128),
                                                 (4096, 8, 2, 4096, 512, None)])
def test_an_moe_layer_replays_its_experts_backward(T, E, K, D, F, round_to):
    """The experts block's backward replayed with new tokens (new routing) at each step, bit for bit the program's:
    at few rows per expert the Combine's backward copy, the fused dgrad, FC2's weight gradient, the lone dgrad, FC1's
    input regathered for its weight gradient, the Gather's backward combine; at 1024 rows per expert (the last case)
    the fused dgrad and FC2's weight gradient read dY through the routing index and FC1's weight gradient reads x
    through it (no copies), the lone dgrad on its wide tile."""
    from fusion import Combine, Gather, MoE

    torch.manual_seed(0)
    experts = fusion.Sequential(Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), Combine())
    moe = MoE(D, E, k=K, experts=experts, round_to=round_to).to("cuda", torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)

    def step(x, enabled):
        B.ENABLED = enabled
        try:
            moe.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = moe(xi)
            y.backward(torch.ones_like(y))
            return [y.detach(), xi.grad] + [p.grad for p in moe.parameters()]
        finally:
            B.ENABLED = True

    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    step(x, True)
    runner = runner_for(moe.experts, x)
    (replay,) = [r for r in runner.backward_replays.values() if r]
    gathers = (torch.bfloat16, "backward_gather") in runner.program.backward_steps[1]._kernels
    assert gathers == (T * K >= 1024 * E)         # the call shape where dY is read through the index
    for seed in range(1, 4):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
        calls = replay.calls
        replayed = step(x, True)
        assert replay.calls == calls + 1
        _same(replayed, step(x, False))
