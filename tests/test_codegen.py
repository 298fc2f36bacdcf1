"""Generated epilogues compute what the reference ops compute, forward and backward.

The generated source is executed with torch standing in for the kernel's fp32 math (the emulate backend's
`em`, fusion/runtime/torch_math.py), in float64, and compared with the ops' reference implementations
(forward) and torch.autograd through them (backward), including the saved value, the row-scale terms and the
output recomputed from the saved value.
"""
import pytest
import torch

from fusion import Activation, Bias, Clamp, GeGLU, GroupLinear, QuantizeMXFP8, Scale, SReLU, SwiGLU
from fusion.codegen import slots
from fusion.codegen.cache import source_key
from fusion.codegen.emit import epilogue_source
from fusion.codegen.spec import Unsupported, backward_spec, forward_spec
from fusion.ops.base import RunContext
from fusion.runtime.emulate import epilogue_class

CASES = {
    "swiglu-scale-mxfp8": lambda: [GroupLinear(3, 8, 16), SwiGLU(), Scale(), QuantizeMXFP8()],
    "geglu-clamp-const": lambda: [GroupLinear(3, 8, 16), GeGLU(), Clamp(-0.3, 0.4), Scale(value=0.5)],
    "srelu-bias": lambda: [GroupLinear(3, 8, 16), SReLU(), Bias(16)],
    "gptoss": lambda: [GroupLinear(3, 8, 16), Activation("gptoss_swiglu", limit=1.5)],
    "xielu-scale": lambda: [GroupLinear(3, 8, 16), Activation("xielu"), Scale()],
    "prebias-swiglu": lambda: [GroupLinear(3, 8, 16, bias=True), Bias(16, num_groups=3), SwiGLU()],
    "clamp-scale-no-act": lambda: [GroupLinear(3, 8, 16), Scale(value=2.0), Clamp(-0.5, 0.5), Scale()],
}
ROWS = 64
SIZES = torch.tensor([ROWS // 2, 0, ROWS - ROWS // 2])
GROUP = torch.repeat_interleave(torch.arange(3), SIZES)


def load(source):
    return epilogue_class(source)()


def slot_values(slot, ops, ctx):
    """The values `apply` receives for an input slot, as full (rows, n) tensors."""
    if isinstance(slot, slots.RowScale):
        return (ctx.extra[slot.name][:, None],)
    bias = ops[slot.position].bias.detach().double()
    per_row = bias[GROUP] if bias.dim() == 2 else bias.expand(ROWS, -1)
    return tuple(per_row.chunk(2, -1)) if slot.paired else (per_row,)


def reference(ops, acc, ctx):
    """The chain's reference on the GEMM output `acc` (the GEMM's own bias added)."""
    y = acc
    if ops[0].bias is not None:
        y = y + ops[0].bias.detach().double()[GROUP]
    for op in ops[1:]:
        if op.spec.kind != "quantize":
            y = op.reference(y, ctx)
    return y


def first_reader(ops):
    """The position the built-in patterns save: the first op after the GEMM whose gradient reads its input."""
    return next((k for k, op in enumerate(ops) if k and op.spec.grad_reads_input), None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_forward_and_backward_match_the_reference(case):
    torch.manual_seed(0)
    ops = [op.double() for op in CASES[case]()]
    spec = forward_spec(ops, first_reader(ops))
    acc = torch.randn(ROWS, ops[0].out_features, dtype=torch.float64) * 2
    ctx = RunContext(group_sizes=SIZES, extra={"scale": torch.rand(ROWS, dtype=torch.float64)})
    in_slots, out_slots = spec.forward_slots(train=True)
    args = [v for slot in in_slots for v in slot_values(slot, ops, ctx)]
    halves = acc.chunk(2, -1) if spec.gated else (acc,)

    results = load(epilogue_source(spec, "float64", train=True)).apply(*halves, *args)
    results = list(results) if isinstance(results, tuple) else [results]
    expected = reference(ops, acc, ctx)
    torch.testing.assert_close(results[0], expected, rtol=1e-12, atol=1e-12)

    # The saved value is the input of the op at the position asked for.
    saved = None
    assert (spec.saved_position is None) == (first_reader(ops) is None)
    if spec.saved is not None:
        k = spec.saved_position
        leaf = acc.clone()
        saved = reference(ops[:k], leaf, ctx) if k > 0 else leaf
        got = torch.cat(results[-2:], -1) if spec.saved_paired else results[-1]
        torch.testing.assert_close(got, saved, rtol=1e-12, atol=1e-12)

    # Backward: the gradient of the chain's input (after the GEMM and its bias) from the saved value.
    chain = ops[1:]
    bspec = backward_spec(chain, ops[0].out_features)
    post_ok = bspec.saved is not None and not bspec.has_quantize
    b_in, b_out = bspec.backward_slots(postact=post_ok)
    start = acc + (ops[0].bias.detach().double()[GROUP] if ops[0].bias is not None else 0)
    leaf = start.clone().requires_grad_()
    ctx.extra["scale"].requires_grad_()
    out = _chain(chain, leaf, ctx)
    dy = torch.randn_like(out)
    torch.autograd.backward(out, dy)
    bargs = []
    for slot in b_in:
        if isinstance(slot, slots.SavedIn):
            value = _chain(chain[:bspec.saved_position], start, ctx)
            bargs += list(value.chunk(2, -1)) if slot.paired else [value]
        else:
            bargs += list(_bias_values(slot, chain) if isinstance(slot, slots.GroupBias)
                          else slot_values(slot, chain, ctx))
    res = load(epilogue_source(bspec, "float64", backward=True, postact=post_ok)).apply(dy, *bargs)
    res = list(res) if isinstance(res, tuple) else [res]
    dinput = torch.cat(res[:2], -1) if bspec.gated else res[0]
    torch.testing.assert_close(dinput, leaf.grad, rtol=1e-12, atol=1e-12)
    terms = [s for s in b_out if isinstance(s, slots.DScale)]
    if terms:
        k = 2 if bspec.gated else 1
        torch.testing.assert_close(res[k].sum(-1), ctx.extra["scale"].grad, rtol=1e-12, atol=1e-12)
    if post_ok:
        torch.testing.assert_close(res[-1], out.detach(), rtol=1e-12, atol=1e-12)


def _chain(ops, value, ctx):
    for op in ops:
        if op.spec.kind != "quantize":
            value = op.reference(value, ctx)
    return value


def _bias_values(slot, ops):
    bias = ops[slot.position].bias.detach().double()
    per_row = bias[GROUP] if bias.dim() == 2 else bias.expand(ROWS, -1)
    return tuple(per_row.chunk(2, -1)) if slot.paired else (per_row,)


def test_source_and_key_are_deterministic():
    spec = forward_spec([GroupLinear(2, 8, 16), SwiGLU(), Scale()])
    again = forward_spec([GroupLinear(2, 8, 16), SwiGLU(), Scale()])
    assert epilogue_source(spec, "bfloat16") == epilogue_source(again, "bfloat16")
    assert source_key(epilogue_source(spec, "bfloat16")) != source_key(epilogue_source(spec, "float16"))
    bspec = backward_spec([SwiGLU(), Scale()], 16)
    assert source_key(epilogue_source(spec, "bfloat16")) != source_key(epilogue_source(bspec, "bfloat16",
                                                                                      backward=True))


def test_unsupported_epilogues_say_which_op():
    from fusion import QuantizeNVFP4

    with pytest.raises(Unsupported, match="QuantizeNVFP4.*MXFP8 or FP8-block only"):
        forward_spec([GroupLinear(2, 8, 32), QuantizeNVFP4()])
    with pytest.raises(Unsupported, match="only a bias may come before the activation"):
        forward_spec([GroupLinear(2, 8, 16), Scale(), SwiGLU()])


def test_the_forward_kernel_saves_what_it_is_asked_to():
    """The saved value is the caller's choice (the pattern's `save`), never derived: nothing unless asked, the
    clamp's input when asked, and never the kernel's own input or output."""
    ops = [GroupLinear(2, 8, 16, bias=True), Scale(value=3.0), Clamp(-1, 1), Scale()]
    assert forward_spec(ops).saved is None
    spec = forward_spec(ops, saved_position=2)
    assert spec.stages[spec.saved].kind == "clamp" and spec.saved_position == 2
    assert "SavedOut" not in repr(forward_spec(ops).forward_slots(train=True))
    assert forward_spec(ops, 1).saved_position == 1  # the constant scale's input, if a pattern names it
    for position in (0, len(ops)):
        with pytest.raises(Unsupported, match="not position"):
            forward_spec(ops, position)


def test_a_value_saved_before_a_gated_activation_is_written_as_halves():
    """Saving the input of a bias that precedes a gated activation (a 2f-wide value) writes both halves."""
    torch.manual_seed(0)
    ops = [op.double() for op in CASES["prebias-swiglu"]()]
    spec = forward_spec(ops, saved_position=1)
    assert spec.saved_paired and spec.width_at(spec.saved) == 16
    acc = torch.randn(ROWS, 16, dtype=torch.float64)
    ctx = RunContext(group_sizes=SIZES)
    in_slots, _ = spec.forward_slots(train=True)
    args = [v for slot in in_slots for v in slot_values(slot, ops, ctx)]
    results = load(epilogue_source(spec, "float64", train=True)).apply(*acc.chunk(2, -1), *args)
    want = acc + ops[0].bias.detach().double()[GROUP]  # the GEMM's output: the Bias op's input
    torch.testing.assert_close(torch.cat(results[-2:], -1), want, rtol=1e-12, atol=1e-12)


def test_row_scale_gradient_is_declared_as_row_sums():
    """The backward epilogue of a chain with a row Scale declares the scale's gradient as a RowSumOutput (the kernel
    sums each row's terms; no (M, n) tensor of terms), one per row scale; a constant scale has no gradient output."""
    ops = CASES["clamp-scale-no-act"]()
    bspec = backward_spec(ops[1:], 16)
    source = epilogue_source(bspec, "bfloat16", backward=True, postact=False)
    cls = epilogue_class(source)
    row_sums = [o for o in cls.outputs if type(o).__name__ == "RowSumOutput"]
    assert [o.name for o in row_sums] == ["dscale_" + s.name for s in bspec.row_scales()] and len(row_sums) == 1
    assert row_sums[0].block == slots.DScale("x").block == 32
