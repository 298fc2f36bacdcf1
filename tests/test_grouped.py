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
