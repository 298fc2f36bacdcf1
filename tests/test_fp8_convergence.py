"""bench/fp8_convergence.py on a tiny model (CPU, a few seconds): both runs learn, the FP8 run really quantized
(its losses are not the bf16 run's bytes, its weights went through 128x128 FP8 blocks, its plan runs the FP8-block
recipe), the two stay close, and the JSON and the pass/fail verdict follow the tolerance."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import fp8_convergence  # noqa: E402

TINY = ["--preset", "cpu", "--layers", "1", "--d", "128", "--heads", "2", "--ffn", "128", "--batch", "4",
        "--seq", "32", "--steps", "20", "--warmup", "3", "--corpus-mb", "0.25", "--eval-batches", "2", "--no-plot",
        "--threads", "1"]  # one thread: two OpenMP threads on a busy 2-core machine can take 50x longer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8conv") / "conv.json"
    threads = torch.get_num_threads()
    result = fp8_convergence.main(TINY + ["--out", str(out)], log=lambda *a: None)
    assert torch.get_num_threads() == threads  # --threads applies to the run only
    return result, json.loads(out.read_text())


def test_both_runs_learn(tiny):
    result, _ = tiny
    for name in ("bf16", "fp8"):
        losses = result["runs"][name]["losses"]
        assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
        assert losses[0] == pytest.approx(math.log(256), rel=0.1)  # starts near uniform over bytes
        assert sum(losses[-5:]) / 5 < losses[0] - 1.0, (name, losses)


def test_fp8_run_really_quantized(tiny):
    result, _ = tiny
    bf16, fp8 = result["runs"]["bf16"]["losses"], result["runs"]["fp8"]["losses"]
    assert bf16[0] == pytest.approx(fp8[0], rel=1e-2)  # same weights and batch: only the rounding differs
    assert bf16 != fp8
    evidence = result["fp8_evidence"]["group_linears"]
    assert len(evidence) == 2 and all(e["weight_format"] == "fp8_block" for e in evidence)
    assert all(1e-4 < e["rel_quant_err"] < 0.1 for e in evidence)  # E4M3 rounding, not a copy
    fp8_gemms = result["sm90_plan_gemm_steps"]["fp8"]
    # on Hopper: FC1 + SwiGLU·scale and FC2's dgrad + its backward in the fused FP8 kernels, FC2's fprop and
    # FC1's dgrad on the FP8 kernel alone, the two weight gradients by torch (the recipe's bf16 wgrad)
    assert len(fp8_gemms) == 6, fp8_gemms
    assert sorted(m.rsplit(" ", 1)[-1] for m in fp8_gemms if "fused kernel" in m) == [
        "grouped_gemm_fp8", "grouped_gemm_fp8_dgrad"], fp8_gemms
    assert sum("FP8 block-scaled grouped GEMM" in m for m in fp8_gemms) == 2, fp8_gemms
    assert sum("WGRAD_IN_BF16" in m for m in fp8_gemms) == 2, fp8_gemms
    assert not any("fp8" in m for m in result["sm90_plan_gemm_steps"]["bf16"])


def test_runs_stay_close_and_verdict_follows_tolerance(tiny):
    result, written = tiny
    a, b = result["runs"]["bf16"]["final_loss"], result["runs"]["fp8"]["final_loss"]
    assert result["relative_difference"] == pytest.approx(abs(b - a) / a)
    assert result["relative_difference"] < 0.05
    assert result["passed"] == (result["relative_difference"] <= 0.02)
    assert written["config"]["layers"] == 1 and written["device"] == "cpu"
    assert written["runs"]["fp8"]["losses"] == result["runs"]["fp8"]["losses"]
    assert {"parameters", "dtypes", "data", "wall_s", "tolerance"} <= set(written)
    assert written["threads"] == 1


def test_same_init_and_data_order():
    cfg = fp8_convergence.Config(layers=1, d=128, heads=2, ffn=128, seq=16, batch=2)
    torch.manual_seed(0)
    ref = fp8_convergence.MoELM(cfg, 256, fp8=False)
    ref.init_weights(cfg.layers)
    fp8 = fp8_convergence.MoELM(cfg, 256, fp8=True)
    fp8_convergence.copy_parameters(ref, fp8)
    for p, q in zip(ref.parameters(), fp8.parameters()):
        assert torch.equal(p, q)
    starts = fp8_convergence.batch_starts(10_000, cfg, 5, seed=3)
    assert torch.equal(starts, fp8_convergence.batch_starts(10_000, cfg, 5, seed=3))


def test_plot_is_skipped_without_matplotlib(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    messages = []
    assert fp8_convergence.plot(tiny[0], tmp_path / "p.png", messages.append) is False
    assert not (tmp_path / "p.png").exists() and "matplotlib is not installed" in messages[0]


def test_markov_data_is_learnable_and_deterministic():
    seq, info = fp8_convergence.markov_corpus(64, 2000, seed=1)
    again, _ = fp8_convergence.markov_corpus(64, 2000, seed=1)
    assert torch.equal(seq, again) and int(seq.max()) < 64
    assert info["entropy_rate_nats"] < 0.7 * math.log(64)
