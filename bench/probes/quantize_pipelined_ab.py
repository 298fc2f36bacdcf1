"""The FP8-block quantize kernel's slot-layout builds, pipelined (persistent CTAs whose next tiles load by cp.async
while the current one is encoded: fusion.kernels.fp8_quantize.PIPELINED) against one tile a CTA, on the tensors
the FP8 training step quantizes columnwise: a GEMM output gradient's two copies in one launch (rowwise + slots, as
fusion.runtime.fp8_gemm.quantize_for_backward runs it, and as its no-spill rule builds it) and the slot copy alone
(an FP8 weight gradient's input).
Interleaved rounds, medians; TB/s of bytes read and written and as a share of ``x.clone()``'s; every build's
buffers compared byte for byte with the other setting's. ``--switch COLUMN_PAIRS``: instead the A/B of
fusion.kernels.fp8_quantize.COLUMN_PAIRS (the columnwise values tested a packed bf16 pair at a time), or of
``PIPELINED_ROWWISE`` (the rowwise-only build pipelined too; its row is the one that setting changes), or of
``PIPELINED_COLUMNS`` (the (K, M) columnwise + rowwise build a user's ``QuantizeFP8Block(columnwise=True)`` runs,
pipelined; session ai), or of ``BLOCKS_FASTEST`` (that build's tile order), or of ``EDGE_BYTES_BY_LANES`` (its
columns' edge bytes by six lanes or by byte loops; session aj), or of ``SKIP_EMPTY_TILES`` (the pipelined
columnwise builds' tiles of unused capacity written as zeros without their encoding work; session ak).
``--dtype float16``: the input in fp16 (value-at-a-time encoding).

    python bench/probes/quantize_pipelined_ab.py [--shapes olmoe-fc1,mixtral-fc1] [--rounds 5] [--out r.json]
        [--switch PIPELINED_COLUMNS|BLOCKS_FASTEST|EDGE_BYTES_BY_LANES|SKIP_EMPTY_TILES] [--dtype bfloat16|float16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench_quantize import _sizes, _time_ms  # noqa: E402

#: name: (rows M, width K, groups): output gradients and inputs of the FP8 blocks' GEMMs
SHAPES = {"olmoe-fc1": (65536, 2048, 64), "qwen3-30b-a3b-fc1": (65536, 1536, 128),
          "qwen3-30b-a3b-fc2-in": (65536, 768, 128), "mixtral-fc1": (16384, 28672, 8),
          "mixtral-fc2": (16384, 4096, 8), "llama-3-70b-fc1": (8192, 57344, 1),
          "small-batch-fc1": (4096, 2048, 8)}


def builds(x, sizes):
    """name: (callable returning the buffers, bytes read + written)."""
    from fusion.kernels.fp8_quantize_api import (quantize_fp8_block_device, quantize_fp8_block_rowwise_slots,
                                                 quantize_fp8_block_slots)

    M, K = x.shape
    read, codes = x.element_size() * M * K, M * K
    return {"rowwise + slots (2 CTAs)": (lambda: quantize_fp8_block_rowwise_slots(x, sizes, 2), read + 2 * codes),
            "rowwise + slots (rule)": (lambda: quantize_fp8_block_rowwise_slots(x, sizes, 0), read + 2 * codes),
            "slots": (lambda: quantize_fp8_block_slots(x, sizes), read + codes),
            "rowwise only": (lambda: quantize_fp8_block_device(x, False, None), read + codes),
            "(K x M) columnwise + rowwise": (lambda: quantize_fp8_block_device(x, True, sizes), read + 2 * codes)}


def run(name, rounds, iters, device, switch="PIPELINED", dtype=torch.bfloat16, only=()):
    from fusion.kernels import fp8_quantize

    M, K, G = SHAPES[name]
    x = torch.randn(M, K, device=device).to(dtype)
    x.view(-1)[::997] = float("inf")
    x[: M // 3 : 7] *= 1e-30
    sizes = _sizes(M, G, device).to(torch.int32)
    clone_ms = statistics.median(_time_ms(lambda: x.clone(), iters, device) for _ in range(3))
    clone_tbps = 2 * x.element_size() * M * K / clone_ms / 1e9
    print(f"  {name}: M={M} K={K} G={G}  clone {clone_ms:.4f} ms {clone_tbps:.2f} TB/s", flush=True)
    out = {"shape": dict(M=M, K=K, G=G), "clone_ms": round(clone_ms, 4), "builds": {}}
    for build, (fn, nbytes) in builds(x, sizes).items():
        if only and build not in only:
            continue
        results, times = {}, {True: [], False: []}
        original = getattr(fp8_quantize, switch)
        for setting in (False, True):
            setattr(fp8_quantize, switch, setting)
            results[setting] = [t.clone() if t is not None else None for t in fn()]
        same = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(results[True], results[False]))
        for r in range(rounds):
            for setting in ((True, False) if r % 2 else (False, True)):
                setattr(fp8_quantize, switch, setting)
                times[setting].append(_time_ms(fn, iters, device))
        setattr(fp8_quantize, switch, original)
        row = {}
        for setting, label in ((False, "off"), (True, "on")):
            ms = statistics.median(times[setting])
            tbps = nbytes / ms / 1e9
            row[label] = dict(ms=round(ms, 4), TBps=round(tbps, 2), of_clone=round(tbps / clone_tbps, 3))
        change = row["on"]["ms"] / row["off"]["ms"] - 1
        print(f"    {build:26s} {switch} off {row['off']['ms']:8.4f} ms "
              f"({row['off']['of_clone']:.2f} of clone)  on {row['on']['ms']:8.4f} ms "
              f"({row['on']['of_clone']:.2f})  change {change:+.1%}  same bytes: {same}", flush=True)
        out["builds"][build] = dict(row, change=round(change, 4), same_bytes=same)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--switch", default="PIPELINED", choices=["PIPELINED", "COLUMN_PAIRS", "PIPELINED_ROWWISE",
                                                                "PIPELINED_COLUMNS", "BLOCKS_FASTEST",
                                                                "EDGE_BYTES_BY_LANES", "SKIP_EMPTY_TILES"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--builds", default="", help="comma-separated build names (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    dtype = getattr(torch, args.dtype)
    results = {n: run(n, args.rounds, args.iters, device, args.switch, dtype,
                      tuple(b for b in args.builds.split(",") if b)) for n in args.shapes.split(",")}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "switch": args.switch, "dtype": args.dtype,
                       "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
