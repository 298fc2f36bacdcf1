"""The built-in pattern library (patterns/*.fpat) on the demo blocks: the three NVIDIA kernel families."""
import pytest
import torch

import fusion
from fusion import Bias, Clamp, GeGLU, GroupLinear, Linear, QuantizeMXFP8, QuantizeNVFP4, Scale, SwiGLU
from fusion.patterns import registry
from fusion.planner import clear_cache, plan_for
from test_matcher_support import demo_block

pytestmark = pytest.mark.usefixtures("all_templates_available")


@pytest.fixture(autouse=True)
def _builtins_only():
    registry.reset_to_builtins()
    clear_cache()
    yield
    clear_cache()


def fused(plan, direction="forward"):
    return [(s.pattern, s.ops) for s in getattr(plan, direction) if s.fused]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target", ["sm_90", "sm_90a"])
def test_moe_demo_block(dtype, target):
    plan = plan_for(demo_block(dtype=dtype), dtype=dtype, target=target)
    # (2) FC1 + SwiGLU + Scale + QuantizeMXFP8 is ONE fused forward kernel; FC2, with nothing to fuse, runs
    # the varlen-M kernel alone or the vendor grouped GEMM, by rows per group (not a fallback)
    assert len(plan.forward) == 2
    fc1, fc2 = plan.forward
    assert fc1.fused and fc1.ops == (0, 1, 2, 3) and fc1.kernel == "grouped_gemm"
    assert [lab for lab, _ in fc1.epilogue] == ["act", "scale", "quant"]
    assert not fc2.fused and fc2.ops == (4,) and fc2.method.startswith(
        "varlen-M grouped GEMM where the GEMM has >= 2 groups, rows per group")
    assert "else torch._grouped_mm (fusion/runtime/lone_gemm.py)" in fc2.method
    # (3) backward: FC2's dgrad fused with the backward of Scale and SwiGLU (quantize: straight-through)
    b = plan.backward
    assert b[0].fused and b[0].kernel == "grouped_gemm_dgrad" and b[0].ops == (1, 2, 3, 4)
    assert set(b[0].parts) == {(4, "dgrad"), (2, "backward"), (1, "backward")}
    # the remaining GEMM gradients are listed, in autograd order
    rest = [(s.fused, s.parts) for s in b[1:]]
    assert rest[0] == (False, ((4, "wgrad"),))
    assert rest[1] == (False, ((0, "dgrad"),))  # FC1's dgrad: nothing to fuse (no scale before FC1)
    assert rest[2] == (False, ((0, "wgrad"),))
    assert plan.fully_fused and plan.fallbacks == ()


def test_gemm_quantize_family():
    # (1) GEMM + Quantize: a GEMM whose output is quantized for the next one
    seq = fusion.Sequential(GroupLinear(8, 1024, 2048, device="meta"), QuantizeMXFP8(),
                            GroupLinear(8, 2048, 1024, device="meta"))
    plan = plan_for(seq)
    assert fused(plan) == [("gemm_quantize", (0, 1))]


def test_nvfp4_quantize_is_not_fused_and_says_why():
    # The sm_90 epilogue has no NVFP4 store: the pattern library does not list it, and explain() says so.
    seq = fusion.Sequential(GroupLinear(8, 1024, 2048, device="meta"), QuantizeNVFP4(),
                            GroupLinear(8, 2048, 1024, device="meta"))
    plan = plan_for(seq)
    assert fused(plan) == []
    (fallback,) = [f for f in plan.fallbacks if f.direction == "forward"]
    assert fallback.op == 1 and any("QuantizeNVFP4(columnwise=True) is not" in r for r in fallback.reasons)


def test_dense_geglu_bias_clamp():
    seq = fusion.Sequential(Linear(1024, 4096, device="meta"), Bias(4096), GeGLU(), Clamp(-8.0, 8.0),
                            Linear(2048, 1024, device="meta"))
    plan = plan_for(seq)
    assert fused(plan) == [("gemm_act", (0, 1, 2, 3))]
    assert fused(plan, "backward")[0] == ("dgrad_dact", (1, 2, 3, 4))
    assert plan.fully_fused


def test_builtin_failures_read_well():
    # float32, old arch, misaligned shapes: every op unfused, with the reason from the .fpat file
    plan = plan_for(demo_block(), dtype=torch.float32)
    def said(text):  # by some pattern tried (every built-in file's patterns are)
        return any(text in r for r in plan.fallbacks[0].reasons)

    assert not plan.fused_steps and said("dtype float32 not in (bfloat16, float16)")
    plan = plan_for(demo_block(), target="sm_80")
    assert said("arch sm_80 < sm_90")
    plan = plan_for(demo_block(), target="sm_100a")
    assert said("arch sm_100a > sm_90")
    plan = plan_for(demo_block(d=1004))
    act = [f for f in plan.fallbacks if f.op == 1][0]  # FC1's failed predicate, reported on the SwiGLU it would fuse
    assert any("predicate `" in r and "patterns/moe.fpat:" in r for r in act.reasons), act.reasons


def test_explain_with_builtins_names_the_files():
    text = demo_block().explain()
    assert "pattern gemm_act [patterns/moe.fpat:" in text
    assert "pattern dgrad_dact [patterns/moe.fpat:" in text
    assert "elementwise ops unfused (0): none" in text
