"""GPU correctness of the varlen-K grouped GEMM (kernels/varlen_k_gemm.py), the weight gradients' kernel (needs an
sm_90 GPU; skipped otherwise).

    out[g] = A[rows of g].T @ B[rows of g]      (gathered operands: token rows through the index)

Compared per group with a float64 product: imbalanced groups with empty ones (their out[g] must become zeros),
sizes that are not multiples of the 64-row k-step, one-row groups, ragged tile edges (Ma, Nb not multiples of the
tile), NaN in the rows past the last group (never read), and every element of out poisoned first.
"""
import dataclasses

import pytest
import torch
from conftest import hopper_available, moe_block_case

from fusion.kernels.tile_policy import WgradConfig, choose_wgrad_config
from fusion.runtime.compile import KernelJob

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hopper_available(), reason="needs a Hopper (sm_90) GPU")]

DEV = "cuda"

#: (Ma, Nb, G, config): the policy's three tiles, cooperative and pingpong, TMA with and without the CTA pair's
#: multicast (an odd m-tile count: the pair's second CTA computes a tile past Ma), edges and gathers (one gathered
#: operand: it by cp.async, the other by TMA; both gathered: cp.async for both)
CASES = [
    (256, 512, 6, WgradConfig(tile_n=256, stages=4, cluster_m=2)),
    (200, 264, 5, WgradConfig(tile_n=256, stages=4, cluster_m=2)),         # ragged m- and n-tiles, 2 m-tiles
    (392, 264, 5, WgradConfig(tile_n=256, stages=4, cluster_m=2)),         # 4 m-tiles, the last ragged
    (384, 384, 7, WgradConfig(tile_n=192, stages=5, pingpong=True, cluster_m=2)),   # 3 m-tiles: odd
    (264, 456, 6, WgradConfig(tile_n=192, stages=5, pingpong=True, cluster_m=2)),   # ragged 192-column n-tile
    (136, 200, 9, WgradConfig(tile_n=128, stages=6, pingpong=True, cluster_m=2)),
    (256, 320, 4, WgradConfig(tile_n=128, stages=6)),
    (200, 264, 5, WgradConfig(tile_n=256, stages=4)),
    (384, 384, 7, WgradConfig(tile_n=192, stages=5, pingpong=True)),
    (192, 256, 6, WgradConfig(tile_n=256, stages=4, gather_b=True)),
    (320, 192, 5, WgradConfig(tile_n=192, stages=5, pingpong=True, gather_a=True)),
    (128, 136, 8, WgradConfig(tile_n=128, stages=6, pingpong=True, gather_a=True, gather_b=True)),
    (256, 512, 6, WgradConfig(tile_n=256, stages=4, gather_b=True)),
    (200, 264, 5, WgradConfig(tile_n=256, stages=4, gather_b=True)),      # TMA A, a ragged m-tile; cp.async B ragged
    (264, 200, 6, WgradConfig(tile_n=128, stages=6, pingpong=True, gather_a=True)),  # cp.async A ragged, TMA B ragged
    # A gathered, B multicast to a CTA pair on neighbouring m-tiles
    (256, 512, 6, WgradConfig(tile_n=256, stages=4, gather_a=True, cluster_m=2)),
    (264, 200, 6, WgradConfig(tile_n=128, stages=6, pingpong=True, gather_a=True, cluster_m=2)),   # 3 m-tiles: odd
    (384, 384, 7, WgradConfig(tile_n=192, stages=5, pingpong=True, gather_a=True, cluster_m=2)),   # odd, ragged
    # the schedule walking n fastest; 16-byte stores (a quad's 4x4 transpose), ragged n-tiles cutting a 4-chunk run
    (384, 384, 7, WgradConfig(tile_n=192, stages=5, pingpong=True, cluster_m=2, n_fastest=True)),
    (264, 456, 6, WgradConfig(tile_n=192, stages=5, pingpong=True, cluster_m=2, store_bytes=16)),
    (200, 264, 5, WgradConfig(tile_n=256, stages=4, cluster_m=2, n_fastest=True, store_bytes=16)),
    (136, 200, 9, WgradConfig(tile_n=128, stages=6, pingpong=True, store_bytes=16)),
    (136, 200, 9, WgradConfig(tile_n=128, stages=6, pingpong=True, cluster_m=2, store_bytes=16)),   # the policy's
    (264, 200, 6, WgradConfig(tile_n=128, stages=6, pingpong=True, gather_a=True, cluster_m=2, store_bytes=16)),
]


def job(Ma, Nb, G, cfg, dtype="bfloat16") -> KernelJob:
    return KernelJob(step="test", variant="wgrad", source="", config=dataclasses.astuple(cfg), dtype=dtype, N=Nb,
                     K=Ma, G=G, target="sm_90a", mainloop="varlen_k")


def _sizes(G, gen):
    """Imbalanced sizes: one empty group first, one in the middle, a one-row group, the rest 0..300 rows."""
    sizes = torch.randint(0, 300, (G,), generator=gen)
    sizes[0] = 0
    sizes[G // 2] = 0
    sizes[-1] = 1 if G > 2 else sizes[-1]
    return sizes


def _run(Ma, Nb, G, cfg, dtype=torch.bfloat16, seed=0):
    from fusion.kernels.wgrad_api import run_varlen_k_gemm
    from fusion.runtime.compile import load_compiled

    gen = torch.Generator().manual_seed(seed)
    sizes = _sizes(G, gen)
    rows = int(sizes.sum())
    pad = 37                                               # rows past the last group: NaN, never read
    offs = torch.zeros(G + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(sizes, 0)
    T = 97
    index = torch.randint(0, T, (rows + pad,), generator=gen, dtype=torch.int32)
    index[rows:] = -1
    index[:rows][torch.rand(rows, generator=gen) < 0.1] = -1   # padding rows inside the groups: read as zeros
    a_rows = T if cfg.gather_a else rows + pad
    b_rows = T if cfg.gather_b else rows + pad
    A = torch.randn(a_rows, Ma, generator=gen)
    B = torch.randn(b_rows, Nb, generator=gen)
    if not cfg.gather_a:
        A[rows:] = float("nan")
    if not cfg.gather_b:
        B[rows:] = float("nan")
    A, B = A.to(dtype), B.to(dtype)
    padding = (index[:rows] < 0)[:, None]

    def gathered(X):
        return X[index[:rows].long().clamp_min(0)].masked_fill(padding, 0)

    Ag = gathered(A) if cfg.gather_a else A[:rows]
    Bg = gathered(B) if cfg.gather_b else B[:rows]
    want = torch.stack([Ag[offs[g]:offs[g + 1]].double().T @ Bg[offs[g]:offs[g + 1]].double() for g in range(G)])

    comp = load_compiled(job(Ma, Nb, G, cfg, str(dtype).removeprefix("torch.")))
    out = torch.full((G, Ma, Nb), float("nan"), dtype=dtype, device=DEV)
    idx = index.to(DEV) if cfg.gather_a or cfg.gather_b else None
    run_varlen_k_gemm(comp, A.to(DEV), B.to(DEV), offs.to(DEV), out, index=idx)
    got = out.double().cpu()
    return got, want, sizes


@pytest.mark.parametrize("Ma,Nb,G,cfg", CASES, ids=lambda c: str(c) if not isinstance(c, WgradConfig) else
                         f"{c.tile_n}{'pp' if c.pingpong else 'co'}{'-gA' if c.gather_a else ''}"
                         f"{'-gB' if c.gather_b else ''}{'-c2' if c.cluster_m > 1 else ''}"
                         f"{'-nf' if c.n_fastest else ''}{'-st16' if c.store_bytes == 16 else ''}")
def test_varlen_k_matches_float64_per_group(Ma, Nb, G, cfg):
    got, want, sizes = _run(Ma, Nb, G, cfg)
    assert torch.isfinite(got).all(), "an element was not written, or a row past the groups was read"
    for g in torch.nonzero(sizes == 0).flatten().tolist():
        assert (got[g] == 0).all(), f"empty group {g}: its gradient must be zeros"
    err = (got - want).abs().max() / want.abs().max()
    assert err < 1e-2, f"max error {err:.2e} relative to the largest value"
    assert ((got - want).norm() / want.norm()).item() < 4e-3


def test_fp16_and_the_policy_config():
    Ma, Nb, G = 2 * 96, 256, 6
    got, want, _ = _run(Ma, Nb, G, choose_wgrad_config(Ma, Nb, G), dtype=torch.float16, seed=1)
    assert ((got - want).norm() / want.norm()).item() < 2e-3


def test_grouped_wgrad_matches_torch_grouped_mm():
    """The convenience entry against torch._grouped_mm's weight gradient (what the runtime replaces)."""
    from fusion.kernels.wgrad_api import grouped_wgrad

    gen = torch.Generator().manual_seed(2)
    G, Ma, Nb = 8, 256, 512
    sizes = torch.randint(0, 400, (G,), generator=gen)
    ends = torch.cumsum(sizes, 0).to(torch.int32).to(DEV)
    offs = torch.cat([torch.zeros(1, dtype=torch.int32, device=DEV), ends])
    dy = torch.randn(int(sizes.sum()), Ma, generator=gen).to(DEV, torch.bfloat16)
    x = torch.randn(int(sizes.sum()), Nb, generator=gen).to(DEV, torch.bfloat16)
    got = grouped_wgrad(dy, x, offs, G).float()
    want = torch._grouped_mm(dy.t(), x, offs=ends).float()
    assert ((got - want).norm() / want.norm()).item() < 4e-3


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 256), (torch.float16, 256), (torch.bfloat16, 2048)])
def test_training_step_runs_both_weight_gradients_on_the_kernel(monkeypatch, dtype, d):
    """A block's training step on Hopper: both GroupLinear weight gradients come from the varlen-K kernel (counted:
    a silent fallback to torch._grouped_mm would compare torch with torch) and match the reference backend's.
    d = 2048: FC1's gradient (Nb = 2048) at about 300 rows per group takes the tile policy's pingpong 128x192 tile
    (its wide tile is 128x256)."""
    import copy

    from fusion import GroupLinear, Scale, Sequential, SwiGLU
    from fusion.runtime import wgrad_gemm

    calls = []
    real = wgrad_gemm.wgrad
    monkeypatch.setattr(wgrad_gemm, "wgrad",
                        lambda op, x, dy, ctx, **kw: calls.append(op) or real(op, x, dy, ctx, **kw))
    E, f = 6, 192
    gen = torch.Generator().manual_seed(3)
    sizes = _sizes(E, gen) * 3
    rows = int(sizes.sum())
    block = Sequential(GroupLinear(E, d, 2 * f), SwiGLU(), Scale(), GroupLinear(E, f, d)).to(DEV, dtype)
    ref = copy.deepcopy(block)
    ref.backend = "reference"
    x = torch.randn(rows, d, generator=gen).to(DEV, dtype)
    scale = torch.rand(rows, generator=gen).to(DEV, dtype)
    dy = torch.randn(rows, d, generator=gen).to(DEV, dtype)
    grads = []
    for b in (block, ref):
        b(x, group_sizes=sizes.to(DEV), scale=scale).backward(dy)
        grads.append([p.grad.double() for p in b.parameters()])
    assert [id(op) for op in calls] == [id(block[3]), id(block[0])], "the weight gradients did not use the kernel"
    if d == 2048:
        assert wgrad_gemm._config(block[0], rows).pingpong and wgrad_gemm._config(block[0], rows).tile_n == 192
        assert not wgrad_gemm._config(block[0], None).pingpong
    for got, want in zip(*grads):
        assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("gather_in_kernel", [True, False])
def test_moe_fc1_weight_gradient_reads_the_tokens_through_the_index(monkeypatch, gather_in_kernel):
    """An MoE experts block at >= WGRAD_GATHER_ROWS rows per expert (d = 256: the 128x256 tile): FC1's weight
    gradient reads x through the routing index (the kernel's TMA + cp.async producer), so the gather kernel runs
    once (the Combine's backward), not twice (no regathered x); with the rule off, twice. Every gradient matches
    the reference backend's either way."""
    from fusion.kernels import tile_policy
    from fusion.runtime import gather as gather_method
    from fusion.runtime import wgrad_gemm

    monkeypatch.setattr(tile_policy, "WGRAD_GATHER", gather_in_kernel)
    monkeypatch.setattr(tile_policy, "DY_GATHER", False)   # FC2's dY through the index: tests/test_dy_gather_gpu.py
    gathers, indexed = [], []
    real_gather, real_wgrad = gather_method.run, wgrad_gemm.wgrad
    monkeypatch.setattr(gather_method, "run", lambda op, x, ctx: gathers.append(1) or real_gather(op, x, ctx))
    monkeypatch.setattr(wgrad_gemm, "wgrad", lambda op, x, dy, ctx, index=None:
                        indexed.append(index is not None) or real_wgrad(op, x, dy, ctx, index=index))
    block, ref, x, r, dy = moe_block_case(5)     # 2048 routed rows per expert on average
    assert int(r.group_sizes.min()) >= tile_policy.WGRAD_GATHER_ROWS
    grads = []
    for b in (block, ref):
        xg = x.clone().requires_grad_()
        b(xg, index=r.index, group_sizes=r.group_sizes, scale=r.probs.detach()).backward(dy)
        grads.append([xg.grad.double()] + [p.grad.double() for p in b.parameters()])
    assert indexed == [False, gather_in_kernel], indexed      # FC2's gradient, then FC1's
    assert len(gathers) == (1 if gather_in_kernel else 2), gathers
    for got, want in zip(*grads):
        assert ((got - want).norm() / want.norm()).item() < 1e-2
