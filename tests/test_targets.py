"""One target parser (fusion/targets.py) for the planner, explain, compile and the CLI."""
import pytest
import torch

import fusion
from fusion import GroupLinear, Sequential, SwiGLU
from fusion.errors import FusionError, TargetError
from fusion.targets import kernel_target, parse_target, plan_target


@pytest.mark.parametrize("text, canonical", [("sm_90a", "sm_90a"), ("sm_90", "sm_90"), ("SM_90A", "sm_90a"),
                                             (" sm90a ", "sm_90a"), ("sm_100a", "sm_100a"), ("sm_80", "sm_80"),
                                             ("sm_100f", "sm_100f")])
def test_spellings_normalise(text, canonical):
    assert parse_target(text) == canonical


@pytest.mark.parametrize("bad", ["sm_9x", "sm_9", "sm_90b", "sm_90aa", "hopper", "", "90", "sm_1000", None, 90])
def test_bad_targets_are_target_errors(bad):
    with pytest.raises(TargetError, match="sm_90a"):
        parse_target(bad)
    assert issubclass(TargetError, FusionError) and issubclass(TargetError, ValueError)


def block():
    return Sequential(GroupLinear(2, 128, 256, device="meta"), SwiGLU())


@pytest.mark.parametrize("bad", ["sm_9x", "sm_90b", "hopper"])
def test_explain_plan_and_compile_reject_the_same_bad_targets(bad):
    seq = block()
    with pytest.raises(TargetError):
        seq.plan(target=bad)
    with pytest.raises(TargetError):
        seq.explain(target=bad)
    with pytest.raises(TargetError):
        seq.compile(dtype=torch.bfloat16, target=bad)


def test_explain_and_compile_accept_the_same_spellings(monkeypatch):
    from fusion.runtime import aot

    assert block().plan(target="SM90A").target == "sm_90a"
    assert "target sm_90a (given)" in block().explain(target=" sm_90A ")
    monkeypatch.setattr(aot, "compile_jobs", lambda jobs, **kw: jobs)  # the jobs compile() would build
    for spelling in ("SM_90A", " sm90a", "sm_90"):  # Hopper: one code target
        jobs = block().compile(dtype=torch.bfloat16, target=spelling)
        assert jobs and {job.target for job in jobs} == {"sm_90a"}
    assert plan_target("cpu") is None and plan_target(None) is None


def test_other_architectures_cannot_be_compiled():
    for target in ("sm_100a", "sm_80"):
        with pytest.raises(fusion.CompileError, match="sm_90a"):
            kernel_target(target)


def test_cuda_major_asks_once_per_device(monkeypatch):
    """Device methods ask for the compute capability every call: it is cached per device index, and an index-less
    device means the current one."""
    from fusion import targets

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    targets._cuda_major.cache_clear()
    try:
        assert targets.cuda_major(torch.device("cuda", 1)) == 9
        assert targets.cuda_major(torch.device("cuda", 1)) == 9
        assert targets.cuda_major(torch.device("cuda")) == 9 and targets.cuda_major(3) == 9
        assert asked == [1, 3]
    finally:
        targets._cuda_major.cache_clear()
