"""Per-group columnwise blocks (MXFP8, NVFP4, FP8-block): layout, partial blocks, zero-size groups, no sync."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _quant_slow import BLOCKS, reference_columnwise
from fusion import GroupLinear, QuantizeFP8Block, QuantizeMXFP8, QuantizeNVFP4, Sequential
from fusion.quant import QuantizationError, QuantizedTensor, columnwise_blocks, columnwise_capacity, quantize

FORMATS = ["mxfp8", "nvfp4", "fp8_block"]
OPS = {"mxfp8": QuantizeMXFP8, "nvfp4": QuantizeNVFP4, "fp8_block": QuantizeFP8Block}


def features(fmt):
    return 32 if fmt != "fp8_block" else 20


def data_of(x, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*x, generator=g) * torch.exp(torch.randn(x[0], 1, generator=g) * 3)


def test_capacity_and_block_index_hand_computed():
    # B = 4, groups [5, 0, 3, 4]: group 0 has blocks 0, 1 (rows 0-3, row 4), group 1 none, group 2 block 2
    # (rows 5-7), group 3 block 3 (rows 8-11); capacity ceil(12/4) + 4 = 7, blocks 4..6 unused
    assert columnwise_capacity(12, 4, 4) == 7
    b = columnwise_blocks(12, 4, torch.tensor([5, 0, 3, 4]), "cpu")
    assert b.capacity == 7
    assert b.row_block.tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 3]
    assert b.used.tolist() == [True] * 4 + [False] * 3
    one = columnwise_blocks(10, 4, None, "cpu")            # no groups: one group
    assert one.capacity == 3 + 1 and one.row_block.tolist() == [0] * 4 + [1] * 4 + [2] * 2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes", [None, [40], [17, 0, 33, 0], [0, 0, 70], [1, 1, 1, 67], [300]])
def test_columnwise_matches_group_by_group_reference(fmt, sizes):
    M = 70 if sizes is None else sum(sizes)
    x = data_of((M, features(fmt)), seed=M)
    x[3, 1] = float("nan")
    x[M - 1, 2] = float("-inf")
    x[5:9, 4] = 0.0
    gs = None if sizes is None else torch.tensor(sizes)
    q = quantize(x, fmt, group_sizes=gs)
    data, scale = reference_columnwise(fmt, x, sizes)
    G = 1 if sizes is None else len(sizes)
    assert q.columnwise_scale.shape == (-(-M // BLOCKS[fmt]) + G, x.shape[1])
    assert q.columnwise_scale.is_contiguous() and q.columnwise_data.is_contiguous()
    assert torch.equal(q.columnwise_data, data)
    assert torch.equal(q.columnwise_scale, scale)           # includes the zero tail (unused capacity)
    # the columnwise dequantization is the logical tensor (NaN where NaN / Inf were; NVFP4 poisons the block)
    d = q.dequantize(columnwise=True)
    assert d.shape == x.shape and type(d) is torch.Tensor
    assert d[3, 1].isnan() and d[M - 1, 2].isnan()
    clean = torch.where(x.isfinite(), x, torch.zeros_like(x))
    d = quantize(clean, fmt, group_sizes=gs).dequantize(columnwise=True)
    amax = clean.abs().max().item()
    if fmt == "nvfp4":  # E2M1 rounding: a quarter of max(|x|, block scale), the block scale <= amax / 6 (+ 2^-4)
        assert ((d - clean).abs() <= 0.25 * torch.maximum(clean.abs(), torch.tensor(amax / 6 * 1.07))).all()
    else:  # 2^-4 relative in E4M3's normal range, half a subnormal step (<= 2^-9 amax / 448) below it
        assert ((d - clean).abs() <= 2.0 ** -4 * clean.abs() + 2.0 ** -9 * amax / 448).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_never_straddle_groups(fmt):
    # a huge value in group 0 must not change the scale of group 1's first block, though the two share a
    # B-row window of the tensor
    K = features(fmt)
    x = torch.full((20, K), 1e-3)
    x[0] = 1e4
    q = quantize(x, fmt, group_sizes=torch.tensor([3, 17]))
    # the same 17 rows as the first group of a tensor with the same amax (NVFP4's global scale)
    ref = quantize(torch.cat([x[3:], x[:1]]), fmt, group_sizes=torch.tensor([17, 1]))
    n = -(-17 // BLOCKS[fmt])
    assert torch.equal(q.columnwise_scale[1:1 + n], ref.columnwise_scale[:n])
    assert torch.equal(q.dequantize(columnwise=True)[3:], ref.dequantize(columnwise=True)[:17])
    if fmt != "nvfp4":  # (NVFP4's global scale from 1e4 flushes 1e-3 anyway)
        # a block shared with the 1e4 row would have flushed 1e-3 to zero (scale 2^5)
        assert torch.allclose(q.dequantize(columnwise=True)[3:], x[3:], rtol=2.0 ** -4, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_rows(fmt):
    K = features(fmt)
    q = quantize(torch.zeros(0, K), fmt, group_sizes=torch.tensor([0, 0, 0]))
    assert q.columnwise_scale.shape == (3, K) and (q.columnwise_scale == 0).all()
    assert q.columnwise_data.shape[0] == K and q.columnwise_data.shape[1] == 0
    assert q.dequantize(columnwise=True).shape == (0, K)
    q1 = quantize(torch.zeros(0, K), fmt)
    assert q1.columnwise_scale.shape == (1, K)


@pytest.mark.parametrize("fmt", FORMATS)
def test_group_sizes_validation(fmt):
    x = torch.randn(8, features(fmt))
    with pytest.raises(QuantizationError, match="1-D int32/int64"):
        quantize(x, fmt, group_sizes=torch.tensor([4.0, 4.0]))
    with pytest.raises(QuantizationError, match="1-D int32/int64"):
        quantize(x, fmt, group_sizes=[4, 4])
    assert quantize(x, fmt, group_sizes=torch.tensor([4, 4], dtype=torch.int32)).columnwise_scale.shape[0] == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_old_layout_is_refused(fmt):
    q = quantize(torch.randn(64, 32), fmt)
    with pytest.raises(QuantizationError, match="k-block-major"):
        QuantizedTensor(fmt, q.data, q.scale, q.amax, q.shape, q.dtype, columnwise_data=q.columnwise_data,
                        columnwise_scale=q.columnwise_scale.t().contiguous())


@pytest.mark.parametrize("fmt", FORMATS)
def test_rowwise_ignores_groups_and_grouping_needs_no_host_copy(fmt, monkeypatch):
    x = data_of((50, features(fmt)), seed=3)
    gs = torch.tensor([20, 30])

    def no_sync(*_, **__):
        raise AssertionError("group_sizes read on the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    q = quantize(x, fmt, group_sizes=gs)
    d = q.dequantize(columnwise=True)
    monkeypatch.undo()
    assert torch.equal(q.data, quantize(x, fmt).data) and q.group_sizes is gs and d.shape == x.shape


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_op_reads_group_sizes_from_the_block(fmt):
    K = 64 if fmt != "fp8_block" else 130
    block = Sequential(GroupLinear(3, 32, K), OPS[fmt](), backend="reference")
    x = torch.randn(37, 32)
    gs = torch.tensor([10, 0, 27])
    q = block(x, group_sizes=gs)
    assert isinstance(q, QuantizedTensor) and q.group_sizes is gs
    assert q.columnwise_scale.shape == (-(-37 // BLOCKS[fmt]) + 3, K)
    y = block[0](x, group_sizes=gs).detach()
    assert torch.equal(q.columnwise_scale, quantize(y, fmt, group_sizes=gs).columnwise_scale)
    # a dense block has no group_sizes: one group
    dense = OPS[fmt]()(torch.randn(37, K))
    assert dense.group_sizes is None and dense.columnwise_scale.shape[0] == -(-37 // BLOCKS[fmt]) + 1


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(FORMATS), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
       seed=st.integers(0, 2 ** 16))
def test_property_group_sizes(fmt, sizes, seed):
    M = sum(sizes)
    x = data_of((M, features(fmt)), seed=seed) if M else torch.zeros(0, features(fmt))
    q = quantize(x, fmt, group_sizes=torch.tensor(sizes))
    data, scale = reference_columnwise(fmt, x, sizes)
    assert torch.equal(q.columnwise_data, data) and torch.equal(q.columnwise_scale, scale)
