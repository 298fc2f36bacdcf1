"""bench/bench_gather_gemm.py on the CPU: the kernels it times are the MoE layer plan's FC1 training job at the
policy's gathering configuration (single CTAs), the same as CTA pairs along m, that tile on a pre-gathered A,
and the runtime's TMA configuration; all of them configurations the template accepts (so --precompile cannot fail on
the GPU machine)."""
import dataclasses
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_gather_gemm  # noqa: E402
import fusion.kernels as K  # noqa: E402
from fusion.kernels.tile_policy import GemmConfig, n_tile_count  # noqa: E402


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "glm-4.5-air"])
def test_the_timed_kernels_are_the_plans_fc1_at_each_configuration(name):
    E, d, f, _, k = bench_gather_gemm.SHAPES[name]
    jobs = bench_gather_gemm.shape_jobs(E, d, f, k)
    pairs_up = n_tile_count(2 * f, GemmConfig(*jobs["gather"].config).tile_n) % 2 == 0   # a TMA-rows pair along n
    assert set(jobs) == {"gather", "runtime", "pairs", "tma_rows", "same"} | ({"tma_pairs"} if pairs_up else set())
    base = bench_gather_gemm.fc1_job(E, d, f, k)
    assert (base.step, base.variant) == ("F1", "train")
    assert all(job.source == base.source and (job.N, job.K, job.G) == (2 * f, d, E) for job in jobs.values())
    cfg = {name: GemmConfig(*job.config) for name, job in jobs.items()}
    assert cfg["gather"].gather_a and cfg["gather"].cluster_m == 1
    assert cfg["pairs"] == GemmConfig(**{**cfg["gather"].__dict__, "cluster_m": 2})
    assert not cfg["same"].gather_a and cfg["same"].cluster_m == 1 and cfg["same"].tile_n == cfg["gather"].tile_n
    assert not cfg["runtime"].gather_a
    assert cfg["tma_rows"] == GemmConfig(**{**cfg["gather"].__dict__, "gather_tma": True})
    if pairs_up:
        assert cfg["tma_pairs"] == GemmConfig(**{**cfg["gather"].__dict__, "gather_tma": True, "cluster_n": 2})
    epi = K.SwiGLUScaleEpilogue()
    for c in cfg.values():
        K.check_config(c, epi, "bfloat16", 2 * f, d)


def test_runtime_only_times_the_two_kernels_the_runtime_chooses_between():
    E, d, f, _, k = bench_gather_gemm.SHAPES["olmoe"]
    assert set(bench_gather_gemm.shape_jobs(E, d, f, k, runtime_only=True)) == {"gather", "runtime"}


def test_static_adds_the_policy_configuration_on_the_static_order():
    E, d, f, _, k = bench_gather_gemm.SHAPES["qwen3-30b-a3b"]
    jobs = bench_gather_gemm.shape_jobs(E, d, f, k, static=True)
    gather, static = (GemmConfig(*jobs[n].config) for n in ("gather", "static"))
    assert gather.dynamic and not static.dynamic and static.cluster_m == gather.cluster_m == 1
    assert GemmConfig(**{**static.__dict__, "dynamic": True}) == gather


def test_pairs_left_out_where_the_template_cannot_build_them(monkeypatch):
    """GLM-4.5-Air's FC1 at a 176-column tile splits each 88-row half box unevenly between a pair: no "pairs" row
    (the template refuses it), and with the policy's pairs on the "single" row is the other one."""
    from fusion.kernels import tile_policy

    E, d, f, _, k = bench_gather_gemm.SHAPES["glm-4.5-air"]
    policy = tile_policy.tile_config

    def narrow(*args, **kw):   # the gathering tile at 176 columns (88-row half boxes)
        cfg = GemmConfig(*policy(*args, **kw))
        return dataclasses.astuple(dataclasses.replace(cfg, tile_n=176, stages=5, pingpong=True)) \
            if kw.get("gather") else dataclasses.astuple(cfg)

    monkeypatch.setattr(bench_gather_gemm, "tile_config", narrow)
    assert "pairs" not in bench_gather_gemm.shape_jobs(E, d, f, k)
    monkeypatch.undo()
    monkeypatch.setattr(tile_policy, "GATHER_PAIRS", True)
    jobs = bench_gather_gemm.shape_jobs(E, d, f, k)
    assert set(jobs) == {"gather", "runtime", "single", "tma_rows", "same"}   # 11 n-tiles of 256: no TMA-rows pair
    assert GemmConfig(*jobs["gather"].config).cluster_m == 2
