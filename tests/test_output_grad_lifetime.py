"""How long a block's output gradient dY lives in a training step whose loss.backward() nobody else holds dY in.

An unfused torch chain frees dY once FC2's backward node returns, before FC1's gradient arrives. A fused block is one
custom autograd node, which keeps its output gradient (the engine's input buffer and the argument tuple) until its
whole backward returns, so dY (rows x d) lives through FC1's backward: memory the unfused chain does not hold there
(docs/benchmarks.md, session p: the bench's `forward(x).backward(dy)` holds dy in both paths and hides it). The
fused-block test is a strict xfail: it documents the gap and fails CI the day the block frees dY early (then drop the
mark). CPU, backend="emulate" (the runtime's one backward executor, fusion/runtime/program.py)."""
import weakref

import pytest
import torch

from fusion import GroupLinear, Scale, Sequential, SwiGLU

E, D, F, M = 4, 64, 128, 256
SIZES = torch.tensor([64, 64, 64, 64])


def _alive_at_fc1(run_step):
    """Whether the block output's gradient is still referenced when FC1's gradient work starts."""
    seen = {}

    def grab(g):
        seen["dy"] = weakref.ref(g)

    def at_fc1():
        seen["alive"] = seen["dy"]() is not None

    run_step(grab, at_fc1)
    return seen["alive"]


def test_the_unfused_chain_frees_dy_before_fc1():
    torch.manual_seed(0)
    w1 = torch.randn(E, 2 * F, D, requires_grad=True)
    w2 = torch.randn(E, D, F, requires_grad=True)
    probs = torch.rand(M)

    def step(grab, at_fc1):
        x = torch.randn(M, D, requires_grad=True)
        h = torch.cat([x[64 * i: 64 * (i + 1)] @ w1[i].t() for i in range(E)])
        h.register_hook(lambda g: at_fc1())
        a = torch.nn.functional.silu(h[:, :F]) * h[:, F:] * probs[:, None]
        y = torch.cat([a[64 * i: 64 * (i + 1)] @ w2[i].t() for i in range(E)])
        y.register_hook(grab)
        (y * 2.0).sum().backward()

    assert not _alive_at_fc1(step)


@pytest.mark.xfail(strict=True, reason="a fused block's autograd node keeps its output gradient until its backward "
                                       "returns (docs/benchmarks.md, session p)")
def test_a_fused_block_frees_dy_before_fc1(monkeypatch):
    import fusion.runtime.steps as S

    torch.manual_seed(0)
    seq = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), backend="emulate")
    probs = torch.rand(M)

    def step(grab, at_fc1):
        run = S.GemmWgrad.run

        def spy(self, state):
            if self.index == 0:   # FC1's weight gradient
                at_fc1()
            return run(self, state)

        monkeypatch.setattr(S.GemmWgrad, "run", spy)
        x = torch.randn(M, D, requires_grad=True)
        y = seq(x, group_sizes=SIZES, scale=probs)
        y.register_hook(grab)
        (y * 2.0).sum().backward()

    assert not _alive_at_fc1(step)
