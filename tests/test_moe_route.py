"""fusion.moe.route against a per-token Python reference: scores, bias, normalize, k, ties, empty experts,
token rounding and its padding rows; no host sync; torch.compile(fullgraph=True)."""
import pytest
import torch

from fusion import DTypeError, ShapeError
from fusion.moe import capacity, combine, gather, route
from moe_reference import ref_route


def check_against_reference(logits, k, **kw):
    r = route(logits, k, **kw)
    index, expert, probs, sizes = ref_route(logits, k, kw.get("score", "softmax"), kw.get("bias"),
                                            kw.get("normalize", True), kw.get("round_to"))
    assert r.index.tolist() == index
    assert r.expert.tolist() == expert
    assert r.group_sizes.dtype == torch.int32 and r.group_sizes.tolist() == sizes
    assert r.probs.dtype == logits.dtype
    torch.testing.assert_close(r.probs, probs.to(logits.dtype), rtol=1e-12, atol=1e-15)
    T = logits.shape[0]
    assert r.index.numel() == capacity(T, logits.shape[1], k, kw.get("round_to"))
    # the per-token layout lists every non-padding row of each token, in increasing row order
    for t in range(T):
        rows = r.rows_by_token[r.token_offsets[t]:r.token_offsets[t + 1]].tolist()
        assert rows == [i for i, tok in enumerate(index) if tok == t]
    return r


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_route_matches_per_token_reference(score, normalize, k):
    logits = torch.randn(37, 16, dtype=torch.float64)
    check_against_reference(logits, k, score=score, normalize=normalize)


def test_selection_bias_changes_choice_not_probabilities():
    logits = torch.randn(40, 8, dtype=torch.float64)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[3] = 10.0  # every token picks expert 3
    r = check_against_reference(logits, 2, score="sigmoid", bias=bias, normalize=False)
    assert r.group_sizes[3] == 40
    rows = r.expert == 3
    torch.testing.assert_close(r.probs[rows], torch.sigmoid(logits[:, 3]))  # prob is the score, without bias


def test_token_layout_is_built_when_first_read_not_by_route():
    """route() leaves the per-token table to its first reader (an experts block's Combine builds its own): a sort
    of the M rows fewer per routing call."""
    r = route(torch.randn(30, 8, dtype=torch.float64), 2)
    assert "_token_layout" not in r.__dict__
    rows = r.rows_by_token
    assert r.__dict__["_token_layout"][0] is rows and r.rows_by_token is rows   # built once, then kept


def test_large_expert_count_and_empty_experts():
    logits = torch.randn(64, 256, dtype=torch.float64)
    logits[:, 200:] -= 100  # experts 200.. never chosen: empty groups
    r = check_against_reference(logits, 8)
    assert (r.group_sizes[200:] == 0).all() and r.group_sizes.sum() == 64 * 8
    # past 256 experts the sort keys no longer fit in one byte (uint8 -> int16 keys)
    check_against_reference(torch.randn(48, 300, dtype=torch.float64), 4)


def test_ties_go_to_the_lower_expert_and_keep_token_order():
    logits = torch.randint(0, 3, (50, 12)).double()  # many exactly equal scores
    check_against_reference(logits, 4)
    check_against_reference(logits, 4, round_to=8)
    check_against_reference(torch.zeros(9, 6, dtype=torch.float64), 3, round_to=4)


@pytest.mark.parametrize("round_to", [1, 4, 5, 16, 64])
@pytest.mark.parametrize("normalize", [True, False])
def test_token_rounding_matches_reference(round_to, normalize):
    logits = torch.randn(45, 10, dtype=torch.float64) * 2
    r = check_against_reference(logits, 3, round_to=round_to, normalize=normalize)
    sizes = r.group_sizes.long()
    capped = sizes == 45
    assert ((sizes % round_to == 0) | capped).all()
    total = int(sizes.sum())
    assert (r.index[total:] == -1).all() and (r.probs[total:] == 0).all() and (r.expert[total:] == -1).all()
    assert (r.index[:total] >= 0).all()


def test_rounding_directions():
    """Counts 5, 1, 0. R=4: 5 rounds down to 4 (drops the lowest prob), 1 rounds down to 0. R=2: 5 and 1
    are exact halves and round up to 6 and 2 (adding the best tokens not yet routed there)."""
    T = 6
    logits = torch.full((T, 3), -5.0, dtype=torch.float64)
    probs0 = [3, 2, 1, 4, 5, -9]
    for t in range(T):  # k=1: token t picks one expert
        logits[t, 0] = probs0[t]
    logits[5, 1] = 1.0  # token 5 -> expert 1 ...
    # tokens 0..4 -> expert 0 (5 rows); token 5 -> expert 1 (1 row); expert 2 empty
    r = route(logits, 1, normalize=False, round_to=4)
    assert r.group_sizes.tolist() == [4, 0, 0]
    assert r.index[:4].tolist() == [0, 1, 3, 4]  # token 2 (lowest prob) dropped
    r = route(logits, 1, normalize=False, round_to=2)
    assert r.group_sizes.tolist() == [6, 2, 0]  # 5 -> 6 (exact half: up, adds token 5), 1 -> 2 (half: up)
    assert r.index[:6].tolist() == [0, 1, 2, 3, 4, 5]
    # expert 1 adds the other token with the highest softmax prob for it: token 2 (smallest row maximum)
    assert r.index[6:8].tolist() == [2, 5]


def test_rounding_up_is_capped_at_the_token_count():
    logits = torch.randn(5, 4, dtype=torch.float64)
    r = check_against_reference(logits, 2, round_to=8)
    assert (r.group_sizes <= 5).all()


def test_probs_are_differentiable():
    logits = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    for kw in ({}, {"normalize": False}, {"score": "sigmoid"}, {"round_to": 4}):
        assert torch.autograd.gradcheck(lambda z: route(z, 3, **kw).probs, (logits,))
        index, expert, probs, _ = ref_route(logits, 3, kw.get("score", "softmax"), None,
                                            kw.get("normalize", True), kw.get("round_to"))
        w = torch.randn(len(index), dtype=torch.float64)
        (g,) = torch.autograd.grad((route(logits, 3, **kw).probs * w).sum(), logits)
        (g_ref,) = torch.autograd.grad((probs * w).sum(), logits)
        torch.testing.assert_close(g, g_ref)


def test_low_precision_logits_route_in_float32():
    logits = torch.randn(30, 16)
    r = route(logits.bfloat16(), 4)
    assert r.probs.dtype == torch.bfloat16
    r32 = route(logits.bfloat16().float(), 4)
    assert torch.equal(r.index, r32.index)
    torch.testing.assert_close(r.probs, r32.probs.bfloat16())


def test_route_is_deterministic():
    logits = torch.randn(200, 32)
    a, b = route(logits, 8, round_to=16), route(logits, 8, round_to=16)
    for field in ("index", "group_sizes", "probs", "expert", "rows_by_token", "token_offsets"):
        assert torch.equal(getattr(a, field), getattr(b, field))


def test_route_never_reads_device_data_on_the_host(monkeypatch):
    """A stand-in for CUDA's sync check on the CPU: every Tensor -> host conversion raises inside route."""
    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in route")

    logits = torch.randn(33, 16, requires_grad=True)
    bias = torch.randn(16)
    for name in ("item", "tolist", "cpu", "nonzero", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    route(logits, 4, bias=bias)
    r = route(logits, 4, score="sigmoid", round_to=8)
    combine(gather(torch.randn(33, 6), r.index), r.index, 33)


@pytest.mark.parametrize("round_to,backend", [(None, "aot_eager"), (8, "inductor")])
def test_route_compiles_without_graph_breaks(round_to, backend):
    logits = torch.randn(64, 16)
    compiled = torch.compile(lambda z: route(z, 4, round_to=round_to), fullgraph=True, backend=backend)
    got, want = compiled(logits), route(logits, 4, round_to=round_to)
    for field in ("index", "group_sizes", "expert", "rows_by_token", "token_offsets"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    torch.testing.assert_close(got.probs, want.probs)


def test_bad_arguments_name_the_problem():
    logits = torch.randn(4, 8)
    with pytest.raises(ShapeError, match="k must be"):
        route(logits, 9)
    with pytest.raises(ShapeError, match="2-D"):
        route(logits[0], 2)
    with pytest.raises(DTypeError):
        route(logits.long(), 2)
    with pytest.raises(ShapeError, match="bias"):
        route(logits, 2, bias=torch.zeros(7))
    with pytest.raises(ValueError, match="round_to"):
        route(logits, 2, round_to=0)
    with pytest.raises(ValueError, match="score"):
        route(logits, 2, score="relu")


@pytest.mark.gpu
def test_route_on_cuda_does_not_sync():
    logits = torch.randn(512, 64, device="cuda")
    route(logits, 8, round_to=128)  # warm up (lazy init may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        r = route(logits, 8, round_to=128)
        r2 = route(logits, 8)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(r.index.cpu(), route(logits.cpu(), 8, round_to=128).index)
    assert torch.equal(r2.group_sizes.cpu(), route(logits.cpu(), 8).group_sizes)
