"""The FP8-block weight quantize kernel (fusion/kernels/fp8_weight_quantize.py) on the CPU: it compiles for sm_90a
without spills, reads the weight in 16-byte loads and writes both copies in whole 16- and 8-byte stores; the host API
declines what it cannot take (the reference runs there), and fusion.quant's weight quantization reaches the kernel
only through its device-quantizer table, with the reference's bits wherever the kernel declines.

GPU correctness (bit for bit against the reference) is tests/test_fp8_weight_quantize_gpu.py.
"""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from conftest import sass_or_skip  # noqa: E402


@pytest.mark.parametrize("dtype,N,K", [("bfloat16", 1536, 2048), ("float16", 200, 208), ("bfloat16", 8, 16)])
def test_kernel_compiles_without_spills(dtype, N, K):
    from fusion.kernels.api import _cubin_nv_info, sass_opcodes, sass_text
    from fusion.kernels.fp8_weight_quantize import build_kernel

    fn, _ = build_kernel(dtype, N, K, keep_cubin=True)
    info = _cubin_nv_info(fn.__cubin__)
    ops = sass_opcodes(sass_or_skip(lambda: sass_text(fn.__cubin__)))
    assert info.get("frame_size", 0) == 0, f"{info.get('frame_size')}-byte stack frame (spills)"
    assert not any(o.startswith(("LDL", "STL")) for o in ops), "local-memory spills"
    assert ops.count("LDG.E.128") == 16, "a thread's 8 rows x 16 values: sixteen 16-byte loads"
    assert ops.count("STG.E.128") == 8, "a row's 16 codes: one 16-byte store"
    assert ops.count("STG.E.64") == 16, "a column's 8 codes of the transposed copy: one 8-byte store"
    assert ops.count("PRMT") >= 48, "the 4x4 byte transposes in registers (prmt), not through shared memory"
    assert any(o.startswith("F2FP.SATFINITE.E4M3") for o in ops), "E4M3 by the saturating pair conversion"
    assert not any(o.startswith(("ATOM", "RED")) for o in ops)


@pytest.mark.parametrize("dtype,N,K", [("float32", 128, 128), ("bfloat16", 12, 128), ("bfloat16", 128, 24)])
def test_kernel_refuses_shapes_it_cannot_take(dtype, N, K):
    from fusion.kernels.fp8_weight_quantize import FP8WeightQuantizeKernel

    with pytest.raises(ValueError, match="bfloat16 or float16|N % 8 == 0 and K % 16 == 0"):
        FP8WeightQuantizeKernel(dtype, N, K)


def test_host_api_declines_what_the_kernel_cannot_take():
    from fusion.kernels.fp8_weight_quantize_api import try_quantize_weight_fp8_block_device, weight_unsupported_reason

    w = torch.randn(2, 128, 128, dtype=torch.bfloat16)
    assert "CUDA" in weight_unsupported_reason(w)
    assert try_quantize_weight_fp8_block_device(w) is None
    assert "bfloat16 or float16" in weight_unsupported_reason(w.float())
    assert "(G, N, K) or (N, K)" in weight_unsupported_reason(w[0, 0])


def test_weight_quantization_goes_through_the_device_quantizer_table(monkeypatch):
    """fusion.quant asks each registered device quantizer first (the runtime registers the kernel's), takes the
    first one's buffers, and runs the reference where every one declines: the same bits on the CPU."""
    import fusion  # noqa: F401 (registers the runtime's quantizer)
    from fusion.quant import fp8_weight
    from fusion.runtime import fp8_gemm

    assert fp8_gemm.quantize_weight_device in fp8_weight.DEVICE_QUANTIZERS
    w = torch.randn(3, 256, 384, dtype=torch.bfloat16)
    want = fp8_weight.quantize_weight_fp8_block_reference(w)
    got = fp8_weight.quantize_weight_fp8_block(w)   # the kernel declines a CPU weight
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    asked = []
    sentinel = tuple(t.clone() for t in want)
    monkeypatch.setattr(fp8_weight, "DEVICE_QUANTIZERS", [lambda t, out: asked.append(t) or None,
                                                          lambda t, out: sentinel])
    got = fp8_weight.quantize_weight_fp8_block(w)
    assert len(asked) == 1 and asked[0] is w
    assert all(a is b for a, b in zip(got, sentinel))
    assert isinstance(got, fp8_weight.FP8BlockWeight)



def test_weight_quantized_again_into_its_own_buffers(monkeypatch):
    """After an optimizer step the cache quantizes the weight again into the buffers it holds (the device quantizer
    is handed them as `out`): no second copy beside the stale one (a weight's FP8 copies are the size of the bf16
    weight itself), and the addresses a captured CUDA graph reads stay."""
    from fusion.quant import fp8_weight

    w = torch.nn.Parameter(torch.randn(2, 128, 256, dtype=torch.bfloat16))
    cache = fp8_weight.FP8BlockWeightCache()
    seen = []

    def quantizer(t, out):
        seen.append(out)
        return None   # the reference then runs, into `out` where given

    monkeypatch.setattr(fp8_weight, "DEVICE_QUANTIZERS", [quantizer])
    first = cache.get(w)
    codes = first.data.clone()
    with torch.no_grad():
        w.mul_(-1)
    second = cache.get(w)
    assert seen == [None, first] and second is first and cache.misses == 2
    assert torch.equal(second.data, fp8_weight.quantize_weight_fp8_block_reference(w).data)
    assert not torch.equal(second.data, codes)
