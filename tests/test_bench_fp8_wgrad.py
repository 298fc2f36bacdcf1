"""bench/bench_fp8_wgrad.py on the CPU: its first FP8 row is the tile the runtime launches, its jobs are what it
times, and the float64 reference it checks the kernel against reads the slot layout right."""
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_fp8_wgrad  # noqa: E402
from fusion.kernels.tile_policy import choose_fp8_wgrad_config  # noqa: E402


def test_the_policy_tile_comes_first_and_every_variant_has_a_job():
    configs = bench_fp8_wgrad.fp8_configs(2048, 768, 128)
    assert configs[0] == choose_fp8_wgrad_config(2048, 768, 128)
    assert len(set(configs)) == len(configs) == 8 and {c.tile_m for c in configs} == {128, 256} \
        and {c.cluster_n for c in configs} == {1, 2} and {c.ctas_per_sm for c in configs} == {1, 2} \
        and {c.store_bytes for c in configs} == {8, 16}
    labels = [bench_fp8_wgrad.config_label(c) for c in configs]
    assert len(set(labels)) == 8 and "128x128 s3 2cta" in labels, labels
    jobs = bench_fp8_wgrad.all_jobs(["qwen3-30b-a3b"])
    # per weight gradient: the bf16 kernel at the shape's rows and the eight FP8 tiles
    assert [j.mainloop for j in jobs] == (["varlen_k"] + ["fp8_varlen_k"] * 8) * 2
    assert len({j.key for j in jobs}) == len(jobs)


def test_the_float64_reference_reads_each_groups_slots():
    from fusion.quant.fp8_block import (fp8_block_columnwise_slots, fp8_block_dequantize_columnwise,
                                        fp8_block_quantize_columnwise)

    sizes = [300, 0, 129, 1]
    x = torch.randn(sum(sizes), 40)
    data, scale = fp8_block_quantize_columnwise(x, torch.tensor(sizes))
    slots = fp8_block_columnwise_slots(data, torch.tensor(sizes))
    groups = bench_fp8_wgrad.dequantized_groups(slots, scale, sizes)
    want = fp8_block_dequantize_columnwise(data, scale, torch.tensor(sizes), torch.float64).t()   # (40, M)
    start = 0
    for n, got in zip(sizes, groups):
        blocks = -(-n // 128)
        assert got.shape == (40, 128 * blocks)
        assert torch.equal(got[:, :n], want[:, start:start + n]) and not got[:, n:].any()
        start += n
