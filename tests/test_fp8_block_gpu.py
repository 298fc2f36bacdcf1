"""fp8_block (Group)Linears on the GPU run the FP8 block-scaled grouped GEMM kernel: fused with the activation
and scale after FC1 and with their backward in FC2's dgrad (patterns/fp8.fpat), and alone elsewhere
(fusion/runtime/fp8_gemm.py).

Against backend="emulate" (the same plan in torch: the recipe of fusion/quant/fp8_linear.py, the same FP8
operands dequantized and multiplied in float32, the same epilogue rounding), forward and every gradient, with
the reference recipe patched out of the kernel run so a silent fallback fails the test, and the fused launches
counted. The kernel and the emulation differ only in summation order, so the bf16 results agree to rounding (a
rounding difference may move one FP8 code of a requantized value by one step). Against backend="reference"
(the ops one by one, each rounding to bf16) they agree to FP8's own noise: the fused epilogue rounds once.
"""
import pytest
import torch

import fusion
from fusion import GroupLinear, Linear, QuantizeFP8Block, Scale, Sequential, SwiGLU
from fusion.quant import fp8_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _block(E, d, f, dense=False, quant=True, backend="auto", columnwise=True):
    torch.manual_seed(0)
    if dense:
        ops = [Linear(d, 2 * f, weight_format="fp8_block"), SwiGLU()]
    else:
        ops = [GroupLinear(E, d, 2 * f, weight_format="fp8_block"), SwiGLU(), Scale()]
    ops += [QuantizeFP8Block(columnwise=columnwise)] if quant else []
    ops += [Linear(f, d, weight_format="fp8_block") if dense else GroupLinear(E, f, d, weight_format="fp8_block")]
    seq = Sequential(*ops, backend=backend).to(DEV, torch.bfloat16)
    for p in seq.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return seq


def _step(seq, x, sizes, probs, dy, call=None):
    """One training step of `seq` (called through `call`, e.g. its torch.compile'd module, if given)."""
    for p in seq.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    extra = {} if sizes is None else {"group_sizes": sizes}
    if probs is not None:
        probs = probs.detach().requires_grad_()
        extra["scale"] = probs
    y = (call or seq)(x, **extra)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad}
    out.update({f"d{name}": p.grad for name, p in seq.named_parameters()})
    if probs is not None:
        out["dprobs"] = probs.grad
    return out


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(E, M, d, sizes):
    torch.manual_seed(1)
    x = torch.randn(M, d, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(M, d, device=DEV, dtype=torch.bfloat16)
    probs = None if sizes is None else torch.rand(M, device=DEV, dtype=torch.bfloat16)
    return x, dy, probs


def _reference(seq, backend="reference"):
    import copy

    ref = copy.copy(seq)
    ref.backend = backend
    return ref


@pytest.fixture
def no_reference_recipe(monkeypatch):
    """The fused run must not call the recipe's reference: it raises if it does."""
    def boom(*a, **k):
        raise AssertionError("the fp8_block reference recipe ran instead of the FP8 kernel")

    def patch():
        for name in ("fp8_block_linear", "fp8_block_dgrad", "fp8_block_wgrad"):
            monkeypatch.setattr(fp8_linear, name, boom)
        monkeypatch.setattr(fusion.quant, "quantize", boom)  # QuantizeFP8Block's reference: the kernel runs it

    return patch


def _assert_kernels_match_recipe(seq, x, sizes, probs, dy, no_reference_recipe, fused=("F1", "B1")):
    """One training step of `seq` on the kernels (the reference recipe patched out) against backend="emulate":
    the output and every gradient present, in the same dtype, finite, within 1e-2 relative; within 4e-2 of
    backend="reference". `fused`: the fused kernels that must have launched."""
    from fusion.runtime.kernel import LAUNCHES

    want = _step(_reference(seq, "emulate"), x, sizes, probs, dy)
    ops = _step(_reference(seq), x, sizes, probs, dy)
    no_reference_recipe()
    LAUNCHES.reset()
    got = _step(seq, x, sizes, probs, dy)
    assert sorted(LAUNCHES.by_step) == sorted(fused), LAUNCHES.by_step
    for name, ref in want.items():
        assert got[name] is not None and got[name].dtype == ref.dtype, name
        assert torch.isfinite(got[name]).all(), name
        err = _rel(got[name], ref)
        assert err < 1e-2, f"{name}: relative error {err:.2e} against the emulated kernels"
        err = _rel(got[name], ops[name])
        assert err < 4e-2, f"{name}: relative error {err:.2e} against the reference"


# (E, group sizes, d, f): one (E, d, f) so that the three cases share their kernels (each (N, K, G) compiles)
CASES = [
    (8, [300, 0, 129, 517, 1, 0, 1000, 77], 256, 256),   # unaligned groups, empty ones
    (8, [1024] * 8, 256, 256),                          # many full tiles
    (8, [0] * 7 + [700], 256, 256),                     # one group holds every row
]


@pytest.mark.parametrize("wgrad_bf16", [False, True], ids=["wgrad-fp8", "wgrad-bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}-M{sum(c[1])}-d{c[2]}-f{c[3]}")
def test_grouped_block_matches_the_recipe(case, wgrad_bf16, monkeypatch, no_reference_recipe):
    E, sizes, d, f = case
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", wgrad_bf16)
    if wgrad_bf16:  # the bf16 weight gradients run the varlen-K kernel, not torch._grouped_mm
        from fusion.runtime import fp8_gemm

        monkeypatch.setattr(fp8_gemm, "_weight_gradient", lambda *a: pytest.fail("torch's wgrad ran"))
    sizes = torch.tensor(sizes, device=DEV)
    M = int(sizes.sum())
    seq = _block(E, d, f)
    x, dy, probs = _inputs(E, M, d, sizes)
    _assert_kernels_match_recipe(seq, x, sizes, probs, dy, no_reference_recipe)


@pytest.mark.parametrize("f", [256, 320], ids=["f256", "f320-partial-block"])
def test_fc1_quantizes_fc2s_input_in_its_epilogue(f, no_reference_recipe):
    """QuantizeFP8Block(columnwise=False) after FC1 -> SwiGLU -> Scale is FC1's store (patterns/fp8.fpat): F1 is
    the one forward kernel before FC2 (no quantize kernel runs), forward and every gradient as the emulated plan,
    in a training step and in an inference forward. f = 320: the last 1 x 128 block is partial."""
    from fusion.runtime.kernel import LAUNCHES

    E, sizes, d = 8, [300, 0, 129, 517, 1, 0, 1000, 77], 256
    seq = _block(E, d, f, columnwise=False)
    plan = seq.plan(dtype=torch.bfloat16)
    assert [step.ops for step in plan.forward if step.fused] == [(0, 1, 2, 3)], plan.forward
    sizes = torch.tensor(sizes, device=DEV)
    x, dy, probs = _inputs(E, int(sizes.sum()), d, sizes)
    with torch.no_grad():   # (the emulation runs the recipe's reference: before it is patched out)
        want = _reference(seq, "emulate")(x, group_sizes=sizes, scale=probs)
    _assert_kernels_match_recipe(seq, x, sizes, probs, dy, no_reference_recipe)
    with torch.no_grad():
        LAUNCHES.reset()
        got = seq(x, group_sizes=sizes, scale=probs)
    assert sorted(LAUNCHES.by_step) == ["F1"], LAUNCHES.by_step
    assert _rel(got, want) < 1e-2


def test_dense_linear_block(no_reference_recipe):
    seq = _block(1, 256, 256, dense=True)
    x, dy, _ = _inputs(1, 1000, 256, None)
    _assert_kernels_match_recipe(seq, x, None, None, dy, no_reference_recipe)


def test_unquantized_input_is_quantized_by_the_runtime(no_reference_recipe):
    """No QuantizeFP8Block before FC2: the device method quantizes FC2's bf16 input itself."""
    sizes = torch.tensor([100, 200, 0, 212, 0, 0, 51, 1], device=DEV)
    seq = _block(8, 256, 256, quant=False)
    x, dy, probs = _inputs(8, 564, 256, sizes)
    _assert_kernels_match_recipe(seq, x, sizes, probs, dy, no_reference_recipe)


def test_widths_the_kernel_cannot_take_run_the_recipe():
    """in_features 72 is not a multiple of 16: the recipe's reference runs, bit for bit backend='reference'."""
    sizes = torch.tensor([10, 30, 24], device=DEV)
    seq = _block(3, 72, 64)
    x, dy, probs = _inputs(3, 64, 72, sizes)
    text = seq.explain(dtype=torch.bfloat16, target="sm_90a")
    assert "op 0 GroupLinear: GroupLinear.reference: the fp8_block recipe" in text
    assert "feature widths that are multiples of 16, got 72" in text
    want = _step(_reference(seq), x, sizes, probs, dy)
    got = _step(seq, x, sizes, probs, dy)
    for name, ref in want.items():
        assert torch.equal(got[name], ref), name


@pytest.mark.parametrize("columnwise", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_device_method_is_the_reference_bit_for_bit(columnwise, dtype):
    from fusion.run_context import RunContext
    from fusion.runtime import fp8_quantize

    torch.manual_seed(2)
    sizes = torch.tensor([300, 0, 129, 1, 70], device=DEV)
    x = torch.randn(500, 264, device=DEV, dtype=dtype) * 100
    x[3, 5], x[7, 200], x[400, 100] = float("nan"), float("inf"), -float("inf")
    x[128:256, 128:256] = 0
    op, ctx = QuantizeFP8Block(columnwise=columnwise), RunContext(group_sizes=sizes)
    assert fp8_quantize.takes(op, x)
    got, want = fp8_quantize.run(op, x, ctx), op.reference(x, ctx)
    for name in ("_data", "scale", "amax", "columnwise_data", "columnwise_scale"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name
    assert got.group_sizes is want.group_sizes and got.shape == want.shape and got.dtype == want.dtype


def test_explain_names_the_kernel():
    text = _block(8, 256, 256).explain(dtype=torch.bfloat16, target="sm_90a")
    assert "grouped_gemm_fp8  <- pattern fp8_gemm_act" in text
    assert "grouped_gemm_fp8_dgrad  <- pattern fp8_dgrad_dact" in text
    assert "op 4 GroupLinear: FP8 block-scaled grouped GEMM" in text
    assert "op 0 GroupLinear dgrad: FP8 block-scaled grouped GEMM of dY" in text
    assert "op 3 QuantizeFP8Block: FP8-block quantize kernel" in text
    assert fusion is not None


@pytest.mark.parametrize("columnwise", [True, False], ids=["columnwise", "fc1-store"])
def test_fp8_block_inside_torch_compile_runs_the_fused_fp8_kernels(columnwise):
    """torch.compile(fullgraph=True) of an FP8 block: the program runs as the block's custom op, on the same fused
    FP8 kernels (counted) as eager, with the same results; with QuantizeFP8Block(columnwise=False) F1 quantizes and
    B1 recomputes FC2's input dequantized (nothing quantized is saved across the op's forward and backward)."""
    from fusion.runtime.kernel import LAUNCHES

    sizes = torch.tensor([300, 0, 129, 517, 1, 0, 1000, 77], device=DEV)
    seq = _block(8, 256, 256, columnwise=columnwise)
    assert ("v4" in seq.plan(dtype=torch.bfloat16).saves) == columnwise
    x, dy, probs = _inputs(8, int(sizes.sum()), 256, sizes)
    want = _step(seq, x, sizes, probs, dy)
    compiled = torch.compile(seq, fullgraph=True)
    LAUNCHES.reset()
    got = _step(seq, x, sizes, probs, dy, call=compiled)
    assert sorted(LAUNCHES.by_step) == ["B1", "F1"], LAUNCHES.by_step
    for name, ref in want.items():
        assert got[name] is not None and _rel(got[name], ref) < 1e-3, name


def _spy_fp8_launches(monkeypatch, record):
    """Every FP8 GEMM launch of what runs next calls ``record(compiled, counter_ptr)`` before it launches: each goes
    through a bound launch (kernels.fp8_api.BoundFp8Gemm: the runtime's, or run_fp8_grouped_gemm's own)."""
    import fusion.kernels.fp8_api as fp8_api

    real = fp8_api.BoundFp8Gemm.__call__

    def spy(self, A, A_scale, B, B_scale, offsets, tensors, counter_ptr=None):
        if self.M:
            record(self.compiled, counter_ptr)
        return real(self, A, A_scale, B, B_scale, offsets, tensors, counter_ptr)

    monkeypatch.setattr(fp8_api.BoundFp8Gemm, "__call__", spy)


def test_lone_fp8_gemms_take_their_tile_counter_from_the_calls_buffer(monkeypatch, no_reference_recipe):
    """FC2's fprop and FC1's dgrad (the lone FP8 GEMMs, dynamic schedule) launch with a counter slot of the call's
    bounds buffer: no launch allocates and zeroes one. The results still match (a shared or stale counter would
    skip tiles)."""
    given = []
    _spy_fp8_launches(monkeypatch, lambda compiled, counter_ptr: given.append(counter_ptr))
    E, sizes, d, f = CASES[0]
    sizes = torch.tensor(sizes, device=DEV)
    seq = _block(E, d, f)
    x, dy, probs = _inputs(E, int(sizes.sum()), d, sizes)
    _assert_kernels_match_recipe(seq, x, sizes, probs, dy, no_reference_recipe)
    assert given and all(p is not None for p in given), given
    assert len(set(given)) == len(given), "every FP8 launch of the step its own counter"


def _steps_by_rows_threshold(monkeypatch, attribute):
    """The FP8 block's step on CASES[1] (8 x 1024 rows; every width there pairs its n-tiles) with
    tile_policy.`attribute` (a single-CTA threshold in rows per group) above those rows (1 << 30) and at them
    (1024): per run, the step's outputs and the (tile_m, cluster_n, ctas_per_sm) of every FP8 launch."""
    from fusion.kernels import tile_policy
    from fusion.planner import clear_cache

    clear_cache()
    launched = []
    _spy_fp8_launches(monkeypatch, lambda compiled, counter_ptr: launched.append(
        (compiled.config.tile_m, compiled.config.cluster_n, compiled.config.ctas_per_sm)))
    E, sizes, d, f = CASES[1]
    sizes = torch.tensor(sizes, device=DEV)
    seq = _block(E, d, f)
    x, dy, probs = _inputs(E, int(sizes.sum()), d, sizes)
    runs = []
    for threshold in (1 << 30, 1024):
        monkeypatch.setattr(tile_policy, attribute, threshold)
        launched.clear()
        runs.append((_step(seq, x, sizes, probs, dy), list(launched)))
    return runs


def test_many_rows_per_group_run_single_ctas_with_the_same_bits(monkeypatch):
    """From tile_policy.FP8_SINGLE_ROWS rows per group a call's FP8 kernels (fused and lone) run the 256-row tile
    as single CTAs instead of pairs: the same tiles and k order, so the output and every gradient are bitwise the
    pairs' (and those match the recipe: test_grouped_block_matches_the_recipe). FC1's gated kernel on the old
    policy's 256-row tile too (FP8_GATED_WAVES off: its 128 x 256 n-waves have no single-CTA variant), and FC2's dgrad
    without writing FC1's dgrad operand (which takes 128 x 128 tiles: tests/test_fp8_quantized_dgrad_operand_gpu.py);
    cooperative tiles throughout (FP8_TWO_CTAS off: two CTAs an SM take 128-row tiles, which the rule leaves alone)."""
    from fusion import dataflow
    from fusion.kernels import tile_policy

    monkeypatch.setattr(tile_policy, "FP8_GATED_WAVES", False)
    monkeypatch.setattr(dataflow, "QUANTIZES_DGRAD_OPERAND", False)
    monkeypatch.setattr(tile_policy, "FP8_TWO_CTAS", False)   # the lone GEMMs' 128-row two-CTA tiles have no pairs rule
    (pairs, launched_pairs), (single, launched_single) = _steps_by_rows_threshold(monkeypatch, "FP8_SINGLE_ROWS")
    assert launched_pairs and set(launched_pairs) == {(256, 2, 1)}, launched_pairs
    assert launched_single and set(launched_single) == {(256, 1, 1)}, launched_single
    for name, value in pairs.items():
        assert torch.equal(single[name], value), name


def test_many_rows_per_group_run_two_cta_tiles_as_single_ctas_with_the_same_bits(monkeypatch):
    """From tile_policy.FP8_TWO_CTAS_SINGLE_ROWS rows per group (4096 by default) a grouped call's lone FP8 GEMMs
    (FC2's forward, FC1's dgrad: 128-row tiles, two CTAs an SM) run as single CTAs instead of CTA pairs: the same
    tiles and k order, so the output and every gradient are bitwise the pairs'; the fused kernels (cooperative here)
    are untouched."""
    (pairs, launched_pairs), (single, launched_single) = _steps_by_rows_threshold(monkeypatch,
                                                                                  "FP8_TWO_CTAS_SINGLE_ROWS")
    assert {t for t in launched_pairs if t[2] == 2} == {(128, 2, 2)}, launched_pairs
    assert {t for t in launched_single if t[2] == 2} == {(128, 1, 2)}, launched_single
    assert sorted(t for t in launched_single if t[2] == 1) == sorted(t for t in launched_pairs if t[2] == 1)
    for name, value in pairs.items():
        assert torch.equal(single[name], value), name


def test_gated_fc1_on_192_column_pairs_matches_the_recipe(no_reference_recipe, monkeypatch):
    """With FP8_GATED_WAVES off, 2f = 384: three 128-column n-tiles (no pairs), two of 192 columns: FC1's inference
    kernel runs 128 x 192 CTA pairs (tile_policy.FP8_WIDE_ODD), each gated half of a tile straddling two
    weight-scale blocks; a training step's FC1 kernel keeps single 128 x 128 CTAs. Both match the recipe."""
    from fusion.kernels import tile_policy
    from fusion.kernels.tile_policy import GemmConfig
    from fusion.runtime import runner_for

    monkeypatch.setattr(tile_policy, "FP8_GATED_WAVES", False)

    assert tile_policy.FP8_WIDE_ODD
    E, d, f = 8, 256, 192
    sizes = torch.tensor([300, 0, 129, 517, 1, 0, 1000, 77], device=DEV)
    seq = _block(E, d, f)
    x, dy, probs = _inputs(E, int(sizes.sum()), d, sizes)
    with torch.no_grad():
        want = _reference(seq, "emulate")(x, group_sizes=sizes, scale=probs)
        got = seq(x, group_sizes=sizes, scale=probs)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2, _rel(got, want)
    _assert_kernels_match_recipe(seq, x, sizes, probs, dy, no_reference_recipe)
    (f1,) = [s for s in runner_for(seq, x).program.forward_steps if getattr(s, "label", None) == "F1"]
    tiles = {variant: (c.tile_m, c.tile_n, c.cluster_n) for (_, variant), k in f1._kernels.items()
             for c in [GemmConfig(*k.job.config)]}
    assert tiles == {"inference": (128, 192, 2), "train": (128, 128, 1)}, tiles
