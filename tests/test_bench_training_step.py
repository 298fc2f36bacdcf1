"""bench/bench_training_step.py's CPU parts: which blocks `--models` selects (the held-out ones among them) and the
group sizes that `--sigma` spreads; bench/ab_switch.py's round order."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import ab_switch  # noqa: E402
import bench_training_step as B  # noqa: E402
import bench_wgrad  # noqa: E402


def test_held_out_blocks_are_none_of_the_tuned_ones():
    tuned = {b.model for b in B.BLOCKS}
    held = {b.model for b in B.HELD_OUT_BLOCKS}
    assert held and not tuned & held
    # Mistral-7B has Llama-3-8B's weight shapes, at half its rows: no (shapes, rows) pair repeats
    assert {(b.E, b.d, b.f, b.rows) for b in B.HELD_OUT_BLOCKS}.isdisjoint({(b.E, b.d, b.f, b.rows) for b in B.BLOCKS})


def test_select_blocks():
    assert B.select_blocks(None) == B.BLOCKS
    assert B.select_blocks("held-out") == B.HELD_OUT_BLOCKS
    assert [b.model for b in B.select_blocks("glm-4.5-air,qwen3-30b-a3b")] == ["qwen3-30b-a3b", "glm-4.5-air"]
    with pytest.raises(SystemExit, match="unknown"):
        B.select_blocks("qwen3-30b-a3b,no-such-model")


def test_the_kernel_benches_hold_the_held_out_shapes():
    for b in B.HELD_OUT_BLOCKS:
        if b.moe:
            assert bench_wgrad.SHAPES[b.model] == (b.E, b.d, b.f, b.tokens, b.top_k)


@pytest.mark.parametrize("block", [b for b in B.BLOCKS + B.HELD_OUT_BLOCKS if b.moe], ids=lambda b: b.model)
def test_group_sizes_route_every_row_and_sigma_spreads_them(block):
    def sizes(**kw):   # the multinomial draw takes torch's global generator: setup_block seeds it
        torch.manual_seed(0)
        return B.group_sizes(block, **kw)

    balanced, default, wide = sizes(sigma=0.0), sizes(), sizes(sigma=1.2)
    for s in (balanced, default, wide):
        assert s.shape == (block.E,) and int(s.sum()) == block.rows and int(s.min()) >= 0
    assert (default == sizes(sigma=B.SIGMA)).all()      # the default is SIGMA
    assert balanced.float().std() < default.float().std() < wide.float().std()


def test_ab_rounds_alternate_after_a_warm_up():
    orders = ab_switch.round_orders(4)
    assert len(orders) == 5 and all(sorted(o) == [False, True] for o in orders)
    kept = orders[1:]
    assert [o[0] for o in kept] == [True, False, True, False]   # each setting goes first in half the kept rounds


@pytest.mark.parametrize("dense", [False, True])
def test_unfused_fullgraph_is_unfused_compileds_math(dense):
    """Path unfused_fullgraph (the unfused block compiled whole, fusion_compiled's partner) computes what
    unfused_compiled computes: forward and every gradient, on the CPU (torch._grouped_mm runs there). Dense blocks
    are one group without the router scale, as the bench builds them."""
    from fusion import GroupLinear, Scale, Sequential, SwiGLU

    torch.manual_seed(0)
    E, d, f, rows = (1 if dense else 4), 32, 48, 64
    ops = [GroupLinear(E, d, 2 * f), SwiGLU()] + ([] if dense else [Scale()]) + [GroupLinear(E, f, d)]
    seq = Sequential(*ops).bfloat16()   # (torch._grouped_mm's meta function takes bf16 only)
    sizes = torch.tensor([rows]) if dense else torch.tensor([16, 0, 32, rows - 48])
    offsets = torch.cumsum(sizes, 0).to(torch.int32)
    probs = None if dense else torch.rand(rows, dtype=torch.bfloat16, requires_grad=True)
    x, dy = torch.randn(rows, d, dtype=torch.bfloat16), torch.randn(rows, d, dtype=torch.bfloat16)
    got = []
    for cls in (B.UnfusedCompiledPath, B.UnfusedFullgraphPath):
        path = cls(seq, offsets, probs)
        xg = x.clone().requires_grad_()
        y = path.forward(xg)
        grads = torch.autograd.grad(y, [xg, *path.params] + ([probs] if probs is not None else []), dy)
        got.append([y.detach(), *grads])
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
