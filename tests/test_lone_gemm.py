"""The lone-GEMM device method (fusion/runtime/lone_gemm.py): the measured rule that sends a GroupLinear's unfused
forward or dgrad to our varlen-M kernel, the kernels Sequential.compile() builds for it, and what explain() says.
The GPU tests (tests/test_lone_gemm_gpu.py) check that it runs where the rule says and computes the GEMM."""
import pytest
import torch

import fusion
from fusion import GroupLinear, Linear, Scale, SwiGLU
from fusion.op_table import LONE_GEMM_RULE, device_method
from fusion.runtime import lone_gemm

ROWS = LONE_GEMM_RULE["max_rows_per_group"]["forward"]
DGRAD_ROWS = LONE_GEMM_RULE["max_rows_per_group"]["dgrad"]


@pytest.fixture
def narrow(monkeypatch):
    """The rule without the wide tile (FUSION_LONE_WIDE=0), whatever FUSION_* the test run has."""
    from fusion.kernels import tile_policy

    monkeypatch.setattr(lone_gemm, "WIDE_TILE", False)
    monkeypatch.setattr(lone_gemm, "OUTPUT_BUDGET", True)
    monkeypatch.setattr(tile_policy, "DYNAMIC_PAIRS", True)


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setattr(lone_gemm, "WIDE_TILE", True)


@pytest.mark.parametrize("rows,groups,n,expect", [
    (32 * 128, 128, 2048, True),          # Qwen3-30B-A3B at 512 tokens: 32 rows per expert
    (256 * 128, 128, 4096, True),         # Qwen3-235B-A22B: 256
    (ROWS * 128, 128, 2048, True),        # the boundary itself
    (ROWS * 128 + 1, 128, 2048, False),
    (2048 * 64, 64, 2048, False),         # OLMoE: 2048 rows per expert, torch measured faster
    (512 * 128, 128, 2880, True),         # GPT-OSS: N = 2880, 15 whole 192-column tiles
    (512 * 128, 128, 2000, False),        # no multiple of 128 or 192: a partial last n-tile
    (0, 8, 1024, True),                   # no rows: the kernel launches nothing
    (512, 1, 4096, False),                # one group: a dense GEMM, cuBLAS measured faster
    (512, 2, 4096, True),
])
def test_rule(narrow, rows, groups, n, expect):
    assert lone_gemm.chooses_kernel(rows, groups, n, 768) is expect


@pytest.mark.parametrize("rows_per_group,expect", [
    (256, True),       # Qwen3-235B-A22B: ours measured faster
    (512, True),       # the boundary (GPT-OSS-120B at T = 16384, top-4)
    (768, False),      # DeepSeek-V2-Lite: torch's dgrad measured faster
    (1024, False),     # Qwen3-30B-A3B at T = 16384: torch's dgrad measured faster on an H100
])
def test_dgrad_rule_takes_fewer_rows(narrow, rows_per_group, expect):
    assert DGRAD_ROWS < ROWS
    assert lone_gemm.chooses_kernel(rows_per_group * 128, 128, 2048, 1536, "dgrad") is expect
    assert lone_gemm.chooses_kernel(rows_per_group * 128, 128, 2048, 768, "forward")   # the forward keeps 1024


OUTPUTS = LONE_GEMM_RULE["max_outputs_per_group"]


@pytest.mark.parametrize("rows_per_group,groups,n,part,expect", [
    (1024, 64, 4096, "forward", False),    # Hunyuan-A13B's FC2 forward: torch measured faster (a held-out block)
    (1024, 64, 3584, "forward", False),    # Qwen2-57B-A14B's
    (512, 128, 4096, "forward", True),     # GLM-4.5-Air's: 2^21 outputs per group, the boundary
    (512, 128, 4096, "dgrad", False),      # GLM-4.5-Air's FC1 dgrad: torch measured faster
    (256, 128, 4096, "dgrad", True),       # Qwen3-235B-A22B's (tied)
    (512, 128, 2880, "dgrad", True),       # GPT-OSS-120B's: ours measured faster
    (1024, 32, 7168, "forward", True),     # DeepSeek-V3's EP8 share: dynamic CTA pairs keep the rows cap alone
    (1024, 16, 4096, "forward", True),     # Phi-3.5-MoE's width: dynamic pairs
    (512, 16, 5120, "forward", False),     # Llama-4-Scout: 16 groups, but 27 n-tiles at 192 do not pair
    (1024, 32, 2880, "forward", False),    # GPT-OSS-20B: 32 groups, 15 n-tiles
])
def test_output_budget(narrow, rows_per_group, groups, n, part, expect):
    assert lone_gemm.chooses_kernel(rows_per_group * groups, groups, n, 2048, part) is expect


def test_dynamic_pairs_switch_reaches_the_rule(narrow, monkeypatch):
    """FUSION_DYNAMIC_PAIRS=0 (tile_policy.DYNAMIC_PAIRS) puts DeepSeek-V3's forward under the budget: the pairs'
    exemption follows the tile the kernel really gets (no stale cache)."""
    from fusion.kernels import tile_policy

    assert lone_gemm.chooses_kernel(1024 * 32, 32, 7168, 2048)
    monkeypatch.setattr(tile_policy, "DYNAMIC_PAIRS", False)
    assert not lone_gemm.runs_dynamic_pairs(7168, 32)
    assert not lone_gemm.chooses_kernel(1024 * 32, 32, 7168, 2048)


def test_output_budget_switch(narrow, monkeypatch):
    assert not lone_gemm.chooses_kernel(1024 * 64, 64, 4096, 3072)
    monkeypatch.setattr(lone_gemm, "OUTPUT_BUDGET", False)
    assert lone_gemm.chooses_kernel(1024 * 64, 64, 4096, 3072)


@pytest.mark.parametrize("rows_per_group,groups,n,k,part,expect,runs_wide", [
    (1024, 64, 4096, 3072, "forward", True, True),    # Hunyuan-A13B's FC2 forward: 2.402 ms against torch's 2.750
    (1024, 64, 3584, 2560, "forward", True, True),    # Qwen2-57B-A14B's
    (2048, 128, 4096, 1024, "forward", True, True),   # SonicMoE's (N >= 2560): 3.480 against 3.754, the cap itself
    (2049, 128, 4096, 1024, "forward", False, True),  # past the wide forward's cap
    (4096, 32, 7168, 2048, "forward", False, True),   # DeepSeek-V3's EP8 share: torch's (5.506 against 5.610)
    (512, 128, 2880, 2880, "forward", True, True),    # GPT-OSS-120B: 12 n-tiles, the last a quarter full
    (2048, 64, 2048, 1024, "forward", False, False),  # OLMoE's: N < 2560 and K < 1280, the narrow rule
    (1024, 128, 2048, 768, "forward", True, False),   # Qwen3-30B-A3B's: the narrow rule, its 128x128 pair
    (1024, 128, 2048, 1536, "dgrad", False, True),    # Qwen3-30B-A3B's FC1 dgrad: wide, but N < 4096 caps at 512
    (512, 128, 4096, 2816, "dgrad", True, True),      # GLM-4.5-Air's: 2.535 against 2.859 (torch 2.523)
    (2048, 128, 4096, 2048, "dgrad", True, True),     # SonicMoE's (N >= 4096: up to 4096 rows): 6.510 against 6.864
    (4096, 32, 7168, 4096, "dgrad", True, True),      # DeepSeek-V3's EP8 share: 11.025 against 11.151
    (1024, 16, 4096, 6400, "forward", False, True),   # Phi-3.5-MoE's forward: K >= 6144, torch's
    (1024, 16, 4096, 12800, "dgrad", True, True),     # its dgrad: 2.484 against 2.553
    (1638, 40, 1536, 512, "forward", False, False),   # Granite's: N < 2560, K < 1280
    (4097, 32, 7168, 4096, "dgrad", False, True),     # past the wide dgrad's cap at N >= 4096
    (513, 128, 2880, 5760, "dgrad", False, True),     # past it below N = 4096 (GPT-OSS-120B's width)
    (512, 60, 2816, 1408, "forward", True, False),    # 11 n-tiles at 256 do not pair: the narrow rule
])
def test_wide_rule(wide, rows_per_group, groups, n, k, part, expect, runs_wide):
    assert lone_gemm.runs_wide_tile(n, k, groups) is runs_wide
    assert lone_gemm.chooses_kernel(rows_per_group * groups, groups, n, k, part) is expect


def test_a_forward_of_long_k_runs_torch_either_way(monkeypatch):
    for wide_tile in (True, False):
        monkeypatch.setattr(lone_gemm, "WIDE_TILE", wide_tile)
        assert not lone_gemm.chooses_kernel(512 * 16, 16, 4096, LONE_GEMM_RULE["max_k"]["forward"])
        assert lone_gemm.chooses_kernel(512 * 16, 16, 4096, LONE_GEMM_RULE["max_k"]["forward"] - 64)


def test_the_wide_switch(monkeypatch):
    monkeypatch.setattr(lone_gemm, "WIDE_TILE", True)
    assert lone_gemm.chooses_kernel(1024 * 64, 64, 4096, 3072)
    monkeypatch.setattr(lone_gemm, "WIDE_TILE", False)
    monkeypatch.setattr(lone_gemm, "OUTPUT_BUDGET", True)
    assert not lone_gemm.runs_wide_tile(4096, 3072, 64)
    assert not lone_gemm.chooses_kernel(1024 * 64, 64, 4096, 3072)


def test_fusion_lone_gemm_torch_switches_the_kernel_off(monkeypatch):
    monkeypatch.setattr(lone_gemm, "ENABLED", False)
    assert not lone_gemm.chooses_kernel(32 * 128, 128, 2048, 768)
    assert not lone_gemm.chooses_kernel(512 * 128, 128, 4096, 2816)


def test_the_rule_is_the_tables():
    assert (lone_gemm.MIN_GROUPS, lone_gemm.MAX_ROWS_PER_GROUP, lone_gemm.N_MULTIPLES,
            lone_gemm.MAX_OUTPUTS_PER_GROUP, lone_gemm.WIDE, lone_gemm.MAX_K) == (
        LONE_GEMM_RULE["min_groups"], LONE_GEMM_RULE["max_rows_per_group"], LONE_GEMM_RULE["n_multiples"],
        LONE_GEMM_RULE["max_outputs_per_group"], LONE_GEMM_RULE["wide"], LONE_GEMM_RULE["max_k"])
    wide = LONE_GEMM_RULE["wide"]
    for part, rows in (("forward", ROWS), ("dgrad", DGRAD_ROWS)):
        module, text = device_method("gemm", part)
        assert module == "lone_gemm"
        assert f"<= {rows} and" in text and "N is a multiple of 128 or 192" in text
        assert f"<= {OUTPUTS[part]} / N (unless its tile runs as dynamic CTA pairs)" in text
        assert f">= {LONE_GEMM_RULE['min_groups']} groups" in text
        assert f"N >= {wide['min_n']} or K >= {wide['min_k']}" in text
        for min_n, cap in wide["max_rows_per_group"][part]:
            assert f"<= {cap}" in text
    assert f"K >= {LONE_GEMM_RULE['max_k']['forward']}" in device_method("gemm", "forward")[1]


def test_takes_nothing_off_a_gpu():
    op = GroupLinear(4, 256, 256).to(torch.bfloat16)
    assert not lone_gemm.takes(op, torch.zeros(64, 256, dtype=torch.bfloat16))


@pytest.mark.parametrize("part,N,K,b_major", [("forward", 384, 256, "K"), ("dgrad", 256, 384, "MN")])
def test_kernel_jobs(part, N, K, b_major):
    op = GroupLinear(4, 256, 384)
    (job,) = lone_gemm.kernel_jobs(op, part, torch.bfloat16)
    assert (job.N, job.K, job.G, job.dtype) == (N, K, 4, "bfloat16")
    cfg = dict(zip(("tile_m", "tile_n", "tile_k", "stages", "cluster_m", "cluster_n", "persistent", "dynamic",
                    "sm_margin", "pingpong", "b_major", "gather_a"), job.config))
    assert cfg["b_major"] == b_major and not cfg["gather_a"]


@pytest.mark.parametrize("part", ["forward", "dgrad"])
def test_gpt_oss_width_builds_whole_192_column_tiles(narrow, part):
    """N = 2880 (GPT-OSS), without the wide tile: the job's tile is 128x192 (15 whole n-tiles), not 128x128 (a
    half-empty last one)."""
    (job,) = lone_gemm.kernel_jobs(GroupLinear(8, 2880, 2880), part, torch.bfloat16)
    tile_n, dynamic, pingpong = job.config[1], job.config[7], job.config[9]
    assert (job.N, tile_n, dynamic, pingpong) == (2880, 192, True, True)


@pytest.mark.parametrize("op,part,dtype", [
    (GroupLinear(4, 256, 384), "wgrad", torch.bfloat16),       # the varlen-K kernel's (wgrad_gemm)
    (GroupLinear(4, 256, 384), "forward", torch.float32),      # the kernel runs bf16/fp16
    (GroupLinear(4, 256, 384, bias=True), "forward", torch.bfloat16),
    (Linear(256, 384), "forward", torch.bfloat16),             # a dense GEMM: F.linear
    (GroupLinear(4, 256, 2000), "forward", torch.bfloat16),    # N no multiple of 128 or 192: never taken
    (GroupLinear(4, 2000, 256), "dgrad", torch.bfloat16),
])
def test_no_kernel_jobs(op, part, dtype):
    assert lone_gemm.kernel_jobs(op, part, dtype) == []


def test_explain_names_the_kernel_and_the_rule_on_hopper_only():
    seq = fusion.Sequential(GroupLinear(8, 256, 512), SwiGLU(), Scale(), GroupLinear(8, 256, 256)).to(torch.bfloat16)
    hopper = seq.explain(target="sm_90a")
    assert "[F2] unfused  op 3 GroupLinear: varlen-M grouped GEMM where the GEMM has >= 2 groups, rows per group average <= 1024" in hopper
    assert "op 0 GroupLinear dgrad: varlen-M grouped GEMM of dY and the weight as stored" in hopper
    cpu = seq.explain(target="cpu")
    assert "varlen-M grouped GEMM where" not in cpu


@pytest.mark.parametrize("op", [GroupLinear(4, 64, 128), GroupLinear(4, 60, 128), Linear(64, 128),
                                GroupLinear(2, 64, 128, bias=True)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gemm_refusal_is_the_tables_answer_kept_per_op_class_widths_and_dtype(op, dtype):
    """The per-call takes() read a kept answer: it must be the table's for every op, width and dtype (a key that
    left one out would hand one op's answer to another)."""
    from fusion.op_table import device_method_refusal, gemm_refusal

    want = device_method_refusal("gemm", None, dtype, (op.in_features, op.out_features), op.spec.name)
    assert gemm_refusal(op, dtype) == want
    assert gemm_refusal(op, dtype) == want   # and again, from the kept answers


DENSE_ROWS = LONE_GEMM_RULE["dense_dgrad_min_rows"]


@pytest.mark.parametrize("rows,n,part,expect", [
    (DENSE_ROWS, 8192, "dgrad", True),          # Llama-3-70B's FC1 dgrad at 8192 rows: ours measured faster
    (16384, 4096, "dgrad", True),               # Llama-3-8B's at 16384
    (DENSE_ROWS - 1, 8192, "dgrad", False),     # fewer rows: torch's led (Llama-3-8B at 4096)
    (16384, 2880, "dgrad", False),              # no whole 128x256 tiles
    (16384, 4096, "forward", False),            # a dense forward stays torch's (it split both ways)
])
def test_a_dense_dgrad_at_many_rows_takes_the_kernel(rows, n, part, expect, monkeypatch):
    assert lone_gemm.chooses_kernel(rows, 1, n, 14336, part) is expect
    monkeypatch.setattr(lone_gemm, "DENSE_DGRAD", False)      # FUSION_DENSE_DGRAD=0
    assert not lone_gemm.chooses_kernel(rows, 1, n, 14336, part)


def test_a_dense_dgrad_job_runs_128x256_cooperative_tiles():
    from fusion.kernels.tile_policy import GemmConfig

    (job,) = lone_gemm.kernel_jobs(GroupLinear(1, 4096, 14336), "dgrad", torch.bfloat16)
    cfg = GemmConfig(*job.config)
    assert (job.N, job.G, cfg.tile_n, cfg.pingpong, cfg.dynamic, cfg.b_major) == (4096, 1, 256, False, True, "MN")
    assert lone_gemm.kernel_jobs(GroupLinear(1, 4096, 14336), "forward", torch.bfloat16) == []
    assert lone_gemm.kernel_jobs(GroupLinear(1, 2880, 5760), "dgrad", torch.bfloat16) == []
    text = device_method("gemm", "dgrad")[1]
    assert f"one group: at >= {DENSE_ROWS} rows with N a multiple of 256" in text


@pytest.mark.parametrize("E,in_f,out_f,part,wide_tile", [
    (128, 2880, 2880, "forward", True),     # GPT-OSS-120B's FC2: 12 n-tiles at 256 pair up
    (128, 2880, 5760, "dgrad", True),       # its FC1 dgrad (N = 2880, K = 5760)
    (64, 3072, 4096, "forward", True),      # Hunyuan-A13B's FC2
    (128, 768, 2048, "forward", False),     # Qwen3-30B-A3B's FC2 forward: N < 2560, K < 1280
    (128, 2048, 1536, "dgrad", True),       # its FC1 dgrad: K = 1536
    (60, 1408, 2816, "forward", False),     # 11 n-tiles at 256
])
def test_kernel_jobs_take_the_wide_tile_where_the_rule_runs_it(wide, E, in_f, out_f, part, wide_tile):
    """The job Sequential.compile() builds is the tile the call runs: 128x256 cooperative dynamic CTA pairs where
    runs_wide_tile, else the tile policy's."""
    from fusion.kernels.tile_policy import GemmConfig

    op = GroupLinear(E, in_f, out_f)
    (job,) = lone_gemm.kernel_jobs(op, part, torch.bfloat16)
    cfg = GemmConfig(*job.config)
    assert (job.N, job.K) == ((out_f, in_f) if part == "forward" else (in_f, out_f))
    assert lone_gemm.runs_wide_tile(job.N, job.K, E) is wide_tile
    got = (cfg.tile_n, cfg.pingpong, cfg.dynamic, cfg.cluster_n, cfg.cluster_m)
    assert (got == (256, False, True, 2, 1)) is wide_tile


def test_the_wide_switch_changes_the_job(monkeypatch):
    op = GroupLinear(64, 3072, 4096)
    monkeypatch.setattr(lone_gemm, "WIDE_TILE", True)
    (wide_job,) = lone_gemm.kernel_jobs(op, "forward", torch.bfloat16)
    monkeypatch.setattr(lone_gemm, "WIDE_TILE", False)
    (narrow_job,) = lone_gemm.kernel_jobs(op, "forward", torch.bfloat16)
    assert wide_job.config[1] == 256 and narrow_job.config[1] == 192 and wide_job.key != narrow_job.key


def test_a_long_k_forward_builds_no_job():
    assert lone_gemm.kernel_jobs(GroupLinear(16, 6400, 4096), "forward", torch.bfloat16) == []
    assert lone_gemm.kernel_jobs(GroupLinear(16, 6400, 4096), "dgrad", torch.bfloat16) != []


def test_explain_names_the_dense_matmul_for_one_group():
    """explain() tells a one-group GroupLinear's unfused GEMM steps that cuBLAS's dense matmul runs what our kernels
    do not (fusion.planner.ONE_GROUP_NOTE, on each of them), and says nothing of it for several groups."""
    from fusion.planner import ONE_GROUP_NOTE

    def explained(E):
        return fusion.Sequential(GroupLinear(E, 256, 1024), SwiGLU(), GroupLinear(E, 512, 256)).to("meta").explain()

    assert explained(1).count(ONE_GROUP_NOTE) == 4   # FC2 forward, its wgrad, FC1 dgrad, its wgrad
    assert ONE_GROUP_NOTE not in explained(8)
