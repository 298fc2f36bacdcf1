"""The FP8 paths of the training-step benchmark (bench/bench_training_step.py), issue 9.

- fusion_fp8   the block with weight_format="fp8_block" on both GroupLinears and QuantizeFP8Block(columnwise=False)
               before FC2 (FC1 -> SwiGLU -> Scale -> QuantizeFP8Block -> FC2), backend="auto": the plan of
               patterns/fp8.fpat (FC1 + SwiGLU·scale + the FP8-block store on the FP8 kernel, FC2's FP8 dgrad +
               d(SwiGLU·scale)), the FP8 kernel alone for FC2's fprop and FC1's dgrad (fusion/runtime/fp8_gemm.py).
               Weight gradients by the default recipe (fusion.quant.fp8_linear.WGRAD_IN_BF16 = "auto": per GEMM
               and call, FP8 columnwise copies on the FP8 varlen-K kernel where the GEMM is wide and its groups
               long, else bf16 GEMMs of the high-precision dY and X: fp8_linear.wgrad_in_bf16).
- fusion_fp8_direct  the same without the QuantizeFP8Block: FC2 quantizes its bf16 input itself (rowwise only),
               and its bf16 weight gradient reads that input as FC2's fused dgrad recomputes it (nothing
               quantized is kept for the backward, nothing is dequantized for it).
- fusion_fp8_fp8wgrad  the same as fusion_fp8 with WGRAD_IN_BF16 = False: the weight gradients from the recipe's FP8
               columnwise operands, dY and X each quantized by the quantize kernel into the slot layout and
               multiplied by the FP8 varlen-K kernel (kernels/fp8_wgrad.py); FC2's input stays the rowwise copy
               FC1's epilogue writes (QuantizeFP8Block(columnwise=False)), so its weight gradient quantizes it
               columnwise from its value. The switch is set when a path is made and kept until the next is made.
- unfused_fp8  what a user writes with torch's FP8 grouped GEMM: torch._scaled_grouped_mm with row-wise scales
               (one per row of A, one per output column of B) for FC1, FC2 and both dgrads; a torch.compile'd
               act·scale and a torch.compile'd row-wise quantization; bf16 torch._grouped_mm weight gradients;
               weights quantized once (as a cache per optimizer step would).
Both start from the bf16 block's weights.
"""
from __future__ import annotations

import torch

_E4M3_MAX = 448.0


def fusion_fp8_block(seq, probs, wgrad_bf16=None, quantize=True):
    """The bf16 block's FP8 twin, with its weights; the process-wide wgrad choice set as asked (None: left as it is,
    as a precompile or an A/B of the switch wants). `quantize`: a QuantizeFP8Block before FC2 (without it FC2's
    device method or fused step quantizes its input itself)."""
    from fusion import GroupLinear, QuantizeFP8Block, Scale, Sequential, SwiGLU
    from fusion.quant import fp8_linear

    if wgrad_bf16 is not None:
        fp8_linear.WGRAD_IN_BF16 = wgrad_bf16

    fc1, fc2 = seq[0], seq[len(seq) - 1]
    E = fc1.num_groups
    ops = [GroupLinear(E, fc1.in_features, fc1.out_features, weight_format="fp8_block"), SwiGLU()]
    ops += [Scale()] if probs is not None else []
    # rowwise only: FC1's epilogue writes it (patterns/fp8.fpat); an FP8 weight gradient quantizes FC2's input
    # columnwise from its value in the backward (fusion/runtime/fp8_gemm.py), cheaper than a quantize kernel
    # writing both copies in the forward in place of the fused store
    ops += [QuantizeFP8Block(columnwise=False)] if quantize else []
    ops += [GroupLinear(E, fc2.in_features, fc2.out_features, weight_format="fp8_block")]
    w = fc1.weight
    fp8 = Sequential(*ops).to(w.device, w.dtype)
    with torch.no_grad():
        fp8[0].weight.copy_(fc1.weight)
        fp8[len(fp8) - 1].weight.copy_(fc2.weight)
    return fp8


#: Compiled for static shapes, as a user's are at a fixed token count (one graph per block shape, so dynamo's recompile
#: limit is raised for a run over every block: past it dynamo would run them eagerly, slower still); for dynamic shapes
#: until session t, which flattered the fused FP8 path.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


@torch.compile(dynamic=False)
def _rowwise_fp8(x):
    """Row-wise E4M3: one float32 scale per row (amax / 448)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / _E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


@torch.compile(dynamic=False)
def _act_scale_fp8(h, probs):
    g, u = h.chunk(2, dim=-1)
    a = (torch.nn.functional.silu(g.float()) * u.float() * probs.float()[:, None]).to(h.dtype)
    amax = a.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / _E4M3_MAX
    return a, (a.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


@torch.compile(dynamic=False)
def _act_scale_backward(h, da, probs):
    g, u = h.float().chunk(2, dim=-1)
    p = probs.float()[:, None]
    s = torch.sigmoid(g)
    silu = g * s
    dga = da.float() * p
    dg = dga * u * (s + silu * (1 - s))
    du = dga * silu
    dprobs = (da.float() * silu * u).sum(-1)
    return torch.cat([dg, du], -1).to(h.dtype), dprobs.to(probs.dtype)


def _weight_fp8(w):
    """(G, N, K) -> E4M3 (G, N, K) with one scale per output row N (row-wise over K), and its scales (G, N)."""
    amax = w.abs().amax(dim=-1).float().clamp_min(1e-12)
    scale = amax / _E4M3_MAX
    return (w.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def _mm(a8, sa, b8_nk, sb, offs, dtype):
    """A (M, K) x B[g] (N, K).T with row-wise scales."""
    return torch._scaled_grouped_mm(a8, b8_nk.transpose(-2, -1), sa, sb, offs=offs, out_dtype=dtype,
                                    use_fast_accum=True)


class _UnfusedFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, probs, offs, wq):
        x8, sx = _rowwise_fp8(x)
        h = _mm(x8, sx, wq["w1"], wq["s1"], offs, x.dtype)
        _, a8, sa = _act_scale_fp8(h, probs)
        y = _mm(a8, sa, wq["w2"], wq["s2"], offs, x.dtype)
        ctx.save_for_backward(x, h, probs, offs)
        ctx.wq = wq
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, probs, offs = ctx.saved_tensors
        wq = ctx.wq
        dy = dy.contiguous()
        a, _, _ = _act_scale_fp8(h, probs)
        dy8, sdy = _rowwise_fp8(dy)
        da = _mm(dy8, sdy, wq["w2t"], wq["s2t"], offs, dy.dtype)
        dw2 = torch._grouped_mm(dy.t(), a, offs=offs)
        dh, dprobs = _act_scale_backward(h, da, probs)
        dh8, sdh = _rowwise_fp8(dh)
        dx = _mm(dh8, sdh, wq["w1t"], wq["s1t"], offs, dy.dtype)
        dw1 = torch._grouped_mm(dh.t(), x, offs=offs)
        return dx, dw1, dw2, dprobs, None, None


class UnfusedFP8Path:
    """The baseline of issue 9: torch._scaled_grouped_mm (row-wise FP8) with compiled elementwise ops."""

    def __init__(self, seq, offsets, probs):
        if probs is None:
            raise ValueError("unfused_fp8 covers MoE blocks (the router scale); dense blocks are not measured")
        self.w1, self.w2 = seq[0].weight, seq[len(seq) - 1].weight
        self.params = [self.w1, self.w2]
        self.offsets, self.probs = offsets, probs
        with torch.no_grad():
            w1, s1 = _weight_fp8(self.w1)
            w2, s2 = _weight_fp8(self.w2)
            w1t, s1t = _weight_fp8(self.w1.transpose(-2, -1).contiguous())
            w2t, s2t = _weight_fp8(self.w2.transpose(-2, -1).contiguous())
        self.wq = dict(w1=w1, s1=s1, w2=w2, s2=s2, w1t=w1t, s1t=s1t, w2t=w2t, s2t=s2t)

    def forward(self, x):
        return _UnfusedFP8.apply(x, self.w1, self.w2, self.probs, self.offsets, self.wq)
