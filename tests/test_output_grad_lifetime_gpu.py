"""On a Hopper GPU, a fused block's training step under a loss whose gradient only autograd holds: the block output's
gradient dY is freed after FC2's backward (the node's pre-hook, fusion/runtime/autograd.py `_OutputGradient`), so
when FC1's weight gradient runs, dY's bytes less memory is in use (to the allocator's rounding) than with the switch
off; the fused kernels ran (the launch counter), and every gradient is bit for bit the same. Under torch.compile the
backward in two ops frees dY and H the same way."""
import sys
from pathlib import Path

import pytest
import torch

from fusion import GroupLinear, Scale, Sequential, SwiGLU

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_common import loss_of  # noqa: E402  (the benches' loss: y's gradient a fresh copy only autograd holds)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")]
DEV = "cuda"
E, D, F = 8, 1024, 1536
SIZES = [700, 0, 1, 513, 1024, 333, 900, 1281]
M = sum(SIZES)
# within the caching allocator's rounding: it hands out a cached block whole where what would remain of it is under
# 1 MiB, and counts it whole as allocated
ROUNDING = 2 ** 20


def _block_with_fc1_spy(monkeypatch):
    """(block, group sizes, x, router probabilities, another (M, D) tensor, the memory in use at each launch of FC1's
    weight gradient: a list the spy appends to)."""
    import fusion.runtime.steps as S

    sizes = torch.tensor(SIZES, device=DEV)
    torch.manual_seed(0)
    x0 = torch.randn(M, D, device=DEV, dtype=torch.bfloat16)
    probs = torch.rand(M, device=DEV, dtype=torch.bfloat16)
    other = torch.randn(M, D, device=DEV, dtype=torch.bfloat16)
    seq = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D)).to(DEV, torch.bfloat16)
    in_use = []
    run = S.GemmWgrad.run

    def spy(self, state):
        if self.index == 0:   # FC1's weight gradient
            in_use.append(torch.cuda.memory_allocated())
        return run(self, state)

    monkeypatch.setattr(S.GemmWgrad, "run", spy)
    return seq, sizes, x0, probs, other, in_use


def _gradients(seq, x) -> tuple:
    return x.grad.clone(), {n: p.grad.clone() for n, p in seq.named_parameters()}


def _assert_same_gradients(got, want, what: str) -> None:
    (dx, grads), (dx_want, grads_want) = got, want
    assert torch.equal(dx, dx_want), f"dX differs {what}"
    for name, g in grads_want.items():
        assert torch.equal(grads[name], g), f"{name}'s gradient differs {what}"


def test_dy_is_freed_before_fc1_backward(monkeypatch):
    import fusion.runtime.autograd as A
    from fusion.runtime.kernel import LAUNCHES

    seq, sizes, x0, probs, dy, in_use = _block_with_fc1_spy(monkeypatch)
    results = {}
    for free in (True, False, True):
        monkeypatch.setattr(A, "FREE_OUTPUT_GRAD", free)
        x = x0.clone().requires_grad_(True)
        seq.zero_grad(set_to_none=True)
        loss_of(seq(x, group_sizes=sizes, scale=probs), dy).backward()   # warm: compiles, allocator pools
        seq.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        in_use.clear()
        LAUNCHES.reset()
        loss_of(seq(x, group_sizes=sizes, scale=probs), dy).backward()
        torch.cuda.synchronize()
        assert {"F1", "B1"} <= set(LAUNCHES.by_step), f"fused kernels launched: {LAUNCHES.by_step}"
        assert len(in_use) == 1, f"FC1's weight gradient ran {len(in_use)} times"
        results[free] = (in_use[0] - base, _gradients(seq, x))
    (on, grads_on), (off, grads_off) = results[True], results[False]
    _assert_same_gradients(grads_on, grads_off, "with dY freed early")
    assert abs((off - on) - M * D * 2) < ROUNDING, (
        f"at FC1's weight gradient {on / 2**20:.2f} MiB in use with dY freed early, {off / 2**20:.2f} without: "
        f"the difference is not dY's {M * D * 2 / 2**20:.2f} MiB")


def test_compiled_backward_frees_dy_and_h_before_fc1(monkeypatch):
    """Under torch.compile (a loss compiled with the block, as in a compiled model) the backward is two custom ops cut
    after dY's last reader (custom_ops.SPLIT_BACKWARD): when FC1's weight gradient runs, the graph has freed dY and
    the pre-activation H (read by FC2's fused dgrad only), where the one op holds both until it returns."""
    import fusion.runtime.custom_ops as C

    seq, sizes, x0, probs, c, in_use = _block_with_fc1_spy(monkeypatch)
    results = {}
    for split in (True, False):
        monkeypatch.setattr(C, "SPLIT_BACKWARD", split)
        torch._dynamo.reset()
        with torch._inductor.config.patch(force_disable_caches=True):
            step = torch.compile(lambda x: (seq(x, group_sizes=sizes, scale=probs) * c).float().sum(), fullgraph=True)
            for _ in range(2):   # the second step is measured
                x = x0.clone().requires_grad_(True)
                seq.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                in_use.clear()
                step(x).backward()
                torch.cuda.synchronize()
        results[split] = (in_use[-1] - base, _gradients(seq, x))
    torch._dynamo.reset()
    (on, grads_on), (off, grads_off) = results[True], results[False]
    _assert_same_gradients(grads_on, grads_off, "with the backward split")
    dy_bytes, h_bytes = M * D * 2, M * 2 * F * 2
    print(f"at FC1's weight gradient: split {on / 2**20:.2f} MiB, one op {off / 2**20:.2f} MiB; "
          f"dY {dy_bytes / 2**20:.2f}, H {h_bytes / 2**20:.2f}")
    assert abs((off - on) - (dy_bytes + h_bytes)) < ROUNDING, (
        f"at FC1's weight gradient {on / 2**20:.2f} MiB in use with the split, {off / 2**20:.2f} with one op: the "
        f"difference is not dY's and H's {(dy_bytes + h_bytes) / 2**20:.2f} MiB")
