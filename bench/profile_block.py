"""Where a fused training step spends its time: each forward/backward piece of the block, timed alone.

Prints one table per shape: the pieces of fusion's fused step and the torch._grouped_mm equivalents of its
GEMMs (same shapes), so a slow piece stands out. Usage: python bench/profile_block.py [--shapes i,j]
"""
import argparse

import torch

from fusion import GroupLinear, Scale, Sequential, SwiGLU
from fusion.grouped import _dgrad, _wgrad
from fusion.planner import plan_for_run
from fusion.runtime.backward import block_run
from fusion.sequential import make_context

SHAPES = [(8, 32768, 4096, 28672), (32, 65536, 2880, 5760), (128, 196608, 1536, 512), (32, 49152, 1536, 2048),
          (32, 32768, 7168, 4096)]


def bench(fn):
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0,4")
    args = ap.parse_args()
    for i in [int(s) for s in args.shapes.split(",")]:
        E, M, d, f2 = SHAPES[i]
        f = f2 // 2
        block = Sequential(GroupLinear(E, d, f2), SwiGLU(), Scale(), GroupLinear(E, f, d)).cuda().bfloat16()
        w = torch.rand(E) + 0.5
        sizes = torch.floor(w / w.sum() * M).long()
        sizes[0] += M - int(sizes.sum())
        sizes = sizes.cuda()
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        probs = torch.rand(M, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        ctx = make_context(block.ops, x, {"group_sizes": sizes, "scale": probs}, check_sum=False)
        plan = plan_for_run(block, x)
        run = block_run(block, plan)
        from fusion.kernels import offsets_from_group_sizes

        f1 = run.forward_steps[0][1]
        b1 = run.backward_steps[0][1]
        offs = offsets_from_group_sizes(sizes)
        outs = f1.launch(x, ctx, train=True)
        h = outs["out"]
        W1, W2 = block[0].weight, block[3].weight
        rows = {}
        rows["F1 fused fwd (train: +pre)"] = bench(lambda: f1.launch(x, ctx, train=True))
        rows["F1 fused fwd (inference)"] = bench(lambda: f1.launch(x, ctx, train=False))
        rows["F2 fwd (gmm)"] = bench(lambda: torch._grouped_mm(h, W2.transpose(-2, -1), offs=ctx.offsets))
        rows["B1 dgrad FC2 + dSwiGLU*s (ours)"] = bench(lambda: b1.run(dy, outs["pre"], ctx, offs, block))
        dpre, _ = b1.run(dy, outs["pre"], ctx, offs, block)
        rows["  gmm dgrad FC2 alone"] = bench(lambda: _dgrad(dy, W2, sizes, ctx.offsets, "grouped_mm"))
        rows["dgrad FC1 (gmm)"] = bench(lambda: _dgrad(dpre, W1, sizes, ctx.offsets, "grouped_mm"))
        rows["wgrad FC2 (gmm)"] = bench(lambda: _wgrad(dy, h, sizes, ctx.offsets, "grouped_mm", W2.shape))
        rows["wgrad FC1 (gmm)"] = bench(lambda: _wgrad(dpre, x, sizes, ctx.offsets, "grouped_mm", W1.shape))
        xr = x.clone().requires_grad_()
        rows["whole fused step"] = bench(lambda: torch.autograd.backward(block(xr, group_sizes=sizes, scale=probs), dy))
        print(f"\nshape E,M,d,2f = {(E, M, d, f2)}")
        for k, v in rows.items():
            print(f"  {k:<32} {v:8.3f} ms")
        del block, x, dy, outs, h, dpre, xr
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
