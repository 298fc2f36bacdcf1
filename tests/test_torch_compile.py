"""torch.compile(fullgraph=True) of blocks and of models holding them: forward and backward equal eager, with
zero graph breaks, on the reference path (traced op by op) and on the fused program (backend="emulate" here:
the same custom ops the Hopper path uses, fusion::block_forward / fusion::block_backward)."""
import copy

import pytest
import torch

import fusion
from fusion import (Activation, Bias, Clamp, GroupLinear, Linear, QuantizeMXFP8, QuantizeNVFP4, Scale, Sequential,
                    SReLU, SwiGLU)

USER_FILE = """
activation mish_glu(gate, up) {
    forward = gate * tanh(softplus(gate)) * up
}
"""


@pytest.fixture(autouse=True, scope="module")
def _user_patterns(tmp_path_factory):
    path = tmp_path_factory.mktemp("fpat") / "user.fpat"
    path.write_text(USER_FILE)
    fusion.load_patterns(path)
    yield
    from fusion.patterns.registry import reset_to_builtins

    reset_to_builtins()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


E, D, F = 4, 32, 64

BLOCKS = {
    "moe-swiglu-scale": lambda: [GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D)],
    "moe-bias-clamp": lambda: [GroupLinear(E, D, 2 * F, bias=True), SwiGLU(), Clamp(-1.0, 1.0), GroupLinear(E, F, D)],
    "moe-bias-op-scale": lambda: [GroupLinear(E, D, F), Bias(F, num_groups=E), Scale(), GroupLinear(E, F, D)],
    "moe-user-activation": lambda: [GroupLinear(E, D, 2 * F), Activation("mish_glu"), Scale(), GroupLinear(E, F, D)],
    "moe-mxfp8": lambda: [GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), QuantizeMXFP8(columnwise=False),
                          GroupLinear(E, F, D)],
    "moe-nvfp4": lambda: [GroupLinear(E, D, F), SReLU(), QuantizeNVFP4(columnwise=False), GroupLinear(E, F, D)],
    "dense-srelu-const-scale": lambda: [Linear(D, F, bias=True), SReLU(), Scale(value=0.5), Linear(F, D)],
}


def inputs(block, rows=48):
    x = torch.randn(rows, D)
    extra = {}
    if any("group_sizes" in op.spec.extra_inputs for op in block):
        extra["group_sizes"] = torch.tensor([10, 0, 30, rows - 40])
    if any(op.spec.name == "Scale" and op.per_row for op in block):
        extra["scale"] = torch.rand(rows)
    return x, extra


def forward_backward(block, x, extra, dy):
    xi = x.clone().requires_grad_()
    ex = {k: (v.clone().requires_grad_() if v.is_floating_point() else v) for k, v in extra.items()}
    y = block(xi, **ex)
    y.backward(dy)
    return [y.detach(), xi.grad, *(p.grad for p in block.parameters()),
            *(v.grad for v in ex.values() if v.is_floating_point())]


@pytest.mark.parametrize("backend", ["auto", "emulate"])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_fullgraph_equals_eager(name, backend):
    torch.manual_seed(0)
    block = Sequential(*BLOCKS[name](), backend=backend)
    x, extra = inputs(block)
    explanation = torch._dynamo.explain(block)(x, **extra)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = copy.deepcopy(block)
    dy = torch.randn(x.shape[0], D)
    compiled = torch.compile(block, fullgraph=True)
    got = forward_backward(compiled, x, extra, dy)
    want = forward_backward(eager, x, extra, dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class Model(torch.nn.Module):
    """Blocks among ordinary layers: norm -> MoE experts -> residual -> dense MLP."""

    def __init__(self, backend):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.experts = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), backend=backend)
        self.mlp = Sequential(Linear(D, 2 * F), SwiGLU(), Linear(F, D), backend=backend)
        self.head = torch.nn.Linear(D, 8)

    def forward(self, x, group_sizes, probs):
        h = x + self.experts(self.norm(x), group_sizes=group_sizes, scale=probs)
        return self.head(h + self.mlp(h))


@pytest.mark.parametrize("backend", ["auto", "emulate"])
def test_model_with_blocks_fullgraph(backend):
    torch.manual_seed(0)
    model = Model(backend)
    x, sizes, probs = torch.randn(40, D), torch.tensor([8, 12, 0, 20]), torch.rand(40)
    explanation = torch._dynamo.explain(model)(x, sizes, probs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    for m in (compiled, eager):
        m(x, sizes, probs).square().sum().backward()
    torch.testing.assert_close(compiled(x, sizes, probs), eager(x, sizes, probs), rtol=1e-5, atol=1e-5)
    for (n, a), b in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{n}: {m}")


def test_new_group_sizes_do_not_recompile():
    """group_sizes are data: new counts (same shapes) reuse the compiled graph."""
    block = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), backend="emulate")
    compiled = torch.compile(block, fullgraph=True)
    x, extra = inputs(block)
    compiled(x, **extra)
    torch._dynamo.utils.counters.clear()
    for sizes in ([48, 0, 0, 0], [12, 12, 12, 12]):
        y = compiled(x, group_sizes=torch.tensor(sizes), scale=extra["scale"])
        torch.testing.assert_close(y, block(x, group_sizes=torch.tensor(sizes), scale=extra["scale"]))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_bad_inputs_still_raise_under_compile():
    block = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), GroupLinear(E, F, D), backend="emulate")
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(16, D)
    with pytest.raises(Exception, match="group_sizes"):
        compiled(x, group_sizes=torch.tensor([4, 4, 4, 5]))


def test_export_inference_block():
    """torch.export of an inference block (reference path): the exported program computes the block."""
    block = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D))
    x, extra = inputs(block)
    with torch.no_grad():
        exported = torch.export.export(block, (x,), kwargs=extra)
        torch.testing.assert_close(exported.module()(x, **extra), block(x, **extra))


def test_export_emulated_block():
    """torch.export of a block on the fused program: the custom op is in the exported graph."""
    block = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), backend="emulate")
    x, extra = inputs(block)
    with torch.no_grad():
        exported = torch.export.export(block, (x,), kwargs=extra)
        assert "fusion.block_forward" in str(exported.graph)
        torch.testing.assert_close(exported.module()(x, **extra), block(x, **extra))


def test_training_a_bf16_gated_block_of_odd_rows():
    """GroupLinear(E, 64, 320) -> SwiGLU -> GroupLinear(E, 160, 64), bf16, 300 rows, training: the fake of
    fusion::block_forward and the program agree on every saved value (shapes and strides), and compiled equals
    eager."""
    torch.manual_seed(0)
    block = Sequential(GroupLinear(E, 64, 320), SwiGLU(), GroupLinear(E, 160, 64), backend="emulate")
    block = block.to(torch.bfloat16)
    x, sizes = torch.randn(300, 64, dtype=torch.bfloat16), torch.tensor([100, 50, 0, 150])
    dy = torch.randn(300, 64, dtype=torch.bfloat16)
    eager = copy.deepcopy(block)
    got = forward_backward(torch.compile(block, fullgraph=True), x, {"group_sizes": sizes}, dy)
    want = forward_backward(eager, x, {"group_sizes": sizes}, dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


VIEW_FILE = """
activation pass_up(gate, up) {
    forward = up
}
"""


def test_saved_values_that_are_views_come_out_as_the_fake_says(tmp_path):
    """A program value may be a view: here the activation returns its `up` half, a (rows, f) view with stride
    2f of its saved input. The op returns what its fake promises: contiguous, aliasing no other output."""
    path = tmp_path / "view.fpat"
    path.write_text(VIEW_FILE)
    fusion.load_patterns(path)
    torch.manual_seed(0)
    # out_features 24 / in_features 12: no built-in pattern applies, the emulated program runs every op
    block = Sequential(GroupLinear(E, D, 24), Activation("pass_up"), GroupLinear(E, 12, D), backend="emulate")
    x, extra = inputs(block)
    dy = torch.randn(x.shape[0], D)
    eager = copy.deepcopy(block)
    got = forward_backward(torch.compile(block, fullgraph=True), x, extra, dy)
    want = forward_backward(eager, x, extra, dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("columnwise", [False, True])
def test_inference_of_a_block_ending_in_a_quantize_op(columnwise):
    """fullgraph inference of an emulated block whose output is a QuantizedTensor: the traced side rebuilds it
    without running anything on the meta device (dynamo cannot enter that context)."""
    block = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), QuantizeMXFP8(columnwise=columnwise), backend="emulate")
    x, extra = inputs(block)
    with torch.no_grad():
        got = torch.compile(block, fullgraph=True)(x, **extra)
        want = block(x, **extra)
    assert type(got) is type(want) and got.shape == want.shape
    torch.testing.assert_close(got.dequantize(), want.dequantize())
    if columnwise:
        torch.testing.assert_close(got.dequantize(columnwise=True), want.dequantize(columnwise=True))


@pytest.mark.parametrize("op", [QuantizeMXFP8(), QuantizeMXFP8(columnwise=False), QuantizeNVFP4(),
                                QuantizeNVFP4(columnwise=False)], ids=repr)
@pytest.mark.parametrize("grouped", [False, True])
def test_quantized_layout_is_what_the_quantize_op_returns(op, grouped):
    """custom_ops._layout (from the op's attributes) names the buffers a real run returns, in order."""
    from fusion.ops.base import RunContext
    from fusion.runtime.custom_ops import _buffer_names, _layout

    sizes = torch.tensor([40, 24]) if grouped else None
    value = op.reference(torch.randn(64, 64), RunContext(group_sizes=sizes))
    names, meta = _layout(op, torch.float32)
    assert names == _buffer_names(value) and meta == value.__tensor_flatten__()[1]


@pytest.mark.parametrize("copy_rows", [False, True], ids=["gather-in-kernel", "gather-as-copy"])
def test_moe_layer_fullgraph_equals_eager(monkeypatch, copy_rows):
    """A whole fusion.MoE (router, routing with token rounding, Gather, experts, Combine) on the fused program under
    torch.compile(fullgraph=True): output and every gradient equal eager, whether FC1 gathers its rows in its A loads
    or runs the Gather as a copy first (kernels/tile_policy.py gathers_in_kernel; the threshold moved here so this
    small layer takes each)."""
    from fusion.kernels import tile_policy
    from fusion.planner import clear_cache

    monkeypatch.setattr(tile_policy, "FC1_COPY_MIN_N", 0 if copy_rows else 1 << 30)
    clear_cache()
    torch.manual_seed(0)
    moe = fusion.MoE.swiglu(D, 8, F, 2, dtype=torch.float64, backend="emulate", round_to=4)
    twin = copy.deepcopy(moe)
    x = torch.randn(3, 13, D, dtype=torch.float64)
    dy = torch.randn_like(x)

    def grads(layer, fn):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(dy)
        return [y.detach(), xi.grad, *(p.grad for p in layer.parameters())]

    from fusion.runtime import gather as gather_method

    copies = []
    real_run = gather_method.run
    monkeypatch.setattr(gather_method, "run", lambda op, t, ctx: copies.append(t.shape) or real_run(op, t, ctx))
    want = grads(moe, moe)
    assert bool(copies) == copy_rows                    # the plan really took the path this case names
    got = grads(twin, torch.compile(twin, fullgraph=True, backend="aot_eager"))
    for i, (a, b) in enumerate(zip(want, got)):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10, msg=f"output/grad {i}")
    clear_cache()


@pytest.mark.parametrize("split", [True, False], ids=["split", "one-op"])
def test_the_backward_is_cut_after_the_output_gradient(monkeypatch, split):
    """Under torch.compile a graph holds an op's arguments until it returns, so the block's backward runs as two ops
    (fusion::block_backward_head / _tail, program.BackwardSplit) cut after the last reader of dY: the first gets dY
    and the pre-activation H only, the second dH and x only, so the graph can free dY and H between them. Gradients
    equal eager's either way (custom_ops.SPLIT_BACKWARD off: the one op, which gets everything)."""
    from fusion.runtime import custom_ops

    monkeypatch.setattr(custom_ops, "SPLIT_BACKWARD", split)
    parts = _backward_parts(monkeypatch)
    torch.manual_seed(0)
    block = Sequential(*BLOCKS["moe-swiglu-scale"](), backend="emulate")
    x, extra = inputs(block)
    compiled_parts = _compiled_equals_eager(block, x, extra, parts)
    if split:
        assert compiled_parts == [(0, 2, ["g4", "v1"]), (2, 4, ["g1", "v0"])]
    else:
        assert compiled_parts == [(0, 4, ["g4", "v0", "v1"])]


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_every_block_trains_through_its_split_backward(monkeypatch, name):
    """Every block here has a split, and under torch.compile runs it as two parts, each making only the gradients
    the split gives it (the ops check), with eager's gradients."""
    from fusion.runtime import runner_for

    parts = _backward_parts(monkeypatch)
    torch.manual_seed(0)
    block = Sequential(*BLOCKS[name](), backend="emulate")
    x, extra = inputs(block)
    compiled_parts = _compiled_equals_eager(block, x, extra, parts)
    split = runner_for(block, x).program.split
    assert split is not None
    assert [(a, b) for a, b, _ in compiled_parts] == [(0, split.at), (split.at, len(runner_for(block, x).program.backward_steps))]


def _backward_parts(monkeypatch) -> list:
    """(start, stop, the values' names) of every BlockProgram.backward_part call from here on."""
    from fusion.runtime.program import BlockProgram

    parts = []
    run = BlockProgram.backward_part

    def spy(self, values, ctx, rows, needs, start, stop, record=None):
        parts.append((start, stop, sorted(values)))
        return run(self, values, ctx, rows, needs, start, stop, record)

    monkeypatch.setattr(BlockProgram, "backward_part", spy)
    return parts


def _compiled_equals_eager(block, x, extra, parts) -> list:
    """The compiled block's gradients equal an eager copy's; returns the backward parts the compiled run ran."""
    eager = copy.deepcopy(block)
    dy = torch.randn(x.shape[0], D)
    # the switch is read when the backward is traced: no graph from the caches of an earlier run
    with torch._inductor.config.patch(force_disable_caches=True):
        got = forward_backward(torch.compile(block, fullgraph=True), x, extra, dy)
    compiled_parts = list(parts)
    want = forward_backward(eager, x, extra, dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    return compiled_parts


def test_a_part_that_makes_a_gradient_outside_its_share_raises():
    """The split's account of which part makes which gradient is static; a part that makes one outside its share
    would have it dropped, so the op raises instead (custom_ops._part_grads)."""
    import types

    from fusion.errors import FusionError
    from fusion.runtime.custom_ops import _part_grads

    g = torch.zeros(1)
    program = types.SimpleNamespace(gradients=lambda state, needs: (None, [g, None], [g]))
    assert _part_grads(None, program, (True,) * 4, (1, 3))[1] is g
    with pytest.raises(FusionError, match=r"made gradients \[3\] outside its own \(1, 2\)"):
        _part_grads(None, program, (True,) * 4, (1, 2))
