"""The lone-GEMM device method on a Hopper GPU (fusion/runtime/lone_gemm.py): a GroupLinear's unfused forward and
dgrad run our varlen-M kernel where the rule says (few rows per group, N a multiple of 128 or 192) and
torch._grouped_mm elsewhere; both compute the GEMM. A spy on the module's run/dgrad tells which ran (a silent fallback would
compare torch with itself)."""
import pytest
import torch

import fusion
from fusion import GroupLinear, Scale, SwiGLU
from fusion.runtime import lone_gemm
from test_fused_gpu import ragged_sizes, rel, run_both  # noqa: F401  (its autouse fixture: Hopper + poison)
from test_fused_gpu import _hopper_and_poison  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.fixture
def spy(monkeypatch):
    calls = {"run": 0, "dgrad": 0}
    for name in calls:
        real = getattr(lone_gemm, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(lone_gemm, name, counted)
    return calls


def _block(E, d, f, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return fusion.Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d)).to("cuda", dtype)


def _inputs(E, M, d, dtype, seed=0):
    sizes = ragged_sizes(E, M, seed=seed).cuda()
    x = torch.randn(M, d, device="cuda", dtype=dtype)
    probs = torch.rand(M, device="cuda", dtype=dtype)
    return x, {"group_sizes": sizes, "scale": probs}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("E,d,f,M", [(8, 256, 256, 3000), (16, 512, 384, 4099), (4, 128, 256, 1),
                                     (8, 2880, 256, 3001)])   # d = 2880 (GPT-OSS): the wide tile, a partial last n-tile
def test_few_rows_per_group_run_our_kernel(spy, E, d, f, M, dtype):
    """FC2's forward and FC1's dgrad on the varlen-M kernel (ragged groups, empty ones, unaligned M), the block's
    outputs and gradients as the reference's."""
    block = _block(E, d, f, dtype)
    x, extras = _inputs(E, M, d, dtype)
    (y, g), (y_ref, g_ref) = run_both(block, x, extras)
    assert spy == {"run": 1, "dgrad": 1}, spy
    if lone_gemm.WIDE_TILE and d == 2880:
        for op, part in ((block[3], "forward"), (block[0], "dgrad")):
            cfg = lone_gemm._kernel(op, part, dtype).config
            assert (cfg.tile_n, cfg.cluster_n, cfg.dynamic) == (256, 2, True), (part, cfg)
    assert rel(y, y_ref) < 1e-2
    for name, ref in g_ref.items():
        assert ref is None or rel(g[name], ref) < 2e-2, name


def test_many_rows_per_group_run_torch(spy):
    E, d, f = 2, 256, 256
    M = 2 * lone_gemm.MAX_ROWS_PER_GROUP["forward"] + 8
    block = _block(E, d, f)
    x, extras = _inputs(E, M, d, torch.bfloat16)
    (y, g), (y_ref, g_ref) = run_both(block, x, extras)
    assert spy == {"run": 0, "dgrad": 0}, spy
    assert rel(y, y_ref) < 1e-2 and rel(g["x"], g_ref["x"]) < 2e-2


def test_dgrad_threshold_is_lower(spy):
    """600 rows per group: FC2's forward on our kernel (<= 1024), FC1's dgrad on torch's (> 512); both correct."""
    E, d, f = 4, 256, 256
    block = _block(E, d, f)
    x, extras = _inputs(E, 600 * E, d, torch.bfloat16)
    (y, g), (y_ref, g_ref) = run_both(block, x, extras)
    assert spy == {"run": 1, "dgrad": 0}, spy
    assert rel(y, y_ref) < 1e-2 and rel(g["x"], g_ref["x"]) < 2e-2


@pytest.mark.parametrize("wide_tile,E,rows_per_group,expect", [
    (False, 34, 400, {"run": 1, "dgrad": 0}),    # 34 groups (no dynamic pairs): 400 x 4096 outputs, over the dgrad's budget
    (False, 34, 600, {"run": 0, "dgrad": 0}),    # 600 x 4096: over the forward's budget too
    (False, 8, 1000, {"run": 1, "dgrad": 0}),    # 8 groups: dynamic CTA pairs, the forward's rows cap alone
    (True, 34, 400, {"run": 1, "dgrad": 1}),     # the wide tile (N >= 2560): its rows caps alone
    (True, 34, 600, {"run": 1, "dgrad": 1}),
    (True, 8, 1000, {"run": 1, "dgrad": 1}),
])
def test_the_output_budget_sends_large_groups_of_wide_gemms_to_torch(spy, monkeypatch, wide_tile, E, rows_per_group,
                                                                      expect):
    """N = 4096 (FC2's output, FC1's input): without the wide tile a group's output over LONE_GEMM_RULE's budget runs
    torch, unless the tile runs as dynamic CTA pairs; with it (FUSION_LONE_WIDE, on by default) the 128x256 pairs
    take them. The spy tells which ran, and the block is correct either way."""
    from fusion.kernels import tile_policy

    monkeypatch.setattr(lone_gemm, "WIDE_TILE", wide_tile)
    monkeypatch.setattr(lone_gemm, "OUTPUT_BUDGET", True)
    monkeypatch.setattr(tile_policy, "DYNAMIC_PAIRS", True)
    d, f = 4096, 256
    M = rows_per_group * E
    assert lone_gemm.chooses_kernel(M, E, d, f, "forward") is bool(expect["run"])
    assert lone_gemm.chooses_kernel(M, E, d, 2 * f, "dgrad") is bool(expect["dgrad"])
    block = _block(E, d, f)
    x, extras = _inputs(E, M, d, torch.bfloat16)
    (y, g), (y_ref, g_ref) = run_both(block, x, extras)
    assert spy == expect, spy
    if expect["run"]:
        assert (lone_gemm._kernel(block[3], "forward", torch.bfloat16).config.tile_n == 256) is wide_tile
    assert rel(y, y_ref) < 1e-2 and rel(g["x"], g_ref["x"]) < 2e-2


def test_widths_off_the_rule_run_torch(spy):
    """d = 2000: FC2's output and FC1's input width are no multiple of 128 or 192."""
    block = _block(4, 2000, 256)
    x, extras = _inputs(4, 1000, 2000, torch.bfloat16)
    (y, _), (y_ref, _) = run_both(block, x, extras)
    assert spy == {"run": 0, "dgrad": 0}, spy
    assert rel(y, y_ref) < 1e-2


@pytest.mark.parametrize("d_in,d_out", [(384, 640), (1408, 2560)])   # the second: the wide tile both ways
@pytest.mark.parametrize("part", ["forward", "dgrad"])
def test_the_kernel_is_the_grouped_gemm(part, d_in, d_out):
    """The device method alone against a float64 per-group product, with empty groups and NaN-poisoned output
    rows past the groups' rows never read."""
    from fusion.run_context import RunContext

    E, M = 8, 2500
    op = GroupLinear(E, d_in, d_out).to("cuda", torch.bfloat16)
    n, k = (d_out, d_in) if part == "forward" else (d_in, d_out)
    wide = lone_gemm.runs_wide_tile(n, k, E)
    assert wide is (lone_gemm.WIDE_TILE and d_out == 2560)
    sizes = ragged_sizes(E, M, seed=3).cuda()
    ctx = RunContext(group_sizes=sizes)
    a = torch.randn(M, d_in if part == "forward" else d_out, device="cuda", dtype=torch.bfloat16)
    assert lone_gemm.takes(op, a)
    out = lone_gemm.run(op, a, ctx) if part == "forward" else lone_gemm.dgrad(op, a, ctx)
    torch.cuda.synchronize()
    assert (lone_gemm._kernel(op, part, torch.bfloat16).config.tile_n == 256) is wide
    w = op.weight.double()
    ref, r = [], 0
    for g, n in enumerate(sizes.tolist()):
        ref.append(a[r:r + n].double() @ (w[g].T if part == "forward" else w[g]))
        r += n
    ref = torch.cat(ref)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert rel(out, ref) < 5e-3


@pytest.mark.parametrize("round_to", [None, 128])
def test_moe_layer_runs_our_kernel_and_matches_the_reference(spy, round_to):
    """fusion.MoE (Gather -> FC1 -> SwiGLU -> Scale -> FC2 -> Combine; 128 routed rows per expert): FC2's forward and
    FC1's dgrad on the varlen-M kernel, reading the routed block's bounds (with token rounding the padding rows
    sit in the last group); output and every gradient as the reference backend's."""
    import copy

    from fusion import Combine, Gather, MoE

    T, D, F, E, K = 512, 256, 128, 16, 4
    torch.manual_seed(0)
    experts = fusion.Sequential(Gather(), GroupLinear(E, D, 2 * F), SwiGLU(), Scale(), GroupLinear(E, F, D),
                                Combine())
    moe = MoE(D, E, k=K, experts=experts, round_to=round_to).to("cuda", torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    ref = copy.deepcopy(moe)
    ref.experts.backend = "reference"
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    outs = []
    for model in (moe, ref):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(dy)
        outs.append([y, xi.grad] + [p.grad for p in model.parameters()])
    assert spy == {"run": 1, "dgrad": 1}, spy
    for i, (a, b) in enumerate(zip(*outs)):
        assert rel(a, b) < 2e-2, (i, rel(a, b))


@pytest.mark.parametrize("M", [lone_gemm.DENSE_DGRAD_MIN_ROWS, lone_gemm.DENSE_DGRAD_MIN_ROWS + 77])
def test_a_dense_dgrad_at_many_rows_runs_our_128x256_kernel(spy, M):
    """One group (a dense block): FC1's dgrad on our kernel at 128x256 cooperative tiles from 8192 rows (d = 512, a
    multiple of 256), FC2's forward on torch's; the gradients as the reference's."""
    block = _block(1, 512, 256)
    x, extras = _inputs(1, M, 512, torch.bfloat16)
    (y, g), (y_ref, g_ref) = run_both(block, x, extras)
    assert spy == {"run": 0, "dgrad": 1}, spy
    assert lone_gemm._kernel(block[0], "dgrad", torch.bfloat16).config.tile_n == 256
    assert rel(y, y_ref) < 1e-2
    for name, ref in g_ref.items():
        assert ref is None or rel(g[name], ref) < 2e-2, name


def test_one_group_runs_cublas_dense_matmul(spy, monkeypatch):
    """A dense block written with one-group GroupLinears: its unfused GEMMs (FC2's forward, FC1's dgrad below the
    dense-dgrad rows, both weight gradients) run torch's dense matmul, never torch._grouped_mm nor our varlen-K
    kernel (fusion.grouped.DENSE_MM, fusion.op_table.WGRAD_RULE), in the fused run and the reference's; outputs and
    gradients as the reference's, and the fused kernels launched (run_both asserts it)."""
    from fusion.runtime import wgrad_gemm

    grouped_mm_calls, wgrad_calls = [], []
    real_grouped_mm, real_wgrad = torch._grouped_mm, wgrad_gemm.wgrad
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: grouped_mm_calls.append(1) or real_grouped_mm(*a, **k))
    monkeypatch.setattr(wgrad_gemm, "wgrad", lambda *a, **k: wgrad_calls.append(1) or real_wgrad(*a, **k))
    torch.manual_seed(0)
    d, f, M = 512, 768, 3001
    block = fusion.Sequential(GroupLinear(1, d, 2 * f), SwiGLU(), GroupLinear(1, f, d)).to("cuda", torch.bfloat16)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    (y, g), (y_ref, g_ref) = run_both(block, x, {"group_sizes": torch.tensor([M], device="cuda")})
    assert spy == {"run": 0, "dgrad": 0}, spy
    assert wgrad_calls == [], "a one-group weight gradient must not run the varlen-K kernel"
    assert grouped_mm_calls == [], "a one-group GEMM must not run torch._grouped_mm"
    assert rel(y, y_ref) < 1e-2
    for name, ref in g_ref.items():
        assert ref is None or rel(g[name], ref) < 2e-2, name
