"""The FP8-block weight quantize kernel on the GPU (fusion/kernels/fp8_weight_quantize.py; needs sm_90, else
skipped): bit for bit against fusion.quant's reference (codes, scales, the transposed copy and its scales) on random,
structured and adversarial weights (zero blocks, Inf/NaN, huge and subnormal values, partial blocks), both dtypes,
2-D and grouped weights, outputs poisoned first; and an fp8_block GroupLinear's weight cache re-quantizing on it after
each optimizer step.

    python3 -m pytest -q -p no:cacheprovider tests/test_fp8_weight_quantize_gpu.py
"""
import pytest
import torch
from conftest import assert_same_bits, hopper_available

pytestmark = pytest.mark.gpu

if not hopper_available():
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

from fusion.kernels.fp8_weight_quantize_api import try_quantize_weight_fp8_block_device  # noqa: E402
from fusion.quant.fp8_weight import quantize_weight_fp8_block_reference  # noqa: E402

NAMES = ("data", "scale", "data_t", "scale_t")


def _same_bits(got, want):
    for name, a, b in zip(NAMES, got, want):
        assert_same_bits(name, a, b)


def _adversarial(w):
    """Zero blocks, Inf/NaN of both signs, huge values, subnormals, a block of one tiny value (each where the weight
    has room for it)."""
    w = w.clone()
    flat = w.view(-1, w.shape[-2], w.shape[-1])
    g, (N, K) = flat.shape[0] - 1, flat.shape[-2:]
    flat[0, :128, :128] = 0
    flat[g, -8:, :16] = float("inf")
    flat[g, :8, -16:] = float("-inf")
    flat[0, N // 2, K // 3] = float("nan")
    flat[g, N - 5, K - 3] = -float("nan")
    flat[0, -1, -1] = 6.0e4 if w.dtype == torch.float16 else 3.0e38
    flat[g, N // 2:N // 2 + 8, K // 2:K // 2 + 16] = 1e-40 if w.dtype == torch.bfloat16 else 6e-8
    if N > 128 and K > 128:
        flat[0, 128:, :128] = 0
        flat[0, 130, 7] = 1e-30 if w.dtype == torch.bfloat16 else 1e-7
    return w


SHAPES = [(1, 128, 128), (4, 256, 384), (3, 200, 208), (2, 8, 16), (130, 136, 144), (1, 1536, 2048)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("data", ["random", "adversarial"])
def test_bit_for_bit_against_the_reference(dtype, shape, data):
    torch.manual_seed(hash((shape, str(dtype))) % 1000)
    w = (torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[-1], device="cuda")).to(dtype)
    if data == "adversarial":
        w = _adversarial(w)
    torch.cuda.empty_cache()
    poison = torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)   # reused memory is poisoned
    del poison
    got = try_quantize_weight_fp8_block_device(w)
    assert got is not None
    _same_bits(got, quantize_weight_fp8_block_reference(w))


def test_two_dimensional_weight():
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
    got = try_quantize_weight_fp8_block_device(w)
    assert got[0].shape == (384, 256) and got[2].shape == (256, 384)
    _same_bits(got, quantize_weight_fp8_block_reference(w))


def test_weight_cache_requantizes_on_the_kernel_after_each_optimizer_step(monkeypatch):
    """A training loop: each optimizer step changes the weights and quantizes them again on the kernel, into the same
    buffers; the next forward's FP8 weights equal the reference's quantization of the updated weights."""
    import fusion
    from fusion import GroupLinear, SwiGLU
    from fusion.kernels import fp8_weight_quantize_api as api

    launched = []
    real = api.try_quantize_weight_fp8_block_device
    monkeypatch.setattr(api, "try_quantize_weight_fp8_block_device",
                        lambda w, out=None: launched.append(tuple(w.shape)) or real(w, out))
    seq = fusion.Sequential(GroupLinear(4, 256, 512, weight_format="fp8_block"), SwiGLU(),
                            GroupLinear(4, 256, 256, weight_format="fp8_block")).cuda().bfloat16()
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    sizes = torch.tensor([100, 0, 300, 112], device="cuda")
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    ptrs = None
    for step in range(3):
        seq(x, group_sizes=sizes).float().square().mean().backward()
        for op in (seq[0], seq[2]):
            _same_bits(op.quantized_weight(), quantize_weight_fp8_block_reference(op.weight))
        now = [t.data_ptr() for op in (seq[0], seq[2]) for t in op.quantized_weight()]
        assert ptrs is None or now == ptrs, "quantized again into the same buffers"
        ptrs = now
        opt.step()
        opt.zero_grad()
    # the first forward's, then one at each step (the optimizer hook's)
    assert launched.count((4, 512, 256)) == 4 and launched.count((4, 256, 256)) == 4, launched


def test_cuda_graph_replays_read_the_stepped_fp8_weights():
    """A no-grad forward captured in a CUDA graph, replayed after each optimizer step (the weights changed, no Python
    ran in the replay): its output is the eager forward's at the stepped weights, bit for bit, because the optimizer
    hook quantizes them again into the buffers the graph reads. (Before session am the cache quantized into new
    buffers at the next eager forward, and the replay read the stale ones.)"""
    import fusion
    from fusion import GroupLinear, SwiGLU

    seq = fusion.Sequential(GroupLinear(4, 256, 512, weight_format="fp8_block"), SwiGLU(),
                            GroupLinear(4, 256, 256, weight_format="fp8_block")).cuda().bfloat16()
    opt = torch.optim.AdamW(seq.parameters(), lr=0.05, fused=True)
    sizes = torch.tensor([100, 0, 300, 112], device="cuda")
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            seq(x, group_sizes=sizes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = seq(x, group_sizes=sizes)
    first = None
    for _ in range(3):
        seq(x, group_sizes=sizes).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        graph.replay()
        with torch.no_grad():
            want = seq(x, group_sizes=sizes)
        assert torch.equal(y, want)
        first = y.clone() if first is None else first
    assert not torch.equal(first, y), "the weights moved between replays"


def test_requantization_reuses_the_stale_buffers_memory():
    """The step after an optimizer step quantizes each weight again in the memory of its stale copies: the peak
    grows by far less than the copies' size (2 bytes an element: codes and the transposed codes)."""
    from fusion import GroupLinear
    from fusion.quant import invalidate_weight_caches

    op = GroupLinear(8, 1024, 2048, weight_format="fp8_block").cuda().bfloat16()
    op.quantized_weight()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    invalidate_weight_caches()
    op.quantized_weight()
    torch.cuda.synchronize()
    copies = 2 * op.weight.numel()
    assert torch.cuda.max_memory_allocated() - base < copies // 8, (torch.cuda.max_memory_allocated() - base, copies)
