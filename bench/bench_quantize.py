"""Bandwidth of the FP8-block quantize kernel (fusion/kernels/fp8_quantize.py) against a copy and the reference.

For each (M, K) shape: GB/s (bytes read + written, divided by the time of one call) of

* ``clone``: ``x.clone()`` (read and write x once: the ceiling a one-pass kernel aims at),
* ``kernel_rowwise``, ``kernel_rowwise_cw``: the kernel, rowwise and rowwise + columnwise (per-group blocks of
  ``--groups`` ragged groups),
* ``kernel_slots``, ``kernel_rowwise_slots``: the columnwise copy in the FP8 weight gradient's slot layout alone, and
  with the rowwise copy in the same pass (what an FP8 training step runs; its padding zeros are bytes written too),
* ``reference_rowwise``, ``reference_rowwise_cw``, ``reference_slots``: the eager torch reference
  (fusion.quant.fp8_block),

and ``of_clone``: the kernel's GB/s over clone's. The kernel rows also record whether the buffers equal the
reference's bit for bit. ``--dry-run`` runs tiny shapes with the reference only (CPU), so the script cannot rot.
``--ab-pairs`` (bf16): instead, the rowwise kernel built both ways of ``fusion.kernels.fp8_quantize.PAIRS`` (values
tested a packed pair at a time, or one at a time), timed in interleaved rounds, and whether both wrote the same bytes.

    python3 bench/bench_quantize.py [--json out.json] [--groups 32] [--shapes 65536x2048,...]
    python3 bench/bench_quantize.py --ab-pairs --shapes 65536x2048,65536x1536
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import run_header  # noqa: E402
from fusion.quant.fp8_block import fp8_block_quantize_2d, fp8_block_quantize_columnwise  # noqa: E402

#: MoE activations (tokens x hidden / expert width) and a small one
SHAPES = "65536x2048,32768x7168,131072x1536,4096x2048"
DRY_SHAPES = "256x256,130x200"
BLOCK = 128


def _sizes(M: int, G: int, device) -> torch.Tensor:
    """G ragged group sizes summing to M (a fixed seed), some empty."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(G, generator=g) + 0.1
    w[::5] = 0
    sizes = (w / w.sum() * M).floor().long()
    sizes[-1] += M - sizes.sum()
    return sizes.to(device)


def _bytes(M: int, K: int, elem: int, columnwise: bool, G: int) -> int:
    nkb = -(-K // BLOCK)
    total = M * K * elem + M * K + 4 * nkb * M
    if columnwise:
        total += M * K + 4 * (-(-M // BLOCK) + G) * K
    return total


def _time_ms(fn, iters: int, device) -> float:
    for _ in range(2):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _slot_bytes(M: int, K: int, elem: int, G: int, rowwise: bool) -> int:
    """Bytes a slot-layout quantization reads and writes: x, the (K, 128 * capacity) codes (zeros past each block's
    rows included) and the (capacity, K) scales, plus the rowwise codes and scales when it makes those too."""
    capacity = -(-M // BLOCK) + G
    total = M * K * elem + K * BLOCK * capacity + 4 * capacity * K
    return total + (M * K + 4 * -(-K // BLOCK) * M if rowwise else 0)


def _reference_slots(x, sizes):
    from fusion.quant.fp8_block import fp8_block_columnwise_slots

    data, scale = fp8_block_quantize_columnwise(x.float(), sizes)
    return fp8_block_columnwise_slots(data, sizes), scale


def _reference(x, columnwise, sizes):
    data, scale = fp8_block_quantize_2d(x.float())
    if not columnwise:
        return data, scale, None, None
    return (data, scale) + fp8_block_quantize_columnwise(x.float(), sizes)


def _equal(got, want) -> bool:
    return all((g is None and w is None) or (g.shape == w.shape and torch.equal(g.view(torch.uint8), w.view(torch.uint8)))
               for g, w in zip(got, want))


def run(shapes, dtype, G: int, device, kernel: bool, iters: int) -> list[dict]:
    rows = []
    for M, K in shapes:
        x = torch.randn(M, K, device=device).to(dtype)
        sizes = _sizes(M, G, device)
        elem = x.element_size()

        def row(path, ms, nbytes, **extra):
            rows.append(dict(M=M, K=K, dtype=str(dtype).removeprefix("torch."), path=path, ms=round(ms, 4),
                             GBps=round(nbytes / ms / 1e6, 1), **extra))

        row("clone", _time_ms(x.clone, iters, device), 2 * M * K * elem)
        clone_gbps = rows[-1]["GBps"]
        for columnwise in (False, True):
            suffix = "_cw" if columnwise else ""
            nbytes = _bytes(M, K, elem, columnwise, G)
            row("reference_rowwise" + suffix, _time_ms(lambda: _reference(x, columnwise, sizes), max(iters // 10, 1),
                                                       device), nbytes)
            if kernel:
                from fusion.kernels.fp8_quantize_api import quantize_fp8_block_device

                call = lambda: quantize_fp8_block_device(x, columnwise, sizes)  # noqa: E731
                ms = _time_ms(call, iters, device)
                matches = _equal(call(), _reference(x, columnwise, sizes))
                row("kernel_rowwise" + suffix, ms, nbytes, matches_reference=matches,
                    of_clone=round(nbytes / ms / 1e6 / clone_gbps, 3))
        row("reference_slots", _time_ms(lambda: _reference_slots(x, sizes), max(iters // 10, 1), device),
            _slot_bytes(M, K, elem, G, False))
        if kernel:
            from fusion.kernels.fp8_quantize_api import quantize_fp8_block_rowwise_slots, quantize_fp8_block_slots

            want = _reference_slots(x, sizes)
            for path, call, rowwise in (
                    ("kernel_slots", lambda: quantize_fp8_block_slots(x, sizes), False),
                    ("kernel_rowwise_slots", lambda: quantize_fp8_block_rowwise_slots(x, sizes), True)):
                nbytes = _slot_bytes(M, K, elem, G, rowwise)
                ms = _time_ms(call, iters, device)
                got = call()
                matches = _equal(got[-2:], want) and (not rowwise or _equal(got[:2], _reference(x, False, sizes)[:2]))
                row(path, ms, nbytes, matches_reference=matches, of_clone=round(nbytes / ms / 1e6 / clone_gbps, 3))
    return rows


def run_ab_pairs(shapes, device, reps: int = 10, iters: int = 20) -> list[dict]:
    """The bf16 rowwise kernel with fp8_quantize.PAIRS on and off (two builds: the switch is in the kernel's key),
    timed in ``reps`` rounds of ``iters`` calls each, the order alternating; the median ms of each."""
    import statistics

    import fusion.kernels.fp8_quantize as Q
    from fusion.kernels.fp8_quantize_api import quantize_fp8_block_device

    rows, default = [], Q.PAIRS
    try:
        for M, K in shapes:
            x = torch.randn(M, K, device=device).to(torch.bfloat16)
            x.view(-1)[:: 997] = float("inf")   # a few non-finite values, so the comparison covers them
            clone_ms = _time_ms(x.clone, iters, device)
            outs, times = {}, {True: [], False: []}
            for pairs in (True, False):
                Q.PAIRS = pairs
                outs[pairs] = quantize_fp8_block_device(x, False, None)
            for r in range(reps):
                for pairs in ((True, False) if r % 2 else (False, True)):
                    Q.PAIRS = pairs
                    times[pairs].append(_time_ms(lambda: quantize_fp8_block_device(x, False, None), iters, device))
            same = _equal(outs[True], outs[False])
            nbytes = _bytes(M, K, 2, False, 1)
            for pairs in (True, False):
                ms = statistics.median(times[pairs])
                rows.append(dict(M=M, K=K, dtype="bfloat16", path="kernel_rowwise_" + ("pairs" if pairs else "values"),
                                 ms=round(ms, 4), GBps=round(nbytes / ms / 1e6, 1),
                                 of_clone=round(clone_ms * nbytes / (2 * M * K * 2) / ms, 3), same_bytes=same))
    finally:
        Q.PAIRS = default
    return rows


def _table(rows) -> str:
    head = f"{'M':>7} {'K':>5} {'dtype':>8} {'path':>22} {'ms':>9} {'GB/s':>8} {'of clone':>8}  exact"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['M']:>7} {r['K']:>5} {r['dtype']:>8} {r['path']:>22} {r['ms']:>9.4f} {r['GBps']:>8.1f} "
                     f"{r.get('of_clone', ''):>8}  {r.get('matches_reference', r.get('same_bytes', ''))}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=None, help=f"MxK,... (default {SHAPES})")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--groups", type=int, default=32, help="groups of the columnwise blocks")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, the reference only, on the CPU")
    p.add_argument("--ab-pairs", action="store_true", help="the bf16 rowwise kernel's two builds (PAIRS on, off)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    spec = args.shapes or (DRY_SHAPES if args.dry_run else SHAPES)
    shapes = [tuple(int(v) for v in s.split("x")) for s in spec.split(",")]
    iters = 2 if args.dry_run else args.iters
    if args.ab_pairs:
        rows = run_ab_pairs(shapes, device, iters=iters)
    else:
        rows = run(shapes, getattr(torch, args.dtype), args.groups, device, kernel=not args.dry_run, iters=iters)
    result = dict(run_header(device.type), groups=args.groups, rows=rows)
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
