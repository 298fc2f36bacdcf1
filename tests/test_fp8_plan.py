"""weight_format in plans: an fp8_block GEMM never enters a bf16 kernel, and when it runs unfused it runs its own
FP8-block recipe (its reference), forward and backward, on every backend: "auto" (CPU) and "emulate" (the
Hopper plan executed in torch) equal backend="reference" bit for bit."""
import pytest
import torch

import fusion
from fusion import GroupLinear, QuantizeFP8Block, Sequential, SwiGLU
from fusion.planner import clear_cache, plan_for
from fusion.quant import fp8_linear
from fusion.runtime.steps import GemmDgrad, GemmWgrad, OpBackward
from test_matcher_support import el, pat

E, D, F = 3, 64, 64
SIZES = torch.tensor([5, 0, 11])


@pytest.fixture(autouse=True)
def _builtins():
    from fusion.patterns.registry import reset_to_builtins

    reset_to_builtins()
    clear_cache()
    yield
    clear_cache()


def block(fmt1="fp8_block", fmt2="fp8_block", backend="reference", dtype=torch.float32, quant=False, E=E, d=D, f=F):
    torch.manual_seed(0)
    ops = [GroupLinear(E, d, 2 * f, weight_format=fmt1), SwiGLU()]
    if quant:
        ops.append(QuantizeFP8Block())
    ops.append(GroupLinear(E, f, d, weight_format=fmt2))
    return Sequential(*ops, backend=backend).to(dtype)


def run(seq, x, sizes):
    x = x.clone().requires_grad_()
    y = seq(x, group_sizes=sizes)
    weights = torch.linspace(-1, 1, y.numel(), dtype=torch.float32).view(y.shape)
    (y.float() * weights).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in seq.parameters()]


def assert_bitwise(got, want, which=None):
    names = ["y", "dx"] + [f"dW{k}" for k in range(len(want) - 2)]
    for k, (a, b) in enumerate(zip(got, want)):
        if which is None or names[k] in which:
            assert torch.equal(a, b), f"{names[k]} differs: max |diff| {(a.float() - b.float()).abs().max()}"


# -- the plan -----------------------------------------------------------------------------------------------------
def test_builtin_patterns_leave_an_fp8_gemm_unfused_and_say_why():
    plan = plan_for(block(fmt2="bf16"), dtype=torch.bfloat16, target="sm_90")
    assert not any(s.fused for s in plan.forward)  # gemm_act used to put op 0 into the bf16 kernel
    act = next(fb for fb in plan.fallbacks if fb.op == 1 and fb.part == "forward")
    assert any('gemm_act [patterns/moe.fpat:' in r and 'predicate `weight_format == "bf16"` is false' in r
               and "weight_format='fp8_block'" in r for r in act.reasons), act.reasons
    text = block(fmt2="bf16", backend="auto").explain()
    assert 'predicate `weight_format == "bf16"` is false (weight_format=\'fp8_block\') on op 0 GroupLinear' in text
    # on Hopper it runs the FP8 kernel (fusion/runtime/fp8_gemm.py); the emulated plan and the CPU its recipe
    assert "op 0 GroupLinear: FP8 block-scaled grouped GEMM (fusion/kernels/fp8_gemm.py)" in text
    assert "the fp8_block recipe" in block(fmt2="bf16", backend="auto").explain(target="cpu")


def test_an_fp8_gemm_backward_is_its_recipe_not_bf16_gemm_steps():
    plan = plan_for(block(fmt2="bf16"), dtype=torch.bfloat16, target="sm_90")
    parts = [p for s in plan.backward for p in s.parts]
    assert (0, "backward") in parts and (0, "dgrad") not in parts and (0, "wgrad") not in parts
    step = next(s for s in plan.backward if s.parts == ((0, "backward"),))
    assert "dgrad: FP8 block-scaled grouped GEMM" in step.method  # fusion/runtime/fp8_gemm.py on Hopper
    assert step.reads == ("g1", "v0") and step.writes == ("g0", "dW0")
    cpu = plan_for(block(fmt2="bf16"), dtype=torch.float32, target=None)
    assert any("fp8_block recipe" in s.method for s in cpu.backward if s.parts == ((0, "backward"),))
    assert plan.ops[0].weight_format == "fp8_block" and plan.ops[0].gemm_by_reference
    assert plan.ops[2].weight_format == "bf16" and not plan.ops[2].gemm_by_reference
    # on Hopper the FP8 kernel runs it: not a fallback; where none does it runs its reference, and is listed as
    # falling back, forward and backward, saying why
    assert not [f for f in plan.fallbacks if f.op == 0]
    cpu_plan = plan_for(block(fmt2="bf16"), dtype=torch.bfloat16, target=None)
    fb = [f for f in cpu_plan.fallbacks if f.op == 0]
    assert [f.part for f in fb] == ["forward", "backward"]
    assert all("weight_format='fp8_block'" in f.reasons[0] for f in fb)
    # FC2 (bf16) keeps its fused dgrad with the SwiGLU backward
    assert any(s.fused and s.pattern == "dgrad_dact" for s in plan.backward)


def test_the_emulated_program_runs_the_recipe_backward():
    from fusion.runtime import runner_for

    seq = block(fmt2="bf16", backend="emulate")
    runner = runner_for(seq, torch.zeros(1, D))
    kinds = {step.parts: type(r) for step, r in zip(runner.plan.backward, runner.program.backward_steps)}
    assert kinds[((0, "backward"),)] is OpBackward
    assert not any(isinstance(r, (GemmDgrad, GemmWgrad)) and r.index == 0 for r in runner.program.backward_steps)


def test_a_pattern_without_the_predicate_still_never_fuses_an_fp8_gemm():
    """The matcher refuses a weight format the kernel template does not run, whatever the pattern says."""
    lax = pat("lax", el("gemm", "GroupLinear"), el("act", "activation"), dtypes=("bfloat16",), arch_min=90)
    plan = plan_for(block(), dtype=torch.bfloat16, target="sm_90", patterns=[lax])
    assert not plan.fused_steps
    (row,) = [a for a in plan.attempts[0] if a.pattern == "lax"]
    assert "kernel template 'grouped_gemm' runs weight_format 'bf16' only, not 'fp8_block'" in row.reason
    plan = plan_for(block("bf16", "bf16"), dtype=torch.bfloat16, target="sm_90", patterns=[lax])
    assert [s.ops for s in plan.fused_steps] == [(0, 1)]


def test_a_bf16_block_is_unaffected():
    plan = plan_for(block("bf16", "bf16"), dtype=torch.bfloat16, target="sm_90")
    assert [(s.pattern, s.ops) for s in plan.fused_steps] == [("gemm_act", (0, 1)), ("dgrad_dact", (1, 2))]
    assert plan.fully_fused and not any(o.gemm_by_reference for o in plan.ops)


# -- running it ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "emulate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_block_equals_reference_bitwise(backend, dtype):
    torch.manual_seed(1)
    x = torch.randn(16, D, dtype=dtype)
    want = run(block(dtype=dtype), x, SIZES)
    assert_bitwise(run(block(dtype=dtype, backend=backend), x, SIZES), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp8_gemm_before_a_fused_dgrad_equals_reference(dtype, monkeypatch):
    """FC1 fp8_block, FC2 bf16: the emulated program runs (FC2's dgrad is fused with the SwiGLU backward), and
    FC1's gradients come from its recipe at the saved input: bitwise the reference's. (FC2's weight gradient
    reads the activation the dgrad kernel recomputes: equal up to rounding.) With the FP8-operand wgrad: the
    quantization of dY absorbs the dgrad kernel's rounding; the default bf16 wgrad reads dY as is."""
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", False)
    torch.manual_seed(1)
    x = torch.randn(16, D, dtype=dtype)
    want = run(block(fmt2="bf16", dtype=dtype), x, SIZES)
    got = run(block(fmt2="bf16", dtype=dtype, backend="emulate"), x, SIZES)
    assert_bitwise(got, want, which=("y", "dx", "dW0"))
    scale = want[3].abs().max()
    torch.testing.assert_close(got[3] / scale, want[3] / scale, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-14)


def test_fp8_gemm_forward_is_bitwise_in_bf16_under_emulate():
    torch.manual_seed(1)
    x = torch.randn(16, D, dtype=torch.bfloat16)
    want = run(block(fmt2="bf16", dtype=torch.bfloat16), x, SIZES)
    got = run(block(fmt2="bf16", dtype=torch.bfloat16, backend="emulate"), x, SIZES)
    assert_bitwise(got, want, which=("y",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp8_gemm_after_a_quantize_reads_the_quantized_input_in_backward(dtype):
    """bf16 FC1 + SwiGLU fused, QuantizeFP8Block, fp8_block FC2: FC2's backward re-runs its recipe on the saved
    QuantizedTensor itself (its columnwise copy, quantized from the high-precision values), not on its
    dequantized value, so its weight gradient is the reference's."""
    torch.manual_seed(1)
    sizes = torch.tensor([100, 200])
    x = torch.randn(300, 64, dtype=dtype) * torch.logspace(-2, 2, 64, dtype=dtype)
    make = dict(fmt1="bf16", quant=True, E=2, d=64, f=160, dtype=dtype)
    want = run(block(**make), x, sizes)
    got = run(block(**make, backend="emulate"), x, sizes)
    assert_bitwise(got, want)


def test_fp8_block_under_torch_compile_emulate():
    """Under torch.compile the program runs inside a custom op, below autograd: the recipe's backward must still
    record its graph there (it used to fail: "element 0 of tensors does not require grad")."""
    torch.manual_seed(1)
    sizes = torch.tensor([100, 200])
    x = torch.randn(300, 64) * torch.logspace(-2, 2, 64)
    make = dict(fmt1="bf16", quant=True, E=2, d=64, f=160)
    want = run(block(**make), x, sizes)
    seq = block(**make, backend="emulate")
    compiled = torch.compile(seq, fullgraph=True)
    x = x.clone().requires_grad_()
    y = compiled(x, group_sizes=sizes)
    (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
    assert_bitwise([y.detach(), x.grad] + [p.grad for p in seq.parameters()], want)


def test_explain_says_why_the_fp8_kernel_does_not_take_a_gemm():
    """The plan names the FP8 kernel only where it runs: 16-multiple widths in bf16/fp16 (as its runtime checks)."""
    seq = Sequential(GroupLinear(2, 72, 128, weight_format="fp8_block"), SwiGLU(),
                     GroupLinear(2, 64, 64, weight_format="fp8_block"))
    text = seq.explain(dtype=torch.bfloat16, target="sm_90a")
    assert "op 0 GroupLinear: GroupLinear.reference: the fp8_block recipe" in text
    assert "the FP8 kernel does not take it: its kernel needs feature widths that are multiples of 16, got 72" in text
    assert "op 2 GroupLinear: FP8 block-scaled grouped GEMM" in text
    text = seq.explain(dtype=torch.float32, target="sm_90a")
    assert "op 2 GroupLinear: GroupLinear.reference: the fp8_block recipe" in text
    assert "its kernel runs bfloat16/float16, the dtype is float32" in text
