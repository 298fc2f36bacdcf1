"""The kernel-template table the matcher consults: plans promise only kernels this build can launch."""
import dataclasses

import torch

import fusion
from fusion import GroupLinear, QuantizeMXFP8, Scale, SwiGLU
from fusion.planner import clear_cache, plan_for
from fusion import kernel_templates as templates


def demo():
    return fusion.Sequential(GroupLinear(8, 1024, 4096, device="meta"), SwiGLU(), Scale(), QuantizeMXFP8(),
                             GroupLinear(8, 2048, 1024, device="meta"))


def test_both_templates_run_in_this_build():
    assert templates.unavailable("grouped_gemm") is None
    assert templates.unavailable("grouped_gemm_dgrad") is None
    assert "does not exist" in templates.unavailable("no_such_kernel")


def test_an_unavailable_template_is_a_reason_not_a_promise(monkeypatch):
    dgrad = templates.TEMPLATES["grouped_gemm_dgrad"]
    monkeypatch.setitem(templates.TEMPLATES, "grouped_gemm_dgrad",
                        dataclasses.replace(dgrad, available=False, unavailable_reason="switched off in this test"))
    clear_cache()
    plan = plan_for(demo(), dtype=torch.bfloat16)
    assert not any(s.fused for s in plan.backward)
    assert any("switched off in this test" in r for f in plan.fallbacks for r in f.reasons)
    assert "switched off in this test" in demo().explain()
    clear_cache()
