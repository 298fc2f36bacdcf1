"""The no-grad forward's replay on a Hopper GPU (fusion/runtime/replay.py): after one interpretive no-grad call at some
rows, later calls at those rows launch the kept launches; their outputs are bit for bit the interpretive path's (the
same kernels on the same inputs) and the reference's within bf16 rounding, for new weights and new group sizes at
each call; calls the replay cannot take go the interpretive way and still raise their errors. (Outputs are not
poisoned here: poisoning turns the replay off. The replay's pointers, without a GPU: tests/test_replay.py.)"""
import copy

import pytest
import torch

import fusion
from fusion import GroupLinear, Linear, Scale, SwiGLU
from fusion.errors import GroupSizesError
from fusion.runtime import replay as R
from fusion.runtime import runner_for
from fusion.runtime.kernel import LAUNCHES

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
    pytest.skip("fused kernels need a Hopper (sm_90) GPU", allow_module_level=True)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _sizes(E, M, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(E, generator=g) + 0.05
    w[::3] = 0
    s = torch.floor(w / w.sum() * M).long()
    s[int(torch.argmax(w))] += M - int(s.sum())
    return s.to(torch.int32).cuda()


def _block(E=8, d=256, f=256):
    torch.manual_seed(0)
    return fusion.Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d)).to("cuda", torch.bfloat16)


def _inputs(E, M, d, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(M, d, device="cuda", dtype=torch.bfloat16),
            {"group_sizes": _sizes(E, M, seed), "scale": torch.rand(M, device="cuda", dtype=torch.bfloat16)})


def _training_step(block, x, extras, dy) -> list:
    """One training step of `block` on fresh leaves: its output, then the gradients of x, the router scale and each
    parameter (set anew by this step's backward)."""
    block.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    scale = extras["scale"].clone().requires_grad_()
    y = block(xi, group_sizes=extras["group_sizes"], scale=scale)
    y.backward(dy)
    return [y.detach(), xi.grad, scale.grad] + [p.grad for p in block.parameters()]


def _interpretive(block, x, extras):
    R.ENABLED = False
    try:
        with torch.no_grad():
            return block(x, **extras)
    finally:
        R.ENABLED = True


@pytest.mark.parametrize("E,d,f,M", [(8, 256, 256, 1000), (16, 512, 384, 4099), (4, 128, 256, 1)])
def test_replayed_calls_equal_the_interpretive_path(E, d, f, M):
    block = _block(E, d, f)
    ref = copy.deepcopy(block)
    ref.backend = "reference"
    x, extras = _inputs(E, M, d)
    with torch.no_grad():
        first = block(x, **extras)                    # interpretive; keeps its launches
    replay = runner_for(block, x).replays.get(M)
    assert isinstance(replay, R.ForwardReplay), "the small block's no-grad forward must be replayable"
    for seed in range(3):                             # new inputs, sizes and weights at every call
        x, extras = _inputs(E, M, d, seed)
        with torch.no_grad():
            for p, q in zip(block.parameters(), ref.parameters()):
                p.mul_(0.9 + 0.1 * seed)
                q.copy_(p)
        calls = replay.calls
        LAUNCHES.reset()
        with torch.no_grad():
            y = block(x, **extras)
        assert replay.calls == calls + 1
        assert LAUNCHES.by_step.get("F1") == 1        # the fused kernel really ran (counted as it runs)
        assert torch.equal(y, _interpretive(block, x, extras))
        with torch.no_grad():
            assert rel(y, ref(x, **extras)) < 1e-2
    assert first.shape == y.shape


def test_calls_it_cannot_take_run_interpretively():
    E, d, f, M = 8, 256, 256, 512
    block = _block(E, d, f)
    x, extras = _inputs(E, M, d)
    with torch.no_grad():
        block(x, **extras)
    replay = runner_for(block, x).replays.get(M)
    calls = replay.calls
    with torch.no_grad():
        strided = torch.randn(d, M, device="cuda", dtype=torch.bfloat16).t()
        assert torch.equal(block(strided, **extras), _interpretive(block, strided.contiguous(), extras))
        with pytest.raises(GroupSizesError):
            block(x, group_sizes=extras["group_sizes"][:-1], scale=extras["scale"])
        block(x, group_sizes=extras["group_sizes"].long(), scale=extras["scale"])   # int64 sizes: another prologue
    y = block(x, **extras)                                                           # recording for autograd
    assert y.requires_grad and replay.calls == calls


def test_a_plan_with_torch_steps_is_not_replayed():
    """A dense block's second GEMM is torch's (F.linear): the call is not replayable, and says so once."""
    torch.manual_seed(0)
    block = fusion.Sequential(Linear(256, 512), SwiGLU(), Linear(256, 256)).to("cuda", torch.bfloat16)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        a = block(x)
        b = block(x)
    assert runner_for(block, x).replays.get(300) is False
    assert torch.equal(a, b)


def test_replayed_training_forwards_give_the_interpretive_gradients():
    """The autograd node's forward replayed: the same output, and a backward over its saved values and bounds buffer
    gives the interpretive call's gradients bit for bit (x, both weights, the router scale)."""
    E, d, f, M = 8, 256, 256, 1000
    block = _block(E, d, f)
    x, extras = _inputs(E, M, d)
    dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)

    def step(enabled: bool):
        R.ENABLED = enabled
        try:
            return _training_step(block, x, extras, dy)
        finally:
            R.ENABLED = True

    step(True)                                         # interpretive; keeps its launches
    replay = runner_for(block, x).train_replays.get(M)
    assert isinstance(replay, R.ForwardReplay) and replay.calls == 0
    replayed = step(True)
    assert replay.calls == 1
    interpreted = step(False)
    assert replay.calls == 1
    for a, b in zip(replayed, interpreted):
        assert torch.equal(a, b)


def _moe(round_to):
    from fusion import Combine, Gather, MoE

    T, D, F, E, K = 512, 256, 128, 16, 4
    torch.manual_seed(0)
    experts = fusion.Sequential(Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), Combine())
    moe = MoE(D, E, k=K, experts=experts, round_to=round_to).to("cuda", torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return moe, T, D


@pytest.mark.parametrize("round_to", [None, 128])
def test_an_moe_layer_replays_its_experts_block(round_to):
    """The experts block (Gather -> FC1 -> SwiGLU -> Scale -> FC2 -> Combine) replayed: the routed prologue, FC1
    loading x's rows through the gather index it wrote, FC2, the Combine by the call's token layout. New tokens (new
    routing: sizes, index, layout) at each call; no grad and training, bit for bit the interpretive calls."""
    moe, T, D = _moe(round_to)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe(x)
    moe.zero_grad(set_to_none=True)
    moe(x).float().square().sum().backward()                 # a training call: keeps its launches too
    replays = runner_for(moe.experts, x).replays
    train_replays = runner_for(moe.experts, x).train_replays
    replay, train = replays.get(T), train_replays.get(T)
    assert isinstance(replay, R.ForwardReplay) and replay.routed
    assert isinstance(train, R.ForwardReplay) and train.routed

    def step(enabled):
        R.ENABLED = enabled
        try:
            moe.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            y = moe(xi)
            y.float().square().sum().backward()
            return [y.detach(), xi.grad] + [p.grad for p in moe.parameters()]
        finally:
            R.ENABLED = True

    for seed in range(1, 4):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
        calls = replay.calls
        with torch.no_grad():
            y = moe(x)
        assert replay.calls == calls + 1
        assert torch.equal(y, _interpretive(moe, x, {}))
        calls = train.calls
        replayed = step(True)
        assert train.calls == calls + 1
        for a, b in zip(replayed, step(False)):
            assert (a is None and b is None) or torch.equal(a, b)


def test_a_frozen_block_replays_with_grad_enabled():
    """Nothing needs a gradient (frozen parameters, x without one): the call records nothing, so it is replayed
    outside torch.no_grad too."""
    E, d, f, M = 8, 256, 256, 512
    block = _block(E, d, f).requires_grad_(False)
    x, extras = _inputs(E, M, d)
    block(x, **extras)
    replay = runner_for(block, x).replays.get(M)
    assert isinstance(replay, R.ForwardReplay)
    y = block(x, **extras)
    assert replay.calls == 1 and not y.requires_grad
    assert torch.equal(y, _interpretive(block, x, extras))


def _fp8_block(E, d, f, quantize: bool):
    """The FP8 twin of the training-step block: FC1's kernel writes FC2's FP8 input where `quantize` (a
    QuantizeFP8Block in its epilogue), else FC2 quantizes its bf16 input itself."""
    from fusion import QuantizeFP8Block

    torch.manual_seed(0)
    ops = [GroupLinear(E, d, 2 * f, weight_format="fp8_block"), SwiGLU(), Scale()]
    ops += [QuantizeFP8Block(columnwise=False)] if quantize else []
    return fusion.Sequential(*ops, GroupLinear(E, f, d, weight_format="fp8_block")).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("quantize", [True, False])
def test_an_fp8_block_replays_its_forwards_and_backward_bit_for_bit(quantize):
    """FP8 weights: the no-grad and the training forward replayed (x's rowwise quantization, the fused FP8 kernel,
    the lone FP8 GEMM), and the backward (dY's quantizations, the fused FP8 dgrad, the lone FP8 dgrad, the weight
    gradients the recipe takes in bf16) give the interpretive outputs and gradients bit for bit, after each optimizer
    step too (each replay asks the weight cache at each call, which quantizes the stepped weights again)."""
    from fusion.runtime import backward_replay as B

    E, d, f, M = 8, 256, 256, 1000
    block = _fp8_block(E, d, f, quantize)
    opt = torch.optim.SGD(block.parameters(), lr=0.5)
    x, extras = _inputs(E, M, d)
    dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)

    def step(enabled: bool):
        R.ENABLED = B.ENABLED = enabled
        try:
            made = _training_step(block, x, extras, dy)
            with torch.no_grad():
                made.append(block(x, **extras))        # the no-grad forward's
            return made
        finally:
            R.ENABLED = B.ENABLED = True

    step(True)                                         # interpretive; keeps its launches
    runner = runner_for(block, x)
    replay, train_replay = runner.replays.get(M), runner.train_replays.get(M)
    backward = runner.backward_replays.get((M, -1, (True, True, True, True)))
    assert isinstance(replay, R.ForwardReplay) and isinstance(train_replay, R.ForwardReplay), "FP8 forwards replay"
    assert isinstance(backward, B.BackwardReplay), "the FP8 backward replays"
    assert replay.fp8 and train_replay.fp8 and backward.fp8
    for _ in range(2):
        LAUNCHES.reset()
        replayed = step(True)
        assert LAUNCHES.by_step.get("F1") == 2         # the fused FP8 kernel ran in both forwards
        assert LAUNCHES.by_step.get("B1") == 1         # the fused FP8 dgrad ran
        interpreted = step(False)
        for a, b in zip(replayed, interpreted):
            assert torch.equal(a, b)
        opt.step()                                     # the weights change: both paths read the re-quantized blocks
    assert replay.calls == 2 and train_replay.calls == 2 and backward.calls == 2
    with torch.no_grad():
        ref = copy.deepcopy(block)
        ref.backend = "reference"
        assert rel(block(x, **extras), ref(x, **extras)) < 2e-2
