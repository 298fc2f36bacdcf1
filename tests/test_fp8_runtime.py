"""The FP8 device methods' CPU-checkable parts (fusion/runtime/fp8_gemm.py, fp8_quantize.py): the fast rowwise
dequantize the bf16 wgrad reads is the reference's bit for bit, and what the methods take."""
import pytest
import torch

from fusion import GroupLinear, QuantizeFP8Block
from fusion.quant import quantize
from fusion.runtime import fp8_gemm, fp8_quantize


@pytest.mark.parametrize("K", [128, 512])
def test_fast_dequantize_is_the_reference_bit_for_bit(K):
    torch.manual_seed(0)
    x = torch.randn(300, K, dtype=torch.bfloat16) * torch.logspace(-30, 30, K, base=2).to(torch.bfloat16)
    x[3, 4], x[5, 6], x[6, 7] = float("nan"), float("inf"), -float("inf")
    x[7, :128] = 0
    x[9, 100] = 1e-38   # a block whose scale is tiny: products near bf16's subnormal range
    q = quantize(x, "fp8_block", columnwise=False)
    got, want = fp8_gemm._dequantize_rowwise(q, torch.bfloat16), q.dequantize(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_partial_last_block_in_bf16_is_the_reference_bitwise():
    """Widths like GPT-OSS's 2880 (22.5 blocks): the partial block's scale covers its 64 columns."""
    torch.manual_seed(3)
    x = torch.randn(10, 2880, dtype=torch.bfloat16) * torch.logspace(-3, 3, 2880).to(torch.bfloat16)
    x[2, 2850:] = 0
    q = quantize(x, "fp8_block", columnwise=False)
    got, want = fp8_gemm._dequantize_rowwise(q, torch.bfloat16), q.dequantize(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp16_takes_the_reference():
    x = torch.randn(10, 136, dtype=torch.float16)
    q = quantize(x, "fp8_block", columnwise=False)
    assert torch.equal(fp8_gemm._dequantize_rowwise(q, torch.float16), q.dequantize(torch.float16))


def test_methods_take_only_cuda_tensors_the_kernels_read():
    op = GroupLinear(2, 64, 64, weight_format="fp8_block")
    assert not fp8_gemm.takes(op, torch.zeros(4, 64))                     # CPU
    assert not fp8_quantize.takes(QuantizeFP8Block(), torch.zeros(4, 64))  # CPU
    assert not fp8_gemm.takes(GroupLinear(2, 72, 64, weight_format="fp8_block"), torch.zeros(4, 72))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_finite_amax_ignores_nan_and_inf_in_every_dtype(dtype):
    from fusion.quant import finite_amax

    x = torch.tensor([1.5, -3.0, float("nan"), float("inf"), -float("inf"), 2.0], dtype=dtype)
    got = finite_amax(x)
    assert got.dtype == torch.float32 and got.dim() == 0 and got.item() == 3.0
    assert finite_amax(torch.full((4,), float("nan"), dtype=dtype)).item() == 0.0
    assert finite_amax(torch.zeros(0, dtype=dtype)).item() == 0.0
    if dtype == torch.float64:  # past float32's range: the Inf it rounds to, so not counted
        assert finite_amax(torch.tensor([1e300, -5.0], dtype=dtype)).item() == 5.0


def test_try_quantize_returns_none_where_the_kernel_refuses():
    from fusion.errors import DeviceError
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_device, try_quantize_fp8_block_device

    x = torch.zeros(4, 64, dtype=torch.bfloat16)   # on the CPU: the kernel refuses it
    assert try_quantize_fp8_block_device(x) is None
    with pytest.raises(DeviceError, match="CUDA"):
        quantize_fp8_block_device(x)


def test_lone_fp8_gemms_read_the_calls_bounds_buffer_where_it_fits():
    """The row bounds a lone GEMM kernel (FP8, or the bf16 weight gradient's) launches with: the program's buffer
    (its G+1 head) when its groups are the GEMM's, never for a dense Linear inside a grouped block, and [0, rows] /
    the offsets without a buffer."""
    from fusion import Linear
    from fusion.run_context import RunContext
    from fusion.runtime.bounds import row_bounds

    grouped, dense = GroupLinear(3, 64, 64, weight_format="fp8_block"), Linear(64, 64, weight_format="fp8_block")
    sizes = torch.tensor([2, 0, 5])
    buffer = torch.tensor([0, 2, 2, 7, 0, 0], dtype=torch.int32)  # G+1 bounds, then two tile counters
    ctx = RunContext(group_sizes=sizes, counters=buffer, groups=3)
    assert row_bounds(grouped, 7, ctx, "cpu") is buffer
    assert row_bounds(dense, 7, ctx, "cpu").tolist() == [0, 7]
    dense_ctx = RunContext(counters=torch.tensor([0, 7, 0], dtype=torch.int32), groups=1)
    assert row_bounds(dense, 7, dense_ctx, "cpu") is dense_ctx.counters
    assert row_bounds(grouped, 7, RunContext(group_sizes=sizes), "cpu").tolist() == [0, 2, 2, 7]


def test_lone_fp8_gemm_steps_hold_tile_counter_slots_of_the_calls_buffer():
    """Every step that launches a dynamically scheduled kernel has its own zeroed counter in the call's buffer:
    the fused steps and the lone FP8 GEMMs (FC2's fprop, FC1's dgrad), so no launch allocates and zeroes one."""
    from fusion import Sequential, SwiGLU
    from fusion.run_context import RunContext
    from fusion.runtime import steps as S
    from fusion.runtime.program import BlockProgram

    block = Sequential(GroupLinear(4, 128, 256, weight_format="fp8_block"), SwiGLU(),
                       GroupLinear(4, 128, 128, weight_format="fp8_block")).bfloat16()
    program = BlockProgram(block, block.plan(torch.bfloat16), "cute")   # the GPU program (built here, never run)
    fwd = {type(r).__name__: r for r in program.forward_steps}
    assert fwd["OpForward"].tile_counter and fwd["FusedForward"].slot != fwd["OpForward"].slot
    dgrads = [r for r in program.backward_steps if isinstance(r, S.GemmDgrad)]
    assert dgrads and all(r.tile_counter for r in dgrads)
    assert program.forward_kernels == 2
    counted = [r for r in program.backward_steps if isinstance(r, S._KernelStep) or getattr(r, "tile_counter", False)]
    assert program.backward_kernels == len(counted) and sorted(r.slot for r in counted) == list(range(len(counted)))
    # the address each passes: its own int32 of the buffer's tail
    state = S.RunState(ctx=RunContext(counters=torch.zeros(5 + program.counters, dtype=torch.int32), groups=4))
    assert fwd["OpForward"]._counter(state) == {
        "counter": state.ctx.counters.data_ptr() + 4 * (5 + fwd["OpForward"].slot)}


def test_many_rows_per_group_take_single_ctas(monkeypatch):
    """tile_policy.fp8_for_rows: where FP8_SINGLE_ROWS is set (0, the default: never), a 256-row tile's CTA pairs
    become single CTAs from that many rows per group on average (read per call); unknown rows, fewer rows, and
    128-row single tiles keep their configuration; fp8_row_configs lists both (Sequential.compile builds both)."""
    from fusion.kernels import tile_policy as P

    # the cooperative tiles (tile_policy.fp8_two_ctas turns a plain one at this K into two 128-row CTAs an SM, which
    # this rule leaves alone)
    pair = P.cooperative_fp8_config(4096, 7168, 32)
    assert (pair.tile_m, pair.cluster_n) == (256, 2)
    assert P.choose_fp8_config(4096, 7168, 32).ctas_per_sm == 2
    monkeypatch.setattr(P, "FP8_SINGLE_ROWS", 0)   # the default: off
    assert P.fp8_for_rows(pair, 10 ** 9, 32) is pair and P.fp8_row_configs(pair, 32) == [pair]
    monkeypatch.setattr(P, "FP8_SINGLE_ROWS", 4096)
    assert P.fp8_for_rows(pair, None, 32) is pair and P.fp8_for_rows(pair, 32 * 4096 - 1, 32) is pair
    single = P.fp8_for_rows(pair, 32 * 4096, 32)
    assert single.cluster_n == 1 and single == P.cooperative_fp8_config(4096, 7168, 32, rows=32 * 4096)
    assert single == pair.__class__(**{**pair.__dict__, "cluster_n": 1})   # nothing else changes
    odd = P.cooperative_fp8_config(2880, 2880, 32)   # 23 n-tiles (15 of 192): single 128-row CTAs whatever the rows
    assert P.fp8_for_rows(odd, 10 ** 8, 32) is odd and P.fp8_row_configs(odd, 32) == [odd]
    assert P.fp8_row_configs(pair, 32) == [pair, single]
    monkeypatch.setattr(P, "FP8_SINGLE_ROWS", 512)   # the attribute is read at each call (bench/ab_switch.py)
    assert P.fp8_for_rows(pair, 32 * 512, 32) == single


def test_many_rows_per_group_take_single_two_cta_ctas(monkeypatch):
    """tile_policy.fp8_for_rows on the two-CTA 128-row tile (ctas_per_sm = 2): a grouped GEMM's CTA pairs become
    single CTAs from FP8_TWO_CTAS_SINGLE_ROWS rows per group (4096 by default: issue 9's 32 x 8192-row shape), and
    nothing else changes; one-group GEMMs (the dense blocks, measured slower as single CTAs) and fewer rows keep
    their pairs; 0 turns it off; fp8_row_configs lists both where the rule can apply."""
    from fusion.kernels import tile_policy as P

    assert P.FP8_TWO_CTAS_SINGLE_ROWS == 4096
    pair = P.choose_fp8_config(4096, 7168, 32, plain_epilogue=True)   # the target shape's lone GEMM
    assert (pair.tile_m, pair.ctas_per_sm, pair.cluster_n) == (128, 2, 2)
    single = P.fp8_for_rows(pair, 32 * 8192, 32)
    assert single == pair.__class__(**{**pair.__dict__, "cluster_n": 1})
    assert P.fp8_for_rows(pair, 32 * 4096 - 1, 32) is pair and P.fp8_for_rows(pair, None, 32) is pair
    assert P.fp8_row_configs(pair, 32) == [pair, single]
    dense = P.choose_fp8_config(8192, 28672, 1, plain_epilogue=True)  # Llama-3-70B's FC2: one group
    assert dense.ctas_per_sm == 2 and dense.cluster_n == 2
    assert P.fp8_for_rows(dense, 10 ** 6, 1) is dense and P.fp8_row_configs(dense, 1) == [dense]
    monkeypatch.setattr(P, "FP8_TWO_CTAS_SINGLE_ROWS", 0)
    assert P.fp8_for_rows(pair, 10 ** 9, 32) is pair and P.fp8_row_configs(pair, 32) == [pair]
    # the 256-row tile's own threshold (FP8_SINGLE_ROWS, off) is not this one
    coop = P.cooperative_fp8_config(4096, 7168, 32)
    monkeypatch.setattr(P, "FP8_TWO_CTAS_SINGLE_ROWS", 4096)
    assert P.fp8_for_rows(coop, 10 ** 9, 32) is coop


def test_a_fused_fp8_kernel_launches_the_configuration_of_the_calls_rows(monkeypatch):
    """CuteKernel (fusion/runtime/kernel.py) of an FP8 job loads and launches, per call, the kernel for A's rows:
    the pair below FP8_SINGLE_ROWS rows per group, the single-CTA job from there (each loaded once); the lone FP8
    GEMMs (fp8_gemm._kernel) choose the same way."""
    from fusion.kernels import tile_policy as P
    from fusion.runtime import compile as C, kernel as Kr
    from fusion.runtime.kernel import BlockScaled, CuteKernel

    monkeypatch.setattr(P, "FP8_SINGLE_ROWS", 1024)
    monkeypatch.setattr(P, "FP8_TWO_CTAS", False)   # the identity job's cooperative 256-row pair (the rule's subject)
    loads, launched = [], []
    monkeypatch.setattr(C, "load_compiled", lambda job: loads.append(job) or job.config)
    class Bound:   # kernels.fp8_api.BoundFp8Gemm's stand-in: records the compiled kernel of each launch
        def __init__(self, compiled):
            self.compiled = compiled

        def __call__(self, *args):
            launched.append(self.compiled)

    fake = type("K", (), {"bind_fp8_grouped_gemm": staticmethod(lambda compiled, *a, **k: Bound(compiled)),
                          "run_grouped_gemm": None})
    monkeypatch.setattr(Kr, "_kernels", lambda: fake)
    job = fp8_gemm.identity_job(256, 512, 4, torch.bfloat16)
    kernel = CuteKernel(job)
    operand = lambda rows: BlockScaled(torch.empty(rows, 512, dtype=torch.uint8), None)   # noqa: E731
    for rows in (4 * 1024 - 1, 4 * 1024, 4 * 5000, 100):
        kernel.run(operand(rows), operand(1), None, {})
    pair, single = P.GemmConfig(*job.config), P.fp8_for_rows(P.GemmConfig(*job.config), 10 ** 9, 4)
    assert [P.GemmConfig(*c).cluster_n for c in launched] == [2, 1, 1, 2]
    assert [j.config for j in loads] == [job.config, Kr.dataclasses.astuple(single)]   # each loaded once
    assert pair.cluster_n == 2
    loads.clear()
    monkeypatch.setattr(fp8_gemm, "_COMPILED", {})
    fp8_gemm._kernel(256, 512, 4, torch.bfloat16, "fprop", 4 * 1024)
    fp8_gemm._kernel(256, 512, 4, torch.bfloat16, "fprop", 4 * 1023)
    assert [P.GemmConfig(*j.config).cluster_n for j in loads] == [1, 2]


def test_odd_128_column_tiles_take_192_column_pairs_where_those_pair(monkeypatch):
    """tile_policy.FP8_WIDE_ODD: GPT-OSS's FC1 (2f = 5760: 45 tiles of 128 columns, 30 of 192) runs 128 x 192 CTA
    pairs; where 192 columns do not pair either (2880: 23 and 15) single 128 x 128 CTAs stay, as do widths whose
    128-column tiles pair (256-row pairs); off, every odd count keeps single 128 x 128 CTAs."""
    from fusion.kernels import tile_policy as P

    def tile(N, gated=False):
        c = P.choose_fp8_config(N, 2880, 32, gated)
        return c.tile_m, c.tile_n, c.cluster_n

    monkeypatch.setattr(P, "FP8_GATED_WAVES", False)   # (on: a gated kernel takes the n-waves, test below)
    monkeypatch.setattr(P, "FP8_WIDE_ODD", True)
    assert tile(5760, gated=True) == tile(5760) == (128, 192, 2)
    assert tile(2880) == (128, 128, 1) and tile(4096, gated=True) == (256, 128, 2)
    assert P.choose_fp8_config(5760, 2880, 32, True, wide_odd=False).tile_n == 128
    monkeypatch.setattr(P, "FP8_WIDE_ODD", False)
    assert tile(5760, gated=True) == (128, 128, 1)


def test_gated_fp8_kernels_take_the_n_waves(monkeypatch):
    """tile_policy.FP8_GATED_WAVES (on): FC1's gated FP8 kernels, training and inference, on the 128 x 256 tile walked
    as gate and up n-waves, as CTA pairs where the 128-column n-tiles of f pair up, else single; off, the old
    policy's tiles."""
    from fusion.kernels import tile_policy as P

    def tile(N):
        c = P.choose_fp8_config(N, 2048, 32, True)
        return c.tile_m, c.tile_n, c.cluster_n

    assert tile(4096) == (128, 256, 2) and tile(5760) == (128, 256, 1) and tile(2816) == (128, 256, 1)
    assert P.choose_fp8_config(4096, 2048, 32, False).tile_n == 128   # not gated: unchanged
    monkeypatch.setattr(P, "FP8_GATED_WAVES", False)
    assert tile(4096) == (256, 128, 2)


def test_a_training_steps_fp8_kernels_keep_128_column_single_ctas(monkeypatch):
    """With FP8_GATED_WAVES off, the jobs of an FP8 block whose FC1 width (2f = 384) pairs only at 192 columns:
    FC1's inference kernel on 128 x 192 CTA pairs, its training kernel (which also writes the saved pre-activation)
    on single 128 x 128 CTAs, as the FP8_WIDE_ODD A/B measured (fusion/runtime/kernel.py make_job)."""
    from fusion import Scale, Sequential, SwiGLU
    from fusion.kernels import tile_policy
    from fusion.kernels.tile_policy import GemmConfig
    from fusion.runtime.aot import plan_jobs

    monkeypatch.setattr(tile_policy, "FP8_GATED_WAVES", False)

    block = Sequential(GroupLinear(8, 256, 384, weight_format="fp8_block"), SwiGLU(), Scale(),
                       GroupLinear(8, 192, 256, weight_format="fp8_block")).to("meta", torch.bfloat16)
    tiles = {(j.step, j.variant): (c.tile_m, c.tile_n, c.cluster_n)
             for j in plan_jobs(block, torch.bfloat16) if j.mainloop == "fp8_block" and j.step == "F1"
             for c in [GemmConfig(*j.config)]}
    assert tiles == {("F1", "inference"): (128, 192, 2), ("F1", "train"): (128, 128, 1)}, tiles


def test_a_lone_fp8_gemm_reloads_when_the_two_cta_switch_flips(monkeypatch):
    """fp8_gemm._kernel keeps a lone FP8 GEMM's kernel under its shape, rows rule and the FP8 policy's switches
    (tile_policy.fp8_switches): flipping FP8_TWO_CTAS in one process (bench/ab_switch.py --plan) loads the other
    kernel rather than reusing the first (session ae's first step A/B compared one kernel with itself so)."""
    from fusion.kernels import tile_policy as P
    from fusion.runtime import compile as C

    loads = []
    monkeypatch.setattr(C, "load_compiled", lambda job: loads.append(P.GemmConfig(*job.config)) or job.config)
    monkeypatch.setattr(fp8_gemm, "_COMPILED", {})
    for two in (True, False, True):
        monkeypatch.setattr(P, "FP8_TWO_CTAS", two)
        fp8_gemm._kernel(2048, 2048, 64, torch.bfloat16, "fprop", 64 * 1024)
    assert [c.ctas_per_sm for c in loads] == [2, 1]   # the third call reuses the first
