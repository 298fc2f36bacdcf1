"""Sequential end to end on the reference path: composition, autograd, state_dict, .to(), bad input."""
import io

import pytest
import torch

import fusion
from fusion import (Bias, Clamp, DeviceError, DTypeError, ExtraInputError, GroupLinear, GroupSizesError, Linear,
                    Scale, Sequential, ShapeError, SReLU, SwiGLU)
from fusion.grouped import row_group_index

E, D, F = 4, 32, 48


def moe_block(dtype=torch.float64, **kw):
    return Sequential(GroupLinear(E, D, 2 * F, dtype=dtype), SwiGLU(), Scale(), GroupLinear(E, F, D, dtype=dtype),
                      **kw)


def inputs(rows=23, sizes=(9, 0, 11, 3), dtype=torch.float64):
    x = torch.randn(rows, D, dtype=dtype)
    return x, torch.tensor(sizes), torch.rand(rows, dtype=dtype)


def independent_moe(x, sizes, probs, w1, w2):
    """Per-row gather formulation, sharing no code with fusion's grouped matmul."""
    g = row_group_index(sizes, x.shape[0])
    h = torch.einsum("mk,mnk->mn", x, w1[g])
    gate, up = h[:, :F], h[:, F:]
    a = gate * torch.sigmoid(gate) * up * probs[:, None]
    return torch.einsum("mk,mnk->mn", a, w2[g])


def test_three_op_block():
    mlp = Sequential(Linear(D, 2 * F, dtype=torch.float64), SwiGLU(), Linear(F, D, dtype=torch.float64))
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    y = mlp(x)
    a, b = (x @ mlp[0].weight.T).chunk(2, -1)
    torch.testing.assert_close(y, (torch.nn.functional.silu(a) * b) @ mlp[2].weight.T)
    assert torch.autograd.gradcheck(lambda t: mlp(t), (x,))


def test_moe_block_forward_backward_against_independent_formulation():
    mlp = moe_block()
    x, sizes, probs = inputs()
    x.requires_grad_(), probs.requires_grad_()
    y = mlp(x, group_sizes=sizes, scale=probs)
    torch.testing.assert_close(y, independent_moe(x, sizes, probs, mlp[0].weight, mlp[3].weight))
    assert torch.autograd.gradcheck(lambda a, p: mlp(a, group_sizes=sizes, scale=p), (x, probs))
    y.sum().backward()
    assert mlp[0].weight.grad is not None and torch.all(mlp[0].weight.grad[1] == 0)


def test_five_op_block_with_bias_and_clamp():
    mlp = Sequential(GroupLinear(E, D, 2 * F, bias=True, dtype=torch.float64), SwiGLU(), Clamp(-2.0, 2.0),
                     Bias(F, num_groups=E, dtype=torch.float64), GroupLinear(E, F, D, dtype=torch.float64))
    x, sizes, _ = inputs()
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda a: mlp(a, group_sizes=sizes), (x,))


def test_all_zero_rows():
    mlp = moe_block()
    x, sizes, probs = inputs(rows=0, sizes=(0, 0, 0, 0))
    y = mlp(x, group_sizes=sizes, scale=probs)
    assert y.shape == (0, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    ref = moe_block()
    mlp = moe_block().to(dtype)
    mlp.load_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
    x, sizes, probs = inputs()
    y = mlp(x.to(dtype), group_sizes=sizes, scale=probs.to(dtype))
    expect = ref(x.to(dtype).double(), group_sizes=sizes, scale=probs.to(dtype).double())
    assert y.dtype == dtype
    assert ((y.double() - expect).norm() / expect.norm()) < 2e-2


def test_state_dict_round_trip_and_to():
    mlp = moe_block(dtype=torch.float32)
    buf = io.BytesIO()
    torch.save(mlp.state_dict(), buf)
    other = moe_block(dtype=torch.float32)
    other.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert set(mlp.state_dict()) == {"0.weight", "3.weight"}
    assert mlp.state_dict()["0.weight"].shape == (E, 2 * F, D)
    x, sizes, probs = inputs(dtype=torch.float32)
    torch.testing.assert_close(mlp(x, group_sizes=sizes, scale=probs), other(x, group_sizes=sizes, scale=probs))
    half = other.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


def test_is_a_module_with_ops():
    mlp = moe_block()
    assert isinstance(mlp, torch.nn.Module) and len(mlp) == 4 and isinstance(mlp[1], SwiGLU)
    assert [type(op).__name__ for op in mlp] == ["GroupLinear", "SwiGLU", "Scale", "GroupLinear"]


# --- bad input: a clear error, never a wrong answer -----------------------------------------------------
def test_shape_mismatch_names_both_ops_and_shapes():
    with pytest.raises(ShapeError, match=r"op 1 SwiGLU\(\) outputs \(M, 48\), but op 2 GroupLinear.*expects 96"):
        Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), GroupLinear(E, 2 * F, D))


def test_input_width_mismatch():
    mlp = moe_block()
    x, sizes, probs = inputs()
    with pytest.raises(ShapeError, match=r"input x has shape \(M, 31\) but op 0 GroupLinear.*expects 32"):
        mlp(x[:, :31], group_sizes=sizes, scale=probs)


def test_swiglu_on_odd_features():
    with pytest.raises(ShapeError, match="SwiGLU.*even feature count, got 7"):
        Sequential(Linear(4, 7), SwiGLU())


def test_wrong_dtype_and_mixed_dtypes():
    mlp = moe_block()
    x, sizes, probs = inputs()
    with pytest.raises(DTypeError, match="x has dtype torch.int64"):
        mlp(x.long(), group_sizes=sizes, scale=probs)
    with pytest.raises(DTypeError, match=r"parameter '0.weight' has torch.float64.*mlp.to"):
        mlp(x.float(), group_sizes=sizes, scale=probs.float())


def test_device_mix_is_reported():
    mlp = moe_block()
    x, sizes, probs = inputs()
    with pytest.raises(DeviceError, match="x is on meta but parameter"):
        mlp(x.to("meta"), group_sizes=sizes, scale=probs)


@pytest.mark.parametrize("sizes, message", [
    (torch.tensor([9, 0, 14]), r"group_sizes must have shape \(4,\)"),
    (torch.tensor([9.0, 0, 11, 3]), "dtype int32 or int64"),
    (torch.tensor([9, 0, 11, 4]), "sums to 24 but x has 23 rows"),
    (torch.tensor([9, 1, 11, 3]).to("meta"), "group_sizes is on meta but x is on cpu"),
    ([9, 0, 11, 3], "must be an int tensor"),
])
def test_group_sizes_errors(sizes, message):
    mlp = moe_block()
    x, _, probs = inputs()
    with pytest.raises(GroupSizesError, match=message):
        mlp(x, group_sizes=sizes, scale=probs)


def test_missing_and_unexpected_extra_inputs():
    mlp = moe_block()
    x, sizes, probs = inputs()
    with pytest.raises(ExtraInputError, match=r"missing keyword input 'scale', read by op 2 Scale\(name='scale'\)"):
        mlp(x, group_sizes=sizes)
    with pytest.raises(ExtraInputError, match=r"missing keyword input 'group_sizes'"):
        mlp(x, scale=probs)
    with pytest.raises(ExtraInputError, match=r"unexpected keyword input\(s\) \['probs'\]"):
        mlp(x, group_sizes=sizes, scale=probs, probs=probs)
    with pytest.raises(ExtraInputError, match=r"'scale' must have shape \(23,\)"):
        mlp(x, group_sizes=sizes, scale=probs[:5])


def test_group_count_disagreement():
    with pytest.raises(ShapeError, match="different group counts"):
        Sequential(GroupLinear(4, D, F), SReLU(), GroupLinear(8, F, D))


def test_bad_backend_and_bad_op():
    with pytest.raises(ValueError, match="backend must be one of"):
        Sequential(Linear(4, 4), backend="fast")
    with pytest.raises(TypeError, match="not a fusion op"):
        Sequential(torch.nn.Linear(4, 4))


def test_public_api_names():
    for name in ["Sequential", "GroupLinear", "Linear", "SwiGLU", "GeGLU", "SReLU", "Activation", "Clamp",
                 "Scale", "Bias", "QuantizeMXFP8", "QuantizeNVFP4", "load_patterns"]:
        assert hasattr(fusion, name)
