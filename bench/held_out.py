"""Public MLP configurations no tile or dispatch rule was tuned on: one table, read by bench_training_step.py (as
blocks, `--models held-out`), bench_moe.py (as whole MoE layers, `--models held-out`) and bench_wgrad.py /
bench_pair_gemm.py (as kernel shapes). A check that the policy's rules carry over to shapes it has not seen: widths
that are no multiple of 192 (2816, 3584, 2560, 12800) or of 256 (1408: 11 n-tiles of 128), E = 40 and 60, top-1 and
top-2 with large f, two dense models. None of them is in the tuned tables (tests/test_bench_training_step.py)."""
from __future__ import annotations

from typing import NamedTuple


class HeldOut(NamedTuple):
    model: str
    E: int          # experts (1: dense)
    tokens: int     # tokens per GPU in the block benchmark
    top_k: int
    d: int          # hidden size
    f: int          # expert intermediate size (FC1 has 2f outputs)
    source: str

    @property
    def moe(self) -> bool:
        return self.E > 1


HELD_OUT = [
    HeldOut("qwen1.5-moe-a2.7b", 60, 8192, 4, 2048, 1408, "Qwen1.5-MoE-A2.7B config.json"),
    HeldOut("granite-3.0-3b-a800m", 40, 8192, 8, 1536, 512, "granite-3.0-3b-a800m config.json"),
    HeldOut("phi-3.5-moe", 16, 8192, 2, 4096, 6400, "Phi-3.5-MoE-instruct config.json"),
    HeldOut("glm-4.5-air", 128, 8192, 8, 4096, 1408, "GLM-4.5-Air config.json"),
    HeldOut("ernie-4.5-21b-a3b", 64, 8192, 6, 2560, 1536, "ERNIE-4.5-21B-A3B config.json"),
    HeldOut("hunyuan-a13b", 64, 8192, 8, 4096, 3072, "Hunyuan-A13B config.json"),
    HeldOut("qwen2-57b-a14b", 64, 8192, 8, 3584, 2560, "Qwen2-57B-A14B config.json"),
    HeldOut("llama-4-scout", 16, 8192, 1, 5120, 8192, "Llama-4-Scout config.json (routed experts only)"),
    HeldOut("dbrx", 16, 4096, 4, 6144, 10752, "dbrx config.json"),
    HeldOut("mistral-7b", 1, 8192, 1, 4096, 14336,
            "Mistral-7B config.json (Llama-3-8B's weight shapes, at half its rows)"),
    HeldOut("qwen2.5-7b-16k", 1, 16384, 1, 3584, 18944, "Qwen2.5-7B config.json at 16384 rows"),
]
