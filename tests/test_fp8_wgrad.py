"""The FP8 weight gradient without a GPU: the slot layout's reference (fusion.quant.fp8_block
`fp8_block_columnwise_slots`), the plan's FP8 varlen-K jobs with WGRAD_IN_BF16 off (and none with it on), both tiles
and the slot quantize kernel compiled for sm_90a (FP8 wgmma, no spills), and the configuration check. On the GPU:
tests/test_fp8_wgrad_gpu.py."""
import re

import pytest
import torch

from fusion import GroupLinear, QuantizeFP8Block, Scale, Sequential, SwiGLU

SIZES = [300, 0, 129, 517, 1, 0, 1000, 77]


@pytest.mark.parametrize("sizes", [SIZES, None, [0, 0, 5]], ids=["groups", "one-group", "mostly-empty"])
def test_slot_layout_holds_each_block_at_its_slot(sizes):
    from fusion.quant.fp8_block import fp8_block_columnwise_slots, fp8_block_quantize_columnwise

    M = sum(sizes) if sizes else 700
    group_sizes = None if sizes is None else torch.tensor(sizes)
    x = torch.randn(M, 48)
    data, scale = fp8_block_quantize_columnwise(x, group_sizes)
    slots = fp8_block_columnwise_slots(data, group_sizes)
    G = 1 if sizes is None else len(sizes)
    capacity = -(-M // 128) + G
    assert slots.shape == (48, 128 * capacity) and scale.shape[0] == capacity
    # walk the groups' blocks by hand: block b of the used prefix holds the next <= 128 rows of its group
    slot, start = 0, 0
    for n in (sizes or [M]):
        for j in range(-(-n // 128)):
            rows = min(128, n - 128 * j)
            block = slots[:, 128 * slot: 128 * slot + 128]
            assert torch.equal(block[:, :rows], data[:, start + 128 * j: start + 128 * j + rows])
            assert not block[:, rows:].any(), "bytes past a block's rows are not zero codes"
            slot += 1
        start += n
    assert not slots[:, 128 * slot:].any(), "unused capacity is not zero"


def _block():
    return Sequential(GroupLinear(8, 256, 768, weight_format="fp8_block"), SwiGLU(), Scale(),
                      QuantizeFP8Block(columnwise=False), GroupLinear(8, 384, 256, weight_format="fp8_block"),
                      backend="auto").to("meta", torch.bfloat16)


def test_plan_jobs_take_the_fp8_wgrad_kernel_only_when_asked(monkeypatch):
    from fusion.planner import clear_cache
    from fusion.quant import fp8_linear
    from fusion.runtime.aot import plan_jobs

    clear_cache()
    assert not [j for j in plan_jobs(_block(), torch.bfloat16) if j.mainloop == "fp8_varlen_k"]
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", False)
    jobs = plan_jobs(_block(), torch.bfloat16)
    wgrads = sorted((j.K, j.N, j.G) for j in jobs if j.step == "wgrad")
    # dW (G, out, in): FC1's (768, 256), FC2's (256, 384), both on the FP8 varlen-K kernel, no bf16 one
    assert wgrads == [(256, 384, 8), (768, 256, 8)]
    assert {j.mainloop for j in jobs if j.step == "wgrad"} == {"fp8_varlen_k"}


def test_fp8_wgrad_kernels_compile_clean(monkeypatch):
    """The plan's FP8 weight-gradient kernels through Sequential.compile (the cache path the runtime loads), and
    both tiles of one shape directly: FP8 wgmma (QGMMA) in the SASS, no local memory."""
    import dataclasses

    from fusion.kernels import sass_text
    from fusion.kernels.fp8_wgrad_api import compile_fp8_varlen_k_gemm
    from fusion.kernels.tile_policy import FP8_SMEM_TWO_CTAS, choose_fp8_wgrad_config, fp8_wgrad_stages, \
        fp8_wgrad_two_ctas
    from fusion.planner import clear_cache
    from fusion.quant import fp8_linear

    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", False)
    clear_cache()
    kernels = [k for k in _block().compile(dtype=torch.bfloat16, target="sm_90a") if "wgrad" in k.name]
    assert len(kernels) == 2 and all("_fp8_" in k.name for k in kernels), [k.name for k in kernels]
    for tile_m in (128, 256):
        cfg = dataclasses.replace(choose_fp8_wgrad_config(4096, 7168, 32), tile_m=tile_m,
                                  stages=fp8_wgrad_stages(tile_m, 128))
        kernels.append(compile_fp8_varlen_k_gemm(cfg, 4096, 7168, 32))
    two = compile_fp8_varlen_k_gemm(fp8_wgrad_two_ctas(), 4096, 7168, 32)
    kernels.append(two)
    for k in kernels:
        sass = sass_text(k.cubin)
        assert re.search(r"\bQGMMA\.", sass), f"{k.name}: no FP8 wgmma"
        assert not re.findall(r"\b(LDL|STL)\b", sass), f"{k.name}: register spills"
        assert 0 < k.shared_memory_bytes <= 227 * 1024
    # two CTAs an SM: launched for two (128 registers a thread), the consumer taking 224 from the producer's 32,
    # the stages in half the SM's shared memory
    assert re.search(r"\.minnctapersm 2", two.ptx) and two.registers <= 128
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+224;", two.ptx)
    assert two.shared_memory_bytes <= FP8_SMEM_TWO_CTAS + 1024 and "_2cta" in two.name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_slot_quantize_kernel_compiles_without_spills(dtype):
    from fusion.kernels.api import _cubin_nv_info
    from fusion.kernels.fp8_quantize import build_kernel

    _, cubin, kernel = build_kernel(dtype, 1024, True, 32, "int32", slots=True, rowwise=False)
    assert kernel.slots and not kernel.rowwise
    assert _cubin_nv_info(cubin).get("frame_size", 0) == 0


def test_the_policy_runs_256_row_pairs_unless_switched(monkeypatch):
    """The FP8 weight gradient's tile (tile_policy.choose_fp8_wgrad_config): 256 x 128 CTA pairs along n by default
    (FP8_WGRAD_PAIRS, measured 2.1-2.4% off the FP8 steps that run it), single CTAs with the switch off, the two-CTA
    128 x 128 tile with FP8_WGRAD_TWO_CTAS, 16-byte stores with FP8_WGRAD_STORE16; each a buildable configuration."""
    from fusion.kernels import tile_policy
    from fusion.kernels.fp8_wgrad_api import check_fp8_wgrad_config

    cfg = tile_policy.choose_fp8_wgrad_config(4096, 14336, 8)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_n, cfg.ctas_per_sm, cfg.store_bytes) == (256, 128, 2, 1, 8)
    seen = [cfg]
    for attr, value, want in (("FP8_WGRAD_PAIRS", False, dict(cluster_n=1)),
                              ("FP8_WGRAD_STORE16", True, dict(store_bytes=16)),
                              ("FP8_WGRAD_TWO_CTAS", True, dict(tile_m=128, ctas_per_sm=2, cluster_n=1, stages=3))):
        monkeypatch.setattr(tile_policy, attr, value)
        cfg = tile_policy.choose_fp8_wgrad_config(4096, 14336, 8)
        assert all(getattr(cfg, k) == v for k, v in want.items()), (attr, cfg)
        check_fp8_wgrad_config(cfg, 4096, 14336)
        seen.append(cfg)
    assert len(set(seen)) == 4


def test_config_check_names_the_problem():
    from fusion.errors import KernelConfigError
    from fusion.kernels.fp8_wgrad_api import check_fp8_wgrad_config
    from fusion.kernels.tile_policy import WgradConfig

    with pytest.raises(KernelConfigError, match="tile_n = 256"):
        check_fp8_wgrad_config(WgradConfig(tile_m=128, tile_n=256, tile_k=128, stages=4), 256, 256)
    with pytest.raises(KernelConfigError, match="multiples of 8"):
        check_fp8_wgrad_config(WgradConfig(tile_m=128, tile_n=128, tile_k=128, stages=4), 260, 256)
    with pytest.raises(KernelConfigError, match="ctas_per_sm = 2 with a 256-row tile"):
        check_fp8_wgrad_config(WgradConfig(tile_m=256, tile_n=128, tile_k=128, stages=2, ctas_per_sm=2), 256, 256)
    with pytest.raises(KernelConfigError, match="for each of two CTAs an SM"):
        check_fp8_wgrad_config(WgradConfig(tile_m=128, tile_n=128, tile_k=128, stages=4, ctas_per_sm=2), 256, 256)
    with pytest.raises(KernelConfigError, match="store_bytes = 4"):
        check_fp8_wgrad_config(WgradConfig(tile_m=128, tile_n=128, tile_k=128, stages=4, store_bytes=4), 256, 256)


def test_the_auto_rule_takes_fp8_for_wide_gemms_and_long_groups(monkeypatch):
    from fusion.quant import fp8_linear

    assert fp8_linear.WGRAD_IN_BF16 == "auto"
    rule = fp8_linear.wgrad_in_bf16
    # Mixtral's FC1 (28672 x 4096, harmonic width 3584) at 2048 rows per group: FP8; at 1024: bf16
    assert not rule(28672, 4096, 8 * 2048, 8) and rule(28672, 4096, 8 * 1024, 8)
    # DeepSeek-V3's FC2 (7168 x 2048: 1593) and Qwen3-30B-A3B's FC1 (1536 x 2048: 878): bf16 at any rows
    assert rule(7168, 2048, 1 << 30, 32) and rule(1536, 2048, 1 << 30, 128)
    for forced in (True, False):
        monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", forced)
        assert rule(28672, 4096, 1 << 30, 8) is forced and rule(64, 64, 1, 1) is forced


def _wide(monkeypatch):
    """A small block that the rule treats as wide (its threshold lowered): FC1 256 -> 512, FC2 256 -> 256."""
    from fusion.quant import fp8_linear

    monkeypatch.setattr(fp8_linear, "FP8_WGRAD_MIN_WIDTH", 100)
    monkeypatch.setattr(fp8_linear, "FP8_WGRAD_MIN_ROWS", 64)
    return Sequential(GroupLinear(4, 256, 512, weight_format="fp8_block"), SwiGLU(),
                      GroupLinear(4, 256, 256, weight_format="fp8_block"), backend="auto")


def test_the_reference_follows_the_rule(monkeypatch):
    """The recipe's weight gradients under "auto" are the FP8 ones where the rule takes FP8 (many rows per group)
    and the bf16 ones where it does not (few): bit for bit the forced settings' (so backend="emulate" runs what the
    GPU runs)."""
    from fusion.quant import fp8_linear

    seq = _wide(monkeypatch)
    torch.manual_seed(0)
    for p in seq.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)

    def grads(setting, sizes):
        monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", setting)
        seq.zero_grad()
        torch.manual_seed(1)
        x = torch.randn(sum(sizes), 256)
        seq(x, group_sizes=torch.tensor(sizes)).backward(torch.randn(sum(sizes), 256))
        return [p.grad.clone() for p in seq.parameters()]

    for sizes, fp8 in (([100, 70, 0, 90], True), ([10, 3, 0, 9], False)):
        auto, forced, other = grads("auto", sizes), grads(not fp8, sizes), grads(fp8, sizes)
        assert all(torch.equal(a, b) for a, b in zip(auto, forced)), sizes
        assert not all(torch.equal(a, b) for a, b in zip(auto, other)), sizes


def test_explain_and_the_ahead_of_time_jobs_say_which_weight_gradient(monkeypatch):
    from fusion.planner import clear_cache
    from fusion.runtime.aot import plan_jobs

    clear_cache()
    narrow = _block().explain(dtype=torch.bfloat16, target="sm_90a")
    assert "harmonic width 192 < 2400" in narrow and "bf16 varlen-K kernel" in narrow
    assert "frees dY" not in narrow   # its weight gradients never take FP8: FC1's dgrad keeps dY
    clear_cache()
    wide = _wide(monkeypatch).to("meta", torch.bfloat16)
    text = wide.explain(dtype=torch.bfloat16, target="sm_90a")
    assert text.count("FP8 columnwise copies of dY and X (FP8 varlen-K kernel) from 64 rows per group") == 2, text
    # FC1's dgrad (op 0) hands dY to its weight gradient; FC2's dY is the caller's (and read by the fused dgrad)
    assert text.count("frees dY before its GEMM") == 1 and "where op 0's weight gradient takes FP8" in text, text
    # both weight-gradient kernels ahead of time: the call's rows choose between them (the bf16 one at every tile
    # its rows per group may take)
    from fusion.kernels.tile_policy import wgrad_configs

    jobs = plan_jobs(wide, torch.bfloat16)
    bf16_tiles = sum(len(wgrad_configs(*op.weight.shape[1:], op.weight.shape[0])) for op in (wide[0], wide[2]))
    assert sorted(j.mainloop for j in jobs if j.step == "wgrad") == ["fp8_varlen_k"] * 2 + ["varlen_k"] * bf16_tiles
    assert bf16_tiles == 4   # each weight: the shape's tile and the store-bound one (kernels/tile_policy.py)
    clear_cache()


def test_fc1_fp8_dgrad_is_marked_to_quantize_dy_for_its_weight_gradient():
    """The program marks an FP8 dgrad step to quantize dY for its op's weight gradient too (dY freed a step
    early; GPU: tests/test_fp8_wgrad_gpu.py) exactly where dY has no other reader: FC1's dgrad on the kernels,
    not under backend="emulate", not a bf16 GEMM's, not where FC2's fused dgrad already writes FC1's operand."""
    from fusion.runtime import steps as S
    from fusion.runtime.program import BlockProgram

    def marks(fmt, backend, fc2_writes_operand=False):
        E, d, f = 8, 256, 512
        kw = {} if fmt is None else {"weight_format": fmt}
        seq = Sequential(GroupLinear(E, d, 2 * f, **kw), SwiGLU(), Scale(), GroupLinear(E, f, d, **kw))
        plan = seq.plan()
        if fc2_writes_operand:   # what fusion/dataflow.py's _link_quantized_operands makes of such a plan
            import dataclasses

            steps = list(plan.backward)
            n = next(k for k, s in enumerate(steps) if isinstance(s.parts, tuple) and s.parts == ((0, "dgrad"),))
            steps[n] = dataclasses.replace(steps[n], reads=steps[n].reads + ("qg1",))
            plan = dataclasses.replace(plan, backward=tuple(steps))
        program = BlockProgram(seq, plan, backend)
        return {(r.index, type(r).__name__): r.feeds_wgrad for r in program.backward_steps
                if isinstance(r, S.GemmDgrad)}

    assert marks("fp8_block", "cute") == {(0, "GemmDgrad"): True}
    assert marks("fp8_block", "emulate") == {(0, "GemmDgrad"): False}
    assert marks(None, "cute") == {(0, "GemmDgrad"): False}
    assert marks("fp8_block", "cute", fc2_writes_operand=True) == {(0, "GemmDgrad"): False}
