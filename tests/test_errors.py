"""Every error a user can meet derives from fusion.FusionError (the user guide promises it), stays catchable
as the builtin it used to be, and names the op, the argument and the fix. Constructors check their
arguments (types, finite numbers, positive sizes) when the op is built, not at the first call."""
import math

import pytest
import torch

import fusion
from fusion import (Activation, Bias, Clamp, ExtraInputError, FusionError, GroupLinear, Linear, OpArgumentError,
                    QuantizeFP8Block, QuantizeMXFP8, QuantizeNVFP4, Scale, Sequential, SwiGLU)

# (constructor, the words the message must hold: the op, the argument)
BAD_CONSTRUCTORS = {
    "GroupLinear(True, ...)": (lambda: GroupLinear(True, 8, 16), ["GroupLinear", "num_groups", "True"]),
    "GroupLinear(0, ...)": (lambda: GroupLinear(0, 8, 16), ["GroupLinear", "num_groups", "positive int"]),
    "GroupLinear(2.0, ...)": (lambda: GroupLinear(2.0, 8, 16), ["GroupLinear", "num_groups"]),
    "GroupLinear(in=-4)": (lambda: GroupLinear(2, -4, 16), ["GroupLinear", "in_features"]),
    "GroupLinear(out='16')": (lambda: GroupLinear(2, 8, "16"), ["GroupLinear", "out_features"]),
    "GroupLinear(bias='yes')": (lambda: GroupLinear(2, 8, 16, bias="yes"), ["GroupLinear", "bias", "True or False"]),
    "GroupLinear(dtype=int)": (lambda: GroupLinear(2, 8, 16, dtype=torch.int32), ["GroupLinear", "dtype"]),
    "GroupLinear(device=bogus)": (lambda: GroupLinear(2, 8, 16, device="bogus"), ["GroupLinear", "device"]),
    "GroupLinear(weight_format)": (lambda: GroupLinear(2, 8, 16, weight_format="int4"), ["weight_format"]),
    "Linear(0, 4)": (lambda: Linear(0, 4), ["Linear", "in_features"]),
    "Linear(4, None)": (lambda: Linear(4, None), ["Linear", "out_features"]),
    "Clamp('a', 'b')": (lambda: Clamp("a", "b"), ["Clamp", "min", "number"]),
    "Clamp(nan, 1)": (lambda: Clamp(math.nan, 1), ["Clamp", "min", "finite"]),
    "Clamp(0, inf)": (lambda: Clamp(0, math.inf), ["Clamp", "max", "finite", "None"]),
    "Clamp(True)": (lambda: Clamp(True), ["Clamp", "min"]),
    "Clamp()": (lambda: Clamp(), ["Clamp", "min, max or both"]),
    "Clamp(2, 1)": (lambda: Clamp(2, 1), ["Clamp", "greater than max"]),
    "Scale('2')": (lambda: Scale("2"), ["Scale", "value", "number"]),
    "Scale(nan)": (lambda: Scale(math.nan), ["Scale", "value", "finite"]),
    "Scale(name=3)": (lambda: Scale(name=3), ["Scale", "name", "identifier"]),
    "Scale(name='for')": (lambda: Scale(name="for"), ["Scale", "name", "identifier"]),
    "Scale(name='x')": (lambda: Scale(name="x"), ["Scale", "name='x'", "reserved", "data input"]),
    "Scale(name='group_sizes')": (lambda: Scale(name="group_sizes"), ["Scale", "reserved", "group_sizes"]),
    "Scale(name='index')": (lambda: Scale(name="index"), ["Scale", "reserved", "index"]),
    "Scale(name='self')": (lambda: Scale(name="self"), ["Scale", "reserved"]),
    "Bias(0)": (lambda: Bias(0), ["Bias", "features"]),
    "Bias(8, num_groups=True)": (lambda: Bias(8, num_groups=True), ["Bias", "num_groups"]),
    "Bias(8.5)": (lambda: Bias(8.5), ["Bias", "features"]),
    "QuantizeMXFP8('no')": (lambda: QuantizeMXFP8("no"), ["QuantizeMXFP8", "columnwise", "True or False"]),
    "QuantizeNVFP4(1)": (lambda: QuantizeNVFP4(1), ["QuantizeNVFP4", "columnwise"]),
    "QuantizeFP8Block(None)": (lambda: QuantizeFP8Block(None), ["QuantizeFP8Block", "columnwise"]),
    "Activation(None)": (lambda: Activation(None), ["Activation", "name", "str"]),
    "Activation(unknown param)": (lambda: Activation("gptoss_swiglu", limt=1.0), ["gptoss_swiglu", "limt",
                                                                                   "limit"]),
    "Activation(param='a')": (lambda: Activation("gptoss_swiglu", limit="a"), ["gptoss_swiglu", "limit",
                                                                                "number"]),
    "Activation(param=nan)": (lambda: Activation("gptoss_swiglu", limit=math.nan), ["limit", "finite"]),
    "Sequential()": (lambda: Sequential(), ["Sequential", "at least one op"]),
    "Sequential(nn.Linear)": (lambda: Sequential(torch.nn.Linear(4, 4)), ["Sequential", "not a fusion op"]),
    "Sequential(backend=bogus)": (lambda: Sequential(Linear(4, 4), backend="bogus"), ["Sequential", "backend",
                                                                                      "'bogus'"]),
    "MoE(d=0)": (lambda: fusion.MoE(0, 4, 2, experts=None), ["MoE", "d"]),
    "MoE(score=bogus)": (lambda: fusion.MoE.swiglu(8, 4, 8, k=2, score="bogus"), ["MoE", "score"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CONSTRUCTORS))
def test_bad_constructor_arguments_raise_op_argument_error(case):
    make, words = BAD_CONSTRUCTORS[case]
    with pytest.raises(FusionError) as ei:
        make()
    assert isinstance(ei.value, OpArgumentError), type(ei.value).__mro__
    # catchable as before: ValueError for bad values, TypeError for bad types
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, TypeError)
    for word in words:
        assert word in str(ei.value), (word, str(ei.value))


def test_good_constructor_arguments_still_work():
    import numpy as np

    assert GroupLinear(np.int64(2), 8, 16).num_groups == 2
    assert Clamp(-1, 1).min == -1.0 and Clamp(max=np.float32(0.5)).max == 0.5
    assert Scale(2).value == 2.0 and Scale(name="probs").name == "probs"
    assert Activation("gptoss_swiglu", limit=3).params["limit"] == 3.0
    assert Bias(8, num_groups=2).bias.shape == (2, 8)
    assert QuantizeMXFP8(False).columnwise is False
    assert GroupLinear(2, 8, 16, device="meta", dtype=torch.bfloat16).weight.is_meta


def test_unknown_activation_is_a_fusion_error_and_a_key_error():
    from fusion.patterns.registry import UnknownActivationError

    with pytest.raises(UnknownActivationError) as ei:
        Activation("swiglue")
    assert isinstance(ei.value, FusionError) and isinstance(ei.value, KeyError)
    assert "did you mean 'swiglu'" in str(ei.value) and "load_patterns" in str(ei.value)


def test_quantization_error_is_a_fusion_error():
    from fusion.quant import QuantizationError, quantize_mxfp8

    assert issubclass(QuantizationError, FusionError) and issubclass(QuantizationError, ValueError)
    with pytest.raises(FusionError, match="QuantizeMXFP8"):
        quantize_mxfp8(torch.randn(4, 100))


def test_reserved_name_set_after_construction_fails_at_sequential_build():
    scale = Scale()
    scale.name = "x"  # past the constructor's check: the block still refuses it, clearly
    with pytest.raises(ExtraInputError, match="reads a keyword input named 'x'.*data input"):
        Sequential(GroupLinear(2, 8, 16), SwiGLU(), scale)


def test_other_user_facing_errors_are_fusion_errors():
    mlp = Sequential(Linear(8, 8))
    with pytest.raises(FusionError, match="format must be one of"):
        mlp.explain(format="svg")
    with pytest.raises(FusionError, match="x must be a torch.Tensor"):
        mlp([[1.0] * 8])
    with pytest.raises(FusionError, match="score"):
        fusion.moe.route(torch.randn(4, 8), k=2, score="relu")
    with pytest.raises(FusionError, match="round_to"):
        fusion.moe.route(torch.randn(4, 8), k=2, round_to=0)
    definition = Activation("gptoss_swiglu").definition
    with pytest.raises(FusionError, match="has no parameter"):
        definition.forward(torch.randn(2), torch.randn(2), limt=1.0)


# -- extra inputs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "reference", "emulate"])
@pytest.mark.parametrize("scale_last", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float64, torch.float32, torch.float16])
def test_float_extra_of_another_dtype_is_a_clear_error(backend, scale_last, scale_dtype):
    """A bf16 block's `scale` in float64/float32/float16: a DTypeError naming the input and the fix, never a
    torch message from inside grouped.py nor an output silently promoted to float32 (Scale last)."""
    ops = [GroupLinear(2, 8, 16), SwiGLU(), Scale()] + ([] if scale_last else [GroupLinear(2, 8, 8)])
    mlp = Sequential(*ops, backend=backend).to(torch.bfloat16)
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    with pytest.raises(fusion.DTypeError, match=r"'scale' has dtype .* but x has torch.bfloat16.*scale.to"):
        mlp(x, group_sizes=torch.tensor([2, 4]), scale=torch.rand(6, dtype=scale_dtype))
    assert mlp(x, group_sizes=torch.tensor([2, 4]), scale=torch.rand(6, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("host", [True, False])
def test_group_sizes_whose_int64_sum_wraps_are_rejected(host):
    """Sizes of 2**62 wrap an int64 sum around to x.shape[0]; each size must lie in [0, rows] as well. `host`:
    checked on the host (CPU, backend='reference'), or by device asserts (torch.compile, CUDA graphs)."""
    x = torch.randn(6, 8)
    sizes = torch.tensor([2 ** 62, 2 ** 62, 2 ** 62, 2 ** 62 + 6])
    assert int(sizes.sum()) == 6  # the wrap the check must not be fooled by
    mlp = Sequential(GroupLinear(4, 8, 8))
    with pytest.raises((fusion.GroupSizesError, RuntimeError)) as ei:
        mlp.inputs.context(x, {"group_sizes": sizes}, check_sum=host, host=host)
    if host:
        assert isinstance(ei.value, fusion.GroupSizesError) and "larger than x's 6 rows" in str(ei.value)


@pytest.mark.parametrize("host", [True, False])
def test_routed_group_sizes_whose_int64_sum_wraps_are_rejected(host):
    """The same after a Gather, where the sizes may sum to less than the routed rows."""
    from fusion import Combine, Gather

    x = torch.randn(3, 8)
    mlp = Sequential(Gather(), GroupLinear(5, 8, 8), Combine())
    index = torch.tensor([0, 1, 2, 0])
    sizes = torch.tensor([2 ** 62] * 4 + [4])
    assert int(sizes.sum()) == 4  # wraps to exactly the 4 routed rows: no row past the sum
    with pytest.raises((fusion.GroupSizesError, RuntimeError)):
        mlp.inputs.context(x, {"group_sizes": sizes, "index": index}, check_sum=host, host=host)


def test_second_backward_through_an_eager_fused_block_names_the_problem():
    """The first backward frees the block's saved intermediates after their last readers (a lower peak), so a second
    backward through the same graph cannot run: a SecondBackwardError says so and what to do, instead of a
    TypeError from inside the autograd node. The reference backend differentiates twice."""
    import torch

    import fusion
    from fusion.errors import SecondBackwardError

    def make(backend):
        torch.manual_seed(0)
        return fusion.Sequential(fusion.GroupLinear(4, 32, 64), fusion.SwiGLU(), fusion.Scale(),
                                 fusion.GroupLinear(4, 32, 32), backend=backend).double()

    sizes, scale = torch.tensor([10, 10, 10, 10]), torch.rand(40, dtype=torch.float64)
    x = torch.randn(40, 32, dtype=torch.float64, requires_grad=True)
    y = make("emulate")(x, group_sizes=sizes, scale=scale)
    y.sum().backward(retain_graph=True)
    with pytest.raises(SecondBackwardError, match="retain_graph"):
        y.sum().backward()
    y = make("reference")(x, group_sizes=sizes, scale=scale)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
