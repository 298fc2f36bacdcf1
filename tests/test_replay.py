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
from fusion.runtime.fp8_gemm import Fp8Launch
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


def _call(ops: list, saves: tuple, params: list):
    """(runner, x, sizes, probs, ctx) of a call at ROWS over G equal groups: a runner stand-in whose plan has `ops` and
    `saves`, with `params`, the keyword inputs group_sizes and scale, and the context its interpretive call made."""
    program = SimpleNamespace(plan=SimpleNamespace(ops=ops, saves=saves), counters=COUNTERS)
    runner = SimpleNamespace(program=program, params=params, device_checked=True,
                             seq=SimpleNamespace(inputs=SimpleNamespace(names=frozenset({"group_sizes", "scale"}))))
    x = torch.randn(ROWS, D, dtype=BF16)
    sizes = torch.full((G,), ROWS // G, dtype=torch.int32)
    probs = torch.rand(ROWS, dtype=BF16)
    ctx = RunContext(group_sizes=sizes, routed_group_sizes=sizes, extra={"scale": probs},
                     counters=torch.zeros(G + 1 + COUNTERS, dtype=torch.int32), groups=G)
    return runner, x, sizes, probs, ctx


def _made(monkeypatch, train: bool):
    monkeypatch.setattr(R, "_raw_stream", lambda index: 77)
    log = []
    w1 = torch.randn(G, F, D, dtype=BF16)
    w2 = torch.randn(G, D, F, dtype=BF16)
    fc1, fc2 = SimpleNamespace(_parameters={"weight": w1}), SimpleNamespace(_parameters={"weight": w2})
    # training: the plan saves x and F1's second output v1 (a pre-activation of 2F columns); v2 is recomputed
    runner, x, sizes, probs, ctx = _call([fc1, None, None, fc2], ("v1", "v0", "v2"), [w1, w2])
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
    assert replay.scratch_bytes == R.aligned(ROWS * F * 2)     # the hidden value only: no bounds in it
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
            # ctx.counters is the whole buffer (bounds, tile counters, absorbed sizes); the sizes' view is made
            # only when read, and the offsets' view stops at the bounds
            assert call.counters.shape == (G + 1 + COUNTERS + G,) and call.groups == G
            assert call._group_sizes is None and call.sizes_at[0] is call.counters
            assert call.sizes_at[1:] == (G + 1 + COUNTERS, G)
            assert call.offsets.shape == (G,) and call._group_sizes is None
            assert call.group_sizes.shape == (G,) and call.sizes_at is None
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
            assert gather_at == bounds_ptr + R.aligned(4 * (G + 1 + COUNTERS + G))
        a, b, f1_bounds, counter, f1_index, ptrs, f1_m, f1_t, *_ = f1
        assert (a, b, f1_bounds, f1_index, f1_m) == (x.data_ptr(), w1.data_ptr(), bounds_ptr, gather_at, M)
        y_rows, layout_rows, layout_offsets, out, comb_m, comb_t, _ = comb
        assert (y_rows, out, comb_m, comb_t) == (ptrs[0], y.data_ptr(), M, T)
        assert replay(x, {"index": index[:-1], "group_sizes": sizes, "scale": probs[:-1]}) is None   # another M
        if train:   # a layout already in the call's context (the merged MoE node's route wrote it) is the one launched
            layout = (torch.zeros(M, dtype=torch.int64), torch.zeros(T + 2, dtype=torch.int64))
            call = RunContext(group_sizes=sizes, routed_group_sizes=sizes, extra={"scale": probs}, index=index,
                              tokens=T, derived={"token_layout": layout})
            log.clear()
            replay.train(x, call)
            assert call.derived["token_layout"] is layout
            assert log[-1][1][1:3] == (layout[0].data_ptr(), layout[1].data_ptr())


class Fp8Bound:
    """A kernels.fp8_api.BoundFp8Gemm stand-in: its launch records the arguments."""

    def __init__(self, log, label, names, N, K, num_ctas=5):
        self.names, self.M, self.num_ctas = names, ROWS, num_ctas
        self.a_shape, self.b_shape = torch.Size((ROWS, K)), torch.Size((G, N, K))
        self.launch = lambda *args: log.append((label, args))


class Fp8Op:
    """An fp8_block GroupLinear stand-in: its weight, and the cache's FP8 blocks (`quantized_weight`, which the
    replay asks at each call; `fresh` hands out new buffers, as a cache whose weight changed shape would)."""

    def __init__(self, N, K):
        self._parameters = {"weight": torch.randn(G, N, K, dtype=BF16)}
        self.asked, self.fresh, self.none = 0, False, False
        self._q = self._blocks(N, K)

    @staticmethod
    def _blocks(N, K):
        return SimpleNamespace(data=torch.empty(G, N, K, dtype=torch.uint8),
                               scale=torch.empty(G, -(-N // 128), -(-K // 128), dtype=torch.float32))

    def quantized_weight(self):
        self.asked += 1
        if self.fresh:
            self._q = self._blocks(*self._q.data.shape[1:])
        return None if self.none else self._q


def _fp8_made(monkeypatch, train: bool):
    """An FP8 block's replay: F1 the fused FP8 kernel of GroupLinear(G, D, 2F) + SwiGLU + Scale + QuantizeFP8Block
    (x quantized 1x128 rowwise first; its output FP8-block; training: it saves the pre-activation v1), F2 the lone FP8
    GEMM of GroupLinear(G, F, D) reading F1's codes and scales as they are."""
    monkeypatch.setattr(R, "_raw_stream", lambda index: 77)
    log = []
    fc1, fc2 = Fp8Op(F, D), Fp8Op(D, F)
    runner, x, sizes, probs, ctx = _call([fc1, None, None, None, fc2], ("v1", "v0"),
                                         [fc1._parameters["weight"], fc2._parameters["weight"]])
    quantize = (lambda *args: log.append(("quantize", args)), 9, -(-D // 128))
    names = ("out", "out_scale", "out_amax", *(("saved",) if train else ()), "scale")
    tensors = (("out", None), ("scale", None), ("amax", None), *((("saved", None),) if train else ()),
               ("extra", "scale"))
    f1 = Fp8Launch(Fp8Bound(log, "F1", names, F, D), SimpleNamespace(step="F1"), "v0", "v4", F, fc1, tensors, 0,
                     quantize, "v1" if train else None, 2 * F if train else 0, True)
    f2 = Fp8Launch(Fp8Bound(log, "F2", ("out",), D, F), None, "v4", "v5", D, fc2, (("out", None),), 1, None)
    replay = R.ForwardReplay(runner, x, ctx, [f1, f2], Prologue(log), train)
    return replay, x, {"group_sizes": sizes, "scale": probs}, (fc1, fc2), log


@pytest.mark.parametrize("train", [False, True])
def test_an_fp8_block_replays_its_quantize_and_fp8_kernels(monkeypatch, train):
    """The prologue, then x's rowwise quantization into the scratch, F1 reading those codes and scales with the
    weight's cached FP8 blocks and writing its FP8-block output into the scratch (codes, scales, amax), F2 reading
    them as they are; each kernel its own tile counter, each weight's blocks asked of the cache at each call."""
    replay, x, extra, (fc1, fc2), log = _fp8_made(monkeypatch, train)
    LAUNCHES.reset()
    if train:
        ctx = RunContext(group_sizes=extra["group_sizes"], routed_group_sizes=extra["group_sizes"],
                         extra={"scale": extra["scale"]})
        y, saved = replay.train(x, ctx)
        pre, again = saved
        assert again is x and pre.shape == (ROWS, 2 * F) and pre.dtype == BF16
        bounds = ctx.counters.data_ptr()
    else:
        y = replay(x, extra)
        bounds = log[0][1][1]
    assert y.shape == (ROWS, D) and y.dtype == BF16 and replay.calls == 1
    assert [label for label, _ in log] == ["prologue", "quantize", "F1", "F2"]
    (_, q), (_, f1), (_, f2) = log[1:]
    x_ptr, codes, scales, *zeros, rows, grid, stream = q
    assert (x_ptr, rows, grid, stream, zeros) == (x.data_ptr(), ROWS, 9, 77, [0, 0, 0, 0])
    assert scales - codes >= ROWS * D and (scales - codes) % R.ALIGN == 0
    assert train or (codes - bounds) % R.ALIGN == 0 and codes - bounds >= 4 * (G + 1 + COUNTERS)   # past the bounds
    w1 = fc1.quantized_weight()
    a, b, sa, sb, offsets, counter, ptrs, M, ctas, stream = f1
    assert (a, b, sa, sb, offsets, M, ctas) == (codes, w1.data.data_ptr(), scales, w1.scale.data_ptr(), bounds, ROWS, 5)
    assert counter == bounds + 4 * (G + 1)
    out_codes, out_scales, amax = ptrs[:3]
    assert len({codes, scales, out_codes, out_scales, amax}) == 5 and ptrs[-1] == extra["scale"].data_ptr()
    if train:
        assert ptrs[3] == pre.data_ptr()
    w2 = fc2.quantized_weight()
    a, b, sa, sb, offsets, counter, ptrs, M, ctas, stream = f2
    assert (a, b, sa, sb, offsets, ptrs) == (out_codes, w2.data.data_ptr(), out_scales, w2.scale.data_ptr(), bounds,
                                             (y.data_ptr(),))
    assert counter == bounds + 4 * (G + 2)
    assert LAUNCHES.by_step == {"F1": 1}
    assert fc1.asked == fc2.asked == 2   # once in the call (and once above)


def test_an_fp8_replay_reads_the_weight_blocks_at_each_call(monkeypatch):
    """After an optimizer step the cache hands out the stepped weight's blocks: the replay launches on what it
    returns at that call; a cache with none sends the call back to the interpretive path."""
    replay, x, extra, (fc1, fc2), log = _fp8_made(monkeypatch, False)
    fc1.fresh = True
    replay(x, extra)
    assert log[2][1][1] == fc1._q.data.data_ptr() and log[2][1][3] == fc1._q.scale.data_ptr()
    log.clear()
    fc2.none = True
    assert replay(x, extra) is None and log == []
    fc2.none = False
    from fusion.kernels import fp8_quantize_api, tile_policy

    monkeypatch.setattr(tile_policy, "FP8_TILE_M", not tile_policy.FP8_TILE_M)    # another FP8 tile
    assert replay(x, extra) is None and log == []
    monkeypatch.undo()
    monkeypatch.setattr(R, "_raw_stream", lambda index: 77)
    assert replay(x, extra) is not None
    monkeypatch.setattr(fp8_quantize_api, "BOUND_ROWWISE", False)                # the quantize's binding off
    log.clear()
    assert replay(x, extra) is None and log == []
    monkeypatch.setattr(fp8_quantize_api, "BOUND_ROWWISE", True)
    monkeypatch.setattr(R, "FP8", False)                                          # the FP8 replays' A/B switch
    assert replay(x, extra) is None and log == []


def test_build_keeps_a_quantized_value_in_the_replay(monkeypatch):
    """An FP8-block value only feeds the FP8 GEMM that reads it as is: a plan whose output, or a value the backward
    reads, is quantized is not replayed; a plain step cannot read a quantized value."""
    from fusion.runtime.bounds import DevicePrologue

    replay, x, extra, (fc1, fc2), log = _fp8_made(monkeypatch, True)
    prologue = DevicePrologue(G, True)
    prologue._compiled[torch.int32] = Prologue(log)
    ctx = RunContext(group_sizes=extra["group_sizes"], routed_group_sizes=extra["group_sizes"],
                     extra={"scale": extra["scale"]}, counters=torch.zeros(G + 1 + COUNTERS, dtype=torch.int32),
                     groups=G)
    quantize = (lambda *args: None, 9, 1)
    q1 = Fp8Launch(Fp8Bound(log, "F1", ("out", "out_scale", "out_amax"), F, D), None, "v0", "v4", F, fc1,
                     (("out", None), ("scale", None), ("amax", None)), 0, quantize, quantized=True)
    q2 = Fp8Launch(Fp8Bound(log, "F2", ("out",), D, F), None, "v4", "v5", D, fc2, (("out", None),), 1, None)
    plain2 = S.BoundLaunch(Bound(log, "F2", ("out",)), None, "v4", "v5", D, fc2, (("out", None),), 1)

    def built(launches, saves=("v0",), ops=5):
        steps = [SimpleNamespace(replay_launch=lambda state, train, launch=launch: launch) for launch in launches]
        program = SimpleNamespace(prologue=prologue, forward_steps=steps, counters=COUNTERS,
                                  plan=SimpleNamespace(ops=[fc1] + [None] * (ops - 1), saves=saves))
        runner = SimpleNamespace(program=program, params=[], device_checked=True,
                                 seq=SimpleNamespace(inputs=SimpleNamespace(names=frozenset({"group_sizes", "scale"}))))
        state = SimpleNamespace(env={"v0": x})
        return R.build(runner, x, ctx, state, train=True)

    assert isinstance(built([q1, q2]), R.ForwardReplay)
    assert built([q1, q2], saves=("v0", "v4")) is None      # the backward reads F1's FP8 output
    assert built([q1], ops=4) is None                        # the block's output is FP8
    assert built([q1, plain2]) is None                       # a bf16 kernel cannot read the codes
