"""bench/bench_gather_gemm.py on the CPU: the kernels it times are the MoE layer plan's FC1 training job at the
policy's gathering configuration (CTA pairs along m), the same as single CTAs, that tile on a pre-gathered A, and
the runtime's TMA configuration; all of them configurations the template accepts (so --precompile cannot fail on
the GPU machine)."""
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_gather_gemm  # noqa: E402
import fusion.kernels as K  # noqa: E402
from fusion.kernels.tile_policy import GemmConfig  # noqa: E402


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "glm-4.5-air"])
def test_the_timed_kernels_are_the_plans_fc1_at_each_configuration(name):
    E, d, f, _, k = bench_gather_gemm.SHAPES[name]
    jobs = bench_gather_gemm.shape_jobs(E, d, f, k)
    assert set(jobs) == {"gather", "runtime", "single", "same"}
    base = bench_gather_gemm.fc1_job(E, d, f, k)
    assert (base.step, base.variant) == ("F1", "train")
    assert all(job.source == base.source and (job.N, job.K, job.G) == (2 * f, d, E) for job in jobs.values())
    cfg = {name: GemmConfig(*job.config) for name, job in jobs.items()}
    assert cfg["gather"].gather_a and cfg["gather"].cluster_m == 2
    assert cfg["single"] == GemmConfig(**{**cfg["gather"].__dict__, "cluster_m": 1})
    assert not cfg["same"].gather_a and cfg["same"].cluster_m == 1 and cfg["same"].tile_n == cfg["single"].tile_n
    assert not cfg["runtime"].gather_a
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
    assert gather.dynamic and not static.dynamic and static.cluster_m == gather.cluster_m == 2
    assert GemmConfig(**{**static.__dict__, "dynamic": True}) == gather
