"""explain(): text / json / dot on the demo block, against golden files (FUSION_UPDATE_GOLDEN=1 rewrites them).

The goldens use the test pattern library of test_matcher_support (stable whatever the built-in .fpat files
say); test_explain_builtin_golden covers the built-in library."""
import json
import os
import pathlib

import pytest
import torch

import fusion
from fusion import Clamp, QuantizeMXFP8, SwiGLU
from fusion.explain import explain
from fusion.patterns import registry
from fusion.planner import clear_cache
from test_matcher_support import demo_block, demo_patterns

pytestmark = pytest.mark.usefixtures("all_templates_available")

GOLDEN = pathlib.Path(__file__).parent / "golden"
UPDATE = os.environ.get("FUSION_UPDATE_GOLDEN") == "1"


def check_golden(name: str, text: str):
    path = GOLDEN / name
    if UPDATE or not path.exists():
        if not UPDATE:
            pytest.fail(f"golden file {path} is missing; run with FUSION_UPDATE_GOLDEN=1 to create it")
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert text == path.read_text(), f"{name} differs from its golden file; FUSION_UPDATE_GOLDEN=1 updates it"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    # unfused GEMM steps name torch._grouped_mm where this torch has it: keep expected texts independent of it
    monkeypatch.setattr(torch, "_grouped_mm", getattr(torch, "_grouped_mm", None) or (lambda *a, **k: None),
                        raising=False)
    clear_cache()
    yield
    clear_cache()


PATS = demo_patterns()


@pytest.mark.parametrize("fmt,ext", [("text", "txt"), ("dot", "dot")])
def test_demo_golden(fmt, ext):
    check_golden(f"explain_demo.{ext}", explain(demo_block(), format=fmt, patterns=PATS))


def test_json_is_the_plan_as_data():
    """format="json" carries the plan itself: every step with what it reads and writes, the saves."""
    from fusion.planner import plan_for

    block = demo_block(SwiGLU(), Clamp(min=-1.0, max=1.0), QuantizeMXFP8())
    data = json.loads(explain(block, format="json", patterns=PATS))
    plan = plan_for(block, patterns=PATS)
    assert data["plan"]["saves"] == list(plan.saves)
    for key, steps in (("forward", plan.forward), ("backward", plan.backward)):
        assert [(s["fused"], s["reads"], s["writes"]) for s in data["plan"][key]] == \
            [(s.fused, list(s.reads), list(s.writes)) for s in steps]
    assert data["plan"]["fused_kernels"] == len(plan.fused_steps) > 0


@pytest.mark.parametrize("fmt,ext", [("text", "txt"), ("dot", "dot")])
def test_partly_fused_golden(fmt, ext):
    seq = demo_block(SwiGLU(), Clamp(min=-1.0, max=1.0), QuantizeMXFP8())
    check_golden(f"explain_partial.{ext}", explain(seq, format=fmt, patterns=PATS))


def test_builtin_golden():
    registry.reset_to_builtins()
    check_golden("explain_demo_builtin.txt", explain(demo_block()))


def test_text_content():
    text = explain(demo_block(), patterns=PATS)
    assert text.startswith(f"fusion {fusion.__version__} plan of a Sequential of 5 ops")
    assert "planned for: dtype bfloat16 (the parameters' dtype), target sm_90 (default" in text
    assert "(M, 1024) -> (M, 4096)" in text
    assert "[F1] fused    grouped_gemm  <- pattern gemm_act_scale_quant [patterns/test.fpat:2]" in text
    assert "[B1] fused    grouped_gemm_dact  <- pattern dact_dgrad [patterns/test.fpat:15]" in text
    assert "elementwise ops unfused (0): none" in text


def test_summary_names_every_kernel_and_every_unfused_gemm():
    """The summary says precisely what is fused: not "fully fused" for a plan whose FC2 and three of four backward
    steps run unfused GEMMs, but each fused kernel with what it computes and each GEMM outside them."""
    import fusion.patterns.registry as registry
    registry.reset_to_builtins()
    summary = explain(demo_block()).split("summary:\n", 1)[1].splitlines()
    assert summary == [
        "  fused kernels (2): F1 GEMM+SwiGLU+Scale+QuantizeMXFP8 (ops 0-3), B1 dgrad+dScale+dSwiGLU (ops 1-4)",
        "  unfused GEMMs (4): F2 op 4 GroupLinear forward, B2 op 4 GroupLinear wgrad, B3 op 0 GroupLinear dgrad, "
        "B4 op 0 GroupLinear wgrad",
        "  elementwise ops unfused (0): none"]
    text = explain(demo_block(SwiGLU(), Clamp(min=-1.0, max=1.0)), patterns=PATS)
    assert ("elementwise ops unfused (3): F2 op 2 Clamp forward, B3 op 2 Clamp backward, B4 op 1 SwiGLU backward"
            in text.split("summary:")[1])
    assert "summary: nothing fused (backend='reference')" in explain(demo_block(backend="reference"), patterns=PATS)


def test_defaults_and_header():
    f32 = demo_block(dtype=torch.float32)
    text = explain(f32, patterns=PATS)
    assert "dtype bfloat16 (default: the parameters are float32" in text
    text = explain(f32, dtype=torch.float32, target="sm_90a", patterns=PATS)
    assert "planned for: dtype float32 (given), target sm_90a (given)" in text
    assert "dtype float32 not in (bfloat16, float16)" in text
    assert "left unfused, and why (every pattern tried):" in text
    fp16 = demo_block(dtype=torch.float16)
    assert "dtype float16 (the parameters' dtype)" in explain(fp16, patterns=PATS)


def test_sequential_explain_method_and_formats():
    seq = demo_block()
    assert isinstance(seq.explain(), str)
    data = json.loads(seq.explain(format="json"))
    assert data["dtype"] == "bfloat16" and data["target"] == "sm_90"
    assert data["fusion_version"] == fusion.__version__
    assert seq.explain(format="dot").startswith("digraph fusion_plan {")
    with pytest.raises(ValueError, match="format"):
        seq.explain(format="yaml")


def test_json_is_the_plan_as_data():
    data = json.loads(explain(demo_block(SwiGLU(), Clamp(max=1.0), QuantizeMXFP8()), format="json", patterns=PATS))
    plan = data["plan"]
    assert [s["fused"] for s in plan["forward"]] == [True, False, False, True]
    assert plan["fully_fused"] is False
    fb = plan["fallbacks"][0]
    assert fb["op"] == 2 and fb["part"] == "forward" and len(fb["reasons"]) == 2
    assert plan["attempts"]["2"][0]["outcome"] == "failed"
    assert plan["forward"][0]["epilogue"] == [["act", 1]]


def test_dot_clusters_and_fallback_colour():
    dot = explain(demo_block(SwiGLU(), Clamp(max=1.0), QuantizeMXFP8()), format="dot", patterns=PATS)
    assert 'subgraph cluster_fwd1 {' in dot and 'label="gemm_act_scale_quant [patterns/test.fpat:2]' in dot
    assert 'op2 [label="op 2\\nClamp(min=None, max=1.0)", fillcolor="#fde2e1"];' in dot
    assert dot.rstrip().endswith("}")
    try:
        import networkx.drawing.nx_pydot  # noqa: F401
        import pydot
    except ImportError:
        return
    assert pydot.graph_from_dot_data(dot)


# -- backend="reference": the plan promises no kernel ---------------------------------------------------------------
def test_reference_backend_plan_runs_every_op_unfused():
    """A block built with backend="reference" never launches a fused kernel; explain() used to show the fused
    plan ("fully fused") all the same."""
    seq = demo_block(backend="reference")
    assert explain(demo_block(), patterns=PATS).count("fused    ") > 0  # the same block fuses with backend='auto'
    text = explain(seq, patterns=PATS)
    assert "fused    " not in text and "0 fused kernels" in text
    assert "nothing fused: backend='reference'" in text
    assert "every op runs its reference (unfused) path" in text and "backend='auto'" in text
    data = json.loads(explain(seq, format="json", patterns=PATS))
    assert data["backend"] == "reference" and data["plan"]["reason"] == "backend='reference'"
    assert not any(s["fused"] for s in data["plan"]["forward"] + data["plan"]["backward"])
    assert "cluster_fwd" not in explain(seq, format="dot", patterns=PATS)
    assert not any(s.fused for s in seq.plan().steps)


def test_reference_backend_compiles_nothing(monkeypatch):
    """compile() of a backend="reference" block compiles no kernel (none would ever run) and says so."""
    import fusion.runtime.aot as aot

    def no_compile(*args, **kwargs):
        raise AssertionError("compile() compiled a kernel for a backend='reference' block")

    monkeypatch.setattr(aot, "compile_to_disk", no_compile)
    monkeypatch.setattr(aot, "compile_jobs", no_compile)
    seq = demo_block(backend="reference")
    with pytest.warns(UserWarning, match="backend='reference' compiles nothing"):
        assert seq.compile(dtype=torch.bfloat16, target="sm_90a") == []


def test_compile_plan_of_a_reference_block_compiles_nothing(monkeypatch):
    """fusion.runtime.aot.compile_plan called directly honours backend="reference" as Sequential.compile
    does: no job, no kernel compiled, a warning; plan_jobs has no job for it either."""
    import fusion.patterns.registry as registry
    import fusion.runtime.aot as compile_module

    def no_compile(*args, **kwargs):
        raise AssertionError("compile_plan compiled a kernel for a backend='reference' block")

    monkeypatch.setattr(compile_module, "compile_to_disk", no_compile)
    monkeypatch.setattr(compile_module, "compile_jobs", no_compile)
    registry.reset_to_builtins()
    seq = demo_block(backend="reference")
    assert compile_module.plan_jobs(seq, torch.bfloat16) == []
    assert compile_module.plan_jobs(demo_block(), torch.bfloat16)  # the same block with backend='auto' has jobs
    with pytest.warns(UserWarning, match="backend='reference' compiles nothing"):
        assert compile_module.compile_plan(seq, dtype=torch.bfloat16, target="sm_90a") == []
