"""bench/bench_pair_gemm.py on the CPU: the kernels it times are the plan's (the policy's configuration first), each
under the other schedules, with CTA pairs only where the n-tile count is even; and every one of them is a kernel the
template accepts (so --precompile cannot fail on the GPU machine)."""
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_pair_gemm  # noqa: E402
from fusion.kernels.tile_policy import GemmConfig  # noqa: E402


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b"])
def test_variants_start_with_the_policy_and_pair_only_even_tiles(name):
    E, d, f, _, _ = bench_pair_gemm.SHAPES[name]
    plan = bench_pair_gemm.plan_kernels(E, d, f)
    assert set(plan) == {"fc1_fwd", "fc1_fwd_inference", "fc2_fwd", "fc2_dgrad", "fc1_dgrad"}
    for gemm, job in plan.items():
        gated = gemm.startswith("fc1_fwd")
        variants = bench_pair_gemm.variants(job)
        labels = [label for label, _ in variants]
        assert labels[0] == "policy" and variants[0][1] == job
        configs = [GemmConfig(*j.config) for _, j in variants]
        assert len(set(configs)) == len(configs), "a schedule timed twice"
        n_log, tile = (job.N // 2, configs[0].tile_n // 2) if gated else (job.N, configs[0].tile_n)
        even = -(-n_log // tile) % 2 == 0
        assert any(c.cluster_n == 2 for c in configs) == even
        assert {c.dynamic for c in configs} == {False, True}


def test_every_timed_kernel_passes_the_config_check():
    from fusion.kernels.api import check_config
    from fusion.runtime.compile import _epilogue

    for job in bench_pair_gemm.all_jobs(["qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3-ep8"]):
        check_config(GemmConfig(*job.config), _epilogue(job), job.dtype, job.N, job.K)


def test_no_schedules_times_the_policy_and_the_listed_tiles_only(monkeypatch):
    monkeypatch.setitem(bench_pair_gemm.SCHEDULES, "on", False)
    monkeypatch.setitem(bench_pair_gemm.TILES, "extra", ((256, 4, False),))
    monkeypatch.setitem(bench_pair_gemm.TILES, "pairs", True)
    E, d, f, _, _ = bench_pair_gemm.SHAPES["glm-4.5-air"]
    job = bench_pair_gemm.plan_kernels(E, d, f)["fc1_dgrad"]
    labels = [label for label, _ in bench_pair_gemm.variants(job)]
    assert labels == ["policy", "128x256 coop s4 dyn", "128x256 coop s4 static c2", "128x256 coop s4 dyn c2"]
    monkeypatch.setitem(bench_pair_gemm.TILES, "m_pairs", True)   # torch._grouped_mm's sm90 tile: 128x256, 2x1
    variants = dict(bench_pair_gemm.variants(job))
    m2 = GemmConfig(*variants["128x256 coop s4 dyn m2"].config)
    assert (m2.tile_n, m2.pingpong, m2.dynamic, m2.cluster_m, m2.cluster_n) == (256, False, True, 2, 1)
    gated = bench_pair_gemm.plan_kernels(E, d, f)["fc1_fwd"]
    assert not any(label.endswith("m2") for label, _ in bench_pair_gemm.variants(gated))
