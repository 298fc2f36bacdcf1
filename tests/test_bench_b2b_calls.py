"""bench/b2b_calls.py on the CPU: its ratio is baseline / fused from the rounds' medians, and the rounds alternate which
path goes first (a drift of the clocks within a round must favour neither)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import b2b_calls  # noqa: E402


def test_ratio_is_baseline_over_fused_of_the_medians():
    times = {("fusion", 10): [4.0, 9.0, 5.0], ("unfused_fullgraph", 10): [6.0, 6.5, 1.0],
             ("fusion", 100): [2.0, 2.0, 2.0], ("unfused_fullgraph", 100): [3.0, 3.0, 3.0]}
    rows = b2b_calls.ratio_rows("m", times, [10, 100])
    assert [r["count"] for r in rows] == [10, 100]
    assert rows[0]["fusion_ms"] == 5.0 and rows[0]["unfused_fullgraph_ms"] == 6.0
    assert rows[0]["ratio"] == 1.2 and rows[1]["ratio"] == 1.5
    assert (rows[0]["fused"], rows[0]["baseline"]) == ("fusion", "unfused_fullgraph")


def test_other_paths_name_their_columns():
    times = {("fusion_fp8", 100): [1.0], ("unfused_fullgraph", 100): [1.3]}
    row, = b2b_calls.ratio_rows("m", times, [100], ("fusion_fp8", "unfused_fullgraph"))
    assert row["fusion_fp8_ms"] == 1.0 and row["ratio"] == 1.3 and row["fused"] == "fusion_fp8"


def test_several_fused_paths_each_against_the_last():
    """--fused fusion,fusion_fp8: one row per fused path and count, each ratio against the baseline (the last path)."""
    times = {("fusion", 100): [2.0, 2.2], ("fusion_fp8", 100): [1.5, 1.5], ("unfused_fullgraph", 100): [3.0, 3.0]}
    rows = b2b_calls.ratio_rows("m", times, [100], ("fusion", "fusion_fp8", "unfused_fullgraph"))
    assert [(r["fused"], r["baseline"]) for r in rows] == [("fusion", "unfused_fullgraph"),
                                                            ("fusion_fp8", "unfused_fullgraph")]
    assert rows[0]["ratio"] == round(3.0 / 2.1, 4) and rows[1]["ratio"] == 2.0
    assert "fusion_fp8_ms" not in rows[0] and rows[1]["fusion_fp8_ms"] == 1.5


def test_rounds_alternate_the_order(monkeypatch):
    """run() times each count once per path per round, the fused path first in even rounds and last in odd ones."""
    calls = []

    class Setup:
        x = dy = None

        def path(self, name):
            return name

    monkeypatch.setattr(b2b_calls.B, "setup_block", lambda block: Setup())
    # a path's call records its warm-up; the fake timer records (path, count) from the call's default argument
    monkeypatch.setattr(b2b_calls.B, "phase_fn",
                        lambda path, phase, x, dy: (lambda p=path: calls.append(("warm", p)), lambda: None))
    monkeypatch.setattr(b2b_calls, "steps_ms", lambda fn, clear, count: calls.append((fn.__defaults__[0], count)) or 1.0)
    monkeypatch.setattr(b2b_calls.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(b2b_calls.torch.cuda, "empty_cache", lambda: None)

    class Block:
        model = "m"

    rows = b2b_calls.run(Block(), [10, 100], 2, lambda msg: None)
    timed = [c for c in calls if c[0] != "warm"]
    assert timed == [("fusion", 10), ("unfused_fullgraph", 10), ("fusion", 100), ("unfused_fullgraph", 100),
                     ("unfused_fullgraph", 10), ("fusion", 10), ("unfused_fullgraph", 100), ("fusion", 100)]
    assert [r["ratio"] for r in rows] == [1.0, 1.0]


def test_clock_rows_take_the_samples_inside_each_window():
    smi = [["timestamp", " clocks.sm [MHz]", " power.draw [W]", " temperature.gpu"],
           ["2026/11/29 19:00:00.000", "1980", "100", "40"],     # before the window
           ["2026/11/29 19:00:01.000", "1400", "690", "50"],
           ["2026/11/29 19:00:01.100", "1420", "700", "52"],
           ["2026/11/29 19:00:01.200", "1410", "[N/A]", "51"],   # unreadable: skipped
           ["2026/11/29 19:00:05.000", "1980", "90", "45"]]      # after it
    import datetime
    t0 = datetime.datetime(2026, 11, 29, 19, 0, 0, 500000).timestamp()
    lines = [f"window m fusion 100 {t0:.3f} {t0 + 1.0:.3f} 4.0000\n",
             f"window m fusion 10 {t0:.3f} {t0 + 1.0:.3f} 4.0000\n",     # short: left out
             "m 100 steps ...\n"]
    row, = b2b_calls.clock_rows(lines, smi)
    assert (row["path"], row["count"], row["samples"]) == ("fusion", 100, 2)
    assert row["sm_mhz"] == 1410 and row["power_w"] == 695 and row["temp_c"] == 52
    assert row["joules_per_step"] == round(695 * 4.0 / 1e3, 3)


def test_weights_change_adds_each_fp8_paths_after_step_twin():
    """--weights-change times each FP8 path beside its twin whose every step is the first after an optimizer step
    (bench_training_step's <path>_after_step); bf16 paths and the baseline stay as they are, the baseline last."""
    assert b2b_calls.with_after_step(("fusion", "fusion_fp8", "unfused_fullgraph")) == (
        "fusion", "fusion_fp8", "fusion_fp8_after_step", "unfused_fullgraph")


def test_after_step_path_invalidates_the_weight_caches_before_each_call():
    """The _after_step path makes each call as the first after an optimizer step: every FP8 weight cache goes stale
    (fusion.quant.invalidate_weight_caches) before the inner path's forward runs."""
    from types import SimpleNamespace

    import bench_training_step as B
    from fusion.quant import fp8_weight

    seen = []
    inner = SimpleNamespace(params=[], probs=None, forward=lambda x: seen.append(fp8_weight._GENERATION[0]) or x)
    path = B.AfterStepPath(inner)
    start = fp8_weight._GENERATION[0]
    assert path.forward(1) == 1 and path.forward(2) == 2
    assert seen == [start + 1, start + 2]
