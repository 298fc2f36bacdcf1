"""GPU: padding rows (index -1) read as zeros by every gathering kernel, and an MoE block's FC2 backward reading the
tokens' gradient through the routing index (no Combine-backward copy of dY per routed row).

The padding rows of token rounding lie inside the last group: the kernels compute them. The reference gathers zeros
there, so each gathering producer zero-fills a row whose index is -1 (kernels/gather_producer.py, varlen_k_gemm.py).
End to end the padding rows' probabilities are 0, which hides a wrong row from every gradient, so the kernels are
checked here one by one: each output row of a padding row must be exactly what a zero input row gives.
"""
import dataclasses
import importlib

import pytest
import torch
from conftest import hopper_available, moe_block_case

import fusion.kernels as K
from fusion.kernels.tile_policy import tile_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hopper_available(), reason="needs a Hopper (sm_90) GPU")]

DEV = "cuda"


def _routing(T, G, M, gen, holes=0.1):
    """(offsets (G+1,) int32, index (M,) int32) on the GPU: M routed rows in G ragged groups (one empty), tokens
    drawn from T, about `holes` of the rows padding (-1) and the last 40 rows too (token rounding's tail)."""
    cuts = torch.sort(torch.randint(0, M + 1, (G - 1,), generator=gen)).values
    offs = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([M])])
    offs[2] = offs[1]                                   # group 1 empty
    index = torch.randint(0, T, (M,), generator=gen, dtype=torch.int32)
    index[torch.rand(M, generator=gen) < holes] = -1
    index[-40:] = -1
    return offs.to(torch.int32).to(DEV), index.to(DEV)


def _gathered(X, index):
    """X's rows through index, zeros at -1: what the reference's gathered copy holds."""
    return X[index.long().clamp_min(0)].masked_fill((index < 0)[:, None], 0)


def test_forward_gather_reads_zeros_at_padding_rows():
    """FC1's gathering kernel (SwiGLU * scale epilogue on a gated weight): a padding row's output is the
    epilogue of a zero accumulator (0), where reading token 0 would give a non-zero row; the other rows match the
    kernel run on the gathered copy bit for bit."""
    gen = torch.Generator().manual_seed(0)
    T, G, M, d, f = 300, 6, 1200, 256, 128
    offs, index = _routing(T, G, M, gen)
    x = torch.randn(T, d, generator=gen).to(DEV, torch.bfloat16)
    W = (torch.randn(G, 2 * f, d, generator=gen) / d ** 0.5).to(DEV, torch.bfloat16)
    scale = torch.rand(M, generator=gen).to(DEV) + 0.5
    epi = K.SwiGLUScaleEpilogue()
    gathering = K.compile_grouped_gemm(K.GemmConfig(*tile_config(2 * f, d, G, True, "K", False, gather=True)), epi,
                                       "bfloat16", 2 * f, d, G)
    in_order = K.compile_grouped_gemm(dataclasses.replace(gathering.config, gather_a=False), epi, "bfloat16",
                                      2 * f, d, G)
    got = torch.full((M, f), float("nan"), dtype=torch.bfloat16, device=DEV)
    want = torch.full((M, f), float("nan"), dtype=torch.bfloat16, device=DEV)
    K.run_grouped_gemm(gathering, x, W, offs, {"out": got}, {"scale": scale}, index=index)
    K.run_grouped_gemm(in_order, _gathered(x, index).contiguous(), W, offs, {"out": want}, {"scale": scale})
    torch.cuda.synchronize()
    assert got[index < 0].eq(0).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("f,d,G", [(256, 512, 6), (192, 256, 5), (320, 384, 4)])
def test_fc2_dgrad_reads_dy_through_the_index(f, d, G):
    """FC2's fused dgrad with d(SwiGLU * scale) (the row sums of d(scale) too) reading dY (T, d) through the index,
    the weight (G, d, f) as stored (MN-major), at the tile the runtime asks for: against float64 on the zero-filled
    copy; a padding row's d(pre-activation) and d(scale) exactly 0."""
    gen = torch.Generator().manual_seed(f)
    T, M = 500, 2000
    offs, index = _routing(T, G, M, gen)
    dY = torch.randn(T, d, generator=gen).to(DEV, torch.bfloat16)
    W2 = (torch.randn(G, d, f, generator=gen) / d ** 0.5).to(DEV, torch.bfloat16)
    pre = torch.randn(M, 2 * f, generator=gen).to(DEV, torch.bfloat16)
    scale = torch.rand(M, generator=gen).to(DEV)
    config = K.GemmConfig(*tile_config(f, d, G, False, "MN", True, gather=True))
    assert config.gather_a and config.b_major == "MN"
    comp = K.compile_grouped_gemm(config, _DSwiGLURowSum(), "bfloat16", f, d, G)
    parts = -(-f // 32)
    dpre = torch.full((M, 2 * f), float("nan"), dtype=torch.bfloat16, device=DEV)
    partials = torch.full((M, parts), float("nan"), dtype=torch.float32, device=DEV)
    K.run_grouped_gemm(comp, dY, W2, offs, {"dpre": dpre, "dscale": partials}, {"pre": pre, "scale": scale},
                       index=index)
    torch.cuda.synchronize()
    pad = index < 0
    assert dpre[pad].eq(0).all() and partials[pad].eq(0).all()
    dYg = _gathered(dY, index).double()
    dh = torch.empty(M, f, dtype=torch.float64, device=DEV)
    bounds = offs.tolist()
    for g in range(G):
        dh[bounds[g]:bounds[g + 1]] = dYg[bounds[g]:bounds[g + 1]] @ W2[g].double()
    g_, u = pre.double().chunk(2, -1)
    s = torch.sigmoid(g_)
    dhs = dh * scale.double()[:, None]
    want = torch.cat([dhs * u * (s + g_ * s * (1 - s)), dhs * g_ * s], -1)
    assert ((dpre.double() - want).norm() / want.norm()).item() < 1e-2
    terms = torch.nn.functional.pad(dh * g_ * s * u, (0, parts * 32 - f)).view(M, parts, 32).sum(-1)
    assert ((partials.double() - terms).norm() / terms.norm()).item() < 1e-2


class _DSwiGLURowSum(K.Epilogue):
    """dH = dY @ W2[g]; reads pre = [g | u]; writes dpre = [d_gate | d_up] and d(scale)'s row sums (float32
    partials per 32 columns), as the runtime's generated FC2 dgrad epilogue declares them."""
    gated = False
    inputs = (K.AuxInput("pre", paired=True), K.RowVector("scale"))
    outputs = (K.Output("dpre", paired=True), K.RowSumOutput("dscale"))

    def apply(self, dy, g, u, scale):
        em = importlib.import_module(K.__name__ + ".epi_math")
        sig = em.sigmoid(g)
        silu = g * sig
        return dy * scale * u * (sig + silu * (1.0 - sig)), dy * scale * silu, dy * silu * u


@pytest.mark.parametrize("dy_gather", [True, False])
def test_moe_fc2_backward_reads_the_tokens_gradient_through_the_index(monkeypatch, dy_gather):
    """An MoE experts block at >= WGRAD_GATHER_ROWS rows per expert with token rounding (padding rows): FC2's fused
    dgrad and weight gradient read dY through the routing index, so the gather kernel never runs (FC1's weight
    gradient reads x through the index too); with the rule off the Combine's backward copy runs once. Every
    gradient matches the reference backend's either way."""
    from fusion.kernels import tile_policy
    from fusion.runtime import gather as gather_method
    from fusion.runtime import wgrad_gemm
    from fusion.runtime.kernel import LAUNCHES

    monkeypatch.setattr(tile_policy, "DY_GATHER", dy_gather)
    gathers, dy_indexed = [], []
    real_gather, real_wgrad = gather_method.run, wgrad_gemm.wgrad
    monkeypatch.setattr(gather_method, "run", lambda op, x, ctx: gathers.append(1) or real_gather(op, x, ctx))
    monkeypatch.setattr(wgrad_gemm, "wgrad", lambda op, x, dy, ctx, index=None, dy_index=None:
                        dy_indexed.append(dy_index is not None) or
                        real_wgrad(op, x, dy, ctx, index=index, dy_index=dy_index))
    block, ref, x, r, dy = moe_block_case(7, round_to=128)
    assert int((r.index < 0).sum()) > 0 and int(r.group_sizes.min()) >= tile_policy.WGRAD_GATHER_ROWS
    grads = []
    LAUNCHES.reset()
    for b in (block, ref):
        xg = x.clone().requires_grad_()
        probs = r.probs.detach().requires_grad_()
        b(xg, index=r.index, group_sizes=r.group_sizes, scale=probs).backward(dy)
        grads.append([xg.grad.double(), probs.grad.double()] + [p.grad.double() for p in b.parameters()])
    assert dy_indexed == [dy_gather, False], dy_indexed     # FC2's gradient, then FC1's
    assert len(gathers) == (0 if dy_gather else 1), gathers
    assert sum(n for step, n in LAUNCHES.by_step.items() if step.startswith("B")) == 1   # the fused dgrad ran
    for got, want in zip(*grads):
        assert ((got - want).norm() / want.norm().clamp_min(1e-30)).item() < 1e-2
