"""A pattern means what it says: changing a field of a .fpat pattern changes the plan, the generated kernel source
and what the runtime keeps, and a field that would mean nothing is a load error.

The block is FC1 -> SwiGLU -> Clamp -> FC2; user patterns (priority above the built-ins) fuse FC1 with SwiGLU and
Clamp and differ only in `save`. The built-in dgrad_dact reads act.in (v1) for FC2's dgrad.
"""
from __future__ import annotations

import copy

import pytest
import torch

import fusion
from fusion import Clamp, GroupLinear, Scale, Sequential, SwiGLU
from fusion.errors import PatternError
from fusion.patterns.registry import fusion_patterns, reset_to_builtins
from fusion.planner import plan_for
from fusion.runtime.kernel import LAUNCHES
from fusion.runtime.program import BlockProgram

E, D, F = 4, 32, 48

PATTERN = """
fusion fc1_user {{
    kernel    = grouped_gemm
    priority  = 100
    chain {{
        gemm:  GroupLinear
        act:   activation
        clamp: Clamp
    }}
    {save}
}}
"""


@pytest.fixture(autouse=True)
def _builtins_only():
    reset_to_builtins()
    yield
    reset_to_builtins()


def load(tmp_path, save: str):
    path = tmp_path / "user.fpat"
    path.write_text(PATTERN.format(save=save))
    fusion.load_patterns(path)


def block():
    return Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), Clamp(-0.5, 0.5), GroupLinear(E, F, D),
                      backend="emulate").double()


def forward_runner(seq):
    plan = plan_for(seq, dtype=torch.bfloat16)
    program = BlockProgram(seq, plan, "emulate")
    return plan, program.forward_steps[0]


@pytest.mark.parametrize("save,writes,recomputed,saved_decl", [
    ("", ("v3",), ("v1",), None),
    ("save = act.in", ("v3", "v1"), (), '_epi.Output("saved", paired=True)'),
    ("save = gemm.out", ("v3", "v1"), (), '_epi.Output("saved", paired=True)'),
    ("save = clamp.in", ("v3", "v2"), ("v1",), '_epi.Output("saved", paired=False)'),
])
def test_save_decides_what_the_kernel_writes_and_the_plan_keeps(tmp_path, save, writes, recomputed, saved_decl):
    load(tmp_path, save)
    seq = block()
    plan, runner = forward_runner(seq)
    f1 = plan.forward[0]
    assert f1.pattern == "fc1_user" and f1.writes == writes
    assert plan.recomputed == recomputed  # what the backward reads (v1) and the forward does not keep
    train = runner.source(torch.bfloat16, train=True)
    if saved_decl is None:
        assert '"saved"' not in train and not runner.writes_saved
    else:
        assert saved_decl in train and runner.writes_saved
    assert '"saved"' not in runner.source(torch.bfloat16, train=False)  # inference never writes it
    unread = "no backward step reads it" in seq.explain()
    assert unread == (save == "save = clamp.in")


@pytest.mark.parametrize("save", ["", "save = act.in", "save = clamp.in"])
def test_every_save_runs_correctly_under_emulate(tmp_path, save):
    """Whatever the pattern saves, the gradients are the reference's: a value not saved is recomputed."""
    load(tmp_path, save)
    seq = block()
    reference = copy.deepcopy(seq)
    reference.backend = "reference"
    x = torch.randn(40, D, dtype=torch.float64)
    sizes = torch.tensor([10, 0, 25, 5])
    dy = torch.randn(40, D, dtype=torch.float64)
    grads = []
    for b in (seq, reference):
        xi = x.clone().requires_grad_()
        LAUNCHES.reset()
        b(xi, group_sizes=sizes).backward(dy)
        grads.append([xi.grad, *(p.grad for p in b.parameters())])
        if b is seq:
            assert LAUNCHES.by_step == {"F1": 1, "B1": 1}  # the user pattern's kernel and dgrad_dact ran
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_save_no_gradient_reads_declines_the_pattern_with_a_reason(tmp_path):
    """`save = scale.in` on a Scale by a constant would be written for nothing: the pattern does not apply, and
    explain() says why; the built-in gemm_scale_const (no save) fuses it instead."""
    path = tmp_path / "scale.fpat"
    path.write_text("fusion my_gemm_scale {\n  kernel = grouped_gemm\n  priority = 100\n  chain {\n"
                    "    gemm: GroupLinear\n    scale: Scale\n  }\n  save = scale.in\n}\n")
    fusion.load_patterns(path)
    const = Sequential(GroupLinear(E, D, D), Scale(value=0.5))
    plan = plan_for(const)
    assert plan.forward[0].pattern == "gemm_scale_const" and not plan.forward[0].saves
    reason = next(a.reason for a in plan.attempts[1] if a.pattern == "my_gemm_scale")
    assert reason.startswith("save = scale.in: the value enters op 1 Scale(value=0.5), whose gradient reads no "
                             "value") and "scale.fpat:1" in reason
    per_row = plan_for(Sequential(GroupLinear(E, D, D), Scale()))
    assert per_row.forward[0].pattern == "my_gemm_scale" and per_row.forward[0].writes == ("v2", "v1")


def test_the_epilogue_is_the_chain(tmp_path):
    """No `epilogue` field can disagree with the kernel: the labels come from the chain, in the order the
    kernel applies them, and the field itself is refused."""
    load(tmp_path, "save = act.in")
    (user,) = [p for p in fusion_patterns() if p.name == "fc1_user"]
    assert user.epilogue == ("act", "clamp")
    (bwd,) = [p for p in fusion_patterns() if p.name == "dgrad_dact"]
    assert bwd.epilogue == ("quant", "scale", "clamp", "act", "bias")
    plan = plan_for(block(), dtype=torch.bfloat16)
    assert plan.forward[0].epilogue == (("act", 1), ("clamp", 2))
    with pytest.raises(PatternError, match="`epilogue` is not a field: the epilogue is the chain itself"):
        load(tmp_path, "epilogue = clamp, act")
    with pytest.raises(PatternError, match="`option NAME = value` is not part of the language"):
        load(tmp_path, "option tile_n = 128")


@pytest.mark.parametrize("save,message", [
    ("save = gemm.out, clamp.in", "save names 2 values but kernel template 'grouped_gemm' writes 1"),
    ("save = gemm.in", "save: 'gemm.in' is the kernel's input"),
    ("save = clamp.out", "save: 'clamp.out' is the chain's output"),
])
def test_a_save_the_template_cannot_write_is_a_load_error(tmp_path, save, message):
    with pytest.raises(PatternError, match=message) as info:
        load(tmp_path, save)
    assert info.value.file.endswith("user.fpat") and info.value.line == 10
    assert [p.name for p in fusion_patterns() if p.name == "fc1_user"] == []  # a failed load changes nothing
