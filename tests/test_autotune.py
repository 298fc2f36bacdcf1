"""Autotune mode: candidates, choosing the fastest, and the on-disk record (timing is faked: no GPU here)."""
import dataclasses

import pytest
import torch

from fusion import GroupLinear, Sequential, SwiGLU
from fusion.runtime import autotune
from fusion.runtime.aot import plan_jobs


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    block = Sequential(GroupLinear(4, 256, 768), SwiGLU()).to("meta")
    return plan_jobs(block, torch.bfloat16)[0]


def test_candidates_start_with_the_heuristic_and_divide_n(job):
    from fusion.kernels import GemmConfig

    base = GemmConfig(*job.config)
    cands = autotune.candidates(base, job.N)
    assert cands[0] == base and len(cands) == len(set(cands))
    assert all(job.N % c.tile_n == 0 for c in cands[1:])
    assert {c.pingpong for c in cands} == {False, True}


def test_tune_records_the_fastest_and_skips_failures(job):
    def fake_time(cfg):
        if cfg.tile_n == 256:
            raise RuntimeError("does not fit")
        return 1.0 if not (cfg.tile_n == 128 and cfg.pingpong and not cfg.dynamic) else 0.5

    assert autotune.recorded(job, "GPU-X") is None
    best = autotune.tune(job, "GPU-X", fake_time)
    assert (best.tile_n, best.pingpong, best.dynamic) == (128, True, False)
    assert autotune.recorded(job, "GPU-X") == best  # read back from disk
    assert autotune.recorded(job, "GPU-Y") is None  # per GPU model
    other = dataclasses.replace(job, dtype="float16")
    assert autotune.recorded(other, "GPU-X") is None  # per problem


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("FUSION_AUTOTUNE", raising=False)
    assert not autotune.enabled()
    monkeypatch.setenv("FUSION_AUTOTUNE", "1")
    assert autotune.enabled()
