"""GPU: a wide MoE FC1 (N = 2f >= tile_policy.FC1_COPY_MIN_N) runs its Gather as a copy by the gather kernel, then the
TMA kernel without gather_a (kernels/tile_policy.py gathers_in_kernel); with the switch off the gathering kernel.
Both match the reference backend, forward and every gradient, with token rounding's padding rows."""
import pytest
import torch
from conftest import hopper_available, launched_f1_config, moe_block_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hopper_available(), reason="needs a Hopper (sm_90) GPU")]


@pytest.mark.parametrize("copy", [True, False])
def test_wide_fc1_copies_the_gathered_rows_first(monkeypatch, copy):
    from fusion.kernels import tile_policy
    from fusion.runtime import gather as gather_method
    from fusion.runtime.kernel import LAUNCHES

    monkeypatch.setattr(tile_policy, "FC1_COPY", copy)
    copies = []
    real_gather = gather_method.run
    monkeypatch.setattr(gather_method, "run",
                        lambda op, x, ctx: copies.append(tuple(x.shape)) or real_gather(op, x, ctx))
    f = tile_policy.FC1_COPY_MIN_N // 2
    block, ref, x, r, dy = moe_block_case(7, round_to=128, f=f)   # the routing test_dy_gather_gpu.py pads
    assert int((r.index < 0).sum()) > 0
    outs = []
    for b in (block, ref):
        xg = x.clone().requires_grad_()
        probs = r.probs.detach().requires_grad_()
        LAUNCHES.reset()
        copies.clear()
        y = b(xg, index=r.index, group_sizes=r.group_sizes, scale=probs)
        if b is block:
            assert LAUNCHES.by_step.get("F1") == 1
            assert copies == ([(x.shape[0], x.shape[1])] if copy else []), copies   # the forward's copy of x's rows
            assert bool(launched_f1_config(block, torch.bfloat16).gather_a) != copy
        y.backward(dy)
        outs.append([y.double(), xg.grad.double(), probs.grad.double()] + [p.grad.double() for p in b.parameters()])
    for got, want in zip(*outs):
        assert ((got - want).norm() / want.norm().clamp_min(1e-30)).item() < 1e-2
