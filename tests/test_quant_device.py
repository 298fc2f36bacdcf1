"""The reference gives the same bytes on CUDA as on CPU (skipped without a GPU)."""

import pytest
import torch

from fusion.quant import encode_e4m3, quantize_mxfp8, quantize_nvfp4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [quantize_mxfp8, quantize_nvfp4])
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
    a, b = fn(x), fn(x.cuda())
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
