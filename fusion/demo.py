"""`python -m fusion demo`: build two MoE MLP blocks, print their plans, compile their fused kernels for
sm_90a, and run forward + backward on the best available device against a float64 reference."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

import fusion
from fusion import GroupLinear, QuantizeMXFP8, Scale, Sequential, SwiGLU


@dataclass(frozen=True)
class BlockShape:
    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    tokens: int

    def scaled(self, factor: int) -> "BlockShape":
        """A smaller copy for CPUs: hidden/intermediate/tokens divided by `factor`, alignment kept."""
        def shrink(v):
            return max(64, (v // factor) // 64 * 64)
        return BlockShape(self.name, self.experts, shrink(self.hidden), shrink(self.intermediate), self.top_k,
                          max(32, self.tokens // factor))


#: Public shapes of two MoE families (the expert counts of DeepSeek-V3 reduced to 32 for a demo).
GPT_OSS_LIKE = BlockShape("GPT-OSS-like", experts=32, hidden=2880, intermediate=2880, top_k=4, tokens=4096)
DEEPSEEK_LIKE = BlockShape("DeepSeek-like", experts=32, hidden=7168, intermediate=2048, top_k=8, tokens=2048)


def build_block(shape: BlockShape, dtype: torch.dtype, device) -> Sequential:
    """FC1 -> SwiGLU -> Scale (router probs) -> QuantizeMXFP8 -> FC2, the block of API.md.

    The weights are created on `device` in `dtype`: on "meta" (enough to explain and compile: plans and kernels
    depend on shapes, not values) nothing is allocated or initialised, where a CPU build of the full-size
    blocks would first fill gigabytes of float32 weights."""
    E, d, f = shape.experts, shape.hidden, shape.intermediate
    factory = {"device": device, "dtype": dtype}
    return Sequential(GroupLinear(E, d, 2 * f, **factory), SwiGLU(), Scale(), QuantizeMXFP8(),
                      GroupLinear(E, f, d, **factory)).to(device=device, dtype=dtype)


def routed_inputs(shape: BlockShape, dtype, device, generator):
    """Random routing: tokens * top_k rows spread unevenly over experts, some experts empty."""
    rows = shape.tokens * shape.top_k
    logits = torch.randn(shape.experts, generator=generator) * 1.5
    logits[torch.randperm(shape.experts, generator=generator)[: max(1, shape.experts // 8)]] = -float("inf")
    expert = torch.multinomial(torch.softmax(logits, 0), rows, replacement=True, generator=generator)
    sizes = torch.bincount(expert, minlength=shape.experts)
    x = torch.randn(rows, shape.hidden, generator=generator)
    probs = torch.rand(rows, generator=generator)
    return (x.to(device=device, dtype=dtype), sizes.to(device=device, dtype=torch.int32),
            probs.to(device=device, dtype=dtype))


def _timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def run_block(shape: BlockShape, device, dtype, compile_kernels: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    # Explaining and compiling read shapes only: a weightless (meta) copy of the block serves both.
    plan_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    shell = build_block(shape, plan_dtype, "meta")
    print(f"\n=== {shape.name}: E={shape.experts} d={shape.hidden} f={shape.intermediate} "
          f"rows={shape.tokens * shape.top_k} ({dtype}, {device}) ===\n")
    print(shell.explain(dtype=plan_dtype))
    kernels = []
    if compile_kernels:
        t0 = time.perf_counter()
        kernels = shell.compile(dtype=torch.bfloat16, target="sm_90a")
        print(f"\ncompiled {len(kernels)} fused kernel(s) for sm_90a in {time.perf_counter() - t0:.1f} s:")
        for k in kernels:
            print(f"  {k.name}: {k.registers} registers, {k.shared_memory_bytes} B shared memory, "
                  f"{len(k.cubin)} B cubin")
    mlp = build_block(shape, dtype, device)  # the weights, needed to run
    x, sizes, probs = routed_inputs(shape, dtype, device, gen)
    x.requires_grad_()
    # Warm up once (first-call work stays out of the timing), then time forward and backward.
    mlp(x, group_sizes=sizes, scale=probs).float().sum().backward()
    y, t_fwd = _timed(lambda: mlp(x, group_sizes=sizes, scale=probs), device)
    _, t_bwd = _timed(lambda: y.float().sum().backward(), device)

    ref = copy.deepcopy(mlp).to(device="cpu", dtype=torch.float64)
    ref.backend = "reference"
    y64 = ref(x.detach().cpu().double(), group_sizes=sizes.cpu(), scale=probs.cpu().double())
    err = ((y.detach().cpu().double() - y64).norm() / y64.norm()).item()
    return {"block": shape.name, "shape": f"E={shape.experts} d={shape.hidden} f={shape.intermediate}",
            "rows": x.shape[0], "fwd_ms": t_fwd, "bwd_ms": t_bwd, "rel_err": err, "kernels": len(kernels)}


def main(full: bool = False, compile_kernels: bool = True, device: str | None = None) -> int:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = [GPT_OSS_LIKE, DEEPSEEK_LIKE]
    if dev.type == "cpu" and not full:
        shapes = [s.scaled(8) for s in shapes]
        print("CPU run: shapes divided by 8 (pass --full for the real sizes). Fused kernels run on Hopper GPUs;")
        print("here every op runs its reference implementation, and the plan shown is the sm_90 plan.")
    print(f"fusion {fusion.__version__}, torch {torch.__version__}, device {dev}")
    rows = [run_block(s, dev, dtype, compile_kernels) for s in shapes]
    print("\n{:<14} {:<26} {:>7} {:>10} {:>10} {:>22}".format(
        "block", "shape", "rows", "fwd ms", "bwd ms", "rel err vs float64"))
    for r in rows:
        print("{block:<14} {shape:<26} {rows:>7} {fwd_ms:>10.2f} {bwd_ms:>10.2f} {rel_err:>22.2e}".format(**r))
    bound = 3e-2  # MXFP8 quantization of the intermediate dominates (E4M3 has 3 mantissa bits)
    bad = [r["block"] for r in rows if not r["rel_err"] < bound]
    if bad:
        print(f"FAILED: relative error above {bound} for {bad}")
        return 1
    return 0
