"""The torch.compile custom ops make a call's row bounds as the eager call does: by the program's device prologue
(one launch) where the runner has one, not by torch ops (fusion/runtime/custom_ops.py `_context`, DEVICE_BOUNDS).

The prologue exists only on a Hopper GPU; here a stand-in with the DevicePrologue's contract (the (G+1+counters,)
int32 buffer from ctx.group_sizes) takes its place on an emulated block, so the branch the GPU takes runs on the
CPU, and must give what the eager block gives."""
import pytest
import torch

import fusion
from fusion import Gather, GroupLinear, QuantizeMXFP8, Scale, Sequential, SwiGLU
from fusion.run_context import RunContext
from fusion.runtime import custom_ops, runner_for

E, D, F, ROWS = 4, 32, 64, 48


class StandInPrologue:
    """DevicePrologue's contract in torch ops: [0, o_1..o_G | zeroed counters]; records its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, ctx, rows, device, counters):
        self.calls += 1
        offsets = torch.cumsum(ctx.group_sizes, 0, dtype=torch.int32)
        return torch.nn.functional.pad(offsets, (1, counters))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _block():
    torch.manual_seed(0)
    return Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), backend="emulate")


def _inputs():
    x = torch.randn(ROWS, D, requires_grad=True)
    sizes = torch.tensor([10, 0, 30, ROWS - 40])
    probs = torch.rand(ROWS, requires_grad=True)
    return x, sizes, probs


def _step(call, seq, x, sizes, probs):
    y = call(x, group_sizes=sizes, scale=probs)
    y.backward(torch.ones_like(y))
    out = [y.detach(), x.grad, probs.grad, *(p.grad for p in seq.parameters())]
    x.grad = probs.grad = None
    for p in seq.parameters():
        p.grad = None
    return out


@pytest.mark.parametrize("device_bounds", [True, False])
def test_compiled_block_takes_the_programs_prologue(monkeypatch, device_bounds):
    seq = _block()
    x, sizes, probs = _inputs()
    want = _step(seq, seq, x, sizes, probs)   # eager, the emulated plan with torch bounds
    runner = runner_for(seq, x)
    stand_in = StandInPrologue()
    monkeypatch.setattr(runner.program, "prologue", stand_in)
    monkeypatch.setattr(runner, "device_checked", True)
    monkeypatch.setattr(custom_ops, "DEVICE_BOUNDS", device_bounds)
    cumsums = []
    real = custom_ops.group_offsets
    monkeypatch.setattr(custom_ops, "group_offsets", lambda s: cumsums.append(s) or real(s))
    # a fresh trace: a cached compiled backward may predate the split (its key does not hold SPLIT_BACKWARD)
    with torch._inductor.config.patch(force_disable_caches=True):
        got = _step(torch.compile(seq, fullgraph=True), seq, x, sizes, probs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    ops = 1 + (2 if custom_ops.SPLIT_BACKWARD and runner.program.split is not None else 1)
    assert ops == 3   # the forward op, and the backward in two (program.BackwardSplit)
    # the forward op makes the call's bounds and hands its buffer to the backward ops, which make none
    if device_bounds:   # one prologue launch; no torch offsets
        assert stand_in.calls == 1 and cumsums == []
    else:               # the torch ops make the offsets; the program then pads them (no prologue)
        assert stand_in.calls == 0 and len(cumsums) == 1


def test_backward_ops_take_the_forwards_buffer_and_zero_its_counters(monkeypatch):
    """The backward ops run over the buffer the forward's prologue made (no prologue of their own), and the last
    part zeroes the backward's tile counters after its launches: a second backward over the same forward
    (retain_graph) then finds them zeroed, as the kernels' dynamic schedules need. Kernels count on the counters;
    under emulation nothing does, so the program's backward parts here dirty them as launches would."""
    seq = _block()
    x, sizes, probs = _inputs()
    want = _step(seq, seq, x, sizes, probs)
    runner = runner_for(seq, x)
    program = runner.program
    assert program.backward_kernels > 0
    made, seen = [], []
    monkeypatch.setattr(program, "prologue", lambda ctx, rows, device, counters: made.append(
        StandInPrologue()(ctx, rows, device, counters)) or made[-1])
    monkeypatch.setattr(runner, "device_checked", True)
    real_part = program.backward_part

    def dirtying_part(values, ctx, rows, needs, start, stop):
        seen.append(ctx.counters)
        state = real_part(values, ctx, rows, needs, start, stop)
        with torch.autograd._unsafe_preserve_version_counter(ctx.counters):   # as a kernel's atomics: unseen
            ctx.counters.narrow(0, ctx.groups + 1 + program.forward_kernels, program.backward_kernels).fill_(7)
        return state

    monkeypatch.setattr(program, "backward_part", dirtying_part)
    compiled = torch.compile(seq, fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True):
        y = compiled(x, group_sizes=sizes, scale=probs)
        y.backward(torch.ones_like(y), retain_graph=True)
        first = [x.grad.clone(), probs.grad.clone()]
        x.grad = probs.grad = None
        y.backward(torch.ones_like(y))
    assert len(made) == 1 and len(seen) == 4 and all(b is made[0] for b in seen)
    backward = made[0][made[0].numel() - program.backward_kernels:]
    assert backward.eq(0).all()   # zeroed after the last part of each backward
    for got in (first, [x.grad, probs.grad]):
        torch.testing.assert_close(got[0], want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[2], rtol=1e-5, atol=1e-6)


def test_context_leaves_bounds_to_the_prologue():
    seq = _block()
    x, sizes, probs = _inputs()
    ctx = custom_ops._context(seq, x, sizes, None, [probs], device_checked=True)
    assert ctx.offsets is None and ctx.group_sizes is sizes and ctx.extra == {"scale": probs}
    ctx = custom_ops._context(seq, x, sizes, None, [probs], device_checked=False)
    assert ctx.offsets.tolist() == [10, 10, 40, 48]


def _moe_block(quantize: bool):
    ops = [Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale()]
    ops += [QuantizeMXFP8()] if quantize else []
    return Sequential(*ops, GroupLinear(E, F, D), backend="emulate")


def test_context_after_a_gather():
    """The routed prologue absorbs the padding rows (index -1 past the sizes' sum) into the last group; an empty
    routing has nothing for it to launch on, so torch ops do it."""
    seq = _moe_block(False)
    tokens = torch.randn(8, D)
    index = torch.tensor([0, 1, 2, 3, 4, 5, -1, -1])
    sizes = torch.tensor([2, 0, 3, 1])   # 6 of 8 routed rows; two padding rows
    probs = torch.rand(8)
    ctx = custom_ops._context(seq, tokens, sizes, index, [probs], device_checked=True)
    assert ctx.offsets is None and ctx.group_sizes is sizes and ctx.routed_group_sizes is sizes
    ctx = custom_ops._context(seq, tokens, sizes, index, [probs], device_checked=False)
    assert ctx.group_sizes.tolist() == [2, 0, 3, 3] and ctx.offsets.tolist() == [2, 2, 5, 8]
    empty = torch.empty(0, dtype=torch.long)
    ctx = custom_ops._context(seq, tokens, torch.zeros(E, dtype=torch.long), empty, [torch.rand(0)],
                              device_checked=True)
    assert ctx.offsets is not None and ctx.offsets.tolist() == [0, 0, 0, 0]


def test_saved_quantized_values_see_the_absorbed_sizes():
    """A saved QuantizedTensor's columnwise blocks are per group of the sizes its forward saw (padding absorbed):
    the backward op rebuilds it with those, before the routed prologue has run; without a quantized saved value it
    computes nothing."""
    index = torch.tensor([0, 1, 2, -1])
    sizes = torch.tensor([1, 0, 2, 0])
    ctx = RunContext(group_sizes=sizes, routed_group_sizes=sizes, index=index)
    seq = _moe_block(True)
    quantized = [f"v{i + 1}" for i, op in enumerate(seq.ops) if op.spec.kind == "quantize"]
    assert custom_ops._saved_group_sizes(seq, quantized, ctx, index).tolist() == [1, 0, 2, 1]
    assert custom_ops._saved_group_sizes(seq, ["v2"], ctx, index) is None
    ctx.offsets = torch.tensor([1, 1, 3, 4], dtype=torch.int32)   # torch ops made them: ctx's sizes as they are
    assert custom_ops._saved_group_sizes(seq, quantized, ctx, index) is sizes
    assert custom_ops._saved_group_sizes(seq, quantized, ctx, None) is sizes


def _traced_graphs(seq, x, sizes, probs) -> list:
    """The FX graphs dynamo hands a backend when it compiles a forward of `seq` (run eagerly)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(seq, fullgraph=True, backend=backend)(x, group_sizes=sizes, scale=probs)
    return graphs


def _asserts(graphs) -> int:
    return sum("_assert_async" in str(node.target) for gm in graphs for node in gm.graph.nodes)


def test_graph_leaves_the_sizes_values_to_the_programs_prologue(monkeypatch):
    """Where the op's program checks the group sizes' values on the device (its prologue), the traced graph checks
    only what reads no data: no device assert, no kernel of its own around the op. Without a prologue it keeps
    them; and a call that then makes the bounds by torch ops (DEVICE_BOUNDS off after tracing) checks the values
    inside the op, so a bad size still raises."""
    seq = _block()
    x, sizes, probs = _inputs()
    x = x.detach()
    assert _asserts(_traced_graphs(seq, x, sizes, probs)) == 1      # emulate: no prologue, the graph checks
    torch._dynamo.reset()
    runner = runner_for(seq, x)
    monkeypatch.setattr(runner.program, "prologue", StandInPrologue())
    monkeypatch.setattr(runner, "device_checked", True)
    assert _asserts(_traced_graphs(seq, x, sizes, probs)) == 0
    torch._dynamo.reset()
    compiled = torch.compile(seq, fullgraph=True)
    bad = torch.tensor([10, -5, 35, ROWS - 40])                     # sums to ROWS, one negative
    with torch.no_grad():
        compiled(x, group_sizes=sizes, scale=probs)                  # traced with the values left to the prologue
        monkeypatch.setattr(custom_ops, "DEVICE_BOUNDS", False)
        with pytest.raises(RuntimeError, match="group_sizes must be in"):
            compiled(x, group_sizes=bad, scale=probs)


#: The ops' schemas (a hash) under each contract name. torch's on-disk caches of compiled graphs key a training graph
#: by its traced forward, which names the forward op only: an op whose arguments change under the same name would be
#: called by a cached graph with the old ones (fusion/runtime/custom_ops.py CONTRACT). A change to what the ops take,
#: or to what they return (a Tensor[] in any schema, so no hash sees it), needs a new CONTRACT and an entry here.
CONTRACT_SCHEMAS = {"v2": "e937e4e299473d6a"}


def test_a_changed_op_schema_comes_with_a_new_contract():
    import hashlib

    names = sorted(custom_ops.IMPLEMENTATIONS)
    schemas = [str(getattr(getattr(torch.ops.fusion, n), custom_ops.CONTRACT)._schema) for n in names]
    digest = hashlib.sha256("\n".join(schemas).encode()).hexdigest()[:16]
    assert CONTRACT_SCHEMAS.get(custom_ops.CONTRACT) == digest, (
        f"the ops' schemas changed ({digest}) under contract {custom_ops.CONTRACT!r}: give custom_ops.CONTRACT a new "
        f"name and add it here")
