"""backend="emulate" runs the Hopper plan (the fused runtime: generated epilogues, saved values, the backward
executor) with each kernel in torch; here it must equal backend="reference" in float64, forward and every
gradient, on random op chains the built-in patterns match. This is how CI tests the fused runtime on every
commit. Each case also asserts that the plan's fused kernels really ran (the launch counter), so a silent
fallback to the reference fails."""
import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusion
from fusion import (Activation, Bias, Clamp, GeGLU, GroupLinear, Linear, QuantizeMXFP8, QuantizeNVFP4, Scale,
                    Sequential, SReLU, SwiGLU)
from fusion.planner import plan_for_run
from fusion.runtime.kernel import LAUNCHES

ACTIVATIONS = {
    "SwiGLU": (lambda: SwiGLU(), True),
    "GeGLU": (lambda: GeGLU(), True),
    "SReLU": (lambda: SReLU(), False),
    "gptoss_swiglu": (lambda: Activation("gptoss_swiglu", limit=1.5), True),
    "reglu": (lambda: Activation("reglu"), True),
    "geglu_erf": (lambda: Activation("geglu_erf"), True),
    "silu": (lambda: Activation("silu"), False),
    "gelu_tanh": (lambda: Activation("gelu_tanh"), False),
    "relu": (lambda: Activation("relu"), False),
    "xielu": (lambda: Activation("xielu"), False),
    "mish_glu (user file)": (lambda: Activation("mish_glu"), True),
}

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


def ragged(groups: int, rows: int, rng: random.Random) -> torch.Tensor:
    """Random sizes summing to rows, with some empty groups."""
    if rows == 0:
        return torch.zeros(groups, dtype=torch.int64)
    cuts = sorted(rng.randint(0, rows) for _ in range(groups - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, rows])]
    return torch.tensor(sizes, dtype=torch.int64)


def build(act: str, E: int, d: int, f: int, *, bias: bool, pre_bias: bool, clamp: bool, scale: str,
          quant: bool, dense: bool):
    make, gated = ACTIVATIONS[act]
    width = 2 * f if gated else f
    gemm1 = Linear(d, width, bias=bias) if dense else GroupLinear(E, d, width, bias=bias)
    ops = [gemm1]
    if pre_bias:
        ops.append(Bias(width, num_groups=None if dense else E))
    ops.append(make())
    if clamp:
        ops.append(Clamp(-0.75, 0.9))
    if scale == "row":
        ops.append(Scale())
    elif scale == "const":
        ops.append(Scale(value=0.5))
    if quant == "nvfp4":
        ops.append(QuantizeNVFP4(columnwise=True))
    elif quant:
        ops.append(QuantizeMXFP8(columnwise=quant == "mxfp8-columnwise"))
    ops.append(Linear(f, d) if dense else GroupLinear(E, f, d))
    return Sequential(*ops, backend="emulate").double()


def run(block, x, extras, dy):
    xi = x.detach().clone().requires_grad_()
    ex = {k: (v.detach().clone().requires_grad_() if v.is_floating_point() else v) for k, v in extras.items()}
    y = block(xi, **ex)
    y.backward(dy)
    grads = {"x": xi.grad, **{f"p:{n}": p.grad for n, p in block.named_parameters()},
             **{f"e:{k}": v.grad for k, v in ex.items() if v.is_floating_point()}}
    return y.detach(), grads


def check(block, rows: int, E: int, rng: random.Random, dense: bool):
    d = block[0].in_features
    x = torch.randn(rows, d, dtype=torch.float64)
    extras = {}
    if not dense:
        extras["group_sizes"] = ragged(E, rows, rng)
    if any(op.spec.name == "Scale" and op.per_row for op in block):
        extras["scale"] = torch.rand(rows, dtype=torch.float64)
    reference = copy.deepcopy(block)
    reference.backend = "reference"
    plan = plan_for_run(block, x)
    fused = [s for s in plan.forward + plan.backward if s.fused]
    assert fused, block.explain()
    dy = torch.randn(rows, d, dtype=torch.float64)
    LAUNCHES.reset()
    y, grads = run(block, x, extras, dy)
    if rows:
        assert LAUNCHES.total == len(fused), (LAUNCHES.by_step, [s.pattern for s in fused])
    y_ref, grads_ref = run(reference, x, extras, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        a, b = grads[name], grads_ref[name]
        if b is None:
            assert a is None or not a.abs().any(), name
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


CASES = []
_rng = random.Random(1234)
for i, act in enumerate(ACTIVATIONS):
    for variant in range(3):
        CASES.append(dict(act=act, E=_rng.choice([1, 2, 5, 64]) if variant else 8, rows=_rng.choice([0, 1, 7, 96, 257]),
                          bias=_rng.random() < 0.4, pre_bias=_rng.random() < 0.3, clamp=_rng.random() < 0.4,
                          scale=_rng.choice(["row", "const", "none"]),
                          quant=_rng.choice([False, False, "mxfp8", "mxfp8-columnwise", "nvfp4"]),
                          dense=variant == 2))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_emulate_equals_reference(case):
    case = dict(case)
    rows, E, dense = case.pop("rows"), case.pop("E"), case["dense"]
    if case["quant"]:
        case["d"], case["f"] = 32, 64
    else:
        case["d"], case["f"] = 24, 48
    block = build(E=E, **case)
    check(block, rows, E, random.Random(rows * 31 + E), dense)


def test_bias_and_scale_without_activation():
    """gemm_bias + dgrad_scale: the saved value is the Scale's input; its gradient is a row sum."""
    E, d = 4, 16
    block = Sequential(GroupLinear(E, d, 32), Bias(32, num_groups=E), Scale(), GroupLinear(E, 32, d),
                       backend="emulate").double()
    check(block, 50, E, random.Random(0), dense=False)


def test_gemm_then_a_constant_scale():
    """A Scale by a constant after a GEMM (no per-row input) fuses through gemm_scale_const, which saves nothing
    (its gradient reads no value): it plans, its kernel job is one inference variant, and it runs correctly. It
    used to crash: gemm_scale saved scale.in, which the kernel for a constant scale could not write."""
    from fusion.runtime.aot import plan_jobs

    E, d = 4, 16
    block = Sequential(GroupLinear(E, d, d), Scale(value=0.5), backend="emulate").double()
    plan = plan_for_run(block, torch.zeros(1, d, dtype=torch.float64))
    assert [(s.pattern, s.writes) for s in plan.forward] == [("gemm_scale_const", ("v2",))]
    assert [j.variant for j in plan_jobs(block, torch.bfloat16)] == ["inference"]
    check(block, 50, E, random.Random(0), dense=False)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(act=st.sampled_from(sorted(ACTIVATIONS)), E=st.integers(1, 64), rows=st.integers(0, 200),
       bias=st.booleans(), clamp=st.booleans(), scale=st.sampled_from(["row", "const", "none"]),
       quant=st.sampled_from([False, "mxfp8", "mxfp8-columnwise", "nvfp4"]), seed=st.integers(0, 2 ** 16))
def test_emulate_property(act, E, rows, bias, clamp, scale, quant, seed):
    torch.manual_seed(seed)
    d, f = (32, 32) if quant else (16, 32)
    block = build(act, E, d, f, bias=bias, pre_bias=False, clamp=clamp, scale=scale, quant=quant, dense=False)
    check(block, rows, E, random.Random(seed), dense=False)


def test_emulate_runs_in_float32_and_bfloat16():
    """Low precision: close to the float64 reference at each dtype's tolerance."""
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        block = build("SwiGLU", 4, 32, 48, bias=True, pre_bias=False, clamp=False, scale="row", quant=False,
                      dense=False)
        x = torch.randn(64, 32, dtype=torch.float64)
        extras = {"group_sizes": torch.tensor([20, 0, 30, 14]), "scale": torch.rand(64, dtype=torch.float64)}
        reference = copy.deepcopy(block)
        reference.backend = "reference"
        y_ref = reference(x, **extras)
        low = copy.deepcopy(block).to(dtype)
        y = low(x.to(dtype), group_sizes=extras["group_sizes"], scale=extras["scale"].to(dtype))
        rel = ((y.double() - y_ref).norm() / y_ref.norm()).item()
        assert rel < tol, (dtype, rel)


def test_row_sum_partials_are_block_sums():
    """A RowSumOutput's emulation (a row scale's gradient in the dgrad epilogue): each row's sum over every 32
    consecutive columns, the last block partial, as the kernel stores them."""
    from fusion.runtime.emulate import EmulatedKernel

    v = torch.randn(3, 70, dtype=torch.float64)
    got = EmulatedKernel._block_sums(v, 32)
    want = torch.stack([v[:, :32].sum(-1), v[:, 32:64].sum(-1), v[:, 64:].sum(-1)], -1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
