"""FP8-block weights (128x128 blocks, transposed copy) and the cache that is never stale."""

import copy
import io

import pytest
import torch

from fusion import GroupLinear, Linear
from fusion.quant import (FP8BlockWeightCache, QuantizationError, invalidate_weight_caches,
                          quantize_weight_fp8_block)


def test_hand_computed_weight():
    # (G=2, N=130, K=140): 2 x 2 blocks per group, the last row and column of blocks partial
    w = torch.zeros(2, 130, 140)
    w[0, 0, 0] = 3.0           # block (0, 0): amax 3 -> 2^-7, 3 * 2^7 = 384 -> 0x7C
    w[0, 5, 130] = -0.5        # block (0, 1): amax 0.5 = 2^-1 -> e = -1 - 8 = -9, -0.5 * 2^9 = -256 -> 0xF8
    w[0, 129, 139] = 1000.0    # block (1, 1): amax 1000 -> e = 2, 250 -> 256 -> 0x78
    q = quantize_weight_fp8_block(w)
    assert q.data.shape == (2, 130, 140) and q.data.dtype == torch.uint8
    assert q.scale.shape == (2, 2, 2) and q.scale.dtype == torch.float32
    assert q.scale[0].tolist() == [[2.0 ** -7, 2.0 ** -9], [1.0, 4.0]]
    assert (q.scale[1] == 1).all()                        # all-zero blocks: scale 1
    assert q.data[0, 0, 0].item() == 0x7C and q.data[0, 5, 130].item() == 0xF8
    assert q.data[0, 129, 139].item() == 0x78
    assert int((q.data != 0).sum()) == 3
    d = q.dequantize()
    assert d[0, 0, 0].item() == 3.0 and d[0, 5, 130].item() == -0.5 and d[0, 129, 139].item() == 1024.0
    # the transposed copy: (G, K, N) data, (G, ceil(K/128), ceil(N/128)) scales, the same blocks
    assert q.data_t.shape == (2, 140, 130) and q.scale_t.shape == (2, 2, 2)
    assert q.data_t.is_contiguous() and q.scale_t.is_contiguous()
    assert torch.equal(q.data_t, q.data.mT) and torch.equal(q.scale_t, q.scale.mT)
    assert torch.equal(q.dequantize_t(), d.mT)


def test_weight_blocks_are_2d_and_nan_inf():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(0))
    w[200, 10] = float("nan")
    w[5, 250] = float("inf")
    q = quantize_weight_fp8_block(w)                      # (N, K): no group dim
    assert q.data.shape == (300, 260) and q.scale.shape == (3, 3) and q.data_t.shape == (260, 300)
    assert q.data[200, 10].item() == 0x7F and q.data[5, 250].item() == 0x7F
    for i, j in [(0, 0), (1, 2), (2, 1), (2, 2)]:
        blk = w[128 * i:128 * i + 128, 128 * j:128 * j + 128]
        amax = torch.where(blk.isfinite(), blk.abs(), torch.zeros_like(blk)).amax()
        assert q.scale[i, j].item() >= amax.item() / 448 > q.scale[i, j].item() / 2
    d = q.dequantize()
    fin = w.isfinite()
    assert ((d - w).abs()[fin] <= 2.0 ** -4 * w.abs()[fin] + 2.0 ** -10 * q.scale.max()).all()
    with pytest.raises(QuantizationError, match="weight"):
        quantize_weight_fp8_block(torch.randn(4))
    assert quantize_weight_fp8_block(w.double()).dequantize().dtype == torch.float32


def fresh(layer):
    return quantize_weight_fp8_block(layer.weight).data


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, foreach=False),
    lambda p: torch.optim.Adam(p, lr=0.1, foreach=True),
    lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),       # does not bump _version
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
], ids=["sgd", "adam_foreach", "adamw_fused", "sgd_fused"])
def test_cache_never_stale_after_optimizer_step(make_opt):
    layer = GroupLinear(2, 64, 32, weight_format="fp8_block")
    cache = layer._fp8_weight
    a = layer.quantized_weight()
    assert layer.quantized_weight() is a and cache.misses == 1          # cached
    opt = make_opt(layer.parameters())
    x = torch.randn(10, 64)
    gs = torch.tensor([4, 6])
    layer(x, group_sizes=gs).square().sum().backward()
    before = a.data.clone()
    opt.step()                                            # the hook quantizes the stepped weight at once ...
    assert cache.misses == 2
    b = layer.quantized_weight()
    assert b is a and cache.misses == 2 and torch.equal(b.data, fresh(layer))   # ... into the same buffers
    assert not torch.equal(b.data, before)
    # the forward after the step uses the new weight
    from fusion.quant import fp8_block_linear
    assert torch.equal(layer(x, group_sizes=gs), fp8_block_linear(x, layer.weight.detach(), gs))


@pytest.mark.parametrize("fused", [False, True])
def test_frozen_weight_is_quantized_once_across_optimizer_steps(fused):
    """A frozen weight (requires_grad False: a frozen expert, base weights under an adapter) gets no gradient, which
    every optimizer skips: its cache survives the steps of the parameters that train, while theirs re-quantize;
    unfreezing it, an in-place write and invalidate_weight_caches() still re-quantize it."""
    frozen = GroupLinear(2, 64, 32, weight_format="fp8_block")
    frozen.weight.requires_grad_(False)
    trained = GroupLinear(2, 32, 64, weight_format="fp8_block")
    opt = torch.optim.AdamW([*frozen.parameters(), *trained.parameters()], lr=0.1, fused=fused)
    x = torch.randn(10, 64)
    gs = torch.tensor([4, 6])
    for _ in range(3):
        trained(frozen(x, group_sizes=gs), group_sizes=gs).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert frozen._fp8_weight.misses == 1
    assert trained._fp8_weight.misses == 4                # its first forward, then at each step (the hook)
    assert torch.equal(trained.quantized_weight().data, fresh(trained)) and trained._fp8_weight.misses == 4
    frozen.weight.requires_grad_(True)                    # trains from now on: quantized again
    frozen.quantized_weight()
    assert frozen._fp8_weight.misses == 2
    frozen.weight.requires_grad_(False)
    frozen.quantized_weight()
    with torch.no_grad():
        frozen.weight.mul_(3)                             # bumps _version
    assert torch.equal(frozen.quantized_weight().data, fresh(frozen))
    misses = frozen._fp8_weight.misses
    invalidate_weight_caches()
    frozen.quantized_weight()
    assert frozen._fp8_weight.misses == misses + 1


def test_gradient_accumulation_quantizes_once_per_optimizer_step():
    """Micro-batches between optimizer steps reuse the weight's FP8 blocks: the quantization a step after an optimizer
    step pays (docs/benchmarks.md, session am) is divided by the micro-batches a gradient accumulation runs."""
    from fusion import Sequential, SwiGLU

    seq = Sequential(GroupLinear(2, 64, 64, weight_format="fp8_block"), SwiGLU(),
                     GroupLinear(2, 32, 64, weight_format="fp8_block"), backend="emulate")
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    gs = torch.tensor([4, 6])
    for _ in range(3):
        for _ in range(4):   # micro-batches
            seq(torch.randn(10, 64), group_sizes=gs).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert seq[0]._fp8_weight.misses == 1 + 3 and seq[2]._fp8_weight.misses == 1 + 3   # first use, then each step


def test_requantized_in_place_so_a_captured_graph_reads_the_stepped_weights():
    """The buffers a CUDA graph captured (their addresses) hold the stepped weight's blocks after optimizer.step(),
    with no forward in between (a replay runs no Python): the hook quantizes the parameters that optimizer holds, into
    the same buffers. A parameter of another optimizer, or none, goes stale and is quantized at its next use, into
    its own buffers too; another parameter in the op's place gets new ones."""
    stepped = GroupLinear(2, 64, 32, weight_format="fp8_block")
    other = GroupLinear(2, 32, 64, weight_format="fp8_block")
    captured = [t.data_ptr() for t in stepped.quantized_weight()]
    other_ptrs = [t.data_ptr() for t in other.quantized_weight()]
    opt = torch.optim.AdamW(stepped.parameters(), lr=0.1, fused=True)   # (fused: no _version bump)
    gs = torch.tensor([4, 6])
    other(stepped(torch.randn(10, 64), group_sizes=gs), group_sizes=gs).square().sum().backward()
    opt.step()
    assert stepped._fp8_weight.misses == 2 and other._fp8_weight.misses == 1   # one at once, the other later
    value = stepped._fp8_weight._value
    assert [t.data_ptr() for t in value] == captured and torch.equal(value.data, fresh(stepped))
    assert [t.data_ptr() for t in other.quantized_weight()] == other_ptrs and other._fp8_weight.misses == 2
    stepped.weight = torch.nn.Parameter(torch.randn(2, 32, 64))    # another parameter: new buffers
    assert [t.data_ptr() for t in stepped.quantized_weight()] != captured


def test_cache_sees_inplace_writes_and_replaced_data():
    layer = Linear(64, 32, weight_format="fp8_block")
    cache = layer._fp8_weight
    layer.quantized_weight()
    with torch.no_grad():
        layer.weight.mul_(2)                              # bumps _version
    assert torch.equal(layer.quantized_weight().data, fresh(layer)) and cache.misses == 2
    layer.weight.data = torch.randn(32, 64)               # new storage
    assert torch.equal(layer.quantized_weight().data, fresh(layer)) and cache.misses == 3
    layer.load_state_dict({"weight": torch.randn(32, 64)})
    assert torch.equal(layer.quantized_weight().data, fresh(layer)) and cache.misses == 4
    layer.weight.data.add_(1.0)                           # bypasses the version counter: documented ...
    invalidate_weight_caches()                            # ... and this is the way out
    assert torch.equal(layer.quantized_weight().data, fresh(layer)) and cache.misses == 5
    layer.weight = torch.nn.Parameter(torch.randn(32, 64))  # another parameter
    assert torch.equal(layer.quantized_weight().data, fresh(layer)) and cache.misses == 6


def test_cache_is_not_state_and_copies_start_empty():
    layer = GroupLinear(3, 64, 32, bias=True, weight_format="fp8_block")
    layer.quantized_weight()
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert not any(isinstance(b, torch.Tensor) for b in layer.buffers())
    clone = copy.deepcopy(layer)
    assert clone._fp8_weight is not layer._fp8_weight and clone._fp8_weight.misses == 0
    assert torch.equal(clone.quantized_weight().data, layer.quantized_weight().data)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded._fp8_weight.misses == 0 and torch.equal(loaded.quantized_weight().data, fresh(layer))
    plain = GroupLinear(3, 64, 32)
    assert plain.quantized_weight() is None and plain._fp8_weight is None


def test_cache_standalone():
    cache = FP8BlockWeightCache()
    p = torch.nn.Parameter(torch.randn(16, 16))
    a = cache.get(p)
    assert cache.get(p) is a
    q = torch.nn.Parameter(p.detach().clone())            # equal values, another parameter: not the same entry
    assert cache.get(q) is not a
    cache.clear()
    assert cache.get(q) is not a and "FP8BlockWeightCache" in repr(cache)


def test_optimizer_hook_traced_by_the_compiler_only_marks_the_caches_stale(monkeypatch):
    """Under torch.compile (a compiled optimizer step) the hook launches nothing: it marks the caches of parameters
    that require grad stale (each is quantized at its next use, into its buffers), so the traced step stays a graph."""
    from fusion.quant import fp8_weight

    layer = GroupLinear(2, 64, 32, weight_format="fp8_block")
    layer.quantized_weight()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    steps = fp8_weight._STEPS[0]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fp8_weight._optimizer_stepped(opt, (), {})
    monkeypatch.undo()
    assert fp8_weight._STEPS[0] == steps + 1 and layer._fp8_weight.misses == 1
    layer.quantized_weight()
    assert layer._fp8_weight.misses == 2
