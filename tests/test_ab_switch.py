"""bench/ab_switch.py's MoE subjects on the CPU: the twin layer of --moe --plan shares every parameter with the
layer but runs its own experts block (its own plan and kernels), leaving the layer as it was; unknown --moe models are
an error before anything is built."""
import sys
import types
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import ab_switch  # noqa: E402
from moe_paths import twin_layer  # noqa: E402


def test_twin_layer_shares_the_parameters_not_the_experts_block():
    import fusion

    torch.manual_seed(0)
    moe = fusion.MoE.swiglu(16, 4, 8, 2, backend="reference")
    experts = moe.experts
    twin = twin_layer(moe)
    assert twin.experts is not experts and moe.experts is experts          # the layer keeps its own block
    assert twin.router is moe.router
    assert [p.data_ptr() for p in twin.parameters()] == [p.data_ptr() for p in moe.parameters()]
    assert list(twin.experts.ops) == list(experts.ops)                       # the same ops, so the same weights
    x = torch.randn(5, 16)
    torch.testing.assert_close(twin(x), moe(x), rtol=0, atol=0)


def test_unknown_moe_models_stop_before_anything_is_built():
    args = types.SimpleNamespace(moe=True, models="qwen3-30b-a3b,no-such-model", tokens=1024, plan=False,
                                 phases="moe_training_step")
    with pytest.raises(SystemExit, match="no-such-model"):
        next(ab_switch.subjects(args, None, "X"))


def test_precompile_builds_both_settings_plans(monkeypatch):
    """--precompile with --on / --off values (a threshold, not a bool, parsed as literals): the MoE layer's plan is
    made at each value, so the kernels of both settings reach the cache (the FC1 of Qwen3-30B-A3B loads a copy by
    TMA at 0 and gathers in its A loads at 5760), and the attribute is restored afterwards."""
    import fusion.kernels.api as K
    import fusion.kernels.tile_policy as tile_policy
    import fusion.runtime.aot as aot

    seen = []
    monkeypatch.setattr(aot, "compile_jobs", lambda jobs, parallel=1: seen.append(list(jobs)))
    original = tile_policy.FC1_COPY_MIN_N
    ab_switch.main(["--switch", "fusion.kernels.tile_policy:FC1_COPY_MIN_N", "--on", "0", "--off", "5760", "--moe",
                    "--plan", "--models", "qwen3-30b-a3b", "--precompile"])
    assert tile_policy.FC1_COPY_MIN_N == original and len(seen) == 2

    def fc1_gathers(jobs):
        return {K.GemmConfig(*j.config).gather_a for j in jobs if j.mainloop == "bf16" and "F1" in j.step}

    assert fc1_gathers(seen[0]) == {False} and fc1_gathers(seen[1]) == {True}


def test_precompile_of_the_fp8_path_plans_both_tile_rows(monkeypatch):
    """--path fusion_fp8 with the FP8 kernel's tile rows as the switch (FP8_TILE_M, 256 against 128): the FP8
    block's plan is made at each value, so the FP8 kernels of both reach the cache, and the attribute is
    restored."""
    import fusion.kernels.api as K
    import fusion.kernels.tile_policy as tile_policy
    import fusion.runtime.aot as aot

    seen = []
    monkeypatch.setattr(aot, "compile_jobs", lambda jobs, parallel=1: seen.append(list(jobs)))
    original = tile_policy.FP8_TILE_M
    ab_switch.main(["--switch", "fusion.kernels.tile_policy:FP8_TILE_M", "--on", "256", "--off", "128", "--plan",
                    "--path", "fusion_fp8", "--models", "qwen3-30b-a3b", "--precompile"])
    assert tile_policy.FP8_TILE_M == original and len(seen) == 2

    def fp8_rows(jobs):
        return {K.GemmConfig(*j.config).tile_m for j in jobs if j.mainloop == "fp8_block"}

    # (FC1's kernel with the FP8-block store is 128 x 256 at either value: fp8_block_output_tile)
    assert fp8_rows(seen[0]) == {256, 128} and fp8_rows(seen[1]) == {128}
