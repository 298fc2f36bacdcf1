"""Every op's reference, forward and backward: gradcheck in float64 and an independent torch formulation."""
import math

import pytest
import torch

from fusion import Bias, Clamp, GeGLU, GroupLinear, Linear, Scale, SReLU, SwiGLU
from fusion.ops.base import RunContext
from fusion.grouped import group_offsets

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def ctx_for(sizes=None, **extra):
    ctx = RunContext(extra=extra)
    if sizes is not None:
        ctx.group_sizes = sizes
        ctx.offsets = group_offsets(sizes)
    return ctx


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# --- activations against independent formulas (written from the math, not torch.nn.functional) -------------
def silu_ref(a):
    return a / (1 + torch.exp(-a))


def gelu_tanh_ref(a):
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


@pytest.mark.parametrize("op, ref", [
    (SwiGLU(), lambda x: silu_ref(x[:, :4]) * x[:, 4:]),
    (GeGLU(), lambda x: gelu_tanh_ref(x[:, :4]) * x[:, 4:]),
    (SReLU(), lambda x: torch.where(x > 0, x * x, torch.zeros_like(x))),
    (Clamp(-0.5, 0.25), lambda x: torch.where(x < -0.5, -0.5, torch.where(x > 0.25, 0.25, x))),
    (Clamp(max=0.1), lambda x: torch.where(x > 0.1, 0.1, x)),
    (Scale(value=0.5), lambda x: 0.5 * x),
])
@pytest.mark.parametrize("dtype", [torch.float64] + DTYPES)
def test_elementwise_forward(op, ref, dtype):
    x = torch.randn(5, 8, dtype=torch.float64)
    out = op.reference(x.to(dtype), ctx_for())
    assert out.dtype == dtype
    assert rel_err(out, ref(x)) < TOL[dtype]


@pytest.mark.parametrize("op", [SwiGLU(), GeGLU(), SReLU(), Clamp(-0.5, 0.25), Scale(value=-2.0)])
def test_elementwise_gradcheck(op):
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: op.reference(t, ctx_for()), (x,))


def test_gated_output_features_halve():
    assert SwiGLU().output_features(10) == 5
    assert SReLU().output_features(10) == 10


def test_scale_per_row_and_its_gradient():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    p = torch.rand(5, dtype=torch.float64, requires_grad=True)
    op = Scale()
    assert op.spec.extra_inputs == ("scale",)
    torch.testing.assert_close(op.reference(x, ctx_for(scale=p)), x * p[:, None])
    assert torch.autograd.gradcheck(lambda a, b: op.reference(a, ctx_for(scale=b)), (x, p))


def test_scale_named_input():
    op = Scale(name="probs")
    assert op.spec.extra_inputs == ("probs",)
    x, p = torch.randn(2, 3), torch.rand(2)
    torch.testing.assert_close(op.reference(x, ctx_for(probs=p)), x * p[:, None])


def test_bias_plain_and_per_group():
    x = torch.randn(6, 4, dtype=torch.float64)
    plain = Bias(4, dtype=torch.float64)
    torch.testing.assert_close(plain.reference(x, ctx_for()), x + plain.bias)
    grouped = Bias(4, num_groups=3, dtype=torch.float64)
    sizes = torch.tensor([2, 0, 4])
    expected = x + torch.cat([grouped.bias[0].expand(2, 4), grouped.bias[2].expand(4, 4)])
    torch.testing.assert_close(grouped.reference(x, ctx_for(sizes)), expected)
    xr = x.clone().requires_grad_()
    grouped.reference(xr, ctx_for(sizes)).sum().backward()
    assert grouped.bias.grad[1].abs().sum() == 0 and torch.all(grouped.bias.grad[2] == 4)


# --- GEMMs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [0, 0, 0, 9], [4, 4, 4, 4]])
@pytest.mark.parametrize("bias", [False, True])
def test_group_linear_matches_loop_and_gradcheck(sizes, bias):
    sizes = torch.tensor(sizes)
    op = GroupLinear(4, 6, 5, bias=bias, dtype=torch.float64)
    x = torch.randn(int(sizes.sum()), 6, dtype=torch.float64, requires_grad=True)
    out = op.reference(x, ctx_for(sizes))
    rows, start = [], 0
    for g, n in enumerate(sizes.tolist()):
        r = x[start:start + n] @ op.weight[g].T
        rows.append(r + op.bias[g] if bias else r)
        start += n
    torch.testing.assert_close(out, torch.cat(rows))
    assert torch.autograd.gradcheck(lambda a: op.reference(a, ctx_for(sizes)), (x,))
    out.sum().backward()
    for g, n in enumerate(sizes.tolist()):
        if n == 0:
            assert torch.all(op.weight.grad[g] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_linear_low_precision(dtype):
    sizes = torch.tensor([7, 0, 9])
    op = GroupLinear(3, 32, 16)
    x = torch.randn(16, 32)
    op64 = GroupLinear(3, 32, 16, dtype=torch.float64)
    op64.weight.data.copy_(op.weight.data)
    ref = op64.reference(x.double(), ctx_for(sizes))
    out = op.to(dtype).reference(x.to(dtype), ctx_for(sizes))
    assert out.dtype == dtype and rel_err(out, ref) < 1e-2


def test_group_linear_init_like_nn_linear():
    torch.manual_seed(1)
    op = GroupLinear(2, 256, 64, bias=True)
    bound = 1 / math.sqrt(256)
    assert op.weight.abs().max() <= bound + 1e-6 and op.bias.abs().max() <= bound + 1e-6
    # Each group is initialised independently (not one shared matrix).
    assert not torch.equal(op.weight[0], op.weight[1])
    assert op.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def test_linear_is_dense_with_nn_linear_layout():
    op = Linear(6, 4, bias=True, dtype=torch.float64)
    assert op.weight.shape == (4, 6) and op.bias.shape == (4,)
    assert op.spec.extra_inputs == ()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(op.reference(x, ctx_for()), x @ op.weight.T + op.bias)
    assert torch.autograd.gradcheck(lambda a: op.reference(a, ctx_for()), (x,))


def test_specs_are_data():
    spec = GroupLinear(8, 64, 128, bias=True).spec
    assert spec.kind == "gemm" and spec.attrs["in_features"] == 64 and spec.attrs["bias"] is True
    assert SwiGLU().spec.kind == "activation" and SwiGLU().spec.gated
    assert SwiGLU().spec.attrs["activation"] == "swiglu"
    assert Clamp(0, 1).spec.kind == "elementwise"
    hash(GroupLinear(8, 64, 128).spec.signature())
