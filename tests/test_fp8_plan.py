"""weight_format in plans: an fp8_block GEMM never enters a bf16 kernel; on Hopper the FP8 patterns
(patterns/fp8.fpat) put it into the FP8 kernel with its epilogue, and its other steps run its FP8 kernels or, where
none runs, its recipe's reference. "auto" on the CPU equals backend="reference" bit for bit; "emulate" (the Hopper
plan executed in torch) equals it up to the epilogue's rounding."""
import pytest
import torch

import fusion
from fusion import GroupLinear, QuantizeFP8Block, Sequential, SwiGLU
from fusion.planner import clear_cache, plan_for
from fusion.quant import fp8_linear
from fusion.runtime.steps import GemmDgrad, GemmWgrad, OpBackward
from test_matcher_support import el, pat

E, D, F = 3, 64, 64
SIZES = torch.tensor([5, 0, 11])


@pytest.fixture(autouse=True)
def _builtins():
    from fusion.patterns.registry import reset_to_builtins

    reset_to_builtins()
    clear_cache()
    yield
    clear_cache()


def block(fmt1="fp8_block", fmt2="fp8_block", backend="reference", dtype=torch.float32, quant=False, E=E, d=D, f=F):
    torch.manual_seed(0)
    ops = [GroupLinear(E, d, 2 * f, weight_format=fmt1), SwiGLU()]
    if quant:
        ops.append(QuantizeFP8Block())
    ops.append(GroupLinear(E, f, d, weight_format=fmt2))
    return Sequential(*ops, backend=backend).to(dtype)


def run(seq, x, sizes):
    x = x.clone().requires_grad_()
    y = seq(x, group_sizes=sizes)
    weights = torch.linspace(-1, 1, y.numel(), dtype=torch.float32).view(y.shape)
    (y.float() * weights).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in seq.parameters()]


def assert_bitwise(got, want, which=None):
    names = ["y", "dx"] + [f"dW{k}" for k in range(len(want) - 2)]
    for k, (a, b) in enumerate(zip(got, want)):
        if which is None or names[k] in which:
            assert torch.equal(a, b), f"{names[k]} differs: max |diff| {(a.float() - b.float()).abs().max()}"


# -- the plan -----------------------------------------------------------------------------------------------------
def test_builtin_fp8_patterns_put_an_fp8_gemm_into_the_fp8_kernel():
    plan = plan_for(block(fmt2="bf16"), dtype=torch.bfloat16, target="sm_90")
    assert [(s.pattern, s.kernel, s.ops) for s in plan.fused_steps if s.direction == "forward"] == [
        ("fp8_gemm_act", "grouped_gemm_fp8", (0, 1))]
    # the bf16 pattern refuses it, saying why (gemm_act used to put op 0 into the bf16 kernel)
    rows = [a for a in plan.attempts[0] if a.pattern == "gemm_act"]
    assert any('predicate `weight_format == "bf16"` is false' in (a.reason or "") for a in rows), rows
    text = block(fmt2="bf16", backend="auto").explain()
    assert "grouped_gemm_fp8  <- pattern fp8_gemm_act [patterns/fp8.fpat:" in text
    # both GEMMs FP8: FC1 + SwiGLU forward, FC2's dgrad + dSwiGLU backward, on the FP8 kernels
    plan = plan_for(block(), dtype=torch.bfloat16, target="sm_90")
    assert [(s.pattern, s.kernel, s.ops) for s in plan.fused_steps] == [
        ("fp8_gemm_act", "grouped_gemm_fp8", (0, 1)), ("fp8_dgrad_dact", "grouped_gemm_fp8_dgrad", (1, 2))]
    assert plan.fully_fused
    # a QuantizeFP8Block before FC2 passes the gradient straight through inside the fused dgrad
    plan = plan_for(block(quant=True), dtype=torch.bfloat16, target="sm_90")
    assert [s.ops for s in plan.fused_steps if s.direction == "backward"] == [(1, 2, 3)]
    # where the FP8 kernel cannot go (a GEMM with a bias), the recipe runs, and explain() says why
    biased = Sequential(GroupLinear(E, D, 2 * F, bias=True, weight_format="fp8_block"), SwiGLU(),
                        GroupLinear(E, F, D, weight_format="fp8_block"))
    text = biased.explain(dtype=torch.bfloat16, target="sm_90")
    assert "predicate `not bias` is false" in text
    assert "the fp8_block recipe" in block(fmt2="bf16", backend="auto").explain(target="cpu")


def test_an_fp8_gemm_backward_is_a_dgrad_step_and_a_wgrad_step():
    """One backward model: every GEMM has a dgrad and a wgrad step, whatever its weight format; an fp8_block
    GEMM's run its FP8 kernels on Hopper, its recipe's reference elsewhere."""
    plan = plan_for(block(fmt2="bf16"), dtype=torch.bfloat16, target="sm_90")
    steps = {s.parts: s for s in plan.backward if not s.fused}
    dgrad, wgrad = steps[((0, "dgrad"),)], steps[((0, "wgrad"),)]
    assert "FP8 block-scaled grouped GEMM of dY (quantized 1x128)" in dgrad.method
    assert "varlen-K grouped GEMM of the high-precision dY and X" in wgrad.method
    assert (dgrad.reads, dgrad.writes) == (("g1",), ("g0",))
    assert (wgrad.reads, wgrad.writes) == (("g1", "v0"), ("dW0",))
    cpu = plan_for(block(fmt2="bf16"), dtype=torch.float32, target=None)
    methods = {s.parts: s.method for s in cpu.backward}
    assert "the fp8_block recipe's input gradient" in methods[((0, "dgrad"),)]
    assert "the fp8_block recipe's weight gradient" in methods[((0, "wgrad"),)]
    assert plan.ops[0].weight_format == "fp8_block" and plan.ops[0].gemm_by_reference
    assert plan.ops[2].weight_format == "bf16" and not plan.ops[2].gemm_by_reference
    # on Hopper the FP8 kernels run it: not a fallback; where none does it runs its recipe, and is listed as
    # falling back, forward and both backward steps, saying why
    assert not [f for f in plan.fallbacks if f.op == 0]
    cpu_plan = plan_for(block(fmt2="bf16"), dtype=torch.bfloat16, target=None)
    fb = [f for f in cpu_plan.fallbacks if f.op == 0]
    assert [f.part for f in fb] == ["forward", "dgrad", "wgrad"]
    assert all("weight_format='fp8_block'" in f.reasons[0] for f in fb)


def test_the_emulated_program_runs_the_fp8_steps():
    from fusion.runtime import runner_for
    from fusion.runtime.steps import FusedDgrad, FusedForward

    runner = runner_for(block(backend="emulate"), torch.zeros(1, D))
    program = runner.program
    forward, = [r for r in program.forward_steps if isinstance(r, FusedForward)]
    dgrad, = [r for r in program.backward_steps if isinstance(r, FusedDgrad)]
    assert forward.fp8 and dgrad.fp8 and dgrad.b_major == "K"
    assert forward.job(torch.bfloat16, "train").mainloop == "fp8_block"
    fc1 = [r for r in program.backward_steps if isinstance(r, (GemmDgrad, GemmWgrad)) and r.index == 0]
    assert len(fc1) == 2 and all(r.fp8 and r.device is None for r in fc1)  # emulate: the recipe, not the GPU
    assert not any(isinstance(r, OpBackward) for r in program.backward_steps)


def test_a_pattern_without_the_predicate_still_never_fuses_an_fp8_gemm():
    """The matcher refuses a weight format the kernel template does not run, whatever the pattern says."""
    lax = pat("lax", el("gemm", "GroupLinear"), el("act", "activation"), dtypes=("bfloat16",), arch_min=90)
    plan = plan_for(block(), dtype=torch.bfloat16, target="sm_90", patterns=[lax])
    assert not plan.fused_steps
    (row,) = [a for a in plan.attempts[0] if a.pattern == "lax"]
    assert "kernel template 'grouped_gemm' runs weight_format 'bf16' only, not 'fp8_block'" in row.reason
    plan = plan_for(block("bf16", "bf16"), dtype=torch.bfloat16, target="sm_90", patterns=[lax])
    assert [s.ops for s in plan.fused_steps] == [(0, 1)]


def test_a_bf16_block_is_unaffected():
    plan = plan_for(block("bf16", "bf16"), dtype=torch.bfloat16, target="sm_90")
    assert [(s.pattern, s.ops) for s in plan.fused_steps] == [("gemm_act", (0, 1)), ("dgrad_dact", (1, 2))]
    assert plan.fully_fused and not any(o.gemm_by_reference for o in plan.ops)


# -- running it ---------------------------------------------------------------------------------------------------
def assert_close(got, want, tol, which=None):
    """Each result within `tol` of the reference, relative to its largest element."""
    names = ["y", "dx"] + [f"dW{k}" for k in range(len(want) - 2)]
    for k, (a, b) in enumerate(zip(got, want)):
        if which is None or names[k] in which:
            scale = b.abs().max().double()
            err = ((a.double() - b.double()).abs().max() / scale).item()
            assert err <= tol, f"{names[k]}: max error {err:.3g} of its largest element (tolerance {tol})"


def launched():
    from fusion.runtime.kernel import LAUNCHES

    return dict(LAUNCHES.by_step)


def test_fp8_block_on_the_cpu_is_the_reference_bitwise():
    torch.manual_seed(1)
    x = torch.randn(16, D)
    assert_bitwise(run(block(backend="auto"), x, SIZES), run(block(), x, SIZES))


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 0.08)])
def test_the_emulated_fp8_kernels_equal_the_reference(dtype, tol, quant):
    """backend="emulate" runs the Hopper plan (FC1 + SwiGLU on the FP8 kernel, FC2's FP8 dgrad + dSwiGLU, the FP8
    GEMMs' other steps by the recipe) in torch: the recipe's numbers up to where the epilogue rounds (float64,
    float32: rounding; bf16: the fused kernel keeps the activation in fp32 and rounds once, and FC2's FP8
    quantization turns those last-bit differences into an E4M3 step here and there)."""
    from fusion.runtime.kernel import LAUNCHES

    torch.manual_seed(1)
    sizes = torch.tensor([100, 0, 200])
    x = torch.randn(300, D, dtype=dtype)
    want = run(block(dtype=dtype, quant=quant), x, sizes)
    LAUNCHES.reset()
    got = run(block(dtype=dtype, quant=quant, backend="emulate"), x, sizes)
    assert launched() == {"F1": 1, "B1": 1}  # the fused forward and dgrad kernels ran (emulated)
    assert_close(got, want, tol)


def test_the_emulated_fp8_forward_multiplies_the_recipes_operands():
    """The fused FP8 kernel's GEMM is the recipe's (x quantized 1x128, the weight's 128x128 blocks, one float32
    product): in float64, with a linear activation in its place, FC1's output is the recipe's GEMM to rounding. A
    kernel that multiplied the unquantized x, or the weight without its scales, fails by orders of magnitude."""
    torch.manual_seed(2)
    seq = Sequential(GroupLinear(E, D, 2 * F, weight_format="fp8_block"), SwiGLU(),
                     GroupLinear(E, F, D, weight_format="fp8_block"), backend="emulate").double()
    x = torch.randn(16, D, dtype=torch.float64) * 3
    want = fusion.Sequential(*seq.ops, backend="reference")(x, group_sizes=SIZES)
    got = seq(x, group_sizes=SIZES)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * want.abs().max().item())
    hp = Sequential(GroupLinear(E, D, 2 * F), SwiGLU(), GroupLinear(E, F, D), backend="reference").double()
    hp.load_state_dict(seq.state_dict())
    assert (hp(x, group_sizes=SIZES) - want).abs().max() > 1e-4 * want.abs().max()  # FP8 is visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp8_gemm_before_a_fused_dgrad_follows_the_recipe(dtype, monkeypatch):
    """FC1 fp8_block (fused with SwiGLU on the FP8 kernel), FC2 bf16 (its dgrad fused with the SwiGLU backward):
    FC1's dgrad and wgrad steps run the recipe at the saved input. With the FP8-operand wgrad the quantizations
    of dH absorb the fused kernels' rounding: dx and FC1's weight gradient are the reference's bit for bit; the
    output and FC2's weight gradient agree to rounding (the epilogue rounds once)."""
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", False)
    torch.manual_seed(1)
    x = torch.randn(16, D, dtype=dtype)
    want = run(block(fmt2="bf16", dtype=dtype), x, SIZES)
    got = run(block(fmt2="bf16", dtype=dtype, backend="emulate"), x, SIZES)
    assert_bitwise(got, want, which=("dx", "dW0"))
    assert_close(got, want, 1e-6 if dtype == torch.float32 else 1e-14, which=("y", "dW1"))


@pytest.mark.parametrize("wgrad_bf16", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp8_gemm_after_a_quantize_reads_the_quantized_input_in_backward(dtype, wgrad_bf16, monkeypatch):
    """bf16 FC1 + SwiGLU fused, QuantizeFP8Block, fp8_block FC2: FC2's wgrad step reads the saved QuantizedTensor
    itself (dequantized for the bf16 wgrad, its own columnwise copy for the FP8 one), so its weight gradient is
    the reference's bit for bit; the forward too. The fused FP8 dgrad + dSwiGLU rounds differently from the
    reference's op-by-op backward: those gradients agree to rounding."""
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", wgrad_bf16)
    torch.manual_seed(1)
    sizes = torch.tensor([100, 200])
    x = torch.randn(300, 64, dtype=dtype) * torch.logspace(-2, 2, 64, dtype=dtype)
    make = dict(fmt1="bf16", quant=True, E=2, d=64, f=160, dtype=dtype)
    want = run(block(**make), x, sizes)
    got = run(block(**make, backend="emulate"), x, sizes)
    assert_bitwise(got, want, which=("y", "dW1"))
    assert_close(got, want, 1e-5 if dtype == torch.float32 else 1e-12, which=("dx", "dW0"))


def test_fp8_block_under_torch_compile_emulate():
    """Under torch.compile the program runs inside a custom op, below autograd: the recipe's steps and the fused
    FP8 kernels still run there (it used to fail: "element 0 of tensors does not require grad")."""
    torch.manual_seed(1)
    sizes = torch.tensor([100, 200])
    x = torch.randn(300, 64) * torch.logspace(-2, 2, 64)
    make = dict(fmt1="bf16", quant=True, E=2, d=64, f=160)
    want = run(block(**make), x, sizes)
    seq = block(**make, backend="emulate")
    compiled = torch.compile(seq, fullgraph=True)
    x = x.clone().requires_grad_()
    y = compiled(x, group_sizes=sizes)
    (y.float() * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
    assert_close([y.detach(), x.grad] + [p.grad for p in seq.parameters()], want, 1e-5)


def test_explain_says_why_the_fp8_kernel_does_not_take_a_gemm():
    """The plan names the FP8 kernel only where it runs: 16-multiple widths in bf16/fp16 (as its runtime checks)."""
    seq = Sequential(GroupLinear(2, 72, 128, weight_format="fp8_block"), SwiGLU(),
                     GroupLinear(2, 64, 64, weight_format="fp8_block"))
    text = seq.explain(dtype=torch.bfloat16, target="sm_90a")
    assert "op 0 GroupLinear: GroupLinear.reference: the fp8_block recipe" in text
    assert "the FP8 kernel does not take it: its kernel needs feature widths that are multiples of 16, got 72" in text
    assert "op 2 GroupLinear: FP8 block-scaled grouped GEMM" in text
    text = seq.explain(dtype=torch.float32, target="sm_90a")
    assert "op 2 GroupLinear: GroupLinear.reference: the fp8_block recipe" in text
    assert "its kernel runs bfloat16/float16, the dtype is float32" in text


def test_sequential_compile_builds_every_fp8_kernel_the_plan_launches(monkeypatch):
    """Sequential.compile()'s jobs (fusion/runtime/aot.py): the fused FP8 kernels (training and inference FC1,
    FC2's dgrad), the lone FP8 GEMMs of the device method (FC2's fprop, FC1's dgrad), all on the FP8 mainloop,
    and both GEMMs' bf16 weight gradients on the varlen-K kernel; a bf16 block has no FP8 job."""
    from fusion.runtime.aot import plan_jobs

    from fusion.kernels import tile_policy
    from fusion.kernels.tile_policy import GemmConfig

    jobs = plan_jobs(block(E=4, d=256, f=256, backend="auto").to("meta", torch.bfloat16), torch.bfloat16)
    fp8 = [j for j in jobs if j.mainloop == "fp8_block"]
    expected = [("F1", "train", 512, 256), ("F1", "inference", 512, 256), ("B1", "backward", 256, 256),
                ("fp8_fprop", "identity", 256, 256), ("fp8_dgrad", "identity", 256, 512)]
    # the lone GEMMs (a plain epilogue) on two CTAs an SM (tile_policy.fp8_two_ctas), as CTA pairs and, for calls of
    # FP8_TWO_CTAS_SINGLE_ROWS rows per group or more (tile_policy.fp8_for_rows), as single CTAs; the fused kernels
    # cooperative (B1's epilogue at K = 256 < FP8_TWO_CTAS_EPILOGUE_MIN_K)
    lone_pairs = {"fp8_fprop": (2, 1), "fp8_dgrad": (2, 1)}
    assert [(j.step, j.variant, j.N, j.K, GemmConfig(*j.config).cluster_n) for j in fp8] == [
        (*e, pair) for e in expected for pair in lone_pairs.get(e[0], (2,))]
    assert len({j.key for j in fp8}) == 7
    assert [GemmConfig(*j.config).ctas_per_sm for j in fp8] == [1, 1, 1, 2, 2, 2, 2]
    # with single CTAs from FP8_SINGLE_ROWS rows per group too, each 256-row tile also at those: every one of
    # these widths pairs up its 128-column n-tiles; FC1's gated kernels are 128 x 256 n-waves
    # (tile_policy.FP8_GATED_WAVES): no single-CTA variant by rows
    monkeypatch.setattr(tile_policy, "FP8_SINGLE_ROWS", 4096)
    by_rows = [j for j in plan_jobs(block(E=4, d=256, f=256, backend="auto").to("meta", torch.bfloat16),
                                    torch.bfloat16) if j.mainloop == "fp8_block"]
    assert [(j.step, j.variant, j.N, j.K, GemmConfig(*j.config).cluster_n) for j in by_rows] == [
        (*e, pair) for e in expected for pair in ({"B1": (2, 1)} | lone_pairs).get(e[0], (2,))]
    assert all(GemmConfig(*j.config).tile_n == 256 for j in by_rows if j.step == "F1")
    assert len({j.key for j in by_rows}) == 8
    monkeypatch.undo()
    # the weight gradients dW (E, out, in): FC2's (256, 256) and FC1's (512, 256) (N = in, K = out)
    # (each weight's gradient at the shape's tile and at the store-bound one of few rows per group)
    assert sorted((j.N, j.K) for j in jobs if j.mainloop == "varlen_k") == [(256, 256)] * 2 + [(256, 512)] * 2
    assert {j.mainloop for j in jobs} == {"fp8_block", "varlen_k"}
    # a bf16 block: its fused kernels, and its GEMMs' weight gradients on the varlen-K kernel
    assert {j.mainloop for j in plan_jobs(block("bf16", "bf16", backend="auto").to("meta", torch.bfloat16),
                                          torch.bfloat16)} == {"bf16", "varlen_k"}
    # widths the FP8 kernel refuses (72): no job for that GEMM (its weight gradient included: the recipe runs
    # it), nothing to fail at compile time
    odd = Sequential(GroupLinear(2, 72, 128, weight_format="fp8_block"), SwiGLU(),
                     GroupLinear(2, 64, 64, weight_format="fp8_block")).to("meta", torch.bfloat16)
    assert [(j.step, j.N, j.K) for j in plan_jobs(odd, torch.bfloat16)] == [
        ("B1", 64, 64), ("fp8_fprop", 64, 64), ("wgrad", 64, 64), ("wgrad", 64, 64)]   # (two tiles by rows)
    # backend "emulate" launches no device method: only the fused kernels' jobs
    emulated = plan_jobs(block(E=4, d=256, f=256, backend="emulate").to("meta", torch.bfloat16), torch.bfloat16)
    assert [j.step for j in emulated] == ["F1", "F1", "B1"]


def _fc1_chain(quant, f=320):
    from fusion import Scale

    torch.manual_seed(0)
    fc1 = GroupLinear(E, D, 2 * f, weight_format="fp8_block")
    ops = [fc1, SwiGLU(), Scale()] + ([QuantizeFP8Block(columnwise=False)] if quant else [])
    return ops


def test_quantize_fp8_block_without_columnwise_is_fc1s_store():
    """QuantizeFP8Block(columnwise=False) after FC1 -> SwiGLU -> Scale joins F1 (patterns/fp8.fpat), whose kernel
    job is the gated 128 x 256 tile (a row's 1 x 128 block whole in it) writing the FP8-block output and nothing in
    high precision; with columnwise=True it runs alone, and explain() names the predicate."""
    from fusion.runtime.aot import plan_jobs

    ops = _fc1_chain(True) + [GroupLinear(E, 320, D, weight_format="fp8_block")]
    seq = Sequential(*ops).to(torch.bfloat16)
    fused = [s.ops for s in seq.plan().forward if s.fused]
    assert fused == [(0, 1, 2, 3)]
    jobs = [j for j in plan_jobs(seq, torch.bfloat16) if j.step == "F1"]
    assert {j.variant for j in jobs} == {"train", "inference"}
    for j in jobs:
        config = fusion.kernels.GemmConfig(*j.config)
        assert (config.tile_m, config.tile_n) == (128, 256), config
        assert "FP8BlockOutput" in j.source and '_epi.Output("hp")' not in j.source
    ops[3] = QuantizeFP8Block(columnwise=True)
    seq = Sequential(*ops).to(torch.bfloat16)
    assert [s.ops for s in seq.plan().forward if s.fused] == [(0, 1, 2)]
    assert "predicate `not columnwise` is false" in seq.explain()


def test_emulated_fp8_block_store_is_the_quantized_epilogue_output():
    """backend="emulate" runs F1 with its FP8-block store: the QuantizedTensor it returns is, bit for bit, fusion.quant's
    quantization of the same plan's high-precision F1 output (the chain without the QuantizeFP8Block); f = 320 ends
    on a partial block; amax included."""
    from fusion.quant import quantize

    sizes = torch.tensor([100, 0, 37])
    M = int(sizes.sum())
    q = Sequential(*_fc1_chain(True), backend="emulate").to(torch.bfloat16)
    hp_chain = Sequential(*_fc1_chain(False), backend="emulate").to(torch.bfloat16)
    hp_chain[0].weight.data.copy_(q[0].weight.data)
    torch.manual_seed(2)
    x = torch.randn(M, D, dtype=torch.bfloat16)
    x[3] = 0                      # a zero row: scale 1
    x[7] *= 2.0 ** 40             # a huge one
    probs = torch.rand(M, dtype=torch.bfloat16)
    with torch.no_grad():
        got = q(x, group_sizes=sizes, scale=probs)
        hp = hp_chain(x, group_sizes=sizes, scale=probs)
    want = quantize(hp, "fp8_block", columnwise=False)
    assert got.format == "fp8_block" and got.columnwise_data is None
    assert torch.equal(got._data, want._data) and torch.equal(got.scale, want.scale)
    assert got.amax.item() == want.amax.item()


def test_fp8_block_store_under_torch_compile_is_the_eager_program():
    """The block with FC1's FP8-block store (QuantizeFP8Block(columnwise=False) in F1) under torch.compile(fullgraph)
    runs the same program as eagerly: the output and every gradient bit for bit (backend="emulate")."""
    from fusion import Scale

    sizes = torch.tensor([100, 200])
    torch.manual_seed(0)
    x = torch.randn(300, D, dtype=torch.bfloat16)
    probs = torch.rand(300, dtype=torch.bfloat16)
    results = []
    for compiled in (False, True):
        torch.manual_seed(3)
        seq = Sequential(GroupLinear(2, D, 320, weight_format="fp8_block"), SwiGLU(), Scale(),
                         QuantizeFP8Block(columnwise=False), GroupLinear(2, 160, D, weight_format="fp8_block"),
                         backend="emulate").to(torch.bfloat16)
        call = torch.compile(seq, fullgraph=True) if compiled else seq
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = call(xx, group_sizes=sizes, scale=pp)
        y.float().sum().backward()
        results.append([y.detach(), xx.grad, pp.grad] + [p.grad for p in seq.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
