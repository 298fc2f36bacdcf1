"""Bisect a device fault of the FP8 block-scaled grouped GEMM (kernels/fp8_gemm.py): one GPU call, each
variant in its own process (a trap such as "illegal instruction" kills the process's CUDA context).

Every variant builds the kernel with some of its parts changed or left out (Fp8DebugKnobs, overlap, the
scheduler) on a problem chosen so that only some of the parts are exercised, runs it once, and checks the
output against the float64 product of the dequantized operands (the GPU tests' per-element tolerance; with
the scales off, the product of the raw E4M3 codes). One line per variant:

    <name>  OK    max_err=... worst=<largest err/tol>       as expected: ...
    <name>  WRONG ... / CUDA ERROR <message> / HANG (killed after N s) / COMPILE ERROR <message>

The suspected cause at the time of writing: TMA boxes of the scales that start at a float offset that is not
16-byte aligned (``scales="unaligned"``, the kernel's original layout) trap; the kernel now starts every box
on a 16-byte boundary. The ``unaligned`` variants are expected to trap wherever a box start is unaligned and
to pass where every start happens to be aligned; the others are expected to pass. ``expect`` says which.

Usage (repository root, on the GPU machine): python3 bench/fp8_bisect.py [--only a,b] [--jobs 4]
[--timeout 120] [--list] [--compile-only (no GPU: compile every variant)]
"""
import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACC_TOL = 2.0 ** -9      # of sum |products|: FP8 tensor-core accumulation within a 128-wide k-block
OUT_TOL = 2.0 ** -8      # of |ref|: bf16 rounding of the output


@dataclass(frozen=True)
class Variant:
    name: str
    why: str
    G: int
    M: int
    N: int
    K: int
    sizes: tuple = ()            # group sizes; () = ragged random (a quarter of the groups empty)
    over: dict = field(default_factory=dict)   # GemmConfig overrides
    scales: str = "tma"
    regs: bool = True
    gated: bool = False
    bf16: bool = False           # the bf16 kernel, as a control of the machine
    num_ctas: object = None      # launch on this many CTAs (None: the default grid)
    expect: str = "ok"           # "ok" or "trap"


_TINY = dict(G=1, M=128, N=128, K=128, sizes=(128,))
VARIANTS = [
    Variant("bf16-control", "bf16 kernel, the failing test's shape (passes on this machine)", 8, 1000, 512, 64,
            bf16=True),
    Variant("tiny", "one tile, one k-tile: every scale box starts at float 0 (aligned either way)", **_TINY),
    Variant("tiny-unaligned-mode", "as tiny with the original box starts: all aligned here, so it must pass",
            scales="unaligned", **_TINY),
    Variant("tiny-noscales", "no scale TMA, unit scales", scales="off", **_TINY),
    Variant("tiny-noregs", "no setmaxnreg (168 registers everywhere)", regs=False, **_TINY),
    Variant("tiny-minimal", "no scales, no setmaxnreg: TMA of A/B + QGMMA + epilogue only",
            scales="off", regs=False, **_TINY),
    Variant("tiny-k64", "K = 64 < tile_k: A/B boxes half out of bounds", 1, 128, 128, 64, sizes=(128,)),
    Variant("sb-unaligned", "two k-tiles, two weight blocks: sb boxes at floats 1, 2, 3 (sa aligned); fixed",
            1, 128, 256, 256, sizes=(128,)),
    Variant("sb-unaligned-orig", "as sb-unaligned with the original box starts", 1, 128, 256, 256, sizes=(128,),
            scales="unaligned", expect="trap"),
    Variant("sa-unaligned", "ragged groups: sa boxes at odd rows (K = 128, N = 128: sb of group g at float g)",
            2, 256, 128, 128, sizes=(5, 251)),
    Variant("sa-unaligned-orig", "as sa-unaligned with the original box starts", 2, 256, 128, 128,
            sizes=(5, 251), scales="unaligned", expect="trap"),
    Variant("failing-test", "test_identity[G8-M1000-N512-K64-{}], fixed kernel", 8, 1000, 512, 64),
    Variant("failing-test-orig", "the same with the original box starts (the reported fault)", 8, 1000, 512, 64,
            scales="unaligned", expect="trap"),
    Variant("failing-test-noscales", "the same without scales", 8, 1000, 512, 64, scales="off"),
    Variant("failing-test-noregs", "the same without setmaxnreg", 8, 1000, 512, 64, regs=False),
    Variant("k4-7ctas", "4 k-tiles on 7 CTAs: where the removed overlapped fold gave wrong results", 8, 3001, 1024,
            512, num_ctas=7),
    Variant("odd-k-tail", "5 k-tiles (K % 128 = 16): odd tail, partial last k-block", 8, 2000, 1024, 528),
    Variant("dynamic", "dynamic scheduler, 130 groups", 130, 5000, 512, 384, over=dict(dynamic=True)),
    Variant("split-192", "tile_n = 192: tiles straddle weight blocks (two slots)", 8, 4099, 4096, 1024,
            over=dict(tile_m=128, tile_n=192, stages=5)),
    Variant("gated", "SwiGLU on [gate; up]: half boxes of B, two slots, up half straddling (N/2 = 2888)",
            8, 3000, 2 * 2888, 1024, gated=True),
]


# ------------------------------------------------------------------ child: one variant
def _ragged(G, M, gen):
    import torch
    if G == 1:
        return torch.tensor([M])
    w = torch.rand(G, generator=gen) + 0.05
    w[torch.randperm(G, generator=gen)[: max(1, G // 4)]] = 0
    s = torch.floor(w / w.sum() * M).to(torch.int64)
    s[int(torch.argmax(w))] += M - int(s.sum())
    return s


def _blocky(shape, gen, spread=6):
    """Gaussian values times 2^e per row and per 128-column block: every scale differs."""
    import torch
    *lead, R, C = shape
    x = torch.randn(*shape, generator=gen)
    row_e = torch.randint(-spread, spread + 1, (*lead, R, 1), generator=gen)
    blk_e = torch.randint(-spread // 2, spread // 2 + 1, (*lead, 1, -(-C // 128)), generator=gen)
    return x * torch.exp2((row_e + blk_e.repeat_interleave(128, -1)[..., :C]).float())


def _per_group(a, b, sizes):
    """(A @ B[g].T, |A| @ |B[g]|.T) over the rows of each group, float64."""
    import torch
    ref, mag, r = [], [], 0
    for g, n in enumerate(sizes.tolist()):
        ref.append(a[r:r + n] @ b[g].T)
        mag.append(a[r:r + n].abs() @ b[g].abs().T)
        r += n
    return torch.cat(ref), torch.cat(mag)


def _swiglu(ref, mag, scale):
    """silu(gate) * up * scale and its tolerance from the (gate, up) error bounds (the GPU test's)."""
    import torch
    n = ref.shape[1] // 2
    g, u, eg, eu = ref[:, :n], ref[:, n:], ACC_TOL * mag[:, :n], ACC_TOL * mag[:, n:]
    s = scale.double()[:, None]
    silu = torch.nn.functional.silu(g)
    val = silu * u * s
    tol = s.abs() * (1.1 * u.abs() * eg + (silu.abs() + 1.1 * eg) * eu) + 2.0 ** -7 * val.abs()
    return val, tol


def _compare(out, ref, tol):
    import torch
    x = out.double()
    bad_values = int((~torch.isfinite(x)).sum())
    err = (x - ref).abs()
    ratio = err / (tol + 1e-30)
    return dict(max_err=float(err.max()), worst=float(ratio.max()), nonfinite=bad_values,
                n_bad=int((ratio > 1).sum()), max_ref=float(ref.abs().max()))


def build(v: Variant):
    """Compile the variant's kernel (no GPU needed)."""
    sys.path.insert(0, ROOT)
    import fusion.kernels as K
    from fusion.kernels.fp8_gemm import Fp8DebugKnobs
    if v.bf16:
        return K.compile_grouped_gemm(K.choose_config(v.M, v.N, v.K, v.G), K.IdentityEpilogue(), "bfloat16",
                                      v.N, v.K, v.G)
    epi = K.SwiGLUScaleEpilogue() if v.gated else K.IdentityEpilogue()
    cfg = replace(K.cooperative_fp8_config(v.N, v.K, v.G, v.gated), **v.over)
    return K.compile_fp8_grouped_gemm(cfg, epi, v.N, v.K, v.G,
                                      debug=Fp8DebugKnobs(scales=v.scales, reg_realloc=v.regs))


def run_variant(v: Variant, compile_only=False) -> dict:
    t0 = time.time()
    comp = build(v)
    res = dict(compile_s=round(time.time() - t0, 1), kernel=comp.name, regs=comp.registers,
               smem=comp.shared_memory_bytes, frame=comp.frame_size)
    if compile_only:
        return res
    import torch
    import fusion.kernels as K
    from fusion.quant.fp8_block import fp8_block_dequantize_2d, fp8_block_quantize_2d
    from fusion.quant.fp8_weight import quantize_weight_fp8_block

    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor(v.sizes) if v.sizes else _ragged(v.G, v.M, gen)
    assert int(sizes.sum()) == v.M and len(sizes) == v.G
    offs = K.offsets_from_group_sizes(sizes.to(dev))
    x = _blocky((v.M, v.K), gen).to(dev)
    w = (_blocky((v.G, v.N, v.K), gen, spread=4) / v.K ** 0.5).to(dev)
    out = torch.full((v.M, v.N // 2 if v.gated else v.N), float("nan"), dtype=torch.bfloat16, device=dev)
    if v.bf16:
        a, b = x.bfloat16(), w.bfloat16()
        K.run_grouped_gemm(comp, a, b, offs, {"out": out})
        torch.cuda.synchronize()
        ref, mag = _per_group(a.double(), b.double(), sizes)
        return {**res, **_compare(out, ref, OUT_TOL * ref.abs() + 2.0 ** -12 * mag)}

    a_data, a_scale = fp8_block_quantize_2d(x)
    wq = quantize_weight_fp8_block(w)
    if v.scales == "off":   # the kernel multiplies by 1: the product of the raw codes
        a_dq = a_data.view(torch.float8_e4m3fn).float().double()
        b_dq = wq.data.view(torch.float8_e4m3fn).float().double()
    else:
        a_dq = fp8_block_dequantize_2d(a_data, a_scale).double()
        b_dq = wq.dequantize().double()
    extras = {}
    if v.gated:
        extras["scale"] = torch.rand(v.M, device=dev, generator=torch.Generator(dev).manual_seed(1))
    K.run_fp8_grouped_gemm(comp, a_data, a_scale, wq.data, wq.scale, offs, {"out": out}, extras=extras,
                           num_ctas=v.num_ctas)
    torch.cuda.synchronize()
    ref, mag = _per_group(a_dq, b_dq, sizes)
    if v.gated:
        ref, tol = _swiglu(ref, mag, extras["scale"])
    else:
        tol = OUT_TOL * ref.abs() + ACC_TOL * mag
    return {**res, **_compare(out, ref, tol)}


def child(name: str, compile_only: bool):
    v = next(v for v in VARIANTS if v.name == name)
    try:
        res = run_variant(v, compile_only)
        res["status"] = ("COMPILED" if compile_only else
                         "OK" if res["nonfinite"] == 0 and res["n_bad"] == 0 else "WRONG")
    except Exception as e:  # noqa: BLE001 - reported to the parent, whatever it is
        text = f"{type(e).__name__}: {e}".strip().splitlines()
        cuda = any(s in text[0] for s in ("CUDA", "cuda", "AcceleratorError"))
        res = {"status": "CUDA ERROR" if cuda else "ERROR", "error": " | ".join(text[:3])[:400]}
    print("RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------ parent
def launch(v: Variant, timeout: int, compile_only: bool) -> dict:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", v.name] + (["--compile-only"] if compile_only else [])
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "HANG", "error": f"killed after {timeout} s (an mbarrier waiting for bytes that never "
                                           "come, or a scheduler that never ends)"}
    line = next((s for s in reversed(p.stdout.splitlines()) if s.startswith("RESULT ")), None)
    if line is None:
        tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-4:])
        return {"status": "DIED", "error": f"rc={p.returncode}: {tail[-400:]}"}
    res = json.loads(line[len("RESULT "):])
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def verdict(v: Variant, r: dict) -> str:
    if r["status"] == "COMPILED":
        return "compiled"
    trapped = r["status"] in ("CUDA ERROR", "DIED")
    if v.expect == "trap":
        return "as expected (trap)" if trapped else "UNEXPECTED: no trap"
    return "as expected" if r["status"] == "OK" else "UNEXPECTED"


def line(v: Variant, r: dict) -> str:
    if r["status"] in ("OK", "WRONG", "COMPILED"):
        body = "" if r["status"] == "COMPILED" else \
            f"max_err={r['max_err']:.3e} worst={r['worst']:.3g} bad={r['n_bad']} nonfinite={r['nonfinite']} "
        body += f"regs={r.get('regs')} smem={r.get('smem')} frame={r.get('frame')} compile={r.get('compile_s')}s"
    else:
        body = r.get("error", "")
    return f"{v.name:24s} {r['status']:10s} {body}  [{verdict(v, r)}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--jobs", type=int, default=4, help="variants at once (compiles are CPU-bound)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per variant")
    ap.add_argument("--list", action="store_true", help="list the variants and what each isolates")
    ap.add_argument("--compile-only", action="store_true", help="compile every variant, launch nothing (no GPU)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.compile_only)
    chosen = [v for v in VARIANTS if not args.only or v.name in args.only.split(",")]
    if args.list:
        for v in chosen:
            print(f"{v.name:24s} expect {v.expect:5s} {v.why}")
        return
    if not args.compile_only:
        import torch
        if not torch.cuda.is_available():
            sys.exit("fp8_bisect: no CUDA device (--compile-only compiles the variants without one)")
        print(f"# {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, {len(chosen)} variants, "
              f"{args.jobs} at a time", flush=True)
    # the variants expected to pass first, then those expected to trap (a fault stays in its own process,
    # but then nothing that should pass shares the GPU with one)
    results = {}
    for phase in ("ok", "trap"):
        batch = [v for v in chosen if v.expect == phase]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = {v.name: pool.submit(launch, v, args.timeout, args.compile_only) for v in batch}
            for v in batch:    # in order (later ones may finish first)
                results[v.name] = futures[v.name].result()
                print(line(v, results[v.name]), flush=True)
    print("\n# summary")
    for v in chosen:
        print(f"{v.name:24s} {results[v.name]['status']:10s} {verdict(v, results[v.name]):22s} {v.why}")
    unexpected = [v.name for v in chosen if verdict(v, results[v.name]) not in
                  ("as expected", "as expected (trap)", "compiled")]
    print("\n# all as expected" if not unexpected else f"\n# unexpected: {', '.join(unexpected)}")
    sys.exit(1 if unexpected else 0)


if __name__ == "__main__":
    main()
