"""Generated epilogues compute what the reference ops compute, forward and backward.

The generated source is executed on the CPU with torch standing in for the kernel's fp32 math (`em`), then
compared with the ops' reference implementations (forward) and torch.autograd through them (backward).
"""
import types

import pytest
import torch
import torch.nn.functional as F

from fusion import Activation, Bias, Clamp, GeGLU, GroupLinear, QuantizeMXFP8, Scale, SReLU, SwiGLU
from fusion.codegen.cache import source_key
from fusion.codegen.emit import epilogue_source
from fusion.codegen.spec import Unsupported, spec_from_ops
from fusion.ops.base import RunContext

TORCH_EM = types.SimpleNamespace(
    exp=torch.exp, log=torch.log, sqrt=torch.sqrt, tanh=torch.tanh, erf=torch.erf, abs=torch.abs,
    sigmoid=torch.sigmoid, silu=F.silu, relu=torch.relu, softplus=F.softplus,
    gelu_tanh=lambda x: F.gelu(x, approximate="tanh"),
    minimum=lambda a, b: torch.minimum(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)),
    maximum=lambda a, b: torch.maximum(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)),
    clamp=lambda x, lo=None, hi=None: torch.clamp(x, lo, hi),
    where=lambda c, a, b: torch.where(c, torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)),
    pow_const=lambda x, p: x ** p,
)


def load(source):
    """The generated Epilogue class, with torch in place of the kernel math."""
    import fusion.kernels.epilogue as epi

    body = "\n".join(line for line in source.splitlines() if not line.startswith(("from cutlass", "from fusion")))
    ns = {"_f32": lambda v: v, "em": TORCH_EM, "_epi": epi}
    exec(compile(body, "<generated>", "exec"), ns)
    return ns["GeneratedEpilogue"]()


CASES = {
    "swiglu-scale-mxfp8": lambda: [GroupLinear(3, 8, 16), SwiGLU(), Scale(), QuantizeMXFP8()],
    "geglu-clamp-const": lambda: [GroupLinear(3, 8, 16), GeGLU(), Clamp(-0.3, 0.4), Scale(value=0.5)],
    "srelu-bias": lambda: [GroupLinear(3, 8, 16), SReLU(), Bias(16)],
    "gptoss": lambda: [GroupLinear(3, 8, 16), Activation("gptoss_swiglu", limit=1.5)],
    "xielu-scale": lambda: [GroupLinear(3, 8, 16), Activation("xielu"), Scale()],
    "prebias-swiglu": lambda: [GroupLinear(3, 8, 16, bias=True), Bias(16, num_groups=3), SwiGLU()],
}


def inputs_for(ops, spec, rows=64):
    """Random accumulator values, the kernel's extra inputs, and the same data for the reference ops."""
    torch.manual_seed(0)
    width = ops[0].out_features
    acc = torch.randn(rows, width, dtype=torch.float64) * 2
    sizes = torch.tensor([rows // 2, 0, rows - rows // 2])
    group = torch.repeat_interleave(torch.arange(3), sizes)
    probs = torch.rand(rows, dtype=torch.float64)
    ctx = RunContext(group_sizes=sizes, extra={"scale": probs})
    values = {}
    for name, paired in spec.group_inputs:
        index = int(name.removeprefix("bias"))
        bias = ops[index].bias.detach().double()
        per_row = bias[group] if bias.dim() == 2 else bias.expand(rows, -1)
        values[name] = per_row.chunk(2, -1) if paired else (per_row,)
    for name in spec.row_inputs:
        values[f"scale_{name}"] = (probs[:, None],)
    halves = acc.chunk(2, -1) if spec.gated else (acc,)
    return acc, halves, values, ctx


def reference(ops, acc, ctx):
    y = acc
    if ops[0].bias is not None:
        y = y + ops[0].bias.detach().double()[torch.repeat_interleave(torch.arange(3), ctx.group_sizes)]
    for op in ops[1:]:
        if op.spec.kind != "quantize":
            y = op.reference(y, ctx)
    return y


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_forward_and_backward_match_the_reference(case):
    ops = [op.double() for op in CASES[case]()]
    spec = spec_from_ops(ops)
    acc, halves, values, ctx = inputs_for(ops, spec)
    args = [v for name, _ in spec.group_inputs for v in values[name]]
    args += [v for name in spec.row_inputs for v in values[f"scale_{name}"]]

    forward = load(epilogue_source(spec))
    out = forward.apply(*halves, *args)
    out = out[0] if isinstance(out, tuple) else out
    expected = reference(ops, acc, ctx)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)

    dy = torch.randn_like(expected)
    leaf = acc.clone().requires_grad_()
    ctx.extra["scale"].requires_grad_()
    torch.autograd.backward(reference(ops, leaf, ctx), dy)
    backward = load(epilogue_source(spec, backward=True))
    results = backward.apply(dy, *(halves if spec.save_preactivation else ()), *args)
    results = results if isinstance(results, tuple) else (results,)
    dpre = torch.cat(results[:2], -1) if spec.gated else results[0]
    torch.testing.assert_close(dpre, leaf.grad, rtol=1e-9, atol=1e-9)
    if spec.row_inputs:
        torch.testing.assert_close(results[-1].sum(-1), ctx.extra["scale"].grad, rtol=1e-9, atol=1e-9)


def test_source_and_key_are_deterministic():
    spec = spec_from_ops([GroupLinear(2, 8, 16), SwiGLU(), Scale()])
    assert epilogue_source(spec) == epilogue_source(spec_from_ops([GroupLinear(2, 8, 16), SwiGLU(), Scale()]))
    assert source_key(epilogue_source(spec)) != source_key(epilogue_source(spec, backward=True))


def test_unsupported_epilogues_say_which_op():
    from fusion import QuantizeNVFP4

    with pytest.raises(Unsupported, match="QuantizeNVFP4.*MXFP8 only"):
        spec_from_ops([GroupLinear(2, 8, 32), QuantizeNVFP4()])
    with pytest.raises(Unsupported, match="only a bias may come before the activation"):
        spec_from_ops([GroupLinear(2, 8, 16), Scale(), SwiGLU()])
