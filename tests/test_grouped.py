"""Reference grouped matmul against an independent per-row formulation, incl. empty and ragged groups."""
import pytest
import torch

from fusion.grouped import group_offsets, grouped_matmul, row_group_index


def per_row_reference(x, w, sizes):
    """Independent formulation: every row multiplies its own group's weight (gathered per row)."""
    idx = row_group_index(sizes, x.shape[0])
    return torch.einsum("mk,mnk->mn", x, w[idx])


@pytest.mark.parametrize("sizes", [[5, 0, 7, 3], [0, 0, 0, 4], [1], [0, 9], [3, 0]])
def test_forward_matches_per_row(sizes):
    sizes = torch.tensor(sizes)
    x = torch.randn(int(sizes.sum()), 6, dtype=torch.float64)
    w = torch.randn(len(sizes), 5, 6, dtype=torch.float64)
    torch.testing.assert_close(grouped_matmul(x, w, sizes), per_row_reference(x, w, sizes))


def test_gradcheck_float64_with_empty_group():
    sizes = torch.tensor([3, 0, 4])
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: grouped_matmul(a, b, sizes), (x, w))


def test_wgrad_of_empty_group_is_zero():
    sizes = torch.tensor([2, 0])
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(2, 4, 3, requires_grad=True)
    grouped_matmul(x, w, sizes).sum().backward()
    assert torch.all(w.grad[1] == 0)
    assert w.grad[0].abs().sum() > 0


def test_offsets_are_cumulative_int32():
    off = group_offsets(torch.tensor([2, 0, 3]))
    assert off.dtype == torch.int32 and off.tolist() == [2, 2, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_close_to_float64(dtype):
    sizes = torch.tensor([4, 0, 12])
    x = torch.randn(16, 32)
    w = torch.randn(3, 8, 32)
    ref = per_row_reference(x.double(), w.double(), sizes)
    out = grouped_matmul(x.to(dtype), w.to(dtype), sizes).double()
    assert ((out - ref).norm() / ref.norm()) < 1e-2


def _vendor_calls(monkeypatch):
    """Record which vendor GEMM the "grouped_mm" method calls (torch._grouped_mm or a dense matmul), answering with
    the per-row reference so the call itself needs no GPU."""
    import fusion.grouped as grouped

    calls = []

    def fake_grouped_mm(a, b, offs):
        calls.append("grouped_mm")
        raise AssertionError("a one-group GroupLinear must not reach torch._grouped_mm")

    monkeypatch.setattr(grouped.torch, "_grouped_mm", fake_grouped_mm)
    return grouped, calls


def test_one_group_runs_the_dense_matmul(monkeypatch):
    """A GroupLinear of one group on the vendor path (method "grouped_mm", a Hopper GPU's) is a dense layer: its
    forward, input gradient and weight gradient are torch's dense matmul (cuBLAS, measured faster than the grouped
    kernel on the dense blocks), the same numbers as the per-row formulation. Fails if the one-group branch is gone
    (torch._grouped_mm is called) or computes anything else."""
    grouped, calls = _vendor_calls(monkeypatch)
    sizes = torch.tensor([9])
    offsets = group_offsets(sizes)
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 5, 6, dtype=torch.float64, requires_grad=True)
    y = grouped_matmul(x, w, sizes, offsets, method="grouped_mm")
    dy = torch.randn_like(y)
    y.backward(dy)
    assert calls == []
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    yr = per_row_reference(xr, wr, sizes)
    yr.backward(dy)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    # the runtime's direct calls (no autograd): the lone forward and the FP8 path's bf16 weight gradient
    torch.testing.assert_close(grouped.grouped_forward(x.detach(), w.detach(), offsets), yr.detach())
    torch.testing.assert_close(grouped.grouped_wgrad(dy, x.detach(), offsets, w.shape), wr.grad)


def test_dense_mm_switch_off_takes_the_grouped_kernel(monkeypatch):
    """DENSE_MM = False (the A/B's other setting) sends one group to torch._grouped_mm again; several groups always
    go there."""
    grouped, calls = _vendor_calls(monkeypatch)
    x, sizes = torch.randn(4, 8), torch.tensor([4])
    monkeypatch.setattr(grouped, "DENSE_MM", False)
    with pytest.raises(AssertionError):
        grouped.grouped_forward(x, torch.randn(1, 3, 8), group_offsets(sizes))
    monkeypatch.setattr(grouped, "DENSE_MM", True)
    with pytest.raises(AssertionError):
        grouped.grouped_forward(x, torch.randn(2, 3, 8), group_offsets(torch.tensor([2, 2])))
    assert calls == ["grouped_mm", "grouped_mm"]
