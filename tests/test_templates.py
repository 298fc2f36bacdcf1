"""The kernel-template table the matcher consults: plans promise only kernels this build can launch."""
import dataclasses

import pytest
import torch

import fusion
from fusion import GroupLinear, QuantizeMXFP8, Scale, SwiGLU
from fusion.patterns import registry
from fusion.planner import clear_cache, plan_for
from fusion import kernel_templates as templates


def demo():
    return fusion.Sequential(GroupLinear(8, 1024, 4096, device="meta"), SwiGLU(), Scale(), QuantizeMXFP8(),
                             GroupLinear(8, 2048, 1024, device="meta"))


@pytest.fixture(autouse=True)
def _fresh_plans():
    registry.reset_to_builtins()
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize("name", sorted(templates.TEMPLATES))
def test_unavailable_follows_the_table(name):
    """A template is runnable exactly when the table says so; otherwise the reason given is the table's."""
    template = templates.TEMPLATES[name]
    reason = templates.unavailable(name)
    if template.available:
        assert reason is None
    else:
        assert name in reason and template.unavailable_reason in reason


def test_an_unknown_template_names_the_known_ones():
    reason = templates.unavailable("no_such_kernel")
    assert "does not exist" in reason and all(name in reason for name in templates.TEMPLATES)


def test_builtin_plans_fuse_only_available_templates_of_their_direction():
    """Every fused step of a plan from the built-in patterns names a template this build runs, in the direction
    the runtime launches it (forward steps: generated GEMM kernels; backward steps: dgrad kernels)."""
    plan = plan_for(demo(), dtype=torch.bfloat16)
    for direction, steps in (("forward", plan.forward), ("backward", plan.backward)):
        fused = [s for s in steps if s.fused]
        assert fused, f"the demo block fuses nothing {direction}"
        for step in fused:
            assert templates.unavailable(step.kernel) is None
            assert templates.TEMPLATES[step.kernel].direction == direction


def test_an_unavailable_template_is_a_reason_not_a_promise(monkeypatch):
    fused = {s.kernel for s in plan_for(demo(), dtype=torch.bfloat16).backward if s.fused}
    (dgrad,) = fused
    monkeypatch.setitem(templates.TEMPLATES, dgrad, dataclasses.replace(
        templates.TEMPLATES[dgrad], available=False, unavailable_reason="switched off in this test"))
    clear_cache()
    plan = plan_for(demo(), dtype=torch.bfloat16)
    assert not any(s.fused for s in plan.backward)
    assert any("switched off in this test" in r for f in plan.fallbacks for r in f.reasons)
    assert "switched off in this test" in demo().explain()


def _moe_experts(backend="auto"):
    from fusion import Combine, Gather
    return fusion.Sequential(Gather(), GroupLinear(4, 64, 128), SwiGLU(), Scale(), GroupLinear(4, 64, 64), Combine(),
                             backend=backend)


def test_fusion_disable_templates_declines_the_gather_and_says_why(monkeypatch):
    """FUSION_DISABLE_TEMPLATES (read at import into DISABLED): the matcher declines the template as unavailable, the
    plan falls back to the next pattern (Gather unfused, FC1 on gemm_act), and explain() names the variable."""
    seq = _moe_experts()
    assert plan_for(seq).forward[0].kernel == "grouped_gemm_gather"
    monkeypatch.setattr(templates, "DISABLED", frozenset({"grouped_gemm_gather"}))
    clear_cache()
    plan = plan_for(seq)
    assert not plan.forward[0].fused and plan.forward[1].kernel == "grouped_gemm"
    assert "disabled by FUSION_DISABLE_TEMPLATES" in seq.explain()


def test_with_the_gather_declined_the_emulated_block_still_matches_the_reference(monkeypatch):
    monkeypatch.setattr(templates, "DISABLED", frozenset({"grouped_gemm_gather"}))
    clear_cache()
    torch.manual_seed(0)
    T, k, E = 16, 2, 4
    emulated, reference = _moe_experts("emulate"), _moe_experts("reference")
    reference.load_state_dict(emulated.state_dict())
    index = torch.arange(T).repeat_interleave(k)[torch.randperm(T * k)]
    expert = torch.randint(0, E, (T * k,))
    order = torch.argsort(expert, stable=True)
    index, sizes = index[order], torch.bincount(expert, minlength=E)
    x, probs = torch.randn(T, 64), torch.rand(T * k)
    assert "[F1] unfused  op 0 Gather()" in emulated.explain()   # the declined plan is what runs
    got = emulated(x, index=index, group_sizes=sizes, scale=probs)
    want = reference(x, index=index, group_sizes=sizes, scale=probs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_unknown_disabled_template_is_warned_about(monkeypatch):
    monkeypatch.setenv(templates.DISABLE_ENV, "grouped_gemm_gathr,grouped_gemm")
    with pytest.warns(UserWarning, match="grouped_gemm_gathr"):
        assert templates._disabled_from_env() == {"grouped_gemm_gathr", "grouped_gemm"}
