"""GroupLinear / Linear with weight_format="fp8_block": the FP8-block recipe reference, forward and backward."""

import pytest
import torch

import fusion
from fusion import GroupLinear, Linear, QuantizeFP8Block, QuantizeMXFP8, Sequential, SwiGLU
from fusion.ops.linear import WeightFormatError
from fusion.quant import (fp8_block_dequantize_2d, fp8_block_dequantize_columnwise, fp8_block_quantize_2d,
                          fp8_block_quantize_columnwise, quantize, quantize_weight_fp8_block)
from fusion.quant import fp8_linear


def rowwise(t):
    return fp8_block_dequantize_2d(*fp8_block_quantize_2d(t.float()))


def columnwise(t, gs):
    return fp8_block_dequantize_columnwise(*fp8_block_quantize_columnwise(t.float(), gs), gs)


def manual(x, w, gs, dy, wgrad_bf16=False):
    """The recipe written out group by group: (y, dx, dw) in float32."""
    wq = quantize_weight_fp8_block(w).dequantize()
    xr, dyr = rowwise(x), rowwise(dy)
    xc, dyc = columnwise(x, gs), columnwise(dy, gs)
    ys, dxs, dws = [], [], []
    start = 0
    for g, n in enumerate(gs.tolist()):
        rows = slice(start, start + n)
        ys.append(xr[rows] @ wq[g].T)
        dxs.append(dyr[rows] @ wq[g])
        if wgrad_bf16:
            dws.append(dy[rows].float().T @ x[rows].float())
        else:
            dws.append(dyc[rows].T @ xc[rows])
        start += n
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def test_weight_format_validation_and_spec():
    assert GroupLinear(2, 8, 8).weight_format == "bf16" and GroupLinear(2, 8, 8, weight_format="bf16").spec.attrs[
        "weight_format"] == "bf16"
    gl = GroupLinear(2, 8, 8, weight_format="fp8_block")
    assert gl.spec.attrs["weight_format"] == "fp8_block" and "weight_format=fp8_block" in gl.describe()
    assert "weight_format" not in GroupLinear(2, 8, 8).describe()         # the default is not shown
    assert Linear(8, 8, weight_format="fp8_block").spec.attrs["weight_format"] == "fp8_block"
    for bad in ("fp8", "FP8_BLOCK", 8, "mxfp8"):
        with pytest.raises(WeightFormatError, match="weight_format must be one of") as ei:
            Linear(8, 8, weight_format=bad)
        assert isinstance(ei.value, fusion.FusionError) and isinstance(ei.value, ValueError)


@pytest.mark.parametrize("sizes", [[40, 0, 130, 30], [0, 0, 0, 0], [200, 0, 0, 0]])
def test_forward_and_backward_follow_the_recipe(sizes, monkeypatch):
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", False)  # the FP8-operand wgrad (manual() computes it)
    torch.manual_seed(0)
    gs = torch.tensor(sizes)
    M = sum(sizes)
    layer = GroupLinear(4, 140, 136, weight_format="fp8_block")
    x = torch.randn(M, 140, requires_grad=True)
    dy = torch.randn(M, 136)
    y = layer(x, group_sizes=gs)
    y.backward(dy)
    ry, rdx, rdw = manual(x.detach(), layer.weight.detach(), gs, dy)
    assert torch.allclose(y, ry, rtol=1e-6, atol=1e-5)
    assert torch.allclose(x.grad, rdx, rtol=1e-6, atol=1e-5)
    assert torch.allclose(layer.weight.grad, rdw, rtol=1e-6, atol=1e-5)
    # the reference is the float GEMM of the dequantized operands, so it stays near the exact product
    if M:
        exact = torch.cat([xg @ layer.weight[g].detach().T
                           for g, xg in enumerate(torch.split(x.detach(), sizes))])
        assert (y - exact).abs().max() < 0.1 * exact.abs().max()


def test_wgrad_in_bf16_switch(monkeypatch):
    torch.manual_seed(1)
    gs = torch.tensor([50, 78])
    layer = GroupLinear(2, 64, 32, weight_format="fp8_block", dtype=torch.bfloat16)
    x = torch.randn(128, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 32, dtype=torch.bfloat16)
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", True)
    layer(x, group_sizes=gs).backward(dy)
    _, rdx, rdw = manual(x.detach(), layer.weight.detach(), gs, dy, wgrad_bf16=True)
    assert layer.weight.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert torch.equal(layer.weight.grad, rdw.to(torch.bfloat16))
    assert torch.equal(x.grad, rdx.to(torch.bfloat16))
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", False)
    layer.weight.grad = None
    layer(x, group_sizes=gs).backward(dy)
    _, _, fp8_dw = manual(x.detach(), layer.weight.detach(), gs, dy)
    assert torch.equal(layer.weight.grad, fp8_dw.to(torch.bfloat16))
    assert not torch.equal(fp8_dw, rdw)


def test_quantized_input_straight_through_and_reuses_its_columnwise_copy(monkeypatch):
    monkeypatch.setattr(fp8_linear, "WGRAD_IN_BF16", False)  # the FP8-operand wgrad reads the columnwise copy
    torch.manual_seed(2)
    gs = torch.tensor([70, 0, 60])
    layer = GroupLinear(3, 130, 48, weight_format="fp8_block")
    x = torch.randn(130, 130, requires_grad=True)
    q = quantize(x, "fp8_block", group_sizes=gs)
    dy = torch.randn(130, 48)
    y = layer(q, group_sizes=gs)
    y.backward(dy)
    ry, rdx, rdw = manual(x.detach(), layer.weight.detach(), gs, dy)
    assert torch.allclose(y, ry, rtol=1e-6, atol=1e-5)
    assert torch.allclose(x.grad, rdx, rtol=1e-6, atol=1e-5)                 # straight through the quantize
    assert torch.allclose(layer.weight.grad, rdw, rtol=1e-6, atol=1e-5)


def test_other_formats_are_requantized():
    gs = torch.tensor([32, 32])
    layer = GroupLinear(2, 64, 16, weight_format="fp8_block")
    x = torch.randn(64, 64, requires_grad=True)
    m = quantize(x, "mxfp8")
    y = layer(m, group_sizes=gs)
    ry, _, _ = manual(m.dequantize().detach(), layer.weight.detach(), gs, torch.zeros(64, 16))
    assert torch.allclose(y, ry, rtol=1e-6, atol=1e-5)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_linear_nd_bias_and_float64():
    torch.manual_seed(3)
    lin = Linear(200, 24, bias=True, weight_format="fp8_block", dtype=torch.float64)
    x = torch.randn(3, 5, 200, dtype=torch.float64, requires_grad=True)
    y = lin(x)
    assert y.shape == (3, 5, 24) and y.dtype == torch.float64
    xr = rowwise(x.detach().reshape(15, 200)).double()
    wr = quantize_weight_fp8_block(lin.weight).dequantize().double()
    assert torch.allclose(y.reshape(15, 24), xr @ wr.T + lin.bias.detach(), rtol=1e-12, atol=1e-12)
    y.sum().backward()
    assert x.grad.dtype == torch.float64 and lin.weight.grad.dtype == torch.float64
    assert torch.equal(lin.bias.grad, torch.full((24,), 15.0, dtype=torch.float64))


def test_sync_free_path_equals_the_loop(monkeypatch):
    torch.manual_seed(4)
    gs = torch.tensor([7, 0, 100, 21])
    layer = GroupLinear(4, 64, 40, weight_format="fp8_block")
    x = torch.randn(128, 64, requires_grad=True)
    dy = torch.randn(128, 40)
    y1 = layer(x, group_sizes=gs)
    g1 = torch.autograd.grad(y1, [x, layer.weight], dy)

    def no_sync(*_, **__):
        raise AssertionError("group_sizes read on the host")

    monkeypatch.setattr(fp8_linear, "_sync_free", lambda device: True)
    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    y2 = layer(x, group_sizes=gs)
    g2 = torch.autograd.grad(y2, [x, layer.weight], dy)
    monkeypatch.undo()
    assert torch.allclose(y1, y2, rtol=1e-6, atol=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(g1, g2))


def test_block_with_fp8_gemms_trains_on_the_reference_path():
    torch.manual_seed(5)
    block = Sequential(GroupLinear(3, 64, 256, weight_format="fp8_block"), SwiGLU(), QuantizeFP8Block(),
                       GroupLinear(3, 128, 64, weight_format="fp8_block", bias=True), backend="reference")
    x = torch.randn(90, 64, requires_grad=True)
    gs = torch.tensor([30, 0, 60])
    block(x, group_sizes=gs).square().mean().backward()
    assert x.grad.abs().sum() > 0
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), name
    assert block[0].weight.grad[1].eq(0).all()                              # the empty group
    assert QuantizeMXFP8().spec.extra_inputs == ()                          # quantize ops declare nothing
