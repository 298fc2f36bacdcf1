"""One table: grouped GEMM + SwiGLU*scale on MoE shapes, all measured in the same run.

Columns: torch._grouped_mm alone; torch._grouped_mm + torch.compile'd swiglu*scale ("unfused");
quack gemm_act(swiglu, varlen); ours (the kernel with a hand-written SwiGLU*scale epilogue); fusion (the
product: fusion.Sequential(GroupLinear, SwiGLU, Scale) with its generated epilogue, the whole call);
dense bf16 8192^3 matmul as anchor.
TFLOP/s counts 2*M*K*(2N) for every column.
Usage: python bench/bench_grouped_gemm.py [--shapes i,j] [--no-quack] [--no-unfused]
"""
import argparse
import os
import sys
import time

import torch

import fusion.kernels as K  # the installed package (pip install .): its subpackages map folders of this repo

SHAPES = [  # (experts, routed rows, K = hidden, 2N)
    (8, 32768, 4096, 28672),
    (32, 65536, 2880, 5760),
    (128, 196608, 1536, 512),
    (32, 49152, 1536, 2048),
    (32, 32768, 7168, 4096),
]


def bench(fn, warmup=25, rep=200):
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def balanced_sizes(G, M, gen):
    # random but balanced: each expert gets M/G +- 20 %
    w = 1.0 + 0.4 * (torch.rand(G, generator=gen) - 0.5)
    s = torch.floor(w / w.sum() * M).to(torch.int64)
    s[0] += M - int(s.sum())
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--no-quack", action="store_true")
    ap.add_argument("--no-unfused", action="store_true")
    ap.add_argument("--configs", default=None, help="tile_n:stages list to try for ours, e.g. 256:4,128:6")
    args = ap.parse_args()
    idx = [int(i) for i in args.shapes.split(",")] if args.shapes else range(len(SHAPES))
    dev = "cuda"
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)

    a = torch.randn(8192, 8192, dtype=dt, device=dev)
    b = torch.randn(8192, 8192, dtype=dt, device=dev)
    t_dense = bench(lambda: a @ b)
    dense_tf = 2 * 8192 ** 3 / t_dense / 1e9
    del a, b
    print(f"dense 8192^3: {t_dense:.3f} ms {dense_tf:.0f} TFLOP/s", flush=True)

    quack_gemm_act = None
    if not args.no_quack:
        try:
            import quack_compat  # noqa: F401
            from quack.gemm_interface import gemm_act as quack_gemm_act
        except Exception as e:  # pragma: no cover
            print("quack unavailable:", repr(e))

    @torch.compile(dynamic=False)
    def swiglu_scale(h, s):
        g, u = h.chunk(2, -1)
        return torch.nn.functional.silu(g) * u * s[:, None]

    rows = []
    for i in idx:
        G, M, Kd, N2 = SHAPES[i]
        flops = 2.0 * M * Kd * N2
        sizes = balanced_sizes(G, M, gen)
        offs = K.offsets_from_group_sizes(sizes.to(dev))
        offs_end = offs[1:].contiguous()
        A = torch.randn(M, Kd, dtype=dt, device=dev)
        W = torch.randn(G, N2, Kd, dtype=dt, device=dev) / Kd ** 0.5
        scale = torch.rand(M, dtype=torch.float32, device=dev)
        r = {"shape": (G, M, Kd, N2)}
        t0 = time.time()
        r["gmm"] = bench(lambda: torch._grouped_mm(A, W.transpose(-2, -1), offs=offs_end))
        if not args.no_unfused:
            r["unfused"] = bench(lambda: swiglu_scale(torch._grouped_mm(A, W.transpose(-2, -1), offs=offs_end), scale))
        if quack_gemm_act is not None:
            try:
                Wt = W.transpose(-2, -1)
                f = lambda: quack_gemm_act(A, Wt, activation="swiglu", cu_seqlens_m=offs, store_preact=False,
                                           tuned=False)
                f()
                r["quack"] = bench(f)
            except Exception as e:
                print("quack failed:", repr(e)[:300])
        out = torch.empty(M, N2 // 2, dtype=dt, device=dev)
        epi = K.SwiGLUScaleEpilogue()
        cfgs = [K.choose_config(M, N2, Kd, G, True)]
        if args.configs:
            # tile_n:stages[p][d]  (p: pingpong, d: dynamic scheduler), e.g. 256:4,192:5p,192:5pd
            cfgs = []
            for c in args.configs.split(","):
                tn, rest = c.split(":")
                st = int(rest.rstrip("pd"))
                flags = rest[len(str(st)):]
                cfgs.append(K.GemmConfig(tile_n=int(tn), stages=st, dynamic="d" in flags, pingpong="p" in flags))
        best = None
        for cfg in cfgs:
            if N2 % cfg.tile_n and not cfg.pingpong:
                continue
            comp = K.compile_grouped_gemm(cfg, epi, "bfloat16", N2, Kd, G)
            f = lambda: K.run_grouped_gemm(comp, A, W, offs, {"out": out}, {"scale": scale})
            f()
            t = bench(f)
            print(f"  ours {cfg.tile_n}:{cfg.stages}{'p' if cfg.pingpong else ''}{'d' if cfg.dynamic else ''}"
                  f" {t:.3f} ms", flush=True)
            if best is None or t < best[0]:
                best = (t, cfg, comp)
        r["ours"] = best[0]
        # The product path: fusion.Sequential with the epilogue generated from the pattern library
        # (inference: no pre-activation saved), same weights and inputs.
        import fusion
        mlp = fusion.Sequential(fusion.GroupLinear(G, Kd, N2), fusion.SwiGLU(), fusion.Scale()).to(dev, dt)
        with torch.no_grad():
            mlp[0].weight.copy_(W)
            sizes_dev = sizes.to(dev)
            fused_out = mlp(A, group_sizes=sizes_dev, scale=scale)
            r["fusion"] = bench(lambda: mlp(A, group_sizes=sizes_dev, scale=scale))
        r["cfg"] = (f"{best[1].tile_m}x{best[1].tile_n}x{best[1].tile_k}s{best[1].stages}"
                    + ("p" if best[1].pingpong else "") + ("d" if best[1].dynamic else ""))
        # correctness spot check against the unfused result
        h = torch._grouped_mm(A, W.transpose(-2, -1), offs=offs_end).float()
        g_, u_ = h.chunk(2, -1)
        ref = torch.nn.functional.silu(g_) * u_ * scale[:, None]
        K.run_grouped_gemm(best[2], A, W, offs, {"out": out}, {"scale": scale})
        r["err"] = ((out.float() - ref).norm() / ref.norm()).item()
        r["fusion_err"] = ((fused_out.float() - ref).norm() / ref.norm()).item()
        r["flops"] = flops
        rows.append(r)
        print(r, f"({time.time() - t0:.0f}s)", flush=True)
        del A, W, out, h, ref, g_, u_, mlp, fused_out

    def tf(t, fl):
        return fl / t / 1e9 if t else float("nan")

    print()
    hdr = (f"{'G,M,K,2N':>26} | {'gmm':>11} | {'unfused':>11} | {'quack':>11} | {'ours':>11} | {'fusion':>11} |"
           f" ours/quack | ours/unf | ours/dense | fusion/quack | fusion/unf | cfg | err")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        fl = r["flops"]
        cells = []
        for k in ("gmm", "unfused", "quack", "ours", "fusion"):
            t = r.get(k)
            cells.append(f"{t:6.3f}/{tf(t, fl):4.0f}" if t else f"{'-':>11}")
        q = r.get("quack")
        u = r.get("unfused")
        print(f"{str(r['shape']):>26} | " + " | ".join(cells) +
              f" | {q / r['ours'] if q else float('nan'):10.2f} | {u / r['ours'] if u else float('nan'):8.2f} |"
              f" {tf(r['ours'], fl) / dense_tf:10.2f} |"
              f" {q / r['fusion'] if q else float('nan'):12.2f} | {u / r['fusion'] if u else float('nan'):10.2f} |"
              f" {r['cfg']} | {r['err']:.1e}/{r['fusion_err']:.1e}")
    print(f"(cells: ms/TFLOP/s; ours = the kernel with its hand-written SwiGLU*scale epilogue; fusion = "
          f"fusion.Sequential(GroupLinear, SwiGLU, Scale) with the generated epilogue, whole call; "
          f"dense 8192^3 bf16 = {dense_tf:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
