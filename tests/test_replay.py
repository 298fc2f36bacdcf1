"""The no-grad forward's replay (fusion/runtime/replay.py), no GPU: a two-step plan's bound launches are stand-ins that
record their arguments, so the test sees every pointer the replay passes: the prologue first, each step reading what
the step before it wrote in the call's scratch buffer (aligned, past the bounds buffer), the last step writing the
returned output, each kernel its own tile counter; and every guard sending a changed call back to the interpretive
path (None). On the GPU: tests/test_replay_gpu.py."""
from types import SimpleNamespace

import pytest
import torch

from fusion.run_context import RunContext
from fusion.runtime import replay as R
from fusion.runtime import steps as S
from fusion.runtime.kernel import LAUNCHES

BF16 = torch.bfloat16
G, ROWS, D, F = 4, 64, 32, 48
COUNTERS = 5   # the program's tile counters (the buffer: G + 1 bounds, then these)


class Bound:
    """A kernels.api.BoundGemm stand-in: its launch records the arguments."""

    def __init__(self, log, label, names, M=ROWS, num_ctas=3):
        self.names, self.M, self.T, self.num_ctas = names, M, M, num_ctas
        self.launch = lambda *args: log.append((label, args))


class Prologue:
    def __init__(self, log):
        self.launch = lambda *args: log.append(("prologue", args))


def _made(monkeypatch, train: bool):
    monkeypatch.setattr(R, "_raw_stream", lambda index: 77)
    log = []
    w1 = torch.randn(G, F, D, dtype=BF16)
    w2 = torch.randn(G, D, F, dtype=BF16)
    fc1, fc2 = SimpleNamespace(_parameters={"weight": w1}), SimpleNamespace(_parameters={"weight": w2})
    # training: the plan saves x and F1's second output v1 (a pre-activation of 2F columns); v2 is recomputed
    plan = SimpleNamespace(ops=[fc1, None, None, fc2], saves=("v1", "v0", "v2"))
    program = SimpleNamespace(plan=plan, counters=COUNTERS)
    runner = SimpleNamespace(program=program, params=[w1, w2], device_checked=True,
                             seq=SimpleNamespace(inputs=SimpleNamespace(names=frozenset({"group_sizes", "scale"}))))
    x = torch.randn(ROWS, D, dtype=BF16)
    sizes = torch.full((G,), ROWS // G, dtype=torch.int32)
    probs = torch.rand(ROWS, dtype=BF16)
    ctx = RunContext(group_sizes=sizes, routed_group_sizes=sizes, extra={"scale": probs},
                     counters=torch.zeros(G + 1 + COUNTERS, dtype=torch.int32), groups=G)
    job = SimpleNamespace(step="F1")
    f1 = (S.BoundLaunch(Bound(log, "F1", ("out", "saved", "scale")), job, "v0", "v3", F, fc1,
                        (("out", None), ("saved", None), ("extra", "scale")), 0, "v1", 2 * F) if train else
          S.BoundLaunch(Bound(log, "F1", ("out", "scale")), job, "v0", "v3", F, fc1,
                        (("out", None), ("extra", "scale")), 0))
    launches = [f1, S.BoundLaunch(Bound(log, "F2", ("out",)), None, "v3", "v4", D, fc2, (("out", None),), 1)]
    replay = R.ForwardReplay(runner, x, ctx, launches, Prologue(log), train)
    return replay, x, {"group_sizes": sizes, "scale": probs}, (w1, w2), log


@pytest.fixture
def made(monkeypatch):
    """(replay, x, extra, weights, log): a no-grad replay of GroupLinear(G, D, F) + Scale -> GroupLinear(G, F, D)
    at ROWS."""
    return _made(monkeypatch, train=False)


def test_the_training_replay_keeps_what_the_backward_reads(monkeypatch):
    """Training: the bounds buffer and the saved value are tensors of their own (the backward reads them), the
    intermediate only F2 reads sits in a scratch buffer, and ctx gets the bounds buffer as program.forward sets it."""
    replay, x, extra, (w1, w2), log = _made(monkeypatch, train=True)
    ctx = RunContext(group_sizes=extra["group_sizes"], routed_group_sizes=extra["group_sizes"],
                     extra={"scale": extra["scale"]})
    y, saved = replay.train(x, ctx)
    assert y.shape == (ROWS, D) and len(saved) == 3
    pre, again, recomputed = saved
    assert again is x and recomputed is None and pre.shape == (ROWS, 2 * F) and pre.dtype == BF16
    assert ctx.counters.shape == (G + 1 + COUNTERS,) and ctx.counters.dtype == torch.int32 and ctx.groups == G
    assert not ctx.backward_counters_used
    (_, (sizes_ptr, bounds, *_)), (_, f1), (_, f2) = log
    assert bounds == ctx.counters.data_ptr() and sizes_ptr == extra["group_sizes"].data_ptr()
    hidden, saved_ptr, scale_ptr = f1[5]
    assert saved_ptr == pre.data_ptr() and scale_ptr == extra["scale"].data_ptr()
    assert f1[2] == bounds and f1[3] == bounds + 4 * (G + 1)
    assert f2[0] == hidden and f2[5] == (y.data_ptr(),) and f2[3] == bounds + 4 * (G + 2)
    assert replay.scratch_bytes == R._aligned(ROWS * F * 2)     # the hidden value only: no bounds in it
    ctx.routed_group_sizes = extra["group_sizes"].long()        # another prologue kernel: not this replay
    assert replay.train(x, ctx) is None


def test_the_replay_launches_the_chain_through_its_scratch(made):
    replay, x, extra, (w1, w2), log = made
    LAUNCHES.reset()
    y = replay(x, extra)
    assert y.shape == (ROWS, D) and y.dtype == BF16 and replay.calls == 1
    assert [label for label, _ in log] == ["prologue", "F1", "F2"]
    (_, (sizes_ptr, base, rows, counters, stream)), (_, f1), (_, f2) = log
    assert (sizes_ptr, rows, counters, stream) == (extra["group_sizes"].data_ptr(), ROWS, COUNTERS, 77)
    a, b, bounds, counter, index, ptrs, M, T, ctas, stream = f1
    assert (a, b, bounds, index, M, T, ctas, stream) == (x.data_ptr(), w1.data_ptr(), base, base, ROWS, ROWS, 3, 77)
    assert counter == base + 4 * (G + 1 + 0)
    hidden = ptrs[0]
    head = 4 * (G + 1 + COUNTERS)
    assert hidden >= base + head and (hidden - base) % R.ALIGN == 0      # past the bounds buffer, aligned
    assert ptrs[1] == extra["scale"].data_ptr()
    a, b, bounds, counter, index, ptrs, *_ = f2
    assert (a, b, bounds, counter) == (hidden, w2.data_ptr(), base, base + 4 * (G + 1 + 1))
    assert ptrs == (y.data_ptr(),)
    assert replay.scratch_bytes >= (hidden - base) + ROWS * F * 2        # the hidden value fits
    assert LAUNCHES.by_step == {"F1": 1}                                 # the fused step counted, as when it runs


def test_weights_are_read_at_each_call(made):
    replay, x, extra, (w1, w2), log = made
    w1_new = torch.randn_like(w1)
    replay.steps[0].params["weight"] = w1_new     # the op's parameter table: a parameter replaced
    replay(x, extra)
    assert log[1][1][1] == w1_new.data_ptr()


@pytest.mark.parametrize("change", ["rows", "strided x", "x dtype", "misaligned x", "sizes dtype", "sizes shape",
                                    "scale dtype", "scale missing", "extra input", "param dtype", "weight shape",
                                    "strided weight", "poison", "switch", "disabled", "not a tensor"])
def test_a_changed_call_goes_back_to_the_interpretive_path(made, monkeypatch, change):
    replay, x, extra, (w1, w2), log = made
    extra = dict(extra)
    params = replay.steps[0].params
    if change == "rows":
        x = torch.randn(ROWS + 1, D, dtype=BF16)
    elif change == "strided x":
        x = torch.randn(D, ROWS, dtype=BF16).t()
    elif change == "x dtype":
        x = x.half()
    elif change == "misaligned x":
        x = torch.randn(ROWS * D + 1, dtype=BF16)[1:].view(ROWS, D)
    elif change == "sizes dtype":
        extra["group_sizes"] = extra["group_sizes"].long()
    elif change == "sizes shape":
        extra["group_sizes"] = torch.full((G + 1,), 1, dtype=torch.int32)
    elif change == "scale dtype":
        extra["scale"] = extra["scale"].float()
    elif change == "scale missing":
        extra["scale"] = None
    elif change == "extra input":
        extra["other"] = extra["scale"]
    elif change == "param dtype":
        replay.params[1] = w2.half()
    elif change == "weight shape":
        params["weight"] = torch.randn(G, F + 8, D, dtype=BF16)
    elif change == "strided weight":
        params["weight"] = torch.randn(G, D, F, dtype=BF16).transpose(1, 2)
    elif change == "poison":
        monkeypatch.setitem(S.POISON, "on", True)
    elif change == "switch":
        monkeypatch.setattr(R.lone_gemm, "WIDE_TILE", not R.lone_gemm.WIDE_TILE)
    elif change == "disabled":
        monkeypatch.setattr(R, "ENABLED", False)
    elif change == "not a tensor":
        x = x.tolist()
    assert replay(x, extra) is None
    assert log == [] and replay.calls == 0


def test_build_refuses_what_it_cannot_replay(made):
    """No device prologue (a CPU or emulated program, or an MoE block's routed one), or a step without a bound
    launch: no replay."""
    replay, x, extra, _, _ = made
    runner = SimpleNamespace(program=SimpleNamespace(prologue=None, forward_steps=[]), device_checked=True)
    ctx = RunContext(counters=torch.zeros(4, dtype=torch.int32))
    assert R.build(runner, x, ctx, None) is None
    from fusion.runtime.bounds import DevicePrologue

    prologue = DevicePrologue(G, True)
    step = SimpleNamespace(replay_launch=lambda state, train: None)   # e.g. torch's grouped GEMM ran this step
    runner = SimpleNamespace(program=SimpleNamespace(prologue=prologue, forward_steps=[step]), device_checked=True)
    assert R.build(runner, x, ctx, None) is None


def test_an_moe_block_replays_its_routed_prologue_gather_and_combine(monkeypatch):
    """Gather -> GroupLinear + Scale (the kernel loads x's rows through the gather index) -> Combine: the routed
    prologue gets (sizes, index, bounds, gather index, M, T); FC1 reads its index from the scratch the prologue
    wrote; the Combine sums FC1's routed rows into the output by the call's token layout. Training: ctx gets the
    gather index, the absorbed sizes after the bounds and the token layout, as the interpretive call sets them."""
    from fusion.runtime.combine import CombineLaunch

    monkeypatch.setattr(R, "_raw_stream", lambda index: 77)
    T, K, M = 16, 2, 40
    log = []
    w1 = torch.randn(G, F, D, dtype=BF16)
    fc1 = SimpleNamespace(_parameters={"weight": w1})
    plan = SimpleNamespace(ops=[None, fc1, None, None], saves=("v0",))
    program = SimpleNamespace(plan=plan, counters=COUNTERS)
    runner = SimpleNamespace(program=program, params=[w1], device_checked=True, seq=SimpleNamespace(
        inputs=SimpleNamespace(names=frozenset({"index", "group_sizes", "scale"}))))
    x = torch.randn(T, D, dtype=BF16)
    index = torch.cat([torch.arange(T).repeat(K), torch.full((M - T * K,), -1)])
    sizes = torch.tensor([10, 10, 6, 6], dtype=torch.int64)   # 32 rows, 8 padding rows absorbed by the prologue
    probs = torch.rand(M, dtype=BF16)
    ctx = RunContext(group_sizes=sizes, routed_group_sizes=sizes, extra={"scale": probs}, index=index, tokens=T,
                     counters=torch.zeros(G + 1 + COUNTERS, dtype=torch.int32), groups=G)
    fc1_launch = S.BoundLaunch(Bound(log, "F1", ("out", "scale"), M=M), SimpleNamespace(step="F1"), "v0", "v3", F,
                               fc1, (("out", None), ("extra", "scale")), 0, index=True)
    combine = CombineLaunch(lambda *args: log.append(("combine", args)), "v3", "v4", F, M, T)
    for train in (False, True):
        log.clear()
        replay = R.ForwardReplay(runner, x, ctx, [fc1_launch, combine], Prologue(log), train)
        if train:
            call = RunContext(group_sizes=sizes, routed_group_sizes=sizes, extra={"scale": probs}, index=index,
                              tokens=T)
            y, saved = replay.train(x, call)
            assert saved == [x]
            gather = call.derived["gather_index"]
            assert gather.shape == (M,) and gather.dtype == torch.int32
            assert call.counters.shape == (G + 1 + COUNTERS,) and call.group_sizes.shape == (G,)
            assert call.group_sizes.data_ptr() == call.counters.data_ptr() + 4 * (G + 1 + COUNTERS)
            assert call.derived["token_layout"] is not None
            bounds, gather_ptr = call.counters.data_ptr(), gather.data_ptr()
        else:
            y = replay(x, {"index": index, "group_sizes": sizes, "scale": probs})
        assert y.shape == (T, F)
        (_, pro), (_, f1), (_, comb) = log
        sizes_ptr, index_ptr, bounds_ptr, gather_at, rows, tokens, counters, stream = pro
        assert (sizes_ptr, index_ptr, rows, tokens, counters) == (sizes.data_ptr(), index.data_ptr(), M, T, COUNTERS)
        if train:
            assert (bounds_ptr, gather_at) == (bounds, gather_ptr)
        else:   # the scratch: the bounds and absorbed sizes, then the gather index, then FC1's rows
            assert gather_at == bounds_ptr + R._aligned(4 * (G + 1 + COUNTERS + G))
        a, b, f1_bounds, counter, f1_index, ptrs, f1_m, f1_t, *_ = f1
        assert (a, b, f1_bounds, f1_index, f1_m) == (x.data_ptr(), w1.data_ptr(), bounds_ptr, gather_at, M)
        y_rows, layout_rows, layout_offsets, out, comb_m, comb_t, _ = comb
        assert (y_rows, out, comb_m, comb_t) == (ptrs[0], y.data_ptr(), M, T)
        assert replay(x, {"index": index[:-1], "group_sizes": sizes, "scale": probs[:-1]}) is None   # another M
