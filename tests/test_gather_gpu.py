"""GPU correctness of the gather-A grouped GEMM (needs an sm_90 GPU; skipped otherwise).

Routed row r of group g multiplies token x[index[r]]: compared with torch (x[index] @ W[g].T per group, then the
epilogue) in float64, on imbalanced groups with empty ones, tokens routed several times, an index longer than the
routed rows (-1 padding past them) and ragged K; output rows past the groups must stay untouched.
"""
import dataclasses

import pytest
import torch
from conftest import hopper_available

pytestmark = pytest.mark.gpu


if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import fusion.kernels as K  # noqa: E402
from fusion.kernels.tile_policy import n_tile_count, tile_config  # noqa: E402

DEV = "cuda"
POISON = 12345.0  # no result of these inputs comes near it (exact in bf16)


def _routing(T, G, topk, pad, gen):
    """(group sizes (G,), index (rows + pad,) int32): every token sent to `topk` distinct groups, the routed rows
    sorted by group (so tokens repeat across groups), imbalanced sizes, some groups empty, then `pad` rows of
    -1."""
    live = G - max(1, G // 4)                                   # G // 4 groups get no rows
    weights = torch.rand(live, generator=gen) ** 3 + 0.01       # skewed
    choice = torch.stack([torch.multinomial(weights, topk, generator=gen) for _ in range(T)])  # (T, topk)
    ids = torch.randperm(G, generator=gen)[:live]               # the empty groups anywhere, not only last
    groups = ids[choice].flatten()
    order = torch.argsort(groups, stable=True)
    index = (order // topk).to(torch.int32)
    sizes = torch.bincount(groups, minlength=G)
    index = torch.cat([index, torch.full((pad,), -1, dtype=torch.int32)])
    return sizes, index


def _reference(x, W, sizes, index):
    """x[index[r]] @ W[g].T for the routed rows, float64."""
    rows = int(sizes.sum())
    xg = x[index[:rows].long()].double()
    out, r = [], 0
    for g, n in enumerate(sizes.tolist()):
        out.append(xg[r:r + n] @ W[g].double().T)
        r += n
    return torch.cat(out, 0)


def _close(x, ref, tol=1e-2):
    x = x.double()
    assert torch.isfinite(x).all()
    rms = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    bad = (x - ref).abs() > tol * (ref.abs() + rms)
    assert not bad.any(), f"{bad.sum().item()} elements off, first at {bad.nonzero()[0].tolist()}"
    assert ((x - ref).norm() / ref.norm()).item() < tol / 2


def _run(epi, T, G, N, Kd, topk, pad, extras_fn, dynamic=True, cluster_m=1, gather_tma=False, cluster_n=1):
    gen = torch.Generator().manual_seed(1234 + N + Kd)
    x = torch.randn(T, Kd, generator=gen).to(DEV, torch.bfloat16)
    W = (torch.randn(G, N, Kd, generator=gen) / Kd ** 0.5).to(DEV, torch.bfloat16)
    sizes, index = _routing(T, G, topk, pad, gen)
    sizes, index = sizes.to(DEV), index.to(DEV)
    M = index.numel()
    rows = int(sizes.sum())
    offs = K.offsets_from_group_sizes(sizes)
    config = K.GemmConfig(*tile_config(N, Kd, G, epi.gated, "K", False, gather=True))
    config = dataclasses.replace(config, dynamic=dynamic, cluster_m=cluster_m, cluster_n=cluster_n,
                                 gather_tma=gather_tma)
    if cluster_n == 2 and n_tile_count(N, config.tile_n) % 2:
        pytest.skip("a pair along n needs an even n-tile count")
    comp = K.compile_grouped_gemm(config, epi, "bfloat16", N, Kd, G)
    assert comp.config.gather_a and comp.config.dynamic == dynamic and comp.config.cluster_m == cluster_m
    assert comp.config.gather_tma == gather_tma and comp.config.cluster_n == cluster_n
    n_out = N // 2 if epi.gated else N
    out = torch.full((M, n_out), POISON, dtype=torch.bfloat16, device=DEV)
    extras = extras_fn(M, gen)
    K.run_grouped_gemm(comp, x, W, offs, {"out": out}, extras, index=index)
    torch.cuda.synchronize()
    assert (out[rows:] == POISON).all(), "rows past the groups were written"
    return out[:rows], _reference(x, W, sizes.cpu(), index), extras, rows


SCHEDULES = pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
#: single CTAs, and CTA pairs on neighbouring m-tiles sharing B's tile by multicast (each gathers its own A rows;
#: a group with an odd m-tile count leaves rank 1 a tile past its rows, which must store nothing); and single CTAs
#: loading A's rows by one TMA box each (GemmConfig.gather_tma: padding rows and rows past the group by an
#: out-of-bounds row, which TMA zero-fills), alone and as CTA pairs along n, each CTA loading half the rows
#: multicast to both
CLUSTERS = pytest.mark.parametrize("cluster_m,gather_tma,cluster_n", [(1, False, 1), (2, False, 1), (1, True, 1),
                                                                      (1, True, 2)],
                                   ids=["single", "m-pairs", "tma-rows", "tma-rows-n-pairs"])


@SCHEDULES
@CLUSTERS
@pytest.mark.parametrize("N,Kd,T", [(384, 512, 700), (200, 520, 700), (384, 256, 9000)])
def test_gather_identity(N, Kd, T, dynamic, cluster_m, gather_tma, cluster_n):
    """Plain grouped GEMM on gathered rows; (200, 520): partial n-tile and a ragged last k-tile (zero fill);
    T = 9000: 27000 routed rows, many more tiles than CTAs (each CTA walks several, from the counter when
    dynamic)."""
    out, ref, _, _ = _run(K.IdentityEpilogue(), T=T, G=12, N=N, Kd=Kd, topk=3, pad=77,
                          extras_fn=lambda M, gen: None, dynamic=dynamic, cluster_m=cluster_m,
                          gather_tma=gather_tma, cluster_n=cluster_n)
    _close(out, ref)


@SCHEDULES
@CLUSTERS
@pytest.mark.parametrize("N,Kd", [(512, 1024), (4096, 256)])
def test_gather_swiglu_scale(N, Kd, dynamic, cluster_m, gather_tma, cluster_n):
    """Gated FC1 on gathered rows: silu(gate) * up * scale[r] per routed row ((4096, 256): the 128x192 tile); as
    m-pairs each CTA multicasts half of both the gate and the up box."""
    def extras(M, gen):
        return {"scale": torch.rand(M, generator=gen).to(DEV)}

    out, ref, ext, rows = _run(K.SwiGLUScaleEpilogue(), T=600, G=10, N=N, Kd=Kd, topk=2, pad=33,
                               extras_fn=extras, dynamic=dynamic, cluster_m=cluster_m, gather_tma=gather_tma,
                               cluster_n=cluster_n)
    gate, up = ref[:, :N // 2], ref[:, N // 2:]
    expect = gate * torch.sigmoid(gate) * up * ext["scale"][:rows].double()[:, None]
    _close(out, expect)


def test_gather_matches_the_kernel_on_a_pregathered_a():
    """The same tile configuration on x[index] (TMA path) gives the same bits on the routed rows."""
    gen = torch.Generator().manual_seed(7)
    T, G, N, Kd = 500, 6, 384, 512      # the gather kernel of test_gather_identity's first case
    x = torch.randn(T, Kd, generator=gen).to(DEV, torch.bfloat16)
    W = (torch.randn(G, N, Kd, generator=gen) / Kd ** 0.5).to(DEV, torch.bfloat16)
    sizes, index = _routing(T, G, 2, 0, gen)
    offs = K.offsets_from_group_sizes(sizes.to(DEV))
    index = index.to(DEV)
    config = K.GemmConfig(*tile_config(N, Kd, G, False, "K", False, gather=True))
    gathered = K.compile_grouped_gemm(config, K.IdentityEpilogue(), "bfloat16", N, Kd, G)
    in_order = K.compile_grouped_gemm(K.GemmConfig(*tile_config(N, Kd, G, False, "K", False)),
                                      K.IdentityEpilogue(), "bfloat16", N, Kd, G)
    a = torch.empty(index.numel(), N, dtype=torch.bfloat16, device=DEV)
    b = torch.empty_like(a)
    K.run_grouped_gemm(gathered, x, W, offs, {"out": a}, index=index)
    K.run_grouped_gemm(in_order, x[index.long()].contiguous(), W, offs, {"out": b})
    torch.cuda.synchronize()
    assert torch.equal(a, b)


@pytest.mark.parametrize("cluster_n", [1, 2], ids=["single", "n-pairs"])
@pytest.mark.parametrize("N,Kd,pad", [(384, 512, 0), (512, 520, 41), (4096, 256, 17)])
def test_gather_tma_rows_match_cp_async_bitwise(N, Kd, pad, cluster_n):
    """A's rows by one TMA box each (gather_tma; alone and as a pair along n) against the cp.async gathering kernel
    at the same tile: the same bits on every row (the same products in the same order), with padding rows (-1) inside the last group and a
    ragged last k-tile: the TMA kernel's out-of-bounds rows read zeros as cp.async's zero-filled ones do."""
    gen = torch.Generator().manual_seed(11 + N)
    T, G = 700, 9
    gated = N == 4096
    epi = K.SwiGLUScaleEpilogue() if gated else K.IdentityEpilogue()
    x = torch.randn(T, Kd, generator=gen).to(DEV, torch.bfloat16)
    W = (torch.randn(G, N, Kd, generator=gen) / Kd ** 0.5).to(DEV, torch.bfloat16)
    sizes, index = _routing(T, G, 3, pad, gen)
    sizes[-1] += pad                     # the padding rows (-1) inside the last group, as token rounding leaves them
    offs = K.offsets_from_group_sizes(sizes.to(DEV))
    index = index.to(DEV)
    extras = {"scale": torch.rand(index.numel(), generator=gen).to(DEV)} if gated else None
    config = dataclasses.replace(K.GemmConfig(*tile_config(N, Kd, G, gated, "K", False, gather=True)), cluster_m=1)
    outs = []
    if cluster_n == 2 and n_tile_count(N, config.tile_n) % 2:
        pytest.skip("a pair along n needs an even n-tile count")
    for tma in (False, True):
        variant = dataclasses.replace(config, gather_tma=tma, cluster_n=cluster_n if tma else 1)
        comp = K.compile_grouped_gemm(variant, epi, "bfloat16", N, Kd, G)
        out = torch.full((index.numel(), N // 2 if gated else N), POISON, dtype=torch.bfloat16, device=DEV)
        K.run_grouped_gemm(comp, x, W, offs, {"out": out}, extras, index=index)
        outs.append(out)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    if pad:
        assert (outs[1][-pad:] == 0).all(), "a padding row reads zeros"
