"""On the GPU, FC2's fused FP8 dgrad (B1) writes d(pre-activation) quantized 1x128 rowwise for FC1's FP8 dgrad where
the rule is on (FUSION_QUANTIZED_DGRAD_OPERAND=1; fusion/dataflow.py `quantizes_dgrad_operand`; kernels.epilogue.FP8BlockOutput, paired): the codes and scales are,
bit for bit, fusion.quant's quantization of the gradient B1 writes in bf16, with a zero row, huge and tiny rows,
partial tiles and empty groups, f = 384 (three blocks a half); FC1's dgrad reads them (no quantize kernel runs for
it) and the training step's every gradient equals, bit for bit, the same step with the switch off."""
import pytest
import torch

from fusion import GroupLinear, QuantizeFP8Block, Scale, Sequential, SwiGLU
from fusion import dataflow
from fusion.planner import clear_cache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"
E, D = 8, 256
SIZES = [300, 0, 129, 517, 1, 0, 1000, 77]   # unaligned groups, empty ones


def _block(f, quant):
    torch.manual_seed(0)
    ops = [GroupLinear(E, D, 2 * f, weight_format="fp8_block"), SwiGLU(), Scale()]
    ops += [QuantizeFP8Block(columnwise=False)] if quant else []
    ops += [GroupLinear(E, f, D, weight_format="fp8_block")]
    seq = Sequential(*ops).to(DEV, torch.bfloat16)
    for p in seq.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return seq


def _inputs():
    torch.manual_seed(1)
    sizes = torch.tensor(SIZES, device=DEV)
    M = sum(SIZES)
    x = torch.randn(M, D, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(M, D, device=DEV, dtype=torch.bfloat16)
    dy[5] = 0                      # a zero row: every block of its gradient is zero (scale 1)
    dy[700] *= 2.0 ** 60           # huge: large power-of-two scales
    dy[701] *= 2.0 ** -60          # tiny: small power-of-two scales
    probs = torch.rand(M, device=DEV, dtype=torch.bfloat16)
    return x, sizes, probs, dy


def _step(seq, x, sizes, probs, dy):
    for p in seq.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    probs = probs.detach().requires_grad_()
    seq(x, group_sizes=sizes, scale=probs).backward(dy)
    return {"dx": x.grad, "dprobs": probs.grad, **{n: p.grad for n, p in seq.named_parameters()}}


@pytest.mark.parametrize("quant", [True, False], ids=["quantize-op", "direct"])
@pytest.mark.parametrize("f", [256, 384], ids=["f256", "f384"])
def test_b1_writes_fc1s_operand_bit_for_bit(f, quant, monkeypatch):
    from fusion.quant.fp8_block import fp8_block_quantize_2d
    from fusion.runtime import fp8_gemm
    from fusion.runtime.kernel import LAUNCHES

    seen = []
    dgrad = fp8_gemm.dgrad

    def spy(op, dy, ctx, counter=None, quantized=None):
        seen.append((dy.clone(), None if quantized is None else [t.clone() for t in quantized]))
        return dgrad(op, dy, ctx, counter, quantized)

    monkeypatch.setattr(fp8_gemm, "dgrad", spy)
    monkeypatch.setattr(dataflow, "QUANTIZES_DGRAD_OPERAND", True)   # (off by default: measured slower)
    clear_cache()
    x, sizes, probs, dy = _inputs()
    seq = _block(f, quant)
    assert "qg1" in next(s for s in seq.plan(dtype=torch.bfloat16).backward if s.fused).writes
    LAUNCHES.reset()
    got = _step(seq, x, sizes, probs, dy)
    assert sorted(LAUNCHES.by_step) == ["B1", "F1"], LAUNCHES.by_step
    (dh, quantized), = [s for s in seen if s[0].shape[1] == 2 * f]   # FC1's dgrad: dY is d(gate, up)
    assert quantized is not None, "FC1's dgrad quantized its dY itself"
    data, scale = fp8_block_quantize_2d(dh)
    assert torch.equal(quantized[0], data), f"codes differ at {(quantized[0] != data).nonzero()[:8].tolist()}"
    assert torch.equal(quantized[1], scale), f"scales differ at {(quantized[1] != scale).nonzero()[:8].tolist()}"

    # the same step with FC1's dgrad quantizing for itself: every gradient bit for bit
    monkeypatch.setattr(dataflow, "QUANTIZES_DGRAD_OPERAND", False)
    clear_cache()
    seen.clear()
    want = _step(_block(f, quant), x, sizes, probs, dy)
    assert all(q is None for _, q in seen)
    for name, ref in want.items():
        assert torch.equal(got[name].nan_to_num(), ref.nan_to_num()), name
