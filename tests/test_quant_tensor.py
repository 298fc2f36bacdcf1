"""QuantizedTensor behaves as its dequantized value; gradients pass straight through."""

import copy
import pickle

import pytest
import torch

import fusion.quant as fq
from fusion.quant import QuantizedTensor, dequantize, quantize_mxfp8, quantize_nvfp4
from fusion.quant.tensor import quantize

QUANTIZERS = {"mxfp8": quantize_mxfp8, "nvfp4": quantize_nvfp4}


@pytest.fixture(params=["mxfp8", "nvfp4"])
def fmt(request):
    return request.param


def make(fmt, dtype=torch.float32, shape=(64, 64), requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)
    return x, QUANTIZERS[fmt](x)


def test_public_api():
    for name in ["quantize_mxfp8", "quantize_nvfp4", "QuantizedTensor", "dequantize", "MXFP8_BLOCK",
                 "NVFP4_BLOCK", "QuantizationError"]:
        assert hasattr(fq, name)
    assert issubclass(fq.QuantizationError, ValueError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_metadata(fmt, dtype):
    x, q = make(fmt, dtype, shape=(2, 32, 64))
    assert isinstance(q, torch.Tensor) and isinstance(q, QuantizedTensor)
    assert q.format == fmt and q.shape == (2, 32, 64) and q.dtype == dtype and q.device == x.device
    assert q.dim() == 3 and q.numel() == x.numel() and len(q) == 2
    assert q.data.dtype == torch.uint8 and q.scale.dtype == torch.uint8
    assert q.amax.dtype == torch.float32 and q.amax.dim() == 0
    assert (q.global_scale is None) == (fmt == "mxfp8")
    assert q.block_size == {"mxfp8": 32, "nvfp4": 16}[fmt]


def test_ops_see_dequantized_value(fmt):
    x, q = make(fmt)
    d = q.dequantize()
    assert type(d) is torch.Tensor
    w = torch.randn(64, 8)
    for out, ref in [(q.sum(), d.sum()), (q @ w, d @ w), (q[3], d[3]), (q[:, 5:9], d[:, 5:9]),
                     (q * 2 + 1, d * 2 + 1), (torch.relu(q), torch.relu(d)), (q.t(), d.t()),
                     (q.reshape(-1), d.reshape(-1)), (torch.amax(q, 0), d.amax(0)),
                     (torch.nn.functional.linear(q, w.t()), d @ w), (torch.cat([q, q]), torch.cat([d, d]))]:
        assert type(out) is torch.Tensor
        assert torch.equal(out, ref)
    assert q[0, 0].item() == d[0, 0].item()
    assert float(q.sum()) == float(d.sum())
    assert torch.equal(dequantize(q), d) and dequantize(d) is d


def test_repr_and_print(fmt):
    _, q = make(fmt, torch.bfloat16)
    r = repr(q)
    assert r.startswith("QuantizedTensor(") and fmt in r and "bfloat16" in r and "value=tensor(" in r
    assert str(q) == r and f"{q}" == r


def test_conversions(fmt):
    _, q = make(fmt, torch.bfloat16)
    f = q.float()
    assert type(f) is torch.Tensor and f.dtype == torch.float32
    assert torch.equal(f, q.dequantize(torch.float32))
    moved = q.to("cpu")
    assert moved is q or isinstance(moved, QuantizedTensor)
    m2 = q.to(device="cpu", copy=True)
    assert isinstance(m2, QuantizedTensor) and torch.equal(m2.data, q.data)
    h = q.to(torch.float16)
    assert type(h) is torch.Tensor and h.dtype == torch.float16


def test_detach_clone_copy_pickle(fmt):
    x, q = make(fmt, requires_grad=True)
    assert q.requires_grad and q.grad_fn is not None
    dt = q.detach()
    assert isinstance(dt, QuantizedTensor) and not dt.requires_grad and dt.data is q.data
    c = q.detach().clone()
    assert isinstance(c, QuantizedTensor) and c.data is not q.data and torch.equal(c.data, q.data)
    dc = copy.deepcopy(q.detach())
    assert isinstance(dc, QuantizedTensor) and torch.equal(dc.dequantize(), q.dequantize())
    pk = pickle.loads(pickle.dumps(q.detach()))
    assert isinstance(pk, QuantizedTensor) and pk.format == fmt
    assert torch.equal(pk.scale, q.scale) and torch.equal(pk.columnwise_data, q.columnwise_data)


def test_inplace_raises(fmt):
    _, q = make(fmt)
    with pytest.raises(TypeError, match="immutable"):
        q.add_(1)
    with pytest.raises(TypeError, match="immutable"):
        q.copy_(torch.zeros(64, 64))
    out = torch.empty(64, 64)
    out.copy_(q)                                           # writing *from* it is fine
    assert torch.equal(out, q.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_straight_through_gradient(fmt, dtype):
    x, q = make(fmt, dtype, requires_grad=True)
    q.sum().backward()
    assert x.grad.dtype == dtype and torch.equal(x.grad, torch.ones_like(x))


def test_matmul_gradient(fmt):
    x, q = make(fmt, requires_grad=True)
    w = torch.randn(64, 16, requires_grad=True)
    gy = torch.randn(64, 16)
    (q @ w).backward(gy)
    assert torch.allclose(x.grad, gy @ w.detach().t())
    assert torch.allclose(w.grad, q.dequantize().t() @ gy)


def test_nd_gradient_and_linear(fmt):
    x, q = make(fmt, shape=(4, 16, 64), requires_grad=True)
    lin = torch.nn.Linear(64, 8)
    lin(q).pow(2).sum().backward()
    assert x.grad.shape == x.shape and lin.weight.grad is not None


def test_requantize_and_generic_quantize(fmt):
    x, q = make(fmt, requires_grad=True)
    q2 = quantize(q, fmt)
    assert isinstance(q2, QuantizedTensor) and torch.equal(q2.dequantize(), q.dequantize())
    q2.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(fq.QuantizationError, match="unknown format"):
        quantize(x, "int8")


def test_dequantize_columnwise(fmt):
    x, q = make(fmt)
    dc = q.dequantize(columnwise=True)
    assert dc.shape == x.shape
    tol = 2.0 ** -4 if fmt == "mxfp8" else 0.5
    assert torch.allclose(dc, x, atol=tol * x.abs().max().item())
    r = QUANTIZERS[fmt](x, columnwise=False)
    with pytest.raises(fq.QuantizationError, match="columnwise"):
        r.dequantize(columnwise=True)


def test_no_grad_input_gives_no_grad_fn(fmt):
    _, q = make(fmt)
    assert not q.requires_grad and q.grad_fn is None
