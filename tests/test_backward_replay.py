"""The backward's replay (fusion/runtime/backward_replay.py), no GPU: a recorded four-step backward of a two-GEMM block
(fused dgrad with its row sums, FC2's weight gradient, the lone dgrad, FC1's weight gradient) whose launches are
stand-ins that record their arguments, so the test sees every pointer the replay passes: each step reading what an
earlier one allocated, the saved values, dY, the weights and the router scale, each kernel its own tile counter; dY
and the saved values freed where the record dropped them; the gradients returned in the program's order; and every
guard sending a changed call back to the program (None, nothing taken). On the GPU: tests/test_backward_replay_gpu.py.
"""
import weakref
from types import SimpleNamespace

import pytest
import torch

from fusion.run_context import RunContext
from fusion.runtime import backward_replay as B
from fusion.runtime.kernel import LAUNCHES
from fusion.runtime.replay import aligned
from fusion.runtime.steps import StepLaunches

BF16, F32 = torch.bfloat16, torch.float32
G, ROWS, D, F = 4, 64, 32, 48
COUNTERS = 6
BASE = 4 * (G + 1)   # the first tile counter's byte offset in the bounds buffer


class Launch:
    """A compiled launch stand-in: records its arguments (and runs `check` first, if given)."""

    def __init__(self, log, label, check=None):
        self.log, self.label, self.check = log, label, check

    def __call__(self, *args):
        if self.check is not None:
            self.check()
        self.log.append((self.label, args))


def _setup(monkeypatch, dy_dropped_check=None):
    monkeypatch.setattr(B, "_raw_stream", lambda index: 77)
    log = []
    w1 = torch.randn(G, 2 * F, D, dtype=BF16)
    w2 = torch.randn(G, D, F, dtype=BF16)
    fc1, fc2 = SimpleNamespace(_parameters={"weight": w1}), SimpleNamespace(_parameters={"weight": w2})
    zeroed = []
    program = SimpleNamespace(plan=SimpleNamespace(saves=("v1", "v0")), output_grad="g4", input_grad="g0",
                              params=[w1, w2], prologue=object(),
                              zero_backward_counters=lambda ctx: zeroed.append(ctx))
    job = SimpleNamespace(step="B1")
    b1 = StepLaunches(
        ((("value", "g1"), (ROWS, 2 * F), BF16), (None, (ROWS, 2), F32), (("value", "v3"), (ROWS, F), BF16),
         (("extra", "scale"), (ROWS,), BF16)),
        ((Launch(log, "B1"), (("value", "g4"), ("weight", fc2), ("bounds", 0), ("bounds", BASE + 4 * 2), ("bounds", 0),
                              [("made", 0), ("value", "v1"), ("extra", "scale"), ("made", 1), ("made", 2)], ROWS,
                              ROWS, 3, ("stream",)), job),
         (Launch(log, "rows"), (("made", 1), ("made", 3), ROWS, ("stream",)), None)))
    b2 = StepLaunches(((("param", w2), tuple(w2.shape), BF16),),
                      ((Launch(log, "B2"), (("value", "g4"), ("value", "v3"), ("bounds", 0), ("bounds", 0),
                                            ("made", 0), ROWS, ROWS, ROWS, 5, ("stream",)), None),))
    b3 = StepLaunches(((("value", "g0"), (ROWS, D), BF16),),
                      ((Launch(log, "B3", dy_dropped_check), (("value", "g1"), ("weight", fc1), ("bounds", 0),
                                                              ("bounds", BASE + 4 * 4), ("bounds", 0), [("made", 0)],
                                                              ROWS, ROWS, 2, ("stream",)), None),))
    b4 = StepLaunches(((("param", w1), tuple(w1.shape), BF16),),
                      ((Launch(log, "B4"), (("value", "g1"), ("value", "v0"), ("bounds", 0), ("bounds", 0),
                                            ("made", 0), ROWS, ROWS, ROWS, 5, ("stream",)), None),))
    record = [(b1, ("v1",)), (b2, ("g4", "v3")), (b3, ()), (b4, ("g1", "v0"))]
    sizes = torch.full((G,), ROWS // G, dtype=torch.int32)
    probs = torch.rand(ROWS, dtype=BF16)

    def ctx():
        return RunContext(group_sizes=sizes, routed_group_sizes=sizes, extra={"scale": probs},
                          counters=torch.zeros(G + 1 + COUNTERS, dtype=torch.int32), groups=G)

    call = B.CallShape((ROWS, D), BF16, torch.device("cpu"), -1, (((ROWS, 2 * F), BF16), ((ROWS, D), BF16)))
    replay = B.build(program, ctx(), record, call, (True, True, True, True))
    assert isinstance(replay, B.BackwardReplay)
    return SimpleNamespace(replay=replay, log=log, w1=w1, w2=w2, fc1=fc1, probs=probs, ctx=ctx, zeroed=zeroed,
                           program=program, record=record, call=call)


def _call_inputs():
    return torch.randn(ROWS, D, dtype=BF16), torch.randn(ROWS, 2 * F, dtype=BF16), torch.randn(ROWS, D, dtype=BF16)


def test_the_replay_launches_each_step_on_what_the_steps_before_made(monkeypatch):
    s = _setup(monkeypatch)
    dy, pre, x = _call_inputs()
    ctx = s.ctx()
    LAUNCHES.reset()
    dx, grads, extra = s.replay([dy], [pre, x], ctx)
    assert s.replay.calls == 1 and ctx.backward_counters_used and not s.zeroed
    assert [label for label, _ in s.log] == ["B1", "rows", "B2", "B3", "B4"]
    (_, b1), (_, rows), (_, b2), (_, b3), (_, b4) = s.log
    bounds = ctx.counters.data_ptr()
    a, w, offsets, counter, index, ptrs, M, T, ctas, stream = b1
    assert (a, w, offsets, counter, index, M, T, ctas, stream) == (
        dy.data_ptr(), s.w2.data_ptr(), bounds, bounds + BASE + 8, bounds, ROWS, ROWS, 3, 77)
    dinput, saved, scale, partials, postact = ptrs
    assert saved == pre.data_ptr() and scale == s.probs.data_ptr()
    assert len({dinput, partials, postact}) == 3
    assert rows == (partials, extra[0].data_ptr(), ROWS, 77)               # the row sums read the partials
    assert b2[:2] == (dy.data_ptr(), postact) and b2[4] == grads[1].data_ptr()   # FC2's weight gradient
    assert b3[0] == dinput and b3[1] == s.w1.data_ptr() and b3[3] == bounds + BASE + 16
    assert b3[5] == (dx.data_ptr(),)
    assert b4[:2] == (dinput, x.data_ptr()) and b4[4] == grads[0].data_ptr()
    assert dx.shape == (ROWS, D) and grads[0].shape == s.w1.shape and grads[1].shape == s.w2.shape
    assert extra[0].shape == (ROWS,) and extra[0].dtype == BF16
    assert LAUNCHES.by_step == {"B1": 1}                                  # the fused step counted, as when it runs


def test_dy_is_freed_after_its_last_reader(monkeypatch):
    """The record drops dY after FC2's weight gradient: by the lone dgrad's launch no reference is left (the caller
    handed it over in the output_grad list, as the autograd node does)."""
    seen = []
    s = _setup(monkeypatch, dy_dropped_check=lambda: seen.append(ref()))
    dy, pre, x = _call_inputs()
    ref = weakref.ref(dy)
    grad = [dy]
    del dy
    saved = [pre, x]
    s.replay(grad, saved, s.ctx())
    assert seen == [None] and grad == [] and saved == []


def test_a_steps_scratch_is_freed_with_the_step(monkeypatch):
    """The fused dgrad's row-sum partials (scratch: no later step reads them) are gone by the next step's launch, as
    the interpretive step's outputs dictionary is."""
    import gc

    def partials_alive():
        return sum(type(o) is torch.Tensor and o.shape == (ROWS, 2) and o.dtype == F32 for o in gc.get_objects())

    seen = []
    s = _setup(monkeypatch)
    s.replay.steps[0][1][1][0].check = lambda: seen.append(partials_alive())   # the row sums: they read them
    s.replay.steps[1][1][0][0].check = lambda: seen.append(partials_alive())   # FC2's weight gradient: after
    dy, pre, x = _call_inputs()
    s.replay([dy], [pre, x], s.ctx())
    assert seen == [1, 0]


def test_a_second_backward_over_one_buffer_zeroes_its_counters(monkeypatch):
    s = _setup(monkeypatch)
    ctx = s.ctx()
    s.replay([_call_inputs()[0]], list(_call_inputs()[1:]), ctx)
    assert not s.zeroed
    s.replay([_call_inputs()[0]], list(_call_inputs()[1:]), ctx)
    assert s.zeroed == [ctx]


def test_weights_are_read_at_each_call(monkeypatch):
    s = _setup(monkeypatch)
    new = torch.randn_like(s.w1)
    s.fc1._parameters["weight"] = new
    s.replay([_call_inputs()[0]], list(_call_inputs()[1:]), s.ctx())
    assert s.log[3][1][1] == new.data_ptr()


@pytest.mark.parametrize("change", ["dy shape", "dy dtype", "strided dy", "saved shape", "saved missing",
                                    "strided weight", "weight shape", "strided scale", "scale dtype", "groups",
                                    "no bounds", "disabled", "poisoned"])
def test_a_changed_call_goes_to_the_program_with_nothing_taken(monkeypatch, change):
    s = _setup(monkeypatch)
    dy, pre, x = _call_inputs()
    ctx = s.ctx()
    if change == "dy shape":
        dy = torch.randn(ROWS + 1, D, dtype=BF16)
    elif change == "dy dtype":
        dy = dy.half()
    elif change == "strided dy":
        dy = torch.randn(D, ROWS, dtype=BF16).t()
    elif change == "saved shape":
        pre = pre[:-1]
    elif change == "saved missing":
        pre = None
    elif change == "strided weight":
        s.fc1._parameters["weight"] = torch.randn(G, D, 2 * F, dtype=BF16).transpose(1, 2)
    elif change == "weight shape":
        s.fc1._parameters["weight"] = torch.randn(G, 2 * F, D + 8, dtype=BF16)
    elif change == "strided scale":
        ctx.extra["scale"] = torch.rand(ROWS, 2, dtype=BF16)[:, 0]
    elif change == "scale dtype":   # the fused dgrad's epilogue reads the scale in the dtype it was built for
        ctx.extra["scale"] = ctx.extra["scale"].float()
    elif change == "groups":
        ctx.groups = G + 1
    elif change == "no bounds":
        ctx.counters = None
    elif change == "disabled":
        monkeypatch.setattr(B, "ENABLED", False)
    elif change == "poisoned":
        monkeypatch.setitem(B.POISON, "on", True)
    grad, saved = [dy], [pre, x]
    assert s.replay(grad, saved, ctx) is None
    assert grad == [dy] and len(saved) == 2 and not s.log and s.replay.calls == 0


def test_what_cannot_be_repeated_builds_no_replay(monkeypatch):
    s = _setup(monkeypatch)
    needs = (True, True, True, True)
    ctx = s.ctx()
    assert B.build(s.program, ctx, [(None, ())] + s.record[1:], s.call, needs) is None      # a step said nothing
    twice = s.record + [s.record[1]]                                                       # FC2's gradient twice
    assert B.build(s.program, ctx, twice, s.call, needs) is None
    assert B.build(s.program, ctx, s.record[1:], s.call, needs) is None    # reads v3, which no recorded step made
    assert B.build(s.program, ctx, s.record, s.call._replace(saved=(False, None)), needs) is None   # a quantized save
    no_prologue = SimpleNamespace(**{**vars(s.program), "prologue": None})
    assert B.build(no_prologue, ctx, s.record, s.call, needs) is None


def test_gradients_nobody_wants_are_none(monkeypatch):
    """x needs no gradient: the record has no lone dgrad (the program skipped it) and the replay returns dx None."""
    s = _setup(monkeypatch)
    record = [s.record[0], s.record[1], (StepLaunches((), ()), ()), s.record[3]]
    replay = B.build(s.program, s.ctx(), record, s.call, (False, True, True, True))
    dy, pre, x = _call_inputs()
    dx, grads, extra = replay([dy], [pre, x], s.ctx())
    assert dx is None and all(g is not None for g in grads) and extra[0] is not None
    assert [label for label, _ in s.log] == ["B1", "rows", "B2", "B4"]


def test_a_routed_replay_reads_the_calls_index_and_layout(monkeypatch):
    """An MoE block's steps: the Combine's backward copy through the routing index, a weight gradient through the
    gather index, the Gather's backward combine by the call's token layout; the gather kernel was compiled for the
    routing index's dtype, so an int32 index where the replay was built at int64 sends the call to the program."""
    monkeypatch.setattr(B, "_raw_stream", lambda index: 77)
    log = []
    w = torch.randn(G, D, F, dtype=BF16)
    op = SimpleNamespace(_parameters={"weight": w})
    program = SimpleNamespace(plan=SimpleNamespace(saves=("v1",)), output_grad="g2", input_grad="g0", params=[w],
                              prologue=object(), zero_backward_counters=lambda ctx: None)
    copy = StepLaunches(((("value", "g1"), (ROWS, D), BF16),),
                        ((Launch(log, "gather"), (("value", "g2"), ("index",), ("made", 0), ROWS // 2, ROWS,
                                                  ("stream",)), None),))
    wgrad = StepLaunches(((("param", w), tuple(w.shape), BF16),),
                         ((Launch(log, "wgrad"), (("value", "g1"), ("value", "v1"), ("bounds", 0), ("gather_index",),
                                                  ("made", 0), ROWS, ROWS, ROWS, 5, ("stream",)), None),))
    combine = StepLaunches(((("value", "g0"), (ROWS // 2, D), BF16),),
                           ((Launch(log, "combine"), (("value", "g1"), ("layout", 0), ("layout", 1), ("made", 0),
                                                      ROWS, ROWS // 2, ("stream",)), None),))
    index = torch.arange(ROWS) % (ROWS // 2)

    def ctx(index):
        c = RunContext(index=index, counters=torch.zeros(G + 1 + COUNTERS, dtype=torch.int32), groups=G,
                       tokens=ROWS // 2)
        c.derived["gather_index"] = index.to(torch.int32)
        c.derived["token_layout"] = (torch.argsort(index), torch.arange(ROWS // 2 + 1) * 2)
        return c

    call = B.CallShape((ROWS // 2, D), BF16, torch.device("cpu"), -1, (((ROWS, F), BF16),))
    record = [(copy, ("g2",)), (wgrad, ("v1",)), (combine, ("g1",))]
    replay = B.build(program, ctx(index), record, call, (True, True))
    dy, h = torch.randn(ROWS // 2, D, dtype=BF16), torch.randn(ROWS, F, dtype=BF16)
    c = ctx(index)
    dx, grads, extra = replay([dy], [h], c)
    (_, gather), (_, wgrad), (_, comb) = log
    assert gather[1] == index.data_ptr() and wgrad[3] == c.derived["gather_index"].data_ptr()
    rows, offsets = c.derived["token_layout"]             # the Gather's backward sums by the call's token layout
    assert comb[:4] == (gather[2], rows.data_ptr(), offsets.data_ptr(), dx.data_ptr())
    assert dx.shape == (ROWS // 2, D) and grads[0].shape == w.shape and extra == []
    assert replay([dy], [h], ctx(index.to(torch.int32))) is None


class Fp8Op:
    """An fp8_block GroupLinear stand-in: its weight, and the cache's blocks (`quantized_weight`, asked at each
    call: `fresh` hands out new buffers, as after the weight changed shape; `none`: the cache has none)."""

    def __init__(self, weight):
        self._parameters = {"weight": weight}
        self.fresh = self.none = False
        self.blocks = self._blocks()

    def _blocks(self):
        G_, N, K = self._parameters["weight"].shape
        return SimpleNamespace(data_t=torch.empty(G_, K, N, dtype=torch.uint8),
                               scale_t=torch.empty(G_, -(-K // 128), -(-N // 128), dtype=F32))

    def quantized_weight(self):
        if self.fresh:
            self.blocks = self._blocks()
        return None if self.none else self.blocks


def _fp8_setup(monkeypatch):
    """An FP8 block's lone dgrad recorded: dY's rowwise quantization into the step's scratch, then the FP8 kernel
    on those codes and scales with the weight's transposed blocks, writing dX."""
    monkeypatch.setattr(B, "_raw_stream", lambda index: 77)
    log = []
    w = torch.randn(G, D, F, dtype=BF16)
    fc = Fp8Op(w)
    program = SimpleNamespace(plan=SimpleNamespace(saves=()), output_grad="g2", input_grad="g1", params=[w],
                              prologue=object(), zero_backward_counters=lambda ctx: None,
                              backward_steps=[SimpleNamespace(fp8=True)])
    step = StepLaunches(
        ((None, (ROWS, D), torch.uint8), (None, (1, ROWS), F32), (("value", "g1"), (ROWS, F), BF16)),
        ((Launch(log, "quantize"), (("value", "g2"), ("made", 0), ("made", 1), 0, 0, 0, 0, ROWS, 7, ("stream",)),
          None),
         (Launch(log, "dgrad"), (("made", 0), ("fp8_weight", fc, 0), ("made", 1), ("fp8_weight", fc, 1),
                                 ("bounds", 0), ("bounds", BASE), [("made", 2)], ROWS, 4, ("stream",)), None)))
    sizes = torch.full((G,), ROWS // G, dtype=torch.int32)

    def ctx():
        return RunContext(group_sizes=sizes, routed_group_sizes=sizes,
                          counters=torch.zeros(G + 1 + COUNTERS, dtype=torch.int32), groups=G)

    call = B.CallShape((ROWS, D), BF16, torch.device("cpu"), -1, ())
    replay = B.build(program, ctx(), [(step, ("g2",))], call, (True, False))
    assert isinstance(replay, B.BackwardReplay) and replay.fp8
    return replay, fc, log, ctx


def test_an_fp8_dgrad_replays_its_quantization_and_reads_the_weight_blocks_at_each_call(monkeypatch):
    replay, fc, log, ctx = _fp8_setup(monkeypatch)
    dy = torch.randn(ROWS, D, dtype=BF16)
    c = ctx()
    dx, grads, _ = replay([dy], [], c)
    (_, q), (_, k) = log
    assert q[0] == dy.data_ptr() and q[3:] == (0, 0, 0, 0, ROWS, 7, 77)
    codes, scales = q[1], q[2]
    # dY's codes and scales (the step's scratch) share one buffer: one allocation beside dX's
    assert scales == codes + aligned(ROWS * D)
    assert sum(" = _empty" in text for text in replay._run.__fusion_source__.splitlines()) == 2
    bounds = c.counters.data_ptr()
    assert k == (codes, fc.blocks.data_t.data_ptr(), scales, fc.blocks.scale_t.data_ptr(), bounds, bounds + BASE,
                 (dx.data_ptr(),), ROWS, 4, 77)
    assert dx.shape == (ROWS, F) and grads == [None]
    fc.fresh = True                      # the cache's blocks at this call, not the recording's
    log.clear()
    replay([torch.randn(ROWS, D, dtype=BF16)], [], ctx())
    assert log[1][1][1] == fc.blocks.data_t.data_ptr() and log[1][1][3] == fc.blocks.scale_t.data_ptr()
    fc.fresh, fc.none = False, True      # no blocks: the program runs the call
    log.clear()
    assert replay([torch.randn(ROWS, D, dtype=BF16)], [], ctx()) is None and log == []
    fc.none = False
    from fusion.quant import fp8_linear

    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", not fp8_linear.WGRAD_IN_BF16)   # an FP8 switch
    assert replay([torch.randn(ROWS, D, dtype=BF16)], [], ctx()) is None and log == []


def test_the_fp8_switch_sends_fp8_replays_to_the_program(monkeypatch):
    from fusion.runtime import replay as R

    replay, fc, log, ctx = _fp8_setup(monkeypatch)
    monkeypatch.setattr(R, "FP8", False)
    assert replay([torch.randn(ROWS, D, dtype=BF16)], [], ctx()) is None and log == []
    monkeypatch.setattr(R, "FP8", True)
    assert replay([torch.randn(ROWS, D, dtype=BF16)], [], ctx()) is not None
