"""Gather fused into FC1's A loads (pattern gather_gemm_act), run by backend="emulate": the fused plan's numerics
against the reference, forward and every gradient, and what the forward keeps for the backward.

The emulation runs the kernel's operand protocol in torch (fusion/runtime/emulate.py): row r of the GEMM reads
x[index[r]] through the int32 index the runtime gives the kernel, so a bug in how the runtime binds the gather
(the index, padding rows, which rows a group holds) shows here as on the GPU.
"""
from __future__ import annotations

import pytest
import torch

import fusion
from fusion import Combine, Gather, GroupLinear, Scale, Sequential, SwiGLU
from fusion.moe import route
from fusion.runtime.kernel import LAUNCHES

E, D, F = 6, 64, 32


def block(backend: str, seed: int = 1, dtype=torch.float64):
    torch.manual_seed(seed)
    return Sequential(Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D), Combine(),
                      backend=backend).to(dtype)


def run(seq, x0, r, dtype):
    x = x0.clone().to(dtype).requires_grad_()
    probs = r.probs.detach().to(dtype).requires_grad_()
    y = seq(x, index=r.index, group_sizes=r.group_sizes, scale=probs)
    dy = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape).to(dtype)
    grads = torch.autograd.grad(y, [x, probs, *seq.parameters()], dy)
    return (y, *grads)


def routing(T: int, k: int, round_to=None, empty: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    logits[:, E - empty:] = -1e9  # experts no token picks (empty groups)
    return route(logits, k, round_to=round_to)


@pytest.mark.parametrize("k,round_to,empty", [(1, None, 0), (2, None, 2), (2, 8, 0), (4, 4, 1)])
def test_fused_gather_matches_reference(k, round_to, empty):
    T = 37
    r = routing(T, k, round_to, empty)
    x0 = torch.randn(T, D, dtype=torch.float64)
    ref = run(block("reference"), x0, r, torch.float64)
    LAUNCHES.reset()
    got = run(block("emulate"), x0, r, torch.float64)
    assert LAUNCHES.by_step.get("F1") == 1  # the gathering FC1 kernel ran (emulated)
    names = ["y", "dx", "dprobs", "dW1", "dW2"]
    for name, a, b in zip(names, ref, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("round_to", [None, 8])
def test_wide_fc1_copies_the_gathered_rows_first(monkeypatch, round_to):
    """Where kernels/tile_policy.py gathers_in_kernel says so (an FC1 of N >= FC1_COPY_MIN_N columns; here the
    threshold is lowered to this block's 2F), the Gather runs as a copy (the gather device method, padding rows
    zero) and FC1 as the kernel that loads A by TMA: the same values as the reference, forward and every gradient;
    the plan builds that kernel without gather_a, and explain() says so on the Gather's line."""
    from fusion.explain import explain
    from fusion.kernels import tile_policy
    from fusion.kernels.tile_policy import GemmConfig
    from fusion.runtime import gather as gather_method
    from fusion.runtime.aot import plan_jobs

    monkeypatch.setattr(tile_policy, "FC1_COPY_MIN_N", 2 * F)
    copies = []
    real_run = gather_method.run
    monkeypatch.setattr(gather_method, "run", lambda op, x, ctx: copies.append(x.shape) or real_run(op, x, ctx))
    T = 37
    r = routing(T, 2, round_to)
    x0 = torch.randn(T, D, dtype=torch.float64)
    ref = run(block("reference"), x0, r, torch.float64)
    LAUNCHES.reset()
    got = run(block("emulate"), x0, r, torch.float64)
    assert LAUNCHES.by_step.get("F1") == 1 and copies[0] == (T, D)   # the copy, then FC1's kernel
    for name, a, b in zip(["y", "dx", "dprobs", "dW1", "dW2"], ref, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)
    seq = block("auto", dtype=torch.bfloat16)
    fc1 = [GemmConfig(*j.config) for j in plan_jobs(seq, torch.bfloat16) if j.step == "F1"]
    assert fc1 and not any(c.gather_a for c in fc1)
    gather_lines = [ln for ln in explain(seq, dtype=torch.bfloat16, target="sm_90a").splitlines()
                    if "op 0" in ln and "Gather()" in ln and "copied by the gather kernel" in ln]
    assert len(gather_lines) == 1 and "gathers_in_kernel" in gather_lines[0]
    monkeypatch.setattr(tile_policy, "FC1_COPY_MIN_N", 2 * F + 1)   # below the threshold: the gathering kernel
    fc1 = [GemmConfig(*j.config) for j in plan_jobs(block("auto", dtype=torch.bfloat16), torch.bfloat16)
           if j.step == "F1"]
    assert fc1 and all(c.gather_a for c in fc1)


def test_fused_gather_bf16_close_to_reference():
    T, k = 64, 2
    r = routing(T, k)
    x0 = torch.randn(T, D, dtype=torch.float64)
    ref = run(block("reference", dtype=torch.float64), x0, r, torch.float64)
    got = run(block("emulate", dtype=torch.bfloat16), x0, r, torch.bfloat16)
    for a, b in zip(ref, got):
        rel = (b.double() - a).norm() / a.norm()
        assert rel < 2e-2, rel


def test_forward_keeps_x_not_the_gathered_rows():
    """The plan keeps x and FC1's pre-activation; the gathered rows are recomputed, right before FC1's wgrad."""
    seq = block("emulate")
    plan = fusion.planner.plan_for(seq, dtype=torch.bfloat16)
    assert [(s.pattern, s.ops) for s in plan.forward if s.fused][0] == ("gather_gemm_act", (0, 1, 2, 3))
    assert set(plan.saves) == {"v0", "v1", "v2"} and plan.recomputed == ("v1",)
    from fusion.runtime.program import BlockProgram

    program = BlockProgram(seq, plan, "emulate")
    assert program.recompute_bases == {"v1": "v0"}
    readers = [n for n, step in enumerate(plan.backward) if "v1" in step.reads]
    assert len(readers) == 1 and plan.backward[readers[0]].parts[0][1] == "wgrad"
    # x stays until the recompute has read it, and the gathered rows go right after their one reader
    assert "v1" in program.release[readers[0]] and "v0" in program.release[readers[0]]


def test_gathered_rows_exist_only_during_fc1_wgrad(monkeypatch):
    """The recompute runs right before its reader, not at the start of the backward."""
    from fusion.runtime import steps as S

    events = []
    gather_ref = Gather.reference
    wgrad_run = S.GemmWgrad.run

    def gather(self, x, ctx):
        events.append("gather")
        return gather_ref(self, x, ctx)

    def wgrad(self, state):
        events.append(f"wgrad{self.index}")
        return wgrad_run(self, state)

    monkeypatch.setattr(Gather, "reference", gather)
    monkeypatch.setattr(S.GemmWgrad, "run", wgrad)
    r = routing(20, 2)
    run(block("emulate"), torch.randn(20, D, dtype=torch.float64), r, torch.float64)
    assert events == ["wgrad4", "gather", "wgrad1"], events


def test_padding_rows_read_zeros_through_the_index():
    """Token rounding's padding rows (index -1) sit in the last group: the int32 index the kernels read keeps
    their -1 (fusion.runtime.gather.gather_index), and a gathering kernel reads zeros there (its producers
    zero-fill; the emulation does the same), what the reference's gathered copy holds."""
    from fusion.run_context import RunContext
    from fusion.runtime.emulate import _gathered
    from fusion.runtime.gather import gather_index

    index = torch.tensor([3, -1, 0, -1, 2])
    ctx = RunContext(index=index)
    got = gather_index(ctx)
    assert got.dtype == torch.int32 and got.tolist() == [3, -1, 0, -1, 2]
    assert gather_index(ctx) is got  # made once per call
    x = torch.arange(1.0, 17.0).reshape(4, 4)
    rows = _gathered(x, got)
    assert rows[[1, 3]].eq(0).all() and torch.equal(rows[[0, 2, 4]], x[[3, 0, 2]])


def test_gather_backward_skipped_when_x_needs_no_gradient(monkeypatch):
    calls = []
    grad = Gather.input_grad
    monkeypatch.setattr(Gather, "input_grad", lambda self, dy, ctx: calls.append(1) or grad(self, dy, ctx))
    r = routing(20, 2)
    probs = r.probs.detach().requires_grad_()
    y = block("emulate")(torch.randn(20, D, dtype=torch.float64), index=r.index, group_sizes=r.group_sizes,
                         scale=probs)
    y.sum().backward()
    assert probs.grad is not None and calls == []
    x = torch.randn(20, D, dtype=torch.float64, requires_grad=True)
    block("emulate")(x, index=r.index, group_sizes=r.group_sizes, scale=probs).sum().backward()
    assert x.grad is not None and calls == [1]


@pytest.mark.parametrize("k,round_to,empty", [(2, None, 0), (2, 8, 0), (4, 4, 1)])
def test_gather_device_method_wiring(monkeypatch, k, round_to, empty):
    """On the GPU the fused runtime runs the gather kernel (fusion/runtime/gather.py) for the Gather recomputed
    before FC1's weight gradient and for the Combine's backward. Forced here into the emulated program (device
    methods are the GPU runtime's; on the CPU the module falls back to the reference gather), with token
    rounding's padding rows: both steps call it, and every result and gradient is the reference's."""
    from fusion.runtime import gather as gather_method
    from fusion.runtime import steps as S

    used = []
    device_method = S._device_method
    real_run = gather_method.run

    def with_gather(op, part, device_kernels):
        if (op.spec.kind, part) in {("gather", "forward"), ("combine", "backward")}:
            return gather_method
        return device_method(op, part, device_kernels)

    T = 29
    r = routing(T, k, round_to, empty)
    x0 = torch.randn(T, D, dtype=torch.float64)
    ref = run(block("reference"), x0, r, torch.float64)
    monkeypatch.setattr(S, "_device_method", with_gather)
    monkeypatch.setattr(gather_method, "takes", lambda op, x: True)
    monkeypatch.setattr(gather_method, "run", lambda op, x, ctx: used.append(op.spec.kind) or real_run(op, x, ctx))
    monkeypatch.setattr(Gather, "reference", lambda *a: pytest.fail("the recompute ran the reference gather"))
    got = run(block("emulate"), x0, r, torch.float64)
    assert sorted(used) == ["combine", "gather"]
    for name, a, b in zip(["y", "dx", "dprobs", "dW1", "dW2"], ref, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("gathers", [True, False])
def test_fc1_weight_gradient_reads_the_tokens_through_the_index(monkeypatch, gathers):
    """Where the tile policy says so (kernels/tile_policy.py gather_in_wgrad; forced here), FC1's weight gradient
    gets the block's tokens and the int32 routing index instead of the regathered rows, and the program skips the
    Gather's recompute; otherwise the recompute runs and the gradient reads its rows. The weight-gradient device
    method (fusion/runtime/wgrad_gemm.py) is forced into the emulated program, its kernel replaced by torch on the
    operands it is given: every result and gradient is the reference's either way (token rounding's padding
    rows included)."""
    from fusion.grouped import linear_wgrad
    from fusion.runtime import steps as S
    from fusion.runtime import wgrad_gemm

    calls = []
    device_method = S._device_method
    gather_ref = Gather.reference
    recomputes = []

    def with_wgrad(op, part, device_kernels):
        return wgrad_gemm if (op.spec.kind, part) == ("gemm", "wgrad") else device_method(op, part, device_kernels)

    def kernel(op, x, dy, ctx, index=None):
        calls.append(index is not None)
        if index is not None:
            assert index.dtype == torch.int32 and x.shape[0] == T   # the tokens, read through the index
            x = x[index.long()]
        return linear_wgrad(dy, x, op.weight, ctx.group_sizes, ctx.offsets)

    T = 29
    r = routing(T, 4, 4, 1)
    x0 = torch.randn(T, D, dtype=torch.float64)
    ref = run(block("reference"), x0, r, torch.float64)
    monkeypatch.setattr(S, "_device_method", with_wgrad)
    monkeypatch.setattr(wgrad_gemm, "takes", lambda op, x: True)
    monkeypatch.setattr(wgrad_gemm, "gathers", lambda op, rows: gathers)
    monkeypatch.setattr(wgrad_gemm, "wgrad", kernel)
    monkeypatch.setattr(Gather, "reference", lambda self, x, ctx: recomputes.append(1) or gather_ref(self, x, ctx))
    got = run(block("emulate"), x0, r, torch.float64)
    assert calls == [False, gathers]           # FC2's weight gradient, then FC1's
    assert len(recomputes) == (0 if gathers else 1)
    for name, a, b in zip(["y", "dx", "dprobs", "dW1", "dW2"], ref, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)


def test_gather_kernel_in_the_plan():
    """explain() of the block planned for Hopper names the gather kernel for the Combine's backward."""
    from fusion.explain import explain

    text = explain(block("auto", dtype=torch.bfloat16), dtype=torch.bfloat16, target="sm_90a")
    line = next(ln for ln in text.splitlines() if "Combine" in ln and "backward" in ln)
    assert "gather kernel of the tokens' gradients" in line, line


def test_fc1_weight_gradient_gather_rule_reads_the_routed_rows(monkeypatch):
    """GemmWgrad.gathers asks the tile policy at the call's routed rows M (not the tokens T): 4 experts, 2048 tokens,
    k = 2 routed rows each, so 1024 rows per expert (kernels/tile_policy.py WGRAD_GATHER_ROWS) where T alone would
    make 512; a block without a Combine gathers too (padding rows read zeros through the index, as the regathered
    copy holds), a Linear never; and Sequential.compile() builds the gathering kernels of an MoE FC1 (x through
    the index) and FC2 (dY through it)."""
    from fusion import Linear
    from fusion.kernels.tile_policy import WGRAD_GATHER_ROWS, WgradConfig
    from fusion.planner import plan_for
    from fusion.run_context import RunContext
    from fusion.runtime import steps as S
    from fusion.runtime import wgrad_gemm
    from fusion.runtime.aot import plan_jobs

    E, d, f, T, k = 4, 256, 128, 2048, 2
    assert T * k == E * WGRAD_GATHER_ROWS
    monkeypatch.setattr(wgrad_gemm, "takes", lambda op, x: True)

    def fc1_runner(seq):
        plan = plan_for(seq, dtype=torch.bfloat16)
        step = next(s for s in plan.backward if s.parts[0] == (1, "wgrad"))
        return S.GemmWgrad(seq, step, plan, device_kernels=True)

    moe = Sequential(Gather(), GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d), Combine())
    runner = fc1_runner(moe)
    assert runner.tokens == "v0"
    for M, want in ((T * k, True), (T * k - 1, False)):
        state = S.RunState(ctx=RunContext(index=torch.zeros(M, dtype=torch.long)), rows=T)
        state.env["v0"] = torch.empty(T, d)
        assert runner.gathers(state) is want
    assert fc1_runner(Sequential(Gather(), GroupLinear(E, d, 2 * f), SwiGLU(), GroupLinear(E, f, d))).tokens == "v0"
    assert fc1_runner(Sequential(Gather(), Linear(d, 2 * f), SwiGLU(), Linear(f, d), Combine())).tokens is None
    gathered = [WgradConfig(*j.config) for j in plan_jobs(moe, torch.bfloat16) if j.mainloop == "varlen_k"]
    assert WgradConfig(tile_n=256, stages=4, gather_b=True, cluster_m=1) in gathered      # FC1's: x
    # FC2's: dY, B (H) shared by the CTA pair
    assert WgradConfig(tile_n=128, stages=6, pingpong=True, gather_a=True, cluster_m=2) in gathered


def test_a_bias_gradient_alone_needs_no_regathered_rows(monkeypatch):
    """FC1's weight frozen, its bias trained: the wgrad step computes only the bias gradient (dH summed per expert),
    so the program does not recompute the gathered rows; the gradients are the reference's."""
    recomputes = []
    gather_ref = Gather.reference
    T = 23
    r = routing(T, 2)
    x0 = torch.randn(T, D, dtype=torch.float64)

    def with_bias(backend):
        torch.manual_seed(1)
        seq = Sequential(Gather(), GroupLinear(E, D, 2 * F, bias=True), SwiGLU(), Scale(), GroupLinear(E, F, D),
                         Combine(), backend=backend).to(torch.float64)
        seq[1].weight.requires_grad_(False)
        return seq

    def step(seq):
        probs = r.probs.detach().to(torch.float64)
        y = seq(x0, index=r.index, group_sizes=r.group_sizes, scale=probs)
        dy = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
        return torch.autograd.grad(y, [seq[1].bias, seq[4].weight], dy)

    want = step(with_bias("reference"))
    monkeypatch.setattr(Gather, "reference", lambda self, x, ctx: recomputes.append(1) or gather_ref(self, x, ctx))
    got = step(with_bias("emulate"))
    assert recomputes == []
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gathers", [True, False])
@pytest.mark.parametrize("k,round_to,empty", [(2, None, 0), (4, 4, 1)])
def test_fc2_backward_reads_the_tokens_gradient_through_the_index(monkeypatch, gathers, k, round_to, empty):
    """Where the tile policy says so (kernels/tile_policy.py gather_dy; forced here), FC2's fused dgrad and its
    weight gradient read the tokens' gradient (T x d) through the routing index, and the program skips the
    Combine's backward (the copy of dY to every routed row); otherwise the copy is made and both read it. The
    weight-gradient device method is forced into the emulated program, its kernel replaced by torch on the
    operands it is given (a padding row, index -1, reads zeros as the kernel's producer zero-fills it); the fused
    dgrad's emulated kernel reads through the index itself. Every result and gradient is the reference's either
    way, token rounding's padding rows included."""
    from fusion.grouped import linear_wgrad
    from fusion.runtime import steps as S
    from fusion.runtime import wgrad_gemm
    from fusion.runtime.emulate import _gathered

    calls, copies = [], []
    device_method = S._device_method
    combine_grad = Combine.input_grad

    def with_wgrad(op, part, device_kernels):
        return wgrad_gemm if (op.spec.kind, part) == ("gemm", "wgrad") else device_method(op, part, device_kernels)

    def kernel(op, x, dy, ctx, index=None, dy_index=None):
        calls.append(dy_index is not None)
        if dy_index is not None:
            assert dy_index.dtype == torch.int32 and dy.shape[0] == T   # the tokens' gradient, read through the index
            dy = _gathered(dy, dy_index)
        return linear_wgrad(dy, x, op.weight, ctx.group_sizes, ctx.offsets)

    T = 29
    r = routing(T, k, round_to, empty)
    x0 = torch.randn(T, D, dtype=torch.float64)
    ref = run(block("reference"), x0, r, torch.float64)
    monkeypatch.setattr(S, "_device_method", with_wgrad)
    monkeypatch.setattr(S, "gather_dy", lambda G, rows, f: gathers)
    monkeypatch.setattr(wgrad_gemm, "takes", lambda op, x: True)
    monkeypatch.setattr(wgrad_gemm, "gathers", lambda op, rows: False)
    monkeypatch.setattr(wgrad_gemm, "gathers_dy", lambda op, rows: gathers)
    monkeypatch.setattr(wgrad_gemm, "wgrad", kernel)
    monkeypatch.setattr(Combine, "input_grad", lambda self, dy, ctx: copies.append(1) or combine_grad(self, dy, ctx))
    variants = []
    dgrad_kernel = S.FusedDgrad.kernel
    monkeypatch.setattr(S.FusedDgrad, "kernel", lambda self, dtype, variant: variants.append(variant) or
                        dgrad_kernel(self, dtype, variant))
    got = run(block("emulate"), x0, r, torch.float64)
    assert calls == [gathers, False]           # FC2's weight gradient, then FC1's
    assert copies == ([] if gathers else [1])  # the Combine's backward copy only where a reader needs it
    assert variants == ["backward_gather" if gathers else "backward"]
    for name, a, b in zip(["y", "dx", "dprobs", "dW1", "dW2"], ref, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)


def test_fc2_dgrad_alone_reads_through_the_index_when_its_weight_is_frozen(monkeypatch):
    """FC2's weight frozen: its weight gradient does not run, so the fused dgrad is the copy's only reader and reads
    through the index by the rule alone (no device method needed); FC2 with a trained bias keeps the copy (the bias
    gradient sums the routed rows' dY)."""
    from fusion.runtime import steps as S

    copies = []
    combine_grad = Combine.input_grad
    monkeypatch.setattr(S, "gather_dy", lambda G, rows, f: True)
    monkeypatch.setattr(Combine, "input_grad", lambda self, dy, ctx: copies.append(1) or combine_grad(self, dy, ctx))
    T = 31
    r = routing(T, 4, 4, 1)
    x0 = torch.randn(T, D, dtype=torch.float64)
    want, got = [], []
    for backend, out in (("reference", want), ("emulate", got)):
        copies.clear()
        seq = block(backend)
        seq[4].weight.requires_grad_(False)
        x, probs = x0.clone().requires_grad_(), r.probs.detach().to(torch.float64).requires_grad_()
        y = seq(x, index=r.index, group_sizes=r.group_sizes, scale=probs)
        dy = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
        out.extend([y, *torch.autograd.grad(y, [x, probs, seq[1].weight], dy)])
    assert copies == []
    for name, a, b in zip(["y", "dx", "dprobs", "dW1"], want, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)

    def with_bias(backend):
        torch.manual_seed(1)
        return Sequential(Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D, bias=True),
                          Combine(), backend=backend).to(torch.float64)

    # the weight-gradient device method forced in and willing to gather: the trained bias alone keeps the copy
    from fusion.grouped import linear_wgrad
    from fusion.runtime import wgrad_gemm

    device_method = S._device_method
    monkeypatch.setattr(S, "_device_method", lambda op, part, device_kernels: wgrad_gemm
                        if (op.spec.kind, part) == ("gemm", "wgrad") else device_method(op, part, device_kernels))
    monkeypatch.setattr(wgrad_gemm, "takes", lambda op, x: True)
    monkeypatch.setattr(wgrad_gemm, "gathers", lambda op, rows: False)
    monkeypatch.setattr(wgrad_gemm, "gathers_dy", lambda op, rows: True)
    monkeypatch.setattr(wgrad_gemm, "wgrad", lambda op, x, dy, ctx, index=None, dy_index=None:
                        linear_wgrad(dy, x, op.weight, ctx.group_sizes, ctx.offsets))
    want = run(with_bias("reference"), x0, r, torch.float64)
    copies.clear()
    got = run(with_bias("emulate"), x0, r, torch.float64)
    assert copies == [1]
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_compile_builds_the_fc2_dgrad_that_reads_through_the_index():
    """Sequential.compile()'s jobs (fusion/runtime/aot.py) hold FC2's fused dgrad twice: reading the Combine's copy,
    and reading the tokens' gradient through the index (a gathering kernel with the weight read MN-major)."""
    from fusion.kernels.tile_policy import GemmConfig
    from fusion.runtime.aot import plan_jobs

    moe = Sequential(Gather(), GroupLinear(8, 512, 2 * 256), SwiGLU(), Scale(), GroupLinear(8, 256, 512), Combine())
    dgrads = [j for j in plan_jobs(moe, torch.bfloat16) if j.mainloop == "bf16" and j.variant.startswith("backward")]
    assert sorted(j.variant for j in dgrads) == ["backward", "backward_gather"]
    configs = {j.variant: GemmConfig(*j.config) for j in dgrads}
    assert configs["backward_gather"].gather_a and configs["backward_gather"].b_major == "MN"
    assert not configs["backward"].gather_a


def test_compile_builds_a_gathering_dgrad_only_where_the_rule_can_apply(monkeypatch):
    """No "backward_gather" dgrad job where tile_policy.gather_dy never applies: f above DY_GATHER_MAX_F, the switch
    off (FUSION_DY_GATHER=0); an fp8_block FC2 (no kernel reads dY through the index) compiles without either
    gathering FC2 kernel."""
    from fusion.kernels import tile_policy
    from fusion.kernels.tile_policy import WgradConfig
    from fusion.runtime.aot import plan_jobs

    def variants(seq):
        return sorted(j.variant for j in plan_jobs(seq, torch.bfloat16) if j.variant.startswith("backward"))

    wide = tile_policy.DY_GATHER_MAX_F + 256
    assert variants(Sequential(Gather(), GroupLinear(8, 512, 2 * wide), SwiGLU(), Scale(), GroupLinear(8, wide, 512),
                               Combine())) == ["backward"]
    monkeypatch.setattr(tile_policy, "DY_GATHER", False)
    assert variants(Sequential(Gather(), GroupLinear(8, 512, 512), SwiGLU(), Scale(), GroupLinear(8, 256, 512),
                               Combine())) == ["backward"]
    monkeypatch.setattr(tile_policy, "DY_GATHER", True)
    fp8 = Sequential(Gather(), GroupLinear(8, 512, 512, weight_format="fp8_block"), SwiGLU(), Scale(),
                     GroupLinear(8, 256, 512, weight_format="fp8_block"), Combine())
    jobs = plan_jobs(fp8, torch.bfloat16)
    assert jobs and not any(j.variant == "backward_gather" for j in jobs)
    assert not any(WgradConfig(*j.config).gather_a for j in jobs if j.mainloop == "varlen_k")
