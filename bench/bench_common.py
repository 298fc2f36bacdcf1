"""Timing and comparison helpers shared by the benchmarks of record (bench_training_step.py, bench_moe.py).

measure() is the one definition of b2b_ms / sync_ms / host_us / peak_MB; on a CPU (the --dry-run of bench_moe)
the same loop runs with no device to wait for, and the metrics that only a GPU defines (host_us, peak_MB) are
None.
"""
from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


#: Calls per back-to-back window: 100 since session v (10 before). A window of ten steps of a few ms lasts less than
#: the card's power controller takes to answer (about 100 ms), so it timed the clocks the card had before it, not
#: the power-capped ones a loop runs at (docs/benchmarks.md, session v; bench/b2b_calls.py).
B2B_CALLS = 100


def measure(fn, clear, b2b_calls=B2B_CALLS, sync_calls=5, host_calls=5, device="cuda") -> dict:
    """`clear()` drops what a call leaves behind (gradients) before the memory baseline is taken."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(2):
        fn()
        synchronize(device)
    # back to back: one sync per window of b2b_calls calls
    t0 = time.perf_counter()
    for _ in range(b2b_calls):
        fn()
    synchronize(device)
    b2b_ms = (time.perf_counter() - t0) / b2b_calls * 1e3
    # synchronous per call
    times = []
    for _ in range(sync_calls):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    sync_ms = statistics.median(times) * 1e3
    if not cuda:
        return {"b2b_ms": round(b2b_ms, 4), "sync_ms": round(sync_ms, 4), "host_us": None, "peak_MB": None}
    # host: time to issue calls while the GPU is still busy with a long queue of work ahead of them
    host = []
    for _ in range(2):
        torch.cuda._sleep(int(2e8))  # ~100+ ms of GPU time: the host never waits for the GPU below
        t0 = time.perf_counter()
        for _ in range(host_calls):
            fn()
        host.append((time.perf_counter() - t0) / host_calls)
        torch.cuda.synchronize()
    # peak memory of one call beyond what is allocated before it
    torch.cuda.synchronize()
    clear()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak_mb = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    return {"b2b_ms": round(b2b_ms, 4), "sync_ms": round(sync_ms, 4), "host_us": round(min(host) * 1e6, 1),
            "peak_MB": round(peak_mb, 1)}


def graphed_ms(fn, replays: int = 20) -> float:
    """Milliseconds per replay of one call of `fn` captured in a CUDA graph: the call with its host work removed,
    as a user who captures the step (torch.cuda.graph, or torch.compile's mode="reduce-overhead") runs it. Where
    the host is the bottleneck (a small batch), this is the GPU time the path needs; elsewhere it is about the
    back-to-back time. The call is warmed up on a side stream first (compiles, caches and allocator pools made
    outside the capture), as torch.cuda.graph requires; a training step's gradients are then allocated in the
    graph's pool and rewritten by every replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / replays
    del graph
    torch.cuda.synchronize()
    return ms


class _Loss(torch.autograd.Function):
    """A scalar standing for the model's loss above the block: its gradient with respect to the block output y is a
    fresh copy of dy, made when the backward reaches it, that only autograd holds (as in a model, where the layer
    above makes dY). So each path frees dY when its own autograd lets go of it; `y.backward(dy)` would keep the
    caller's dy alive through the whole backward in every path (and torch.autograd.backward holds a gradient passed
    to it until it returns), hiding a path that keeps dY longer than it must. The copy costs each path the same."""

    @staticmethod
    def forward(ctx, y, dy):
        ctx.dy = dy
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return ctx.dy.clone(), None


def loss_of(y, dy):
    """A loss whose backward passes y a fresh copy of dy (see _Loss)."""
    return _Loss.apply(y, dy)


def phase_calls(forward, clear_grads, x, dy, train: bool):
    """(call, clear) for measure(): one no-grad forward, or one training step (forward of x with a gradient, then
    backward of a loss that hands the output a fresh copy of dy, the gradients dropped first); `clear` also drops
    x's gradient."""
    xg = x.detach().requires_grad_()

    def clear():
        clear_grads()
        xg.grad = None

    if not train:
        def fwd():
            with torch.no_grad():
                forward(x)
        return fwd, clear

    def step():
        clear()
        loss_of(forward(xg), dy).backward()
    return step, clear


def rel_errors(got: dict, want: dict) -> dict:
    """||got - want|| / ||want|| per tensor, in fp32 chunks of rows (a whole fp64 copy of an expert weight
    gradient does not fit beside the model on an 80 GB GPU)."""
    out = {}
    for k in want:
        if got.get(k) is None or want[k] is None:
            continue
        a, b = got[k].reshape(-1, got[k].shape[-1]), want[k].reshape(-1, want[k].shape[-1])
        num = den = 0.0
        for i in range(0, a.shape[0], 4096):
            num += (a[i:i + 4096].float() - b[i:i + 4096].float()).square().sum().item()
            den += b[i:i + 4096].float().square().sum().item()
        out[k] = round((num / max(den, 1e-60)) ** 0.5, 5)
    return out


def run_header(device="cuda") -> dict:
    """gpu (or "cpu"), date and commit of a run. FUSION_COMMIT names the commit where a copied tree has no
    history (the lent GPU machine). Otherwise git's HEAD, marked "+modified" where tracked files differ from it:
    the lent machine's copy of the tree can carry a .git older than the files (its HEAD then names a commit the
    run did not measure)."""
    gpu = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"
    return {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": os.environ.get("FUSION_COMMIT") or
            git_commit()}


def git_commit(cwd=HERE) -> str:
    """The short HEAD of the checkout at `cwd`, with "+modified" where its tracked files differ from HEAD;
    "unknown" without git history."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+modified" if git("status", "--porcelain", "--untracked-files=no") else "")


def median_ms(fn) -> float:
    """Median milliseconds of one call of a kernel benchmark (triton's do_bench, which flushes L2 between runs;
    CUDA events without triton)."""
    try:
        import triton
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    except ImportError:
        for _ in range(5):
            fn()
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def warm_gpu(fns, seconds: float = 0.5) -> None:
    """Run `fns` in turn, back to back, for at least `seconds` before a timed round, so that every row of a sweep is
    timed at the clocks a sustained load settles at. Without it the first row timed after a pause (a shape's setup)
    read up to 17% faster than the same kernel timed later in the round (bench/results/H100-2026-11-27e-fc1-sweep-b
    .json: Mixtral's FC1 forward 5.189 ms first, 5.640-5.732 in the middle of the rounds; Granite's 0.344 /
    0.368-0.404)."""
    fns = list(fns)
    if not fns:
        return
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
