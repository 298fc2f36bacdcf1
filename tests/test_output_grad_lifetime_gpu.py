"""On a Hopper GPU, a fused block's training step under a loss whose gradient only autograd holds: the block output's
gradient dY is freed after FC2's backward (the node's pre-hook, fusion/runtime/autograd.py `_OutputGradient`), so
when FC1's weight gradient runs, dY's bytes less memory is in use (to the allocator's rounding) than with the switch
off; the fused kernels ran (the launch counter), and every gradient is bit for bit the same."""
import pytest
import torch

from fusion import GroupLinear, Scale, Sequential, SwiGLU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")]
DEV = "cuda"


class _Loss(torch.autograd.Function):
    """A loss whose gradient with respect to y is a fresh copy of dy (as the layer above a block makes it)."""

    @staticmethod
    def forward(ctx, y, dy):
        ctx.dy = dy
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return ctx.dy.clone(), None


def test_dy_is_freed_before_fc1_backward(monkeypatch):
    import fusion.runtime.autograd as A
    import fusion.runtime.steps as S
    from fusion.runtime.kernel import LAUNCHES

    E, D, F = 8, 1024, 1536
    sizes = torch.tensor([700, 0, 1, 513, 1024, 333, 900, 1281], device=DEV)
    M = int(sizes.sum())
    torch.manual_seed(0)
    x0 = torch.randn(M, D, device=DEV, dtype=torch.bfloat16)
    probs = torch.rand(M, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(M, D, device=DEV, dtype=torch.bfloat16)
    seq = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D)).to(DEV, torch.bfloat16)
    in_use = []
    run = S.GemmWgrad.run

    def spy(self, state):
        if self.index == 0:   # FC1's weight gradient
            in_use.append(torch.cuda.memory_allocated())
        return run(self, state)

    monkeypatch.setattr(S.GemmWgrad, "run", spy)
    results = {}
    for free in (True, False, True):
        monkeypatch.setattr(A, "FREE_OUTPUT_GRAD", free)
        x = x0.clone().requires_grad_(True)
        seq.zero_grad(set_to_none=True)
        _Loss.apply(seq(x, group_sizes=sizes, scale=probs), dy).backward()   # warm: compiles, allocator pools
        seq.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        in_use.clear()
        LAUNCHES.reset()
        _Loss.apply(seq(x, group_sizes=sizes, scale=probs), dy).backward()
        torch.cuda.synchronize()
        assert {"F1", "B1"} <= set(LAUNCHES.by_step), f"fused kernels launched: {LAUNCHES.by_step}"
        assert len(in_use) == 1, f"FC1's weight gradient ran {len(in_use)} times"
        results[free] = (in_use[0] - base, x.grad.clone(), {n: p.grad.clone() for n, p in seq.named_parameters()})
    (on, dx_on, grads_on), (off, dx_off, grads_off) = results[True], results[False]
    assert torch.equal(dx_on, dx_off)
    for name, want in grads_off.items():
        assert torch.equal(grads_on[name], want), f"{name}'s gradient differs with dY freed early"
    # within the caching allocator's rounding: it hands out a cached block whole where what would remain of it is
    # under 1 MiB, and counts it whole as allocated
    assert abs((off - on) - M * D * 2) < 2 ** 20, (
        f"at FC1's weight gradient {on / 2**20:.2f} MiB in use with dY freed early, {off / 2**20:.2f} without: "
        f"the difference is not dY's {M * D * 2 / 2**20:.2f} MiB")
