"""bench/fp8_dgrad_epilogue.py on the CPU: it times the plan's own B1 (the FP8 dgrad with the generated
d(SwiGLU·scale) epilogue and the dequantized FP8-block row) or F1 (the training FC1 with its FP8-block store), and its
problem holds every tensor that epilogue reads and writes, at the shapes the kernel takes."""
import sys
import types
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import fp8_dgrad_epilogue  # noqa: E402


def test_the_b1_job_is_the_fp8_dgrad_with_the_dequantized_row():
    from bench_training_step import BLOCKS

    block = next(b for b in BLOCKS if b.model == "qwen3-30b-a3b")
    job = fp8_dgrad_epilogue.plan_job(block)
    assert job.mainloop == "fp8_block" and (job.N, job.K, job.G) == (block.f, block.d, block.E)
    assert "FP8BlockDequantOutput" in job.source and "RowSumOutput" in job.source


def test_the_problem_has_every_epilogue_tensor():
    from fusion.runtime.compile import _epilogue

    block = types.SimpleNamespace(model="tiny", E=4, d=256, f=320, rows=600)
    job = fp8_dgrad_epilogue.plan_job(block)
    epilogue = _epilogue(job)
    (a, a_scale, b, b_scale, offsets), extras, outputs = fp8_dgrad_epilogue.problem(block, job, epilogue, "cpu")
    assert a.shape == (600, 256) and a_scale.shape == (2, 600)
    assert b.shape == (4, 320, 256) and b_scale.shape == (4, 3, 2) and offsets.shape == (5,)
    assert {s.name for s in epilogue.inputs} == set(extras)
    outs = outputs()
    assert {s.name for s in epilogue.outputs} == set(outs)
    assert outs["dinput"].shape == (600, 640) and outs["postact"].shape == (600, 320)
    assert fp8_dgrad_epilogue.same_bits(outs["postact"], outs["postact"].clone())
    changed = outs["postact"].clone()
    changed[0, 0] = 1.0
    assert not fp8_dgrad_epilogue.same_bits(changed, outs["postact"])
    assert not fp8_dgrad_epilogue.same_bits(torch.zeros(2, 2), torch.full((2, 2), -0.0))


def test_the_f1_job_is_the_training_fc1_with_its_fp8_block_store():
    from fusion.runtime.compile import _epilogue

    block = types.SimpleNamespace(model="tiny", E=4, d=256, f=320, rows=600)
    job = fp8_dgrad_epilogue.plan_job(block, "F1")
    assert job.mainloop == "fp8_block" and (job.N, job.K, job.G) == (640, 256, 4) and job.variant == "train"
    epilogue = _epilogue(job)
    (a, a_scale, b, b_scale, offsets), extras, outputs = fp8_dgrad_epilogue.problem(block, job, epilogue, "cpu")
    assert a.shape == (600, 256) and b.shape == (4, 640, 256)
    assert {s.name for s in epilogue.inputs} == set(extras) == {"scale_scale"}
    outs = outputs()
    assert outs["out"].dtype == torch.float8_e4m3fn and outs["out"].shape == (600, 320)
    assert outs["saved"].shape == (600, 640) and outs["out_amax"].dim() == 0
    assert outs["out_scale"].isnan().all() and outs["saved"].isnan().all()
    codes = outs["out"].clone()
    assert fp8_dgrad_epilogue.same_bits(codes, outs["out"])
    codes.view(torch.uint8)[0, 0] = 0
    assert not fp8_dgrad_epilogue.same_bits(codes, outs["out"])


def test_the_cooperative_variant_is_the_tile_two_ctas_replaced():
    """--variants cooperative: where the policy takes two CTAs an SM (Mixtral-8x7B's B1, K = 4096), the cooperative
    tile it replaced (one CTA an SM, more stages); "two-ctas" keeps the job's own two-CTA tile."""
    from bench_training_step import BLOCKS
    from fusion.runtime.compile import _config

    block = next(b for b in BLOCKS if b.model == "mixtral-8x7b")
    config = _config(fp8_dgrad_epilogue.plan_job(block, "B1"))
    coop = fp8_dgrad_epilogue.cooperative_config(block, "B1")
    assert (config.tile_m, config.tile_n, config.ctas_per_sm) == (128, 128, 2)
    assert (coop.tile_m, coop.tile_n, coop.ctas_per_sm) == (128, 128, 1) and coop.stages > config.stages
    assert fp8_dgrad_epilogue.variant_config(config, "cooperative", coop) == coop
    assert fp8_dgrad_epilogue.variant_config(config, "two-ctas", coop) == config
