"""A block's forward replayed as its launches: issue 7's host time per forward call.

The interpretive forward (fusion/runtime/program.py) walks the plan on every call: it looks up each step's kernel,
allocates each output, binds each launch's pointers through dictionaries of named values. On an H200 machine that
was 68-72 µs of host time for the small block's no-grad forward, whose three launches and three allocations alone
cost 22 (bench/probes/host_floor.py), and about twice that recording for autograd.

After an interpretive call at some rows, the block keeps that call's launches here, each bound at the call's shape by
the code that ran it (`replay_launch` of fusion/runtime/steps.py: the step's kernels.api.BoundGemm and where each of
its pointers comes from). A later call at the same rows runs the guards below, then makes exactly what the
interpretive call made, in the same order on the same stream: the bounds prologue (the group sizes checked on the
device, the row bounds and zeroed tile counters written), then each step's kernel.

Two kinds, one per forward mode (`train`):
  * no grad (`BlockRunner.__call__` under torch.no_grad / inference_mode): two allocations, the output and one
    scratch buffer holding the call's bounds buffer and every intermediate value (the caller sees none of them).
    It runs before the input checks: its guards are those checks, as comparisons against the shapes, dtypes and
    devices it was built at.
  * training (the autograd node's forward, after the input checks made the call's context): the bounds buffer and
    each value the plan saves are tensors of their own (the backward reads them; an intermediate it does not read
    stays in a scratch buffer that is freed with the forward), and the call's context gets its bounds buffer as
    program.forward would set it.

Any guard that fails returns None and the interpretive path runs (and raises its error where the call is wrong).
A plan with a step the replay cannot repeat (torch's GEMM, a quantized output, a gather, FP8 operands, an op's
reference) is never replayed. `ENABLED = False` turns replays off, and builds none (bench/ab_switch.py's A/B).
"""
from __future__ import annotations

import torch

from fusion.dataflow import v
from fusion.kernels import tile_policy
from fusion.runtime import lone_gemm
from fusion.runtime.bounds import DevicePrologue
from fusion.runtime.kernel import LAUNCHES
from fusion.runtime.steps import POISON

#: Read per call: False runs every call through the interpretive forward (the replay's A/B switch).
ENABLED = True

#: Each value in a scratch buffer starts at a multiple of this (TMA needs 16 bytes; 256 keeps rows' sectors whole)
ALIGN = 256

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# where a launch's pointers come from, per call: x, the block output, the scratch buffer, the bounds buffer, then
# the extra inputs (in ForwardReplay.extras order), then the saved tensors (training: in ForwardReplay.saved order)
X, OUT, SCRATCH, BOUNDS, EXTRAS = 0, 1, 2, 3, 4


def _switches() -> tuple:
    """The module switches a lone GEMM's rule reads per call (lone_gemm._takes): a replay holds for these only."""
    return (lone_gemm.ENABLED, lone_gemm.WIDE_TILE, lone_gemm.OUTPUT_BUDGET, tile_policy.DYNAMIC_PAIRS,
            tile_policy.DYNAMIC_PAIRS_MAX_GROUPS)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class ForwardReplay:
    """One block's forward at one call shape (rows, and the extra inputs' dtypes) in one mode, made by :func:`build`.
    No grad: `replay(x, extra)` returns the block output; training: `replay.train(x, ctx)` returns (output, saved
    values in plan.saves order) and sets ctx's bounds buffer. Either returns None where a guard fails."""

    def __init__(self, runner, x: torch.Tensor, ctx, launches: list, prologue, train: bool):
        program = runner.program
        self.params = runner.params
        self.train_mode = train
        self.dtype, self.device, self.index = x.dtype, x.device, x.get_device()
        self.x_shape = tuple(x.shape)
        self.rows = x.shape[0]
        self.names = runner.seq.inputs.names
        # the extra inputs as the interpretive call's checks took them: (name, dtype, shape)
        self.extras = tuple((name, t.dtype, tuple(t.shape)) for name, t in
                            (("group_sizes", ctx.routed_group_sizes), *ctx.extra.items()) if t is not None)
        self.sizes_dtype = None if ctx.routed_group_sizes is None else ctx.routed_group_sizes.dtype
        self.prologue = prologue
        self.counters = program.counters
        self.groups = ctx.groups
        self.bounds_numel = ctx.counters.numel()   # G + 1 bounds, then the tile counters (int32)
        extra_slot = {name: EXTRAS + k for k, (name, _, _) in enumerate(self.extras)}
        last = v(len(program.plan.ops))
        kept = set(program.plan.saves) if train else set()
        where = {v(0): (X, 0)}
        offset = 0 if train else _aligned(4 * self.bounds_numel)   # no grad: the bounds buffer heads the scratch
        esize = x.element_size()
        self.saved_shapes = []     # (rows, width) of each saved tensor, in source order after the extras
        steps = []
        for launch in launches:
            made = {"out": (launch.output, launch.width)}
            if launch.saved is not None:
                made["saved"] = (launch.saved, launch.saved_width)
            sources = {}
            for kind, (name, width) in made.items():
                if name == last:
                    sources[kind] = (OUT, 0)
                    self.width = width
                elif name in kept:
                    sources[kind] = (EXTRAS + len(self.extras) + len(self.saved_shapes), 0)
                    self.saved_shapes.append((name, (self.rows, width)))
                else:
                    sources[kind] = (SCRATCH, offset)
                    offset += _aligned(self.rows * width * esize)
                where[name] = sources[kind]
            ptrs = tuple(sources[kind] if kind in sources else (extra_slot[name], 0) for kind, name in launch.tensors)
            b = launch.bound
            weight = launch.op._parameters["weight"]
            steps.append((b.launch, where[launch.input], launch.op._parameters, tuple(weight.shape), ptrs,
                          4 * (ctx.groups + 1 + launch.slot), b.M, b.T, b.num_ctas))
        self.scratch_bytes = offset
        self.steps = tuple(steps)
        saved_index = {name: k for k, (name, _) in enumerate(self.saved_shapes)}
        # plan.saves in order: ("x",), ("saved", k), or None (a value the backward recomputes)
        self.saves = tuple(("x",) if name == v(0) else ("saved", saved_index[name]) if name in saved_index else None
                           for name in program.plan.saves) if train else ()
        self.jobs = tuple(launch.job for launch in launches if launch.job is not None)
        self.switches = _switches()
        self.calls = 0   # replayed calls (tests assert that the replay ran)

    def _weights(self) -> list | None:
        """Each step's weight pointer, or None where a weight is not as the replay was built (shape, layout)."""
        weights = []
        for step in self.steps:
            w = step[2]["weight"]
            w_ptr = w.data_ptr()
            if w.shape != step[3] or w_ptr & 15 or not w.is_contiguous():
                return None
            weights.append(w_ptr)
        return weights

    def _x_differs(self, x) -> bool:
        return (not ENABLED or type(x) is not torch.Tensor or x.shape != self.x_shape or x.dtype is not self.dtype
                or x.get_device() != self.index or not x.is_contiguous() or x.data_ptr() & 15 or POISON["on"]
                or _switches() != self.switches)

    def _launch(self, ptr: list, base: int, bounds: int, weights: list, sizes_ptr: int | None) -> None:
        stream = _raw_stream(self.index)
        self.prologue.launch(bounds if sizes_ptr is None else sizes_ptr, bounds, self.rows, self.counters, stream)
        for (launch, a, _, _, outs, counter, M, T, ctas), w_ptr in zip(self.steps, weights):
            launch(ptr[a[0]] + a[1], w_ptr, bounds, bounds + counter, bounds, tuple(ptr[s] + o for s, o in outs),
                   M, T, ctas, stream)
        for job in self.jobs:
            LAUNCHES.count(job)
        self.calls += 1

    def __call__(self, x: torch.Tensor, extra: dict) -> torch.Tensor | None:
        """The no-grad forward, or None: the call differs from the one the replay was built at."""
        if self._x_differs(x) or extra.keys() != self.names:
            return None
        index = self.index
        for p in self.params:
            if p.dtype is not self.dtype or p.get_device() != index:
                return None
        ptr = [x.data_ptr(), 0, 0, 0]
        for name, dtype, shape in self.extras:
            t = extra[name]
            if (not isinstance(t, torch.Tensor) or t.dtype is not dtype or t.shape != shape
                    or t.get_device() != index or not t.is_contiguous()):
                return None
            ptr.append(t.data_ptr())
        weights = self._weights()
        if weights is None:
            return None
        device = self.device
        scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=device)
        y = torch.empty(self.rows, self.width, dtype=self.dtype, device=device)
        base = scratch.data_ptr()
        ptr[OUT], ptr[SCRATCH], ptr[BOUNDS] = y.data_ptr(), base, base
        self._launch(ptr, base, base, weights, ptr[EXTRAS] if self.sizes_dtype is not None else None)
        return y

    def train(self, x: torch.Tensor, ctx):
        """The training forward over a checked call's context (BlockInputs.context made it), as program.forward:
        (block output, saved values in plan.saves order), ctx's bounds buffer set; or None."""
        sizes = ctx.routed_group_sizes
        if self._x_differs(x) or (None if sizes is None else sizes.dtype) is not self.sizes_dtype:
            return None
        ptr = [x.data_ptr(), 0, 0, 0]
        if sizes is not None:
            ptr.append(sizes.data_ptr())
        for t in ctx.extra.values():
            if not t.is_contiguous():
                return None
            ptr.append(t.data_ptr())
        weights = self._weights()
        if weights is None:
            return None
        device, dtype = self.device, self.dtype
        buffer = torch.empty(self.bounds_numel, dtype=torch.int32, device=device)
        scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=device) if self.scratch_bytes else None
        y = torch.empty(self.rows, self.width, dtype=dtype, device=device)
        saved = [torch.empty(shape, dtype=dtype, device=device) for _, shape in self.saved_shapes]
        bounds = buffer.data_ptr()
        ptr[OUT], ptr[BOUNDS] = y.data_ptr(), bounds
        if scratch is not None:
            ptr[SCRATCH] = scratch.data_ptr()
        ptr.extend(t.data_ptr() for t in saved)
        self._launch(ptr, ptr[SCRATCH], bounds, weights, ptr[EXTRAS] if sizes is not None else None)
        ctx.counters, ctx.groups, ctx.backward_counters_used = buffer, self.groups, False
        return y, [None if s is None else x if s[0] == "x" else saved[s[1]] for s in self.saves]


def build(runner, x: torch.Tensor, ctx, state, train: bool = False) -> ForwardReplay | None:
    """The replay of the call that just ran (`state`: its run, program.run_forward, in mode `train`), or None where
    the call cannot be replayed: not a fused program on a GPU with a device prologue, or a step without a bound
    launch (steps' `replay_launch`)."""
    program = runner.program
    prologue = program.prologue
    if (type(prologue) is not DevicePrologue or x.shape[0] == 0 or POISON["on"]
            or ctx.counters is None or ctx.index is not None or (prologue.grouped and not runner.device_checked)):
        return None
    launches, made = [], {v(0)}
    for step in program.forward_steps:
        replay_launch = getattr(step, "replay_launch", None)
        launch = None if replay_launch is None else replay_launch(state, train)
        if launch is None or launch.input not in made:
            return None
        launches.append(launch)
        made.update((launch.output, launch.saved))
    last = v(len(program.plan.ops))
    if not launches or launches[-1].output != last:
        return None
    if train and any(name not in made and name in state.env for name in program.plan.saves):
        return None   # a saved value that no replayed step makes
    compiled = prologue._compiled.get(ctx.routed_group_sizes.dtype if prologue.grouped else None)
    if compiled is None:
        return None
    return ForwardReplay(runner, x, ctx, launches, compiled, train)
