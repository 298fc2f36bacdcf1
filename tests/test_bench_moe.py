"""bench/bench_moe.py on the CPU: its --dry-run writes the benchmark JSON (every path and phase, the fields the
report reads), fusion and the plain-PyTorch baseline agree on a tiny layer, and the comparison it records would
see a different layer."""
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_moe  # noqa: E402
import moe_paths  # noqa: E402
from bench_common import rel_errors  # noqa: E402

METRICS = {"b2b_ms", "sync_ms", "host_us", "peak_MB", "TFLOPs"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "moe.json"
    bench_moe.main(["--dry-run", "--out", str(out)])
    return json.loads(out.read_text())


def test_dry_run_writes_every_path_and_phase(dry_run):
    assert {"gpu", "date", "commit", "flops", "configs", "sonicmoe_published_h100", "rows"} <= set(dry_run)
    assert dry_run["gpu"] == "cpu"
    rows = {(r["path"], r["phase"]): r for r in dry_run["rows"]}
    assert set(rows) == {(p, ph) for p in bench_moe.PATHS for ph in bench_moe.PHASES}
    for (path, phase), r in rows.items():
        assert {"model", "tokens", "d", "f", "f2", "E", "k", "rows", "routing_agreement"} <= set(r)
        assert r["rows"] == r["tokens"] * r["k"]
        if path == "sonicmoe" and "error" in r:  # not installed here: recorded, not fatal
            assert r["error"].startswith("not available")
            continue
        assert METRICS <= set(r), (path, phase, r)
        assert r["b2b_ms"] > 0 and r["sync_ms"] > 0
        if phase == "moe_training_step":
            assert "activation_MB" in r
    assert rows[("torch_compiled", "moe_forward")]["variant"] == "parts"
    # token rounding: the same layer routed with round_to, its error against top-k recorded apart (not numerics)
    assert rows[("fusion_rounded", "moe_forward")]["round_to"] == 128
    assert "rel_err" not in rows[("fusion_rounded", "moe_forward")]
    assert set(rows[("fusion_rounded", "moe_forward")]["rel_err_vs_top_k"]) == {"y", "dx", "dw1", "dw2", "drouter"}
    assert rows[("fusion", "moe_training_step")]["explain_saved_MB"] is not None


def test_fusion_agrees_with_the_torch_baseline(dry_run):
    for r in dry_run["rows"]:
        if r["path"] in ("fusion", "fusion_compiled"):
            assert r["routing_agreement"] == 1.0
            assert set(r["rel_err"]) == {"y", "dx", "dw1", "dw2", "drouter"}
            assert max(r["rel_err"].values()) < 1e-4, r["rel_err"]


def test_the_fingerprint_sees_a_different_router():
    import fusion

    cfg, opts = bench_moe.DRY_RUN, bench_moe.Options(device="cpu", dtype=torch.float32, backend="reference",
                                                     compile_backend="eager")
    moe = fusion.MoE.swiglu(cfg.d, cfg.E, cfg.f, cfg.k, dtype=torch.float32, backend="reference")
    x, dy = torch.randn(64, cfg.d), torch.randn(64, cfg.d)
    want = bench_moe.fingerprint(moe_paths.TorchLayer(moe, cfg.k, "parts", "gather_sum", opts.compile_backend), x, dy)
    assert max(rel_errors(bench_moe.fingerprint(moe_paths.FusionLayer(moe), x, dy), want).values()) < 1e-4
    with torch.no_grad():
        moe.router.weight.mul_(3.0)
    err = rel_errors(bench_moe.fingerprint(moe_paths.FusionLayer(moe), x, dy), want)
    assert err["y"] > 1e-3 and err["drouter"] > 1e-3


def test_flops_are_counted_as_sonicmoe_counts_them():
    cfg = bench_moe.MoEConfig("x", d=2048, E=64, k=8, f=1024)
    T = 32768
    fwd = 2 * T * cfg.k * cfg.d * (2 * cfg.f) + 2 * T * cfg.k * cfg.f * cfg.d
    assert cfg.flops(T, "moe_forward") == fwd == 6 * T * cfg.k * cfg.d * cfg.f
    assert cfg.flops(T, "moe_training_step") == 3 * fwd


def test_selection_by_model_and_tokens():
    args = bench_moe.argparse.Namespace(dry_run=False, models="qwen3-30b-a3b,sonic-olmoe-7b", tokens="8192,1024")
    got = [(c.model, t) for c, t in bench_moe.select(args)]
    assert got == [("qwen3-30b-a3b", 8192), ("qwen3-30b-a3b", 1024), ("sonic-olmoe-7b", 32768)]
    with pytest.raises(SystemExit, match="unknown models"):
        bench_moe.select(bench_moe.argparse.Namespace(dry_run=False, models="nope", tokens="8192"))


def test_held_out_layers_are_selected_by_name_only():
    default = bench_moe.select(bench_moe.argparse.Namespace(dry_run=False, models=None, tokens="16384"))
    held = {c.model for c in bench_moe.HELD_OUT}
    assert held and not held & {c.model for c, _ in default}
    assert not held & {c.model for c in bench_moe.CONFIGS}
    got = bench_moe.select(bench_moe.argparse.Namespace(dry_run=False, models="held-out,olmoe-1b-7b", tokens="16384"))
    assert {c.model for c, _ in got} == held | {"olmoe-1b-7b"} and {t for _, t in got} == {16384}


def test_graph_ratio_column_reads_graph_ms():
    """--graphs: the table's "in CUDA graphs" column is torch_compiled's graph_ms over fusion's, '-' without them
    (a CPU run captures nothing: bench_moe.graph_row gives no field there)."""
    base = {"model": "m", "tokens": 8, "d": 4, "f": 2, "E": 2, "k": 1, "phase": "moe_training_step", "TFLOPs": 1.0}
    rows = [dict(base, path="fusion", b2b_ms=2.0, graph_ms=1.0), dict(base, path="torch_compiled", b2b_ms=3.0,
                                                                      graph_ms=1.5)]
    line = bench_moe.table(rows).splitlines()[-1]
    assert "| 1.50x | 1.50x |" in line
    del rows[0]["graph_ms"]
    assert "| 1.50x | - |" in bench_moe.table(rows).splitlines()[-1]
    assert bench_moe.graph_row(None, "moe_forward", None, None, "cpu") == {}


def test_rounded_path_routes_the_same_layer_with_round_to():
    import fusion

    moe = fusion.MoE.swiglu(32, 4, 16, 2, dtype=torch.float32, backend="reference")
    rounded = moe_paths.rounded_moe(moe, 8)
    assert rounded.round_to == 8 and moe.round_to is None
    assert rounded.router is moe.router and rounded.experts is moe.experts   # the same parameters
    r = rounded.route(torch.randn(20, 32))
    sizes = r.group_sizes.tolist()
    assert all(s % 8 == 0 or s == 20 for s in sizes)                        # multiples of 8, or capped at T


def test_router_gradient_of_top_1_routing_is_reported_by_magnitude():
    """With k = 1 the router's gradient is zero by construction: layer_errors reports both paths' largest |drouter|
    (a relative error would divide by the reference's rounding noise) and the other tensors' relative errors as
    before; with k = 2 every tensor keeps its relative error."""
    want = {"y": torch.ones(4, 3), "drouter": torch.full((2, 3), 1e-7)}
    got = {"y": torch.ones(4, 3) * 1.01, "drouter": torch.zeros(2, 3)}
    errs = bench_moe.layer_errors(got, want, k=1)
    assert errs["y"] == pytest.approx(0.01, rel=1e-3) and "drouter" not in errs
    assert errs["drouter_max_abs"] == [0.0, pytest.approx(1e-7)]
    assert bench_moe.layer_errors(got, want, k=2) == rel_errors(got, want)
    assert rel_errors(got, want)["drouter"] == 1.0
