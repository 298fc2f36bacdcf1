"""How long a block's output gradient dY lives in a training step whose loss.backward() nobody else holds dY in.

An unfused torch chain frees dY once FC2's backward node returns, before FC1's gradient arrives. A fused block is one
custom autograd node, and autograd keeps a node's incoming gradients until the node returns; the node's pre-hook
(fusion/runtime/autograd.py `_OutputGradient`) takes dY out of autograd's hands so the program frees it after its last
reader, as the unfused chain does (until session q dY lived through FC1's backward: docs/benchmarks.md). CPU,
backend="emulate" (the runtime's one backward executor, fusion/runtime/program.py)."""
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


@pytest.mark.parametrize("free", [True, False], ids=["hooked", "switch-off"])
def test_a_fused_block_frees_dy_before_fc1(monkeypatch, free):
    """With the node's pre-hook dY is gone when FC1's weight gradient runs; with the switch off (autograd's own
    handling, the state before session q) it is still alive there."""
    import fusion.runtime.autograd as A
    import fusion.runtime.steps as S

    monkeypatch.setattr(A, "FREE_OUTPUT_GRAD", free)
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

    assert _alive_at_fc1(step) is not free


def test_the_bench_loss_hands_over_a_fresh_output_gradient():
    """bench_common.loss_of (the benchmarks' training step): y's gradient is a copy of dy that only autograd holds,
    so the unfused chain frees it before FC1 (the bench's `dy` itself stays the caller's, unchanged)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_common import loss_of

    w1, w2 = torch.randn(D, 2 * F, requires_grad=True), torch.randn(F, D, requires_grad=True)
    dy = torch.randn(M, D)
    seen = {}

    x = torch.randn(M, D, requires_grad=True)
    h = x @ w1
    h.register_hook(lambda g: seen.__setitem__("alive", seen["dy"]() is not None))
    y = torch.nn.functional.silu(h[:, :F]) * h[:, F:] @ w2
    y.register_hook(lambda g: seen.__setitem__("dy", weakref.ref(g)))
    loss_of(y, dy).backward()
    assert seen["dy"]() is None and not seen["alive"]
    torch.testing.assert_close(w2.grad, (torch.nn.functional.silu(h[:, :F]) * h[:, F:]).detach().t() @ dy)


def _block_and_reference():
    torch.manual_seed(1)
    seq = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), backend="emulate")
    ref = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), backend="reference")
    ref.load_state_dict(seq.state_dict())
    return seq, ref


def _grads(seq, loss_of, x, probs):
    x = x.clone().requires_grad_(True)
    for p in seq.parameters():
        p.grad = None
    loss_of(seq(x, group_sizes=SIZES, scale=probs)).backward()
    return [x.grad] + [p.grad for p in seq.parameters()]


@pytest.mark.parametrize("loss_of", [
    pytest.param(lambda y: (y * 3.0).sum(), id="scaled"),
    pytest.param(lambda y: (y + y.detach() * y).sum(), id="output-read-twice"),   # autograd sums two gradients
    pytest.param(lambda y: (y.register_hook(lambda g: g * -2.0), y.pow(2).sum())[1], id="tensor-hook-rewrites-dy"),
])
def test_the_taken_output_gradient_is_the_one_autograd_would_pass(loss_of):
    """The pre-hook hands the program exactly the gradient autograd made (after tensor hooks, summed over readers)."""
    seq, ref = _block_and_reference()
    x, probs = torch.randn(M, D), torch.rand(M)
    for got, want in zip(_grads(seq, loss_of, x, probs), _grads(ref, loss_of, x, probs)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_autograd_grad_and_a_held_output_gradient():
    """torch.autograd.grad with a gradient the caller keeps: the caller's tensor is untouched and the result right."""
    seq, ref = _block_and_reference()
    x, probs, dy = torch.randn(M, D, requires_grad=True), torch.rand(M), torch.randn(M, D)
    kept = dy.clone()
    (got,) = torch.autograd.grad(seq(x, group_sizes=SIZES, scale=probs), x, dy)
    (want,) = torch.autograd.grad(ref(x, group_sizes=SIZES, scale=probs), x, dy)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(dy, kept)



@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_around_a_block(reentrant):
    """torch.utils.checkpoint recomputes the block in the backward, which makes a new node (and registers its
    pre-hook again); the gradients are the reference's, each twice in a row (nothing of one step leaks into the
    next)."""
    from torch.utils.checkpoint import checkpoint

    seq, ref = _block_and_reference()
    x0, probs = torch.randn(M, D), torch.rand(M)
    for _ in range(2):
        got, want = [], []
        for block, out in ((seq, got), (ref, want)):
            x = x0.clone().requires_grad_(True)
            for p in block.parameters():
                p.grad = None
            y = checkpoint(lambda t: block(t, group_sizes=SIZES, scale=probs), x, use_reentrant=reentrant)
            (y * 3.0).sum().backward()
            out += [x.grad] + [p.grad for p in block.parameters()]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
