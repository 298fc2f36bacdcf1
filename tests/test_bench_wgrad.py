"""bench/bench_wgrad.py on the CPU: its group distributions route every row once, and its "ours" row is the tile
the runtime launches at the shape's rows."""
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_wgrad  # noqa: E402
from fusion.kernels.tile_policy import choose_wgrad_config  # noqa: E402


@pytest.mark.parametrize("groups", bench_wgrad.GROUPS)
def test_every_distribution_routes_every_row_once(groups):
    T, E, k = 512, 16, 4
    sizes, index = bench_wgrad.routing(T, E, k, groups, torch.Generator().manual_seed(0), "cpu")
    assert sizes.shape == (E,) and int(sizes.sum()) == T * k and int(sizes.min()) >= 0
    assert index.dtype == torch.int32 and index.shape == (T * k,) and 0 <= int(index.min()) <= int(index.max()) < T


def test_lognormal_is_the_training_step_benchs_imbalance():
    """The largest group far above the mean (the step bench's σ 0.6 weights), the top-k one near it."""
    T, E, k = 8192, 64, 8
    peak = {g: int(bench_wgrad.routing(T, E, k, g, torch.Generator().manual_seed(0), "cpu")[0].max())
            for g in ("topk", "lognormal")}
    assert peak["topk"] < 1.2 * T * k / E < 2 * T * k / E < peak["lognormal"]


def test_ours_is_the_runtimes_tile_at_the_shapes_rows():
    E, d, f, T, k = bench_wgrad.SHAPES["qwen3-235b-a22b-T4096"]
    for _, Ma, Nb, gathered in bench_wgrad.gemms(E, d, f, T, k):
        (plain, _), *rest = bench_wgrad.configs(Ma, Nb, E, T * k, gathered, sweep=True, gather=False)
        assert plain == choose_wgrad_config(Ma, Nb, E, rows=T * k) and plain.pingpong   # 256 rows per expert
        assert plain not in [c for c, _ in rest]
