"""Plans: steps forward and backward, fallbacks and their reasons, caching, plan_for_run and backends."""
import pytest
import torch

import fusion
from fusion import Clamp, FallbackError, QuantizeMXFP8, Scale, SwiGLU
from fusion.grouped import HOST_SYNC_NOTE
from fusion.planner import clear_cache, plan_for, plan_for_run
from test_matcher_support import demo_block, demo_patterns, el, pat

pytestmark = pytest.mark.usefixtures("all_templates_available")


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    # unfused GEMM steps name torch._grouped_mm where this torch has it: keep expected texts independent of it
    monkeypatch.setattr(torch, "_grouped_mm", getattr(torch, "_grouped_mm", None) or (lambda *a, **k: None),
                        raising=False)
    clear_cache()
    yield
    clear_cache()


def test_demo_plan_forward_and_backward():
    plan = plan_for(demo_block(), patterns=demo_patterns())
    assert (plan.target, plan.dtype) == ("sm_90", "bfloat16")
    f1, f2 = plan.forward
    assert f1.fused and f1.pattern == "gemm_act_scale_quant" and f1.pattern_loc == "patterns/test.fpat:2"
    assert f1.ops == (0, 1, 2, 3) and f1.kernel == "grouped_gemm"
    assert f1.epilogue == (("act", 1), ("scale", 2), ("quant", 3)) and f1.saves == ("gemm.out",)
    assert f2.fused and f2.pattern == "gemm" and f2.ops == (4,)
    b = plan.backward
    assert b[0].fused and b[0].pattern == "dact_dgrad" and b[0].ops == (1, 2, 3, 4)
    assert set(b[0].parts) == {(4, "dgrad"), (2, "backward"), (1, "backward")}
    assert [(s.fused, s.parts) for s in b[1:]] == [(False, ((4, "wgrad"),)), (False, ((0, "dgrad"),)),
                                                    (False, ((0, "wgrad"),))]
    # sm_90: the weight gradients on the varlen-K kernel (fusion/runtime/wgrad_gemm.py), the lone dgrad on the
    # varlen-M kernel or torch's by rows per group (fusion/runtime/lone_gemm.py)
    assert b[1].method.startswith("varlen-K grouped GEMM") and b[1].notes == ()
    assert b[2].method.startswith("varlen-M grouped GEMM of dY and the weight as stored where the GEMM has >= 2 "
                                  "groups, rows per group average <= 512") and "else torch._grouped_mm" in b[2].method
    # where it does not run (dtype, widths, a dense Linear), the vendor GEMM and why not: torch's
    plan32 = plan_for(demo_block(), patterns=demo_patterns(), dtype=torch.float32)
    assert not any(s.method.startswith("varlen-K") for s in plan32.backward)
    assert plan.fallbacks == () and plan.fully_fused
    assert [a.outcome for a in plan.attempts[0]] == ["applied", "not chosen", "failed"]


def test_unfused_op_with_reasons_from_every_pattern():
    seq = demo_block(SwiGLU(), Clamp(min=-1.0, max=1.0), QuantizeMXFP8())
    plan = plan_for(seq, patterns=demo_patterns())
    kinds = [(s.fused, s.ops) for s in plan.forward]
    assert kinds == [(True, (0, 1)), (False, (2,)), (False, (3,)), (True, (4,))]
    clamp = plan.forward[1]
    assert clamp.method == "Clamp.reference (torch)"
    fb = {(f.op, f.part): f for f in plan.fallbacks}
    assert set(fb) == {(2, "forward"), (3, "forward"), (2, "backward"), (1, "backward")}
    assert fb[(2, "forward")].reasons == (
        "gemm_act_scale_quant [patterns/test.fpat:2]: its match on ops 0-1 stops before op 2: "
        "Clamp(min=-1.0, max=1.0) is not Scale|quantize (the elements left: scale?, quant?)",
        "gemm [patterns/test.fpat:10]: op 2 Clamp(min=-1.0, max=1.0) is not GroupLinear|Linear")
    # SwiGLU's backward: the backward pattern cannot pass the Clamp
    assert fb[(1, "backward")].reasons == (
        "dact_dgrad [patterns/test.fpat:15]: op 2 Clamp(min=-1.0, max=1.0) is not GroupLinear|Linear "
        "(gemm, after op 1 SwiGLU())",)
    assert not plan.fully_fused
    # backward in autograd order: op 4 dgrad+wgrad, op 3 (straight-through: no step), op 2, op 1, op 0
    assert [s.parts[0] for s in plan.backward] == [(4, "dgrad"), (4, "wgrad"), (2, "backward"), (1, "backward"),
                                                   (0, "dgrad"), (0, "wgrad")]


def test_reason_of_a_failed_gemm_reaches_the_ops_it_would_have_covered():
    plan = plan_for(demo_block(d=100), patterns=demo_patterns())
    fb = {(f.op, f.part): f for f in plan.fallbacks}
    why = ("gemm_act_scale_quant [patterns/test.fpat:2]: predicate `in_features % 64 == 0` is false "
           "(in_features=100) on op 0 GroupLinear [patterns/test.fpat:3]")
    assert (0, "forward") not in fb  # a GEMM is never a fallback: unfused it runs the vendor grouped GEMM
    assert fb[(1, "forward")].reasons[0] == why  # SwiGLU says why the GEMM's pattern failed


def test_float32_and_old_arch():
    plan = plan_for(demo_block(), dtype=torch.float32, patterns=demo_patterns())
    assert not plan.fused_steps
    assert plan.fallbacks[0].reasons[0].endswith("dtype float32 not in (bfloat16, float16)")
    assert plan.forward[0].method == "per-group matmul loop"
    assert plan.forward[0].notes[0].startswith(HOST_SYNC_NOTE)
    plan = plan_for(demo_block(), target="sm_80", patterns=demo_patterns())
    assert "arch sm_80 < sm_90" in plan.fallbacks[0].reasons[0]
    assert "needs sm_90 or newer" in plan.forward[0].notes[0]


def test_misaligned_gemm_note():
    from fusion.plan import OpInfo
    from fusion.planner import reference_method

    info = OpInfo(0, "GroupLinear", "gemm", "GroupLinear(...)", 1001, 64)
    method, notes = reference_method(info, "forward", "bfloat16", "sm_90")
    assert method == "per-group matmul loop" and "16-byte aligned" in notes[0]


def test_cpu_target_and_empty_library():
    plan = plan_for(demo_block(), target="cpu", patterns=demo_patterns())
    assert plan.target is None and plan.reason == "no fused kernels on cpu"
    assert all(f.reasons == ("no fused kernels on cpu",) for f in plan.fallbacks)
    plan = plan_for(demo_block(), patterns=[])
    assert plan.fallbacks[0].reasons == ("no forward fusion patterns are loaded",)


def test_bad_target():
    with pytest.raises(ValueError, match="sm_90"):
        plan_for(demo_block(), target="hopper")


def test_cache_same_object_and_keys():
    pats = demo_patterns()
    p1 = plan_for(demo_block(), patterns=pats)
    assert plan_for(demo_block(), patterns=pats) is p1  # another block with the same op signatures
    assert plan_for(demo_block(), patterns=list(pats)) is p1  # same pattern objects
    assert plan_for(demo_block(), dtype=torch.float16, patterns=pats) is not p1
    assert plan_for(demo_block(), target="sm_90a", patterns=pats) is not p1
    assert plan_for(demo_block(d=512), patterns=pats) is not p1
    assert plan_for(demo_block(), patterns=demo_patterns()) is not p1  # new pattern objects


def test_cache_invalidated_when_patterns_are_loaded(monkeypatch):
    import fusion.patterns.registry as registry

    lib = list(demo_patterns()[:2])
    monkeypatch.setattr(registry, "fusion_patterns", lambda: list(lib))
    p1 = fusion.Sequential.plan(demo_block())
    assert fusion.Sequential.plan(demo_block()) is p1
    assert not p1.fully_fused  # no backward pattern yet
    lib.append(demo_patterns()[2])  # "load" a file with a backward pattern
    p2 = demo_block().plan()
    assert p2 is not p1 and p2.fully_fused


USER_FPAT = """
fusion gemm_clamp_user {
    kernel    = grouped_gemm
    direction = forward
    chain {
        gemm:  GroupLinear
        clamp: Clamp
    }
}
"""


def test_cache_invalidated_by_registry_load(tmp_path):
    import fusion.patterns.registry as registry

    registry.reset_to_builtins()
    seq = fusion.Sequential(fusion.GroupLinear(8, 1024, 1024, device="meta"), Clamp(max=1.0))
    try:
        before = plan_for(seq)
        assert plan_for(seq) is before
        assert [s.fused for s in before.forward] == [False, False]  # no built-in pattern fuses a clamp alone
        f = tmp_path / "user.fpat"
        f.write_text(USER_FPAT)
        fusion.load_patterns(str(f))
        after = plan_for(seq)
        assert after is not before
        assert [(s.fused, s.pattern) for s in after.forward] == [(True, "gemm_clamp_user")]
        assert after.forward[0].pattern_loc.endswith("user.fpat:2")
        assert plan_for(seq) is after
    finally:
        registry.reset_to_builtins()
    assert plan_for(seq) is not after


def _x(seq):
    return torch.zeros(4, seq.features[0], dtype=torch.bfloat16)


def test_plan_for_run_cpu_and_reference():
    seq = demo_block()
    plan = plan_for_run(seq, _x(seq), patterns=demo_patterns())
    assert plan.reason == "no fused kernels on cpu" and not plan.fused_steps
    ref = demo_block(backend="reference")
    plan = plan_for_run(ref, _x(ref), patterns=demo_patterns())
    assert plan.reason == "backend='reference'"
    assert {f.reasons for f in plan.fallbacks} == {("backend='reference'",)}


def test_plan_for_run_fused_on_cpu_raises():
    seq = demo_block(backend="fused")
    with pytest.raises(FallbackError, match="no fused kernels on cpu"):
        plan_for_run(seq, _x(seq), patterns=demo_patterns())


def test_plan_for_run_fused_backend_raises_with_every_reason(monkeypatch):
    import fusion.planner

    monkeypatch.setattr(fusion.planner, "device_target", lambda device: "sm_90")
    seq = demo_block(SwiGLU(), Clamp(min=-1.0, max=1.0), QuantizeMXFP8(), backend="fused")
    with pytest.raises(FallbackError) as info:
        plan_for_run(seq, _x(seq), patterns=demo_patterns())
    msg = str(info.value)
    assert msg.startswith("backend='fused' but 4 op computation(s) would fall back")
    assert "op 2 Clamp(min=-1.0, max=1.0) (forward):" in msg
    assert "- gemm [patterns/test.fpat:10]: op 2 Clamp(min=-1.0, max=1.0) is not GroupLinear|Linear" in msg
    assert "op 1 SwiGLU() (backward):" in msg
    # fully matched block: no error, and auto gets the same plan object
    ok = demo_block(backend="fused")
    pats = demo_patterns()
    plan = plan_for_run(ok, _x(ok), patterns=pats)
    assert plan.fully_fused and plan is plan_for(ok, patterns=pats)


def test_plan_for_run_uses_dtype_of_x(monkeypatch):
    import fusion.planner

    monkeypatch.setattr(fusion.planner, "device_target", lambda device: "sm_90")
    seq = demo_block(dtype=torch.float32)
    x = torch.zeros(2, 1024)
    plan = plan_for_run(seq, x, patterns=demo_patterns())
    assert plan.dtype == "float32" and not plan.fused_steps


def test_constant_scale_left_out_by_predicate():
    per_row = __import__("test_matcher_support").Pred("per_row", lambda a: a["per_row"])
    p = pat("fc1", el("gemm", "GroupLinear"), el("act", "activation"),
            el("scale", "Scale", optional=True, where=(per_row,)))
    plan = plan_for(demo_block(SwiGLU(), Scale(value=0.5)), patterns=[p])
    assert [(s.fused, s.ops) for s in plan.forward] == [(True, (0, 1)), (False, (2,)), (False, (3,))]
    fb = {(f.op, f.part): f.reasons for f in plan.fallbacks}
    assert fb[(2, "forward")] == ("fc1 [patterns/test.fpat:1]: its match on ops 0-1 leaves op 2 out: predicate "
                                  "`per_row` is false (per_row=False) on op 2 Scale(value=0.5) "
                                  "[patterns/test.fpat:99]",)
