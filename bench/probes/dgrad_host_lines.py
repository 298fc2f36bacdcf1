"""Where the fused dgrad step and the bounds prologue spend host time: their bodies with timers between the parts.

    python bench/probes/dgrad_host_lines.py --model small-batch                    # GPU machine
    python bench/probes/dgrad_host_lines.py --moe qwen3-30b-a3b --tokens 1024 [--calls 100] [--cprofile-backward]

Around bench/host_split.py's step (its per-step split first), this prints the parts of `FusedDgrad.run`
(fusion/runtime/steps.py), `DevicePrologue.__call__` / `RoutedPrologue.__call__` (fusion/runtime/bounds.py) and
`BlockProgram._bounds` (fusion/runtime/program.py) in µs per call. They are *copies* of those bodies, as of session x,
with `perf_counter` marks added and monkeypatched over the classes: a change to the originals must be made here too
before the figures mean anything. `--cprofile-backward` also profiles the backward on autograd's device thread
(cProfile sees only the thread it is enabled on). Session x found the scale gradient's torch sum and cast there
(80 of the fused dgrad's 193 µs) and the routed prologue's torch.diff (44-53 µs).
"""
import collections
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from fusion.runtime import bounds as B  # noqa: E402
from fusion.runtime import program as P  # noqa: E402
from fusion.runtime import steps as S  # noqa: E402

T: "collections.Counter[str]" = collections.Counter()   # seconds per part, summed over the calls
N = [0]                                                  # FusedDgrad.run calls timed


class _Marks:
    """`mark(part)` adds the time since the previous mark (or the start) to T[part]."""

    def __init__(self):
        self.last = time.perf_counter()

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        T[part] += now - self.last
        self.last = now


def fused_dgrad_run(self, state):
    mark = _Marks()
    ctx = state.ctx
    index = S.gather_index(ctx) if state.dy_through_index and self.dy_tokens is not None else None
    dy = state.env[self.grad_in if index is None else self.dy_tokens]
    if type(dy) is not torch.Tensor:
        dy = S.dequantize(dy)
    dy = dy if dy.is_contiguous() else dy.contiguous()
    kernel = self.kernel(dy.dtype, "backward" if index is None else "backward_gather")
    weight = S.weight_of(self.gemm)
    G = weight.shape[0] if weight.dim() == 3 else 1
    M = dy.shape[0] if index is None else index.numel()
    tensors = {}
    for slot in self._slots[0]:
        if isinstance(slot, S.slots.SavedIn):
            tensors["saved"] = state.env[self.saved]
        elif isinstance(slot, S.slots.GroupBias):
            shared = self._shared_bias.setdefault(slot.position, S._SharedBias())
            tensors[slot.kernel_name] = shared(self.elementwise[slot.position].bias, G)
        else:
            tensors[slot.kernel_name] = ctx.extra[slot.name]
    mark("1 inputs")
    outs = self._allocate(M, dy.dtype, dy.device)
    mark("2 allocate")
    tensors.update(outs)
    if self.fp8:
        a, b = S.fp8_gemm.operand(dy), S.fp8_gemm.weight_operand(self.gemm, transposed=True)
    else:
        a, b = dy, S._weight_as_b(weight)
    mark("3 operands")
    kernel.run(a, b, state.ctx.counters, tensors, state.counter_ptr(self.slot), index=index)
    mark("4 launch")
    env = state.env
    dinput = outs["dinput"]
    env[f"g{self.first}"] = dinput
    if self.quantized_dinput is not None:
        from fusion.runtime.kernel import BlockScaled

        env[self.quantized_dinput] = BlockScaled(outs["dinput_q"].view(torch.uint8), outs["dinput_q_scale"])
    mark("5 env")
    for kernel_name, name in self._scale_grads:
        state.add(state.extra_grads, name, S.row_sums(outs[kernel_name], ctx.extra[name].dtype,
                                                      self.launcher.name == "cute"))
    mark("6 scale grads")
    for op in self._biases:
        state.add(state.param_grads, id(op.bias), S.segment_sum(dinput, state.bounds, op.num_groups is not None))
    if self.postact:
        env[S.v(self.j)] = outs["postact"]
    mark("7 tail")
    del tensors, outs, dy, a, b
    mark("8 frees")
    N[0] += 1


def device_prologue(self, ctx, rows, device, counters):
    mark = _Marks()
    sizes = ctx.group_sizes
    compiled = self._kernel(sizes if self.grouped else None)
    mark("b1 lookup")
    buffer = torch.empty(self.groups + 1 + counters, dtype=torch.int32, device=device)
    mark("b2 empty")
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    compiled.launch(sizes.data_ptr() if self.grouped else buffer.data_ptr(), buffer.data_ptr(), rows, counters,
                    stream)
    mark("b3 launch")
    return buffer


def routed_prologue(self, ctx, rows, device, counters):
    mark = _Marks()
    sizes, index = ctx.routed_group_sizes, ctx.index
    head = self.groups + 1 + counters
    buffer = torch.empty(head + self.groups, dtype=torch.int32, device=device)
    index32 = torch.empty(rows, dtype=torch.int32, device=device)
    mark("r1 empties")
    key = (sizes.dtype, index.dtype)
    compiled = self._compiled.get(key)
    if compiled is None:
        from fusion.kernels.bounds import compile_routed_bounds

        compiled = self._compiled[key] = compile_routed_bounds(self.groups, B._SIZE_DTYPES[sizes.dtype],
                                                               B._SIZE_DTYPES[index.dtype])
    compiled.launch(sizes.data_ptr(), index.data_ptr(), buffer.data_ptr(), index32.data_ptr(), rows, ctx.tokens,
                    counters, torch._C._cuda_getCurrentRawStream(device.index))
    mark("r2 launch")
    ctx.derived["gather_index"] = index32
    bounds = buffer.narrow(0, 0, head)
    ctx.group_sizes = (buffer.narrow(0, head, self.groups) if B.SIZES_FROM_KERNEL else
                       torch.diff(bounds.narrow(0, 0, self.groups + 1)))
    mark("r3 sizes")
    return bounds


def program_bounds(self, ctx, rows, device):
    mark = _Marks()
    routed = rows if ctx.index is None else ctx.index.numel()
    if self.prologue is not None and ctx.offsets is None:
        buffer = self.prologue(ctx, routed, device, self.counters)
    else:
        buffer = B.torch_bounds(ctx, routed, device, self.counters)
    mark("b0 prologue (all)")
    ctx.counters, ctx.groups, ctx.backward_counters_used = buffer, buffer.numel() - 1 - self.counters, False
    mark("b4 ctx")


S.FusedDgrad.run = fused_dgrad_run
B.DevicePrologue.__call__ = device_prologue
B.RoutedPrologue.__call__ = routed_prologue
P.BlockProgram._bounds = program_bounds


def report() -> None:
    calls = max(N[0], 1)
    for part in sorted(T):
        print(f"    {part:<18} {T[part] / calls * 1e6:7.1f} us")


def main(argv: list[str]) -> None:
    import host_split

    class _Times(collections.Counter):
        def clear(self):   # host_split.measure clears its timers after the warm-up: these too
            super().clear()
            T.clear()
            N[0] = 0

    host_split.TIMES = _Times()
    profile = "--cprofile-backward" in argv
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
    host_split.main([a for a in argv if a != "--cprofile-backward"])
    if profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)
    print(f"  FusedDgrad.run by part ({N[0]} runs, all phases):")
    report()


if __name__ == "__main__":
    main(sys.argv[1:])
