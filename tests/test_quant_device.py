"""The reference gives the same bytes on CUDA as on CPU (skipped without a GPU)."""

import pytest
import torch

from fusion.quant import encode_e4m3, quantize, quantize_fp8_block, quantize_mxfp8, quantize_nvfp4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [quantize_mxfp8, quantize_nvfp4, quantize_fp8_block])
@pytest.mark.parametrize("spread", [0, 3, 7])
def test_cpu_and_cuda_agree(fn, dtype, spread):
    g = torch.Generator().manual_seed(spread)
    x = torch.randn(64, 256, generator=g) * torch.exp(
        torch.randn(64, 16, 1, generator=g) * spread).repeat(1, 1, 16).reshape(64, 256)
    x[0, 5] = float("nan")
    x[7, 40] = float("inf")
    x[9, :32] = 0.0
    x[10, :16] = -0.0
    x = x.to(dtype)
    gs = torch.tensor([20, 0, 33, 11])                      # ragged groups: partial columnwise blocks
    a, b = fn(x, group_sizes=gs), fn(x.cuda(), group_sizes=gs.cuda())
    for name in ("data", "scale", "columnwise_data", "columnwise_scale"):
        assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name
    assert torch.equal(a.amax, b.amax.cpu())
    assert torch.equal(a.dequantize().nan_to_num(), b.dequantize().cpu().nan_to_num())


def test_e4m3_sweep_cpu_and_cuda_agree():
    x = (torch.arange(0, 2 ** 32, 4099, dtype=torch.int64) - 2 ** 31).to(torch.int32).view(torch.float32)
    for sat in (False, True):
        assert torch.equal(encode_e4m3(x, saturate=sat), encode_e4m3(x.cuda(), saturate=sat).cpu())


def test_gradient_and_move_on_cuda():
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    q = quantize_nvfp4(x)
    (q @ torch.randn(64, 8, device="cuda")).sum().backward()
    assert x.grad.is_cuda
    c = q.detach().cpu()
    assert type(c).__name__ == "QuantizedTensor" and c.data.device.type == "cpu"
    assert torch.equal(c.dequantize(), q.detach().dequantize().cpu())


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_block"])
def test_grouped_columnwise_on_cuda_needs_no_host_sync(fmt):
    x = torch.randn(301, 128, device="cuda")
    gs = torch.tensor([100, 0, 201], device="cuda")
    torch.cuda.set_sync_debug_mode("error")                   # any host sync raises
    try:
        q = quantize(x, fmt, group_sizes=gs)
        d = q.dequantize(columnwise=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = quantize(x.cpu(), fmt, group_sizes=gs.cpu())
    assert torch.equal(q.columnwise_scale.cpu(), ref.columnwise_scale)
    assert torch.equal(d.cpu(), ref.dequantize(columnwise=True))


def test_fp8_group_linear_on_cuda_needs_no_host_sync():
    from fusion import GroupLinear
    from fusion.ops.base import RunContext

    layer = GroupLinear(3, 128, 64, weight_format="fp8_block").cuda()
    x = torch.randn(301, 128, device="cuda", requires_grad=True)
    gs = torch.tensor([100, 0, 201], device="cuda")
    layer.quantized_weight()                                   # the cache fills outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer.reference(x, RunContext(group_sizes=gs))
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad.isfinite().all() and layer.weight.grad.isfinite().all()
