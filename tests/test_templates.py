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
