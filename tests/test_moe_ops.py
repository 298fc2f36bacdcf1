"""Gather and Combine: against loops, gradcheck, determinism, and their validation inside a Sequential."""
import pytest
import torch

import fusion
from fusion import (Combine, ExtraInputError, Gather, GroupLinear, GroupSizesError, Scale, Sequential,
                    ShapeError, SwiGLU)
from fusion.moe import combine, gather, token_layout

T, D = 7, 5


def index_with_padding():
    return torch.tensor([3, 0, 6, 3, -1, 2, 0, 3, 5, -1, -1])


def test_gather_matches_loop():
    x = torch.randn(T, D, dtype=torch.float64)
    index = index_with_padding()
    y = gather(x, index)
    for i, t in enumerate(index.tolist()):
        assert torch.equal(y[i], x[t] if t >= 0 else torch.zeros(D, dtype=x.dtype))


def test_padding_rows_are_zero_even_when_x_holds_nan():
    x = torch.randn(T, D)
    x[0] = float("nan")
    y = gather(x, torch.tensor([-1, 1]))
    assert torch.equal(y[0], torch.zeros(D))


def test_combine_matches_loop_in_increasing_row_order():
    y = torch.randn(11, D, dtype=torch.float64)
    index = index_with_padding()
    out = combine(y, index, T)
    assert out.shape == (T, D)
    for t in range(T):
        want = torch.zeros(D, dtype=y.dtype)
        for i, tok in enumerate(index.tolist()):  # sequential, increasing i: the documented order
            if tok == t:
                want = want + y[i]
        assert torch.equal(out[t], want), t  # bitwise: same order of additions


def test_combine_skips_padding_rows_holding_nan():
    y = torch.randn(11, D)
    index = index_with_padding()
    y[index == -1] = float("nan")
    assert torch.isfinite(combine(y, index, T)).all()


def test_combine_low_precision_accumulates_in_float32():
    y = torch.randn(64, D).bfloat16()
    index = torch.zeros(64, dtype=torch.long)
    assert torch.equal(combine(y, index, 1), y.float().sum(0, keepdim=True).bfloat16())


def test_token_layout():
    index = index_with_padding()
    rows, offsets = token_layout(index, T)
    assert offsets.tolist()[-1] == index.numel() and offsets.numel() == T + 2
    for t in range(T + 1):
        want = [i for i, tok in enumerate(index.tolist()) if (tok if tok >= 0 else T) == t]
        assert rows[offsets[t]:offsets[t + 1]].tolist() == want


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gradcheck_gather_and_combine(dtype):
    index = index_with_padding().to(dtype)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    y = torch.randn(11, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: gather(a, index), (x,))
    assert torch.autograd.gradgradcheck(lambda a: gather(a, index), (x,))
    assert torch.autograd.gradcheck(lambda a: combine(a, index, T), (y,))
    assert torch.autograd.gradgradcheck(lambda a: combine(a, index, T), (y,))


def test_gather_backward_is_a_combine_and_combine_backward_a_gather():
    index = index_with_padding()
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(11, D, dtype=torch.float64)
    (dx,) = torch.autograd.grad(gather(x, index), x, dy)
    assert torch.equal(dx, combine(dy, index, T))
    y = torch.randn(11, D, dtype=torch.float64, requires_grad=True)
    dt = torch.randn(T, D, dtype=torch.float64)
    (dyy,) = torch.autograd.grad(combine(y, index, T), y, dt)
    assert torch.equal(dyy, gather(dt, index))


def test_combine_is_bitwise_deterministic():
    y = torch.randn(4096, 64)
    index = torch.randint(-1, 300, (4096,))
    assert torch.equal(combine(y, index, 300), combine(y, index, 300))


# -- inside a Sequential -------------------------------------------------------------------------------------
E, F = 3, 4


def experts(dtype=torch.float64):
    return Sequential(Gather(), GroupLinear(E, D, 2 * F, dtype=dtype), SwiGLU(), Scale(),
                      GroupLinear(E, F, D, dtype=dtype), Combine())


def routed(padding=0):
    """11 routed rows of 7 tokens in 3 groups (4, 0, 7 - padding), the last `padding` rows padding."""
    index = torch.tensor([0, 2, 4, 6, 1, 2, 3, 4, 5, 6, 0])
    if padding:
        index[-padding:] = -1
    sizes = torch.tensor([4, 0, 7 - padding], dtype=torch.int32)
    probs = torch.rand(11, dtype=torch.float64)
    return index, sizes, probs


def loop_reference(block, x, index, sizes, probs):
    w1, w2 = block[1].weight, block[4].weight
    y = torch.zeros_like(x)
    g = torch.repeat_interleave(torch.arange(E), sizes.long())
    for i, (t, e) in enumerate(zip(index.tolist(), g.tolist())):
        if t < 0:
            continue
        h = w1[e] @ x[t]
        y[t] = y[t] + (w2[e] @ (torch.nn.functional.silu(h[:F]) * h[F:])) * probs[i]
    return y


@pytest.mark.parametrize("padding", [0, 3])
def test_experts_block_forward_and_gradients(padding):
    block = experts()
    index, sizes, probs = routed(padding)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    probs.requires_grad_()
    y = block(x, index=index, group_sizes=sizes, scale=probs)
    assert y.shape == (T, D)
    torch.testing.assert_close(y, loop_reference(block, x, index, sizes, probs))
    assert torch.autograd.gradcheck(lambda a, p: block(a, index=index, group_sizes=sizes, scale=p), (x, probs))
    if padding:
        (dp,) = torch.autograd.grad(block(x, index=index, group_sizes=sizes, scale=probs).sum(), probs)
        assert (dp[-padding:] == 0).all()


def test_gather_alone_returns_routed_rows():
    x = torch.randn(T, D)
    index = index_with_padding()
    assert torch.equal(Gather()(x, index=index), gather(x, index))
    assert torch.equal(Sequential(Gather(), Scale())(x, index=index, scale=torch.ones(11)), gather(x, index))


def test_misplaced_gather_or_combine():
    x = torch.randn(T, D, dtype=torch.float64)
    index, sizes, probs = routed()
    with pytest.raises(ShapeError, match="must be the first op"):
        Sequential(Scale(), Gather())(x, index=index, scale=torch.ones(T, dtype=x.dtype))
    with pytest.raises(ShapeError, match="must be the last op"):
        Sequential(Gather(), Combine(), Scale())(x, index=index, scale=torch.ones(11, dtype=x.dtype))
    with pytest.raises(ShapeError, match="needs a Gather"):
        Sequential(Scale(), Combine())(x, index=index, scale=torch.ones(T, dtype=x.dtype))
    with pytest.raises(ShapeError, match="needs a Gather"):
        Combine()(x, index=index)


def test_bad_index():
    block = experts()
    x = torch.randn(T, D, dtype=torch.float64)
    index, sizes, probs = routed()
    cases = [
        (index.float(), ExtraInputError, "int32 or int64"),
        (index.view(1, -1), ExtraInputError, "1-D"),
        (index.tolist(), ExtraInputError, "int tensor"),
        (torch.where(index == 6, 7, index), ExtraInputError, r"must lie in \[-1, 7\)"),
        (torch.where(index == 6, -2, index), ExtraInputError, r"must lie in \[-1, 7\)"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            block(x, index=bad, group_sizes=sizes, scale=probs)
    with pytest.raises(ExtraInputError, match="missing keyword input 'index'"):
        block(x, group_sizes=sizes, scale=probs)
    with pytest.raises(ExtraInputError, match=r"shape \(11,\) \(one value per routed row"):
        block(x, index=index, group_sizes=sizes, scale=probs[:T])


def test_bad_group_sizes_with_gather():
    block = experts()
    x = torch.randn(T, D, dtype=torch.float64)
    index, sizes, probs = routed()
    with pytest.raises(GroupSizesError, match="sums to 12 but index has 11"):
        block(x, index=index, group_sizes=sizes + torch.tensor([1, 0, 0], dtype=torch.int32), scale=probs)
    with pytest.raises(GroupSizesError, match="must be padding"):
        block(x, index=index, group_sizes=sizes - torch.tensor([0, 0, 2], dtype=torch.int32), scale=probs)
    with pytest.raises(GroupSizesError, match="negative"):
        block(x, index=index, group_sizes=torch.tensor([5, -1, 7], dtype=torch.int32), scale=probs)


@pytest.mark.gpu
def test_experts_block_on_cuda_checks_without_sync():
    block = experts(torch.float32).cuda()
    index, sizes, probs = (t.cuda() for t in routed(2))
    x = torch.randn(T, D, device="cuda")
    block(x, index=index, group_sizes=sizes, scale=probs.float())
    from fusion.sequential import make_context

    torch.cuda.set_sync_debug_mode("error")
    try:
        make_context(block.ops, x, {"index": index, "group_sizes": sizes, "scale": probs.float()}, check_sum=False)
        combine(x[index.clamp_min(0)], index, T)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_exports():
    assert fusion.Gather is Gather and fusion.Combine is Combine and fusion.moe.route is not None
    assert {"Gather", "Combine", "MoE", "moe"} <= set(fusion.__all__)


def test_gather_and_combine_compile_without_graph_breaks():
    index = index_with_padding()
    x = torch.randn(T, D, requires_grad=True)

    def roundtrip(a):
        return combine(gather(a, index) * 2, index, T)

    compiled = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")
    got, want = compiled(x), roundtrip(x)
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])


def test_routed_context_is_the_device_checked_context_of_routes_outputs():
    """BlockInputs.routed_context (the merged MoE node's inputs, made by route's kernels) gives the RunContext that
    context() gives for them with the checks left to the device, and declines (None) where context() would raise:
    probs in another dtype than x, another group count, a block that reads other inputs."""
    from fusion.moe import route
    from fusion.runtime import runner_for

    E, d, f, k = 4, 16, 8, 2
    block = Sequential(Gather(), GroupLinear(E, d, 2 * f), SwiGLU(), Scale(name="probs"), GroupLinear(E, f, d),
                       Combine())
    x = torch.randn(T, d)
    r = route(torch.randn(T, E), k)
    inputs = runner_for(block, x).seq.inputs
    got = inputs.routed_context(x, r.index, r.group_sizes, "probs", r.probs)
    want = inputs.context(x, {"index": r.index, "group_sizes": r.group_sizes, "probs": r.probs}, check_sum=False,
                          host=False, device_checked=True)
    assert got == want and got.group_sizes is r.group_sizes and got.routed_group_sizes is r.group_sizes
    assert got.index is r.index and got.extra["probs"] is r.probs and got.tokens == T and got.offsets is None
    assert inputs.routed_context(x, r.index, r.group_sizes, "probs", r.probs.double()) is None
    with pytest.raises(fusion.DTypeError):
        inputs.context(x, {"index": r.index, "group_sizes": r.group_sizes, "probs": r.probs.double()},
                       check_sum=False, host=False, device_checked=True)
    assert inputs.routed_context(x, r.index, torch.ones(E + 1, dtype=torch.int32), "probs", r.probs) is None
    assert inputs.routed_context(x, r.index, r.group_sizes, "scale", r.probs) is None
