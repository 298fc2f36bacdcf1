"""One table: training step (forward + backward) of an MoE MLP block, fused plan vs the unfused reference.

Block: GroupLinear(E, d, 2f) -> SwiGLU -> Scale (router probs) -> GroupLinear(E, f, d), bf16, on the shapes of
bench_grouped_gemm.py. "fused" is backend="auto" (forward kernels + fused dgrad/d-SwiGLU backward kernels);
"reference" is backend="reference" (torch._grouped_mm GEMMs, eager elementwise ops, autograd). Both run the
same weights and inputs in the same process. TFLOP/s counts the six GEMMs (3 forward-equivalents x 2 GEMMs).
Usage: python bench/bench_block.py [--shapes i,j]
"""
import argparse
import copy

import torch

import fusion
from fusion import GroupLinear, Scale, Sequential, SwiGLU

SHAPES = [(8, 32768, 4096, 28672), (32, 65536, 2880, 5760), (128, 196608, 1536, 512), (32, 49152, 1536, 2048),
          (32, 32768, 7168, 4096)]


def bench(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None)
    args = ap.parse_args()
    idx = [int(i) for i in args.shapes.split(",")] if args.shapes else range(len(SHAPES))
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for i in idx:
        E, M, d, f2 = SHAPES[i]
        f = f2 // 2
        fused = Sequential(GroupLinear(E, d, f2), SwiGLU(), Scale(), GroupLinear(E, f, d)).cuda().bfloat16()
        ref = copy.deepcopy(fused)
        ref.backend = "reference"
        w = torch.rand(E) + 0.5
        sizes = torch.floor(w / w.sum() * M).long()
        sizes[0] += M - int(sizes.sum())
        sizes = sizes.cuda()
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)

        def step(block):
            return lambda: torch.autograd.backward(block(x, group_sizes=sizes, scale=probs), dy)

        r = {"shape": (E, M, d, f2), "flops": 3 * (2.0 * M * d * f2 + 2.0 * M * f * d)}
        for name, block in (("fused", fused), ("reference", ref)):
            step(block)()  # compile, repack, warm up
            r[name] = bench(step(block))
        # same gradients (one more step of each from zeroed grads)
        grads = []
        for block in (fused, ref):
            x.grad = probs.grad = None
            block.zero_grad()
            step(block)()
            grads.append((x.grad.float().clone(), block[0].weight.grad.float().clone()))
        r["err"] = max(((a - b).norm() / b.norm()).item() for a, b in zip(*grads))
        rows.append(r)
        print(r, flush=True)
        del fused, ref, x, probs, dy
        torch.cuda.empty_cache()
    print()
    hdr = f"{'E,M,d,2f':>26} | {'fused ms':>9} | {'TFLOP/s':>7} | {'reference ms':>12} | {'TFLOP/s':>7} | fused/ref speedup | grad rel err"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        fl = r["flops"]
        print(f"{str(r['shape']):>26} | {r['fused']:9.3f} | {fl / r['fused'] / 1e9:7.0f} | {r['reference']:12.3f} |"
              f" {fl / r['reference'] / 1e9:7.0f} | {r['reference'] / r['fused']:17.2f} | {r['err']:.1e}")
    print("(one training step: forward + backward of the whole block, median of do_bench)")


if __name__ == "__main__":
    main()
