"""A block's backward replayed as its launches: issue 7's host time per training step.

The interpretive backward (fusion/runtime/program.py `backward_part`) walks the plan's backward steps on every call:
it asks each step whether it is wanted, which kernel variant and tile the call's rows take, whether a GEMM reads its
operand through the routing index, binds each launch through dictionaries of named values and frees each value after
its last reader. On an H200 machine that was about 190 µs of host time for the small block's backward (session y's
split: the fused dgrad 77, the two weight gradients 35 and 26, the lone dgrad 27), where its five launches and their
allocations cost about 40: in a host-bound step (few rows, an MoE layer at a small batch) the GPU waits for it.

After an interpretive backward (autograd's node: fusion/runtime/autograd.py) the runner keeps what that call
launched, each step saying so itself (steps' `replay_backward`: a steps.StepLaunches, its allocations and launches
with where each pointer comes from), and which values the call dropped after each step. A later backward of the same
call shape (rows, routed rows, which gradients autograd wants) runs guards (dY's shape, dtype, layout and device;
each saved value's; each weight's shape and layout; the extra inputs' layout; the module switches the steps' rules
read), then allocates what each step allocated, launches what it launched on the current stream, and drops each
value where the interpretive call did (so dY and the saved activations are freed after their last readers, the same
peak), all as one straight-line function generated when the replay is built (fusion/runtime/launch_code.py).
FP8 steps (fp8_block weights) say theirs too: dY's rowwise quantization (the quantize kernel's launch bound at its
shape, into scratch freed with the step), then the FP8 kernel on those codes and the weight's transposed blocks,
asked of the weight's cache at each call (quantized again there after an optimizer step); a weight gradient the
recipe takes in high precision on the bf16 varlen-K kernel. Anything a step cannot say (the FP8 varlen-K weight
gradient and its slot copies, a dgrad reading the fused dgrad's FP8 copy, torch's GEMM, autograd through an op's
reference, a bias gradient) means no replay for that call shape: every call there stays interpretive.

The gradients are the same bits: the same kernels at the same bindings over the same operands in the same order.
`ENABLED = False` turns the replay off and builds none (the A/B switch).
"""
from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch

from fusion.ops.routing import call_layout
from fusion.runtime import fp8_gemm, lone_gemm, row_sums, wgrad_gemm
from fusion.runtime import replay as replay_module
from fusion.runtime.gather import gather_index
from fusion.runtime.kernel import LAUNCHES
from fusion.runtime.launch_code import LaunchCode, read_switches
from fusion.runtime.replay import aligned, fp8_launch_switch_sources, launch_switch_sources
from fusion.runtime.steps import POISON

#: Read per call: False runs every backward through the program's steps, and builds no replay (the A/B switch).
ENABLED = True

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# pointer slots every replay has: the stream, the call's bounds buffer, its int32 gather index, the routing index,
# the token layout's rows and offsets; then the weights, the extra inputs and the values (by build order)
STREAM, BOUNDS, GATHER_INDEX, INDEX, LAYOUT_ROWS, LAYOUT_OFFSETS = range(6)


def _switch_sources() -> tuple:
    """The module switches read per call that the recorded steps' choices depend on (the lone GEMM's and the
    forward's, the weight gradient's group minimum, the row-sum kernel's), as (module, attribute) pairs."""
    return (*launch_switch_sources(), (wgrad_gemm, "MIN_GROUPS"), (row_sums, "KERNEL"), (lone_gemm, "DENSE_DGRAD"))


def _fp8_switch_sources() -> tuple:
    """Those of a block with fp8_block GEMMs besides: the FP8 launches' and the FP8 recipe's choices."""
    return (*_switch_sources(), *fp8_launch_switch_sources(), *fp8_gemm.replay_switch_sources())


class CallShape(NamedTuple):
    """What a replay is built at, taken before the program takes dY and the saved values (no reference to either
    is kept, so the recording call frees them where it would): dY's shape, dtype and device, and each saved value's
    (shape, dtype), None where none was saved, or False where it is not a plain CUDA tensor."""

    dy_shape: tuple
    dtype: torch.dtype
    device: torch.device
    device_index: int
    saved: tuple

    @staticmethod
    def of(dy, saved) -> "CallShape | None":
        if type(dy) is not torch.Tensor or not dy.is_cuda:
            return None
        return CallShape(tuple(dy.shape), dy.dtype, dy.device, dy.get_device(), tuple(
            None if t is None else (tuple(t.shape), t.dtype) if type(t) is torch.Tensor and t.is_cuda else False
            for t in saved))


class BackwardReplay:
    """One block's backward at one call shape, made by :func:`build` from an interpretive call's record:
    `replay(output_grad, saved, ctx)` returns (dx, parameter gradients, extra-input gradients) as
    program.backward does, emptying `output_grad` and `saved` the same way; or None where a guard fails (nothing
    is taken then, and the caller runs the program)."""

    def __init__(self, program, ctx, record: list, call: CallShape, needs: tuple):
        self.program = program
        self.dtype, self.device, self.device_index = call.dtype, call.device, call.device_index
        self.dy_shape = call.dy_shape
        self.groups = ctx.groups
        # a block with FP8 GEMMs also holds for the FP8 switches (its steps' choices read them)
        self.fp8 = any(getattr(runner, "fp8", False) for runner in getattr(program, "backward_steps", ()))
        self.switch_sources = _fp8_switch_sources() if self.fp8 else _switch_sources()
        self.switches = read_switches(self.switch_sources)
        slot_of: dict = {}   # ("value", name) / ("weight", id) / ("extra", name) -> slot
        count = [LAYOUT_OFFSETS + 1]
        uses = set()         # the shared slots some launch reads

        def new_slot(key):
            slot_of[key] = count[0]
            count[0] += 1
            return slot_of[key]

        self.dy_slot = new_slot(("value", program.output_grad))
        # (slot, position in `saved`, shape, dtype) of each saved value
        self.saved = tuple((new_slot(("value", name)), k, *meta)
                           for k, (name, meta) in enumerate(zip(program.plan.saves, call.saved)) if meta is not None)
        self.weights, self.extras = [], []
        self.fp8_weights = []   # (codes slot, scales slot, op, the transposed codes' shape)
        targets: dict = {}   # ("param", id) / ("extra", name) -> slot

        def source(arg, made_slots):
            kind = arg[0]
            if kind == "made":
                return made_slots[arg[1]], 0
            if kind == "value":
                return slot_of[arg], 0
            if kind == "weight":
                key = ("weight", id(arg[1]))
                if key not in slot_of:
                    weight = arg[1]._parameters["weight"]
                    self.weights.append((new_slot(key), arg[1]._parameters, weight.shape))
                return slot_of[key], 0
            if kind == "fp8_weight":   # the cache's transposed blocks, asked at each call
                key = ("fp8_weight", id(arg[1]))
                if key not in slot_of:
                    blocks = arg[1].quantized_weight()
                    codes, scales = new_slot(key), new_slot(key + ("scales",))
                    self.fp8_weights.append((codes, scales, arg[1], tuple(blocks.data_t.shape)))
                return (slot_of[key] if arg[2] == 0 else slot_of[key + ("scales",)]), 0
            if kind == "extra":   # (its dtype and shape as the call's: a kernel reads it in its own dtype)
                if arg not in slot_of:
                    t = ctx.extra[arg[1]]
                    self.extras.append((new_slot(arg), arg[1], t.dtype, t.shape))
                return slot_of[arg], 0
            shared = {"bounds": BOUNDS, "gather_index": GATHER_INDEX, "index": INDEX, "stream": STREAM}.get(kind)
            if shared is None:   # ("layout", 0 | 1)
                shared = LAYOUT_ROWS + arg[1]
            uses.add(shared)
            return shared, arg[1] if kind == "bounds" else 0

        steps = []
        for launches, release in record:
            made_slots, allocs, scratch = [], [], []
            for target, shape, dtype in launches.made:
                if target is None:   # freed with the step, as the step's own outputs dictionary is
                    slot = new_slot(("scratch", count[0]))
                    scratch.append((slot, tuple(shape), dtype))
                    made_slots.append(slot)
                    continue
                elif target[0] == "value":
                    slot = new_slot(target)
                else:
                    key = (target[0], id(target[1]) if target[0] == "param" else target[1])
                    if key in targets:
                        raise _Unrepeatable(f"two steps make the gradient {key}")   # (the program adds them up)
                    slot = targets[key] = count[0]
                    count[0] += 1
                made_slots.append(slot)
                allocs.append((slot, tuple(shape), dtype))
            calls = []
            for launch, args, job in launches.calls:
                spec = []
                for arg in args:
                    if type(arg) is tuple:
                        spec.append(source(arg, made_slots))
                    elif type(arg) is list:
                        spec.append([source(a, made_slots) for a in arg])
                    else:
                        spec.append(arg)
                calls.append((launch, tuple(spec), job))
            shared = _shared_scratch(scratch)
            if shared is None:   # (none, or one: allocated as it was made)
                allocs += scratch
            dropped = (*(s[0] for s in (scratch if shared is None else scratch[:1])),
                       *(slot_of[("value", name)] for name in release if ("value", name) in slot_of))
            steps.append((tuple(allocs), tuple(calls), dropped, shared))
        self.steps = tuple(steps)
        self.weights, self.extras = tuple(self.weights), tuple(self.extras)
        self.fp8_weights = tuple(self.fp8_weights)
        self.routed = bool(uses & {GATHER_INDEX, INDEX})
        # the routing index's dtype: the gather kernel was compiled for it
        self.index_dtype = None if ctx.index is None else ctx.index.dtype
        self.layout = bool(uses & {LAYOUT_ROWS, LAYOUT_OFFSETS})
        self.dx_slot = slot_of.get(("value", program.input_grad)) if needs[0] else None
        self.param_slots = tuple(targets.get(("param", id(p))) for p in program.params)
        self.extra_slots = tuple(targets.get(("extra", name)) for name in ctx.extra)
        self.calls = 0   # replayed calls (tests assert that the replay ran)
        self._run = self._generate()

    def __call__(self, output_grad: list, saved, ctx):
        made = self._run(output_grad, saved, ctx)
        if made is not None:
            self.calls += 1
        return made

    def _generate(self):
        """The replay as one straight-line function (fusion/runtime/launch_code.py) of (output_grad, saved, ctx):
        the guards, then every step's allocations, launches and drops, each pointer a local variable."""
        code = LaunchCode("backward_replay", "output_grad, saved, ctx")
        c, guard, line = code.const, code.guard, code.line
        tensor = c(torch.Tensor, "Tensor")
        line("dy = output_grad[0]")
        enabled = f"{c(sys.modules[__name__], 'mod')}.ENABLED"
        if self.fp8:   # (the FP8 replays' A/B switch)
            enabled += f" and {c(replay_module, 'replay')}.FP8"
        guard(f"not ({enabled}) or {c(POISON, 'poison')}['on'] or type(dy) is not "
              f"{tensor} or dy.shape != {c(self.dy_shape)} or dy.dtype is not {c(self.dtype, 'dtype')} or not "
              f"dy.is_contiguous() or dy.data_ptr() & 15 or dy.get_device() != {self.device_index} or ctx.counters "
              f"is None or ctx.groups != {c(self.groups)} or "
              f"{code.switches(self.switch_sources)} != {c(self.switches, 'switches')}")
        for slot, k, shape, dtype in self.saved:
            line(f"t = saved[{k}]")
            guard(f"type(t) is not {tensor} or t.shape != {c(tuple(shape))} or t.dtype is not {c(dtype, 'dtype')} "
                  f"or not t.is_contiguous()")
            line(f"p{slot} = t.data_ptr()")
            guard(f"p{slot} & 15")
        for slot, params, shape in self.weights:
            line(f"t = {c(params, 'params')}['weight']")
            line(f"p{slot} = t.data_ptr()")
            guard(f"t.shape != {c(tuple(shape))} or p{slot} & 15 or not t.is_contiguous()")
        for codes, scales, op, shape in self.fp8_weights:   # quantized again here where the weight changed
            line(f"t = {c(op, 'op')}.quantized_weight()")
            guard(f"t is None or t.data_t.shape != {c(shape)}")
            line(f"p{codes}, p{scales} = t.data_t.data_ptr(), t.scale_t.data_ptr()")
        for slot, name, dtype, shape in self.extras:
            line(f"t = ctx.extra.get({name!r})")
            guard(f"t is None or t.dtype is not {c(dtype, 'dtype')} or t.shape != {c(tuple(shape))} or not "
                  f"t.is_contiguous()")
            line(f"p{slot} = t.data_ptr()")
        if self.routed:
            line("t = ctx.index")
            guard(f"t is None or t.dtype is not {c(self.index_dtype, 'dtype')} or not t.is_contiguous()")
            line(f"p{INDEX} = t.data_ptr()")
            line(f"p{GATHER_INDEX} = {c(gather_index, 'gather_index')}(ctx).data_ptr()")
        if self.layout:
            line(f"t = {c(call_layout, 'call_layout')}(ctx)")
            line(f"p{LAYOUT_ROWS}, p{LAYOUT_OFFSETS} = t[0].data_ptr(), t[1].data_ptr()")
        # every guard passed: the replay owns dY and the saved values from here, as the program would
        line("t = None")
        for slot, k, _, _ in self.saved:
            line(f"v{slot} = saved[{k}]")
        line("if isinstance(saved, list):")
        line("    saved.clear()")
        line(f"p{self.dy_slot} = dy.data_ptr()")
        line(f"v{self.dy_slot} = output_grad.pop()")
        line("del dy")
        line("if ctx.backward_counters_used:   # a second backward over one forward's buffer (retain_graph)")
        line(f"    {c(self.program, 'program')}.zero_backward_counters(ctx)")
        line("ctx.backward_counters_used = True")
        line(f"p{BOUNDS} = ctx.counters.data_ptr()")
        line(f"p{STREAM} = {c(_raw_stream, 'raw_stream')}({self.device_index})")
        empty, device = c(torch.empty, "empty"), c(self.device, "device")

        def pointer(source) -> str:
            slot, offset = source
            return f"p{slot}" if not offset else f"p{slot} + {offset}"

        def argument(a) -> str:
            if type(a) is tuple:
                return pointer(a)
            if type(a) is list:
                return "(" + "".join(pointer(s) + ", " for s in a) + ")"
            return c(a)

        for allocs, calls, dropped, shared in self.steps:
            for slot, shape, dtype in allocs:
                line(f"v{slot} = {empty}({c(shape)}, dtype={c(dtype, 'dtype')}, device={device})")
                line(f"p{slot} = v{slot}.data_ptr()")
            if shared is not None:   # the step's scratch values in one buffer, each at its offset
                nbytes, at = shared
                base = at[0][0]
                line(f"v{base} = {empty}({nbytes}, dtype={c(torch.uint8, 'dtype')}, device={device})")
                line(f"p{base} = v{base}.data_ptr()")
                for slot, offset in at[1:]:
                    line(f"p{slot} = p{base} + {offset}")
            for launch, spec, job in calls:
                line(f"{c(launch, 'launch')}({', '.join(argument(a) for a in spec)})")
                if job is not None:
                    line(f"{c(LAUNCHES, 'launches')}.count({c(job, 'job')})")
            for slot in dropped:   # each value freed after its last reader, as the program drops it
                line(f"v{slot} = None")

        def value(slot) -> str:
            return "None" if slot is None else f"v{slot}"

        line(f"return ({value(self.dx_slot)}, [{', '.join(value(s) for s in self.param_slots)}], "
             f"[{', '.join(value(s) for s in self.extra_slots)}])")
        return code.compile()


def _shared_scratch(scratch: list) -> tuple | None:
    """(bytes, ((slot, byte offset), ...)) of one buffer holding a step's scratch values (those no later step reads,
    freed with the step: an FP8 dgrad's quantized dY, codes and scales), each at a multiple of replay.ALIGN; or None
    where the step has fewer than two. One allocation instead of one per value: each torch.empty costs 4-6 µs of
    host time on the H200 machines (bench/probes/replay_lines.py), and every scratch value of a step dies with it."""
    if len(scratch) < 2:
        return None
    at, offset = [], 0
    for slot, shape, dtype in scratch:
        at.append((slot, offset))
        offset += aligned(math.prod(shape) * dtype.itemsize)
    return offset, tuple(at)


class _Unrepeatable(Exception):
    """A record the replay cannot repeat exactly (build returns None)."""


def build(program, ctx, record: list, call: CallShape | None, needs: tuple) -> BackwardReplay | None:
    """The replay of the interpretive backward that just ran (`record`: program.backward_part's; `call`: dY and
    the saved values as the call got them), or None where some step launched what it cannot say (steps'
    `replay_backward` returned None), dY or a saved value is not a plain CUDA tensor, or the call ran without the
    forward's device bounds buffer."""
    if (not ENABLED or POISON["on"] or not record or any(launches is None for launches, _ in record)
            or program.prologue is None or ctx.counters is None or call is None or False in call.saved):
        return None
    try:
        return BackwardReplay(program, ctx, record, call, needs)
    except (_Unrepeatable, KeyError):   # (KeyError: a launch reads a value no recorded step made)
        return None
