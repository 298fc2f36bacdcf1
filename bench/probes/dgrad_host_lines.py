"""Where FusedDgrad.run spends host time: a copy of its body with perf_counter marks between its parts,
monkeypatched over the class, around bench/host_split.py's step (GPU machine: `python bench/probes/dgrad_host_lines.py
--model small-batch` or `--moe qwen3-30b-a3b --tokens 1024`)."""
import collections
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from fusion.runtime import steps as S
from fusion.runtime.steps import gather_index, dequantize, slots, _poison, POISON, fp8_gemm, _weight_as_b, weight_of, v, segment_sum
T = collections.Counter()
N = [0]
def run(self, state):
    t0 = time.perf_counter()
    ctx = state.ctx
    index = gather_index(ctx) if state.dy_through_index and self.dy_tokens is not None else None
    dy = state.env[self.grad_in if index is None else self.dy_tokens]
    if type(dy) is not torch.Tensor:
        dy = dequantize(dy)
    dy = dy if dy.is_contiguous() else dy.contiguous()
    kernel = self.kernel(dy.dtype, "backward" if index is None else "backward_gather")
    weight = weight_of(self.gemm)
    G = weight.shape[0] if weight.dim() == 3 else 1
    M = dy.shape[0] if index is None else index.numel()
    tensors = {}
    for slot in self._slots[0]:
        if isinstance(slot, slots.SavedIn):
            tensors["saved"] = state.env[self.saved]
        elif isinstance(slot, slots.GroupBias):
            shared = self._shared_bias.setdefault(slot.position, S._SharedBias())
            tensors[slot.kernel_name] = shared(self.elementwise[slot.position].bias, G)
        else:
            tensors[slot.kernel_name] = ctx.extra[slot.name]
    t1 = time.perf_counter(); T["1 inputs"] += t1 - t0
    outs = self._allocate(M, dy.dtype, dy.device)
    t2 = time.perf_counter(); T["2 allocate"] += t2 - t1
    tensors.update(outs)
    if self.fp8:
        a, b = fp8_gemm.operand(dy), fp8_gemm.weight_operand(self.gemm, transposed=True)
    else:
        a, b = dy, _weight_as_b(weight)
    t3 = time.perf_counter(); T["3 operands"] += t3 - t2
    kernel.run(a, b, state.ctx.counters, tensors, state.counter_ptr(self.slot), index=index)
    t4 = time.perf_counter(); T["4 launch"] += t4 - t3
    env = state.env
    dinput = outs["dinput"]
    env[f"g{self.first}"] = dinput
    if self.quantized_dinput is not None:
        from fusion.runtime.kernel import BlockScaled
        env[self.quantized_dinput] = BlockScaled(outs["dinput_q"].view(torch.uint8), outs["dinput_q_scale"])
    t5 = time.perf_counter(); T["5 env"] += t5 - t4
    for kernel_name, name in self._scale_grads:
        state.add(state.extra_grads, name, S.row_sums(outs[kernel_name], ctx.extra[name].dtype,
                                                      self.launcher.name == "cute"))
    t5b = time.perf_counter(); T["6 scale grads"] += t5b - t5
    t6 = time.perf_counter()
    for op in self._biases:
        state.add(state.param_grads, id(op.bias), segment_sum(dinput, state.bounds, op.num_groups is not None))
    if self.postact:
        env[v(self.j)] = outs["postact"]
    t7 = time.perf_counter(); T["7 tail"] += t7 - t6
    del tensors, outs, dy, a, b
    T["8 frees"] += time.perf_counter() - t7
    N[0] += 1
S.FusedDgrad.run = run

from fusion.runtime import bounds as B  # noqa: E402
from fusion.runtime import program as P  # noqa: E402


def prologue(self, ctx, rows, device, counters):
    t0 = time.perf_counter()
    sizes = ctx.group_sizes
    compiled = self._kernel(sizes if self.grouped else None)
    t1 = time.perf_counter(); T["b1 lookup"] += t1 - t0
    buffer = torch.empty(self.groups + 1 + counters, dtype=torch.int32, device=device)
    t2 = time.perf_counter(); T["b2 empty"] += t2 - t1
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    compiled.launch(sizes.data_ptr() if self.grouped else buffer.data_ptr(), buffer.data_ptr(), rows, counters,
                    stream)
    T["b3 launch"] += time.perf_counter() - t2
    return buffer


def program_bounds(self, ctx, rows, device):
    t0 = time.perf_counter()
    routed = rows if ctx.index is None else ctx.index.numel()
    if self.prologue is not None and ctx.offsets is None:
        buffer = self.prologue(ctx, routed, device, self.counters)
    else:
        buffer = B.torch_bounds(ctx, routed, device, self.counters)
    t1 = time.perf_counter(); T["b0 prologue (all)"] += t1 - t0
    ctx.counters, ctx.groups, ctx.backward_counters_used = buffer, buffer.numel() - 1 - self.counters, False
    T["b4 ctx"] += time.perf_counter() - t1


def routed(self, ctx, rows, device, counters):
    t0 = time.perf_counter()
    sizes, index = ctx.routed_group_sizes, ctx.index
    head = self.groups + 1 + counters
    buffer = torch.empty(head + self.groups, dtype=torch.int32, device=device)
    index32 = torch.empty(rows, dtype=torch.int32, device=device)
    t1 = time.perf_counter(); T["r1 empties"] += t1 - t0
    key = (sizes.dtype, index.dtype)
    compiled = self._compiled.get(key)
    if compiled is None:
        from fusion.kernels.bounds import compile_routed_bounds

        compiled = self._compiled[key] = compile_routed_bounds(self.groups, B._SIZE_DTYPES[sizes.dtype],
                                                               B._SIZE_DTYPES[index.dtype])
    compiled.launch(sizes.data_ptr(), index.data_ptr(), buffer.data_ptr(), index32.data_ptr(), rows, ctx.tokens,
                    counters, torch._C._cuda_getCurrentRawStream(device.index))
    t2 = time.perf_counter(); T["r2 launch"] += t2 - t1
    ctx.derived["gather_index"] = index32
    bounds = buffer.narrow(0, 0, head)
    ctx.group_sizes = (buffer.narrow(0, head, self.groups) if B.SIZES_FROM_KERNEL else
                       torch.diff(bounds.narrow(0, 0, self.groups + 1)))
    T["r3 sizes"] += time.perf_counter() - t2
    return bounds


B.DevicePrologue.__call__ = prologue
B.RoutedPrologue.__call__ = routed
P.BlockProgram._bounds = program_bounds


def report():
    n = max(N[0], 1)
    for k in sorted(T): print(f"    {k:<14} {T[k] / n * 1e6:7.1f} us")


if __name__ == "__main__":
    import host_split

    class _Times(collections.Counter):
        def clear(self):   # host_split.measure clears its timers after the warm-up: these too
            super().clear()
            T.clear()
            N[0] = 0

    host_split.TIMES = _Times()
    profile = "--cprofile-backward" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--cprofile-backward"]
    if profile:   # cProfile of the backward, on autograd's device thread (where it runs): enabled inside it
        import cProfile
        import pstats

        from fusion.runtime import autograd

        prof = cProfile.Profile()
        inner = autograd._BlockFunction.backward

        def profiled(*a, **k):
            prof.enable()
            try:
                return inner(*a, **k)
            finally:
                prof.disable()

        autograd._BlockFunction.backward = staticmethod(profiled)
    host_split.main(args)
    if profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)
    print(f"  FusedDgrad.run by part ({N[0]} runs, all phases):")
    report()
