"""A block's forward replayed as its launches: issue 7's host time per forward call.

The interpretive forward (fusion/runtime/program.py) walks the plan on every call: it looks up each step's kernel,
allocates each output, binds each launch's pointers through dictionaries of named values. On an H200 machine that
was 64-72 µs of host time for the small block's no-grad forward, whose three launches and three allocations alone
cost 22 (bench/probes/host_floor.py), and about 90 recording for autograd.

After an interpretive call at some rows, the block keeps that call's launches here, each bound at the call's shape by
the code that ran it (`replay_launch` of fusion/runtime/steps.py: a step's kernels.api.BoundGemm, or a Combine's
kernel, and where each of its pointers comes from). A later call at the same rows runs the guards below, then makes
exactly what the interpretive call made, in the same order on the same stream: the bounds prologue (the group sizes
checked on the device, the row bounds and zeroed tile counters written; after a Gather the routing index checked
and the gathering kernels' int32 index written too), then each step's kernel.

Two kinds, one per forward mode (`train`):
  * no grad (`BlockRunner.__call__` under torch.no_grad / inference_mode): two allocations, the output and one
    scratch buffer holding the call's bounds buffer, its gather index and every intermediate value (the caller sees
    none of them). It runs before the input checks: its guards are those checks, as comparisons against the shapes,
    dtypes and devices it was built at.
  * training (the autograd node's forward, after the input checks made the call's context): the bounds buffer, the
    gather index and each value the plan saves are tensors of their own (the backward reads them; an intermediate
    it does not read stays in a scratch buffer that is freed with the forward), and the call's context gets them as
    program.forward would set it.

Each replay runs as one straight-line function generated when it is built (fusion/runtime/launch_code.py): its
guards, allocations and launches with every argument written out, nothing interpreted per call. Any guard that fails
returns None and the interpretive path runs (and raises its error where the call is wrong).
FP8 steps (fp8_block weights) replay too: a fused FP8 kernel or a lone FP8 GEMM (fp8_gemm.Fp8Launch), its input
quantized 1x128 rowwise first by the quantize kernel's launch bound at the call's shape, or read as the FP8-block
output the step before wrote into the scratch buffer (codes, scales, and an amax nobody reads); each weight's FP8
blocks come from its cache at each call (`quantized_weight()`, which quantizes them again after the weight changed).
A plan with a step the replay cannot repeat (torch's GEMM, an op's reference, an MXFP8 output, a quantized value
the backward or the caller reads, a wide GEMM's gather copy) is never replayed. `ENABLED = False` turns replays
off and builds none (the A/B switch).
"""
from __future__ import annotations

import sys

import torch

from fusion.dataflow import v
from fusion.kernels import fp8_quantize_api, tile_policy
from fusion.ops.routing import layout_of
from fusion.runtime import bounds as bounds_module
from fusion.runtime import kernel as runtime_kernel
from fusion.runtime import lone_gemm
from fusion.runtime.bounds import DevicePrologue, RoutedPrologue
from fusion.runtime.kernel import LAUNCHES
from fusion.runtime.launch_code import LaunchCode, read_switches
from fusion.runtime.fp8_gemm import Fp8Launch
from fusion.runtime.steps import POISON, BoundLaunch

#: Read per call: False runs every call through the interpretive forward, and builds no replay (the A/B switch).
ENABLED = True
#: Read per call by replays with FP8 steps, forward and backward: False runs those calls through the interpretive
#: path (the A/B switch of the FP8 replays; replays are still built, so flipping it back replays again).
FP8 = True

#: Each value in a scratch buffer starts at a multiple of this (TMA needs 16 bytes; 256 keeps rows' sectors whole)
ALIGN = 256

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# where a launch's pointers come from, per call: x, the block output, the scratch buffer, the bounds buffer, the
# gather index, then the extra inputs (in ForwardReplay.extras order), then the saved tensors (training)
X, OUT, SCRATCH, BOUNDS, INDEX, EXTRAS = 0, 1, 2, 3, 4, 5


def launch_switch_sources() -> tuple:
    """The module switches read per call that the replayed launches depend on, as (module, attribute) pairs: the lone
    GEMM's rule (lone_gemm._takes) and the routed prologue's sizes (bounds.SIZES_FROM_KERNEL). A replay holds for
    these only."""
    return ((lone_gemm, "ENABLED"), (lone_gemm, "WIDE_TILE"), (lone_gemm, "OUTPUT_BUDGET"),
            (tile_policy, "DYNAMIC_PAIRS"), (tile_policy, "DYNAMIC_PAIRS_MAX_GROUPS"),
            (bounds_module, "SIZES_FROM_KERNEL"))


def fp8_launch_switch_sources() -> tuple:
    """Those that a replayed FP8 step's launches depend on besides: the bound FP8 launches, the FP8 tile policy's,
    the rowwise quantize kernel's build and binding. A replay with FP8 steps holds for these too."""
    return ((runtime_kernel, "FP8_BOUND_LAUNCHES"), *tile_policy.fp8_switch_sources(),
            *fp8_quantize_api.rowwise_switch_sources())


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN: where the next value in a scratch buffer starts."""
    return -(-nbytes // ALIGN) * ALIGN


class _Gemm:
    """A grouped GEMM's bound launch, as the generated replay writes it out: A from `a`, B the op's weight (read at
    each call), the epilogue's tensors from `outs`, its tile counter at `counter` bytes into the bounds buffer, the
    index from `index` (the gather index, or the bounds buffer where the kernel reads none)."""

    __slots__ = ("launch", "a", "params", "weight_shape", "outs", "counter", "index", "M", "T", "ctas")

    def __init__(self, launch: BoundLaunch, a, outs, counter: int):
        b = launch.bound
        self.launch, self.a, self.outs, self.counter = b.launch, a, outs, counter
        self.params = launch.op._parameters
        self.weight_shape = tuple(self.params["weight"].shape)
        self.index = INDEX if launch.index else BOUNDS
        self.M, self.T, self.ctas = b.M, b.T, b.num_ctas


class _Fp8Gemm:
    """An FP8 GEMM's bound launch (fp8_gemm.Fp8Launch), as the generated replay writes it out: where `quantize` is set,
    first the rowwise quantize of the high-precision value at `x` into `a` (codes, scales); A from `a`; B the op's
    cached FP8 weight (`op.quantized_weight()`, read at each call, which quantizes it again where the weight
    changed); the epilogue's tensors from `outs`, its tile counter at `counter` bytes into the bounds buffer."""

    __slots__ = ("launch", "quantize", "x", "a", "op", "params", "weight_shape", "b_shape", "outs", "counter", "M",
                 "ctas")

    def __init__(self, launch: Fp8Launch, x, a, outs, counter: int, b_shape: tuple):
        self.launch, self.quantize, self.x, self.a, self.outs = launch.bound.launch, launch.quantize, x, a, outs
        self.op, self.params = launch.op, launch.op._parameters
        self.weight_shape, self.b_shape = tuple(self.params["weight"].shape), b_shape
        self.counter, self.M, self.ctas = counter, launch.bound.M, launch.bound.num_ctas


class _Combine:
    """The MoE Combine's kernel (fusion/runtime/combine.py), as the generated replay writes it out: the routed rows
    at `y` summed per token into `out`, by the token layout of the call's routing index (made per call: route()
    records it with the index it makes)."""

    __slots__ = ("launch", "y", "out", "M", "T", "index_extra")

    def __init__(self, launch, y, out, index_extra: int):
        self.launch, self.y, self.out, self.M, self.T = launch.launch, y, out, launch.M, launch.T
        self.index_extra = index_extra


class ForwardReplay:
    """One block's forward at one call shape (rows, and the extra inputs' dtypes and shapes) in one mode, made by
    :func:`build`. No grad: `replay(x, extra)` returns the block output; training: `replay.train(x, ctx)` returns
    (output, saved values in plan.saves order) and sets ctx's bounds buffer (and after a Gather its gather index and
    absorbed group sizes). Either returns None where a guard fails."""

    def __init__(self, runner, x: torch.Tensor, ctx, launches: list, prologue, train: bool):
        program = runner.program
        self.params = runner.params
        self.dtype, self.device, self.device_index = x.dtype, x.device, x.get_device()
        self.x_shape = tuple(x.shape)
        self.names = runner.seq.inputs.names
        self.routed = ctx.index is not None
        self.tokens = x.shape[0]
        self.rows = ctx.index.numel() if self.routed else x.shape[0]   # the routed rows M
        # the extra inputs as the interpretive call's checks took them: (name, dtype, shape)
        self.extras = tuple((name, t.dtype, tuple(t.shape)) for name, t in
                            (("index", ctx.index), ("group_sizes", ctx.routed_group_sizes), *ctx.extra.items())
                            if t is not None)
        extra_slot = {name: EXTRAS + k for k, (name, _, _) in enumerate(self.extras)}
        self.sizes_dtype = None if ctx.routed_group_sizes is None else ctx.routed_group_sizes.dtype
        self.prologue = prologue
        self.counters = program.counters
        self.groups = ctx.groups
        self.head = ctx.counters.numel()   # G + 1 bounds, then the tile counters (int32)
        # the routed prologue also writes the absorbed group sizes after the head
        self.bounds_numel = self.head + (self.groups if self.routed else 0)
        last = v(len(program.plan.ops))
        kept = set(program.plan.saves) if train else set()
        where = {v(0): (X, 0)}
        esize = x.element_size()
        offset = 0
        if not train:   # no grad: the bounds buffer and the gather index head the scratch buffer
            offset = aligned(4 * self.bounds_numel)
            self.index_offset = offset
            offset += aligned(4 * self.rows) if self.routed else 0
        self.saved_shapes = []     # (name, (rows, width)) of each saved tensor, in source order after the extras
        steps = []
        quantized = {}             # an FP8-block value (scratch only) -> its (codes, scales, amax) sources

        def place(name: str, rows: int, width: int):
            if name == last:
                self.out_shape = (rows, width)
                where[name] = (OUT, 0)
            elif name in kept:
                where[name] = (EXTRAS + len(self.extras) + len(self.saved_shapes), 0)
                self.saved_shapes.append((name, (rows, width)))
            else:
                nonlocal offset
                where[name] = (SCRATCH, offset)
                offset += aligned(rows * width * esize)
            return where[name]

        def scratch(nbytes: int):
            nonlocal offset
            at = (SCRATCH, offset)
            offset += aligned(nbytes)
            return at

        def place_fp8(rows: int, width: int):
            """Scratch for an FP8-block value: E4M3 codes (rows, width), float32 scales (ceil(width / 128), rows)
            and the int32 amax its kernel may write (nothing reads it, so it is never zeroed)."""
            return scratch(rows * width), scratch(4 * rows * -(-width // 128)), scratch(4)

        for launch in launches:
            if isinstance(launch, Fp8Launch):
                M, K = launch.bound.M, launch.bound.a_shape[1]
                x_at, a = (where[launch.input], place_fp8(M, K)[:2]) if launch.quantize else \
                    (None, quantized[launch.input][:2])
                if launch.quantized:
                    made = dict(zip(("out", "scale", "amax"), place_fp8(M, launch.width)))
                    quantized[launch.output] = (made["out"], made["scale"], made["amax"])
                else:
                    made = {"out": place(launch.output, M, launch.width)}
                if launch.saved is not None:
                    made["saved"] = place(launch.saved, M, launch.saved_width)
                outs = tuple(made[kind] if kind in made else (extra_slot[name], 0) for kind, name in launch.tensors)
                b_shape = tuple(launch.bound.b_shape) if launch.op._parameters["weight"].dim() == 3 else \
                    tuple(launch.bound.b_shape)[1:]
                steps.append(_Fp8Gemm(launch, x_at, a, outs, 4 * (ctx.groups + 1 + launch.slot), b_shape))
                continue
            a = where[launch.input]
            if isinstance(launch, BoundLaunch):
                made = {"out": place(launch.output, launch.bound.M, launch.width)}
                if launch.saved is not None:
                    made["saved"] = place(launch.saved, launch.bound.M, launch.saved_width)
                outs = tuple(made[kind] if kind in made else (extra_slot[name], 0) for kind, name in launch.tensors)
                steps.append(_Gemm(launch, a, outs, 4 * (ctx.groups + 1 + launch.slot)))
            else:   # a CombineLaunch (fusion/runtime/combine.py)
                steps.append(_Combine(launch, a, place(launch.output, launch.T, launch.width),
                                      extra_slot["index"] - EXTRAS))
        self.scratch_bytes = offset
        self.steps = tuple(steps)
        saved_index = {name: k for k, (name, _) in enumerate(self.saved_shapes)}
        # plan.saves in order: ("x",), ("saved", k), or None (a value the backward recomputes)
        self.saves = tuple(("x",) if name == v(0) else ("saved", saved_index[name]) if name in saved_index else None
                           for name in program.plan.saves) if train else ()
        self.jobs = tuple(launch.job for launch in launches if getattr(launch, "job", None) is not None)
        self.fp8 = any(type(step) is _Fp8Gemm for step in self.steps)
        self.switch_sources = launch_switch_sources() + (fp8_launch_switch_sources() if self.fp8 else ())
        self.switches = read_switches(self.switch_sources)
        self.calls = 0   # replayed calls (tests assert that the replay ran)
        self.training = train   # the mode it was built in: __call__ (no grad) or train()
        self._run = self._generate(train)

    def __call__(self, x: torch.Tensor, extra: dict) -> torch.Tensor | None:
        """The no-grad forward, or None: the call differs from the one the replay was built at."""
        y = None if self.training else self._run(x, extra)
        if y is not None:
            self.calls += 1
        return y

    def train(self, x: torch.Tensor, ctx):
        """The training forward over a checked call's context (BlockInputs.context made it), as program.forward:
        (block output, saved values in plan.saves order), ctx's bounds buffer (and gather index, absorbed sizes)
        set; or None."""
        made = self._run(x, ctx) if self.training else None
        if made is not None:
            self.calls += 1
        return made

    def _generate(self, train: bool):
        """The replay as one straight-line function (fusion/runtime/launch_code.py): of (x, extra) without grad,
        of (x, ctx) in training; its guards, allocations and launches, each pointer a local variable."""
        code = LaunchCode("forward_replay", "x, ctx" if train else "x, extra")
        c, guard, line = code.const, code.guard, code.line
        tensor, device, index = c(torch.Tensor, "Tensor"), c(self.device, "device"), self.device_index
        dtype = c(self.dtype, "dtype")
        switches = code.switches(self.switch_sources)
        enabled = f"{c(sys.modules[__name__], 'mod')}.ENABLED"
        if self.fp8:
            enabled += f" and {c(sys.modules[__name__], 'mod')}.FP8"
        x_differs = (f"not ({enabled}) or type(x) is not {tensor} or x.shape != "
                     f"{c(self.x_shape)} or x.dtype is not {dtype} or x.get_device() != {index} or not "
                     f"x.is_contiguous() or x.data_ptr() & 15 or {c(POISON, 'poison')}['on'] or "
                     f"{switches} != {c(self.switches, 'switches')}")
        if train:
            line("sizes = ctx.routed_group_sizes")
            sizes = ("sizes is not None" if self.sizes_dtype is None else
                     f"sizes is None or sizes.dtype is not {c(self.sizes_dtype, 'dtype')}")
            guard(f"{x_differs} or {sizes}")
            for k, (name, t_dtype, shape) in enumerate(self.extras):
                if name == "index":
                    line(f"e{k} = ctx.index")
                    guard(f"e{k}.shape != {c(shape)} or e{k}.dtype is not {c(t_dtype, 'dtype')} or not "
                          f"e{k}.is_contiguous()")
                elif name == "group_sizes" and k == (1 if self.routed else 0) and self.sizes_dtype is not None:
                    line(f"e{k} = sizes")
                else:
                    line(f"e{k} = ctx.extra[{name!r}]")
                    guard(f"not e{k}.is_contiguous()")
        else:
            guard(f"{x_differs} or extra.keys() != {c(self.names, 'names')}")
            line(f"for t in {c(self.params, 'params')}:")   # (the runner's list, read per call)
            line(f"    if t.dtype is not {dtype} or t.get_device() != {index}:")
            line("        return None")
            for k, (name, t_dtype, shape) in enumerate(self.extras):
                line(f"e{k} = extra[{name!r}]")
                guard(f"not isinstance(e{k}, {tensor}) or e{k}.dtype is not {c(t_dtype, 'dtype')} or e{k}.shape != "
                      f"{c(shape)} or e{k}.get_device() != {index} or not e{k}.is_contiguous()")
        for n, step in enumerate(self.steps):   # each GEMM's weight, read at each call (a parameter may be replaced)
            if type(step) is _Gemm:
                line(f"t = {c(step.params, 'params')}['weight']")
                line(f"w{n} = t.data_ptr()")
                guard(f"t.shape != {c(step.weight_shape)} or w{n} & 15 or not t.is_contiguous()")
            elif type(step) is _Fp8Gemm:   # its FP8 blocks from the op's cache (quantized again where it changed)
                guard(f"{c(step.params, 'params')}['weight'].shape != {c(step.weight_shape)}")
                line(f"t = {c(step.op, 'op')}.quantized_weight()")
                guard(f"t is None or t.data.shape != {c(step.b_shape)}")
                line(f"w{n}, ws{n} = t.data.data_ptr(), t.scale.data_ptr()")
        empty = c(torch.empty, "empty")
        pointer = {X: "x.data_ptr()", OUT: "y.data_ptr()"}
        pointer.update({EXTRAS + k: f"e{k}.data_ptr()" for k in range(len(self.extras))})
        if train:
            line(f"bounds = {empty}({self.bounds_numel}, dtype={c(torch.int32, 'dtype')}, device={device})")
            if self.routed:
                line(f"index32 = {empty}({self.rows}, dtype={c(torch.int32, 'dtype')}, device={device})")
                pointer[INDEX] = "index32.data_ptr()"
            if self.scratch_bytes:
                line(f"scratch = {empty}({self.scratch_bytes}, dtype={c(torch.uint8, 'dtype')}, device={device})")
                pointer[SCRATCH] = "scratch.data_ptr()"
            line(f"y = {empty}({c(self.out_shape)}, dtype={dtype}, device={device})")
            for k, (_, shape) in enumerate(self.saved_shapes):
                line(f"s{k} = {empty}({c(shape)}, dtype={dtype}, device={device})")
                pointer[EXTRAS + len(self.extras) + k] = f"s{k}.data_ptr()"
            line("b = bounds.data_ptr()")
        else:
            line(f"scratch = {empty}({self.scratch_bytes}, dtype={c(torch.uint8, 'dtype')}, device={device})")
            line(f"y = {empty}({c(self.out_shape)}, dtype={dtype}, device={device})")
            line("b = scratch.data_ptr()")
            pointer[SCRATCH] = "b"
            if self.routed:
                pointer[INDEX] = f"b + {self.index_offset}"
        pointer[BOUNDS] = "b"
        # each pointer a call reads, once, in a local (p<slot>)
        used = {BOUNDS}
        for step in self.steps:
            if type(step) is _Gemm:
                used.update((step.a[0], step.index, *(s for s, _ in step.outs)))
            elif type(step) is _Fp8Gemm:
                used.update((*(s for s, _ in step.a), *(s for s, _ in step.outs)))
                if step.x is not None:
                    used.add(step.x[0])
            else:
                used.update((step.y[0], step.out[0]))
        if self.routed:
            used.update((EXTRAS, EXTRAS + 1, INDEX))
        elif self.sizes_dtype is not None:
            used.add(EXTRAS)
        for slot in sorted(used):
            line(f"p{slot} = {pointer.get(slot, '0')}")   # (0: a slot the call has none of, as before)

        def at(source) -> str:
            slot, offset = source
            return f"p{slot}" if not offset else f"p{slot} + {offset}"

        line(f"s = {c(_raw_stream, 'raw_stream')}({index})")
        prologue = c(self.prologue, "prologue")
        if self.routed:   # (index, sizes) lead the extras
            line(f"{prologue}.launch(p{EXTRAS + 1}, p{EXTRAS}, p{BOUNDS}, p{INDEX}, {self.rows}, {self.tokens}, "
                 f"{self.counters}, s)")
        else:
            sizes_at = f"p{BOUNDS}" if self.sizes_dtype is None else f"p{EXTRAS}"
            line(f"{prologue}.launch({sizes_at}, p{BOUNDS}, {self.rows}, {self.counters}, s)")
        for n, step in enumerate(self.steps):
            if type(step) is _Fp8Gemm:
                data, scale = (at(o) for o in step.a)
                if step.quantize is not None:   # A's rowwise FP8 copy (kernels/fp8_quantize_api.py rowwise_launch)
                    quantize, grid, _ = step.quantize
                    line(f"{c(quantize, 'quantize')}({at(step.x)}, {data}, {scale}, 0, 0, 0, 0, {step.M}, {grid}, s)")
                outs = "".join(at(o) + ", " for o in step.outs)
                line(f"{c(step.launch, 'launch')}({data}, w{n}, {scale}, ws{n}, p{BOUNDS}, p{BOUNDS} + "
                     f"{step.counter}, ({outs}), {step.M}, {step.ctas}, s)")
            elif type(step) is _Gemm:
                outs = "".join(at(o) + ", " for o in step.outs)
                line(f"{c(step.launch, 'launch')}({at(step.a)}, w{n}, p{BOUNDS}, p{BOUNDS} + {step.counter}, "
                     f"p{step.index}, ({outs}), {step.M}, {step.T}, {step.ctas}, s)")
            else:   # a Combine: the token layout of the call's routing index (the backward's Gather reads it),
                # in training already in ctx where the merged MoE node routed this call (fusion/runtime/moe_node.py).
                # Trusted as it is: ctx.derived["token_layout"] holds the layout of ctx.index over ctx.tokens, and
                # only its producers (that node, fusion.ops.routing.call_layout) write it
                layout = f"{c(layout_of, 'layout_of')}(e{step.index_extra}, {step.T})"
                if train:
                    line("t = ctx.derived.get('token_layout')")
                    line("if t is None:")
                    line(f"    t = ctx.derived['token_layout'] = {layout}")
                else:
                    line(f"t = {layout}")
                line(f"{c(step.launch, 'launch')}({at(step.y)}, t[0].data_ptr(), t[1].data_ptr(), "
                     f"{at(step.out)}, {step.M}, {step.T}, s)")
        for job in self.jobs:
            line(f"{c(LAUNCHES, 'launches')}.count({c(job, 'job')})")
        if not train:
            line("return y")
            return code.compile()
        if self.routed:   # what RoutedPrologue sets (fusion/runtime/bounds.py), without its two views: ctx.counters
            # is the whole buffer (the bounds and tile counters, then the absorbed sizes) and the sizes' view is
            # made only if something reads ctx.group_sizes (a replayed backward reads neither)
            line("ctx.derived['gather_index'] = index32")
            line(f"ctx.absorb_sizes_at(bounds, {self.head}, {self.groups})")
        line(f"ctx.counters, ctx.groups, ctx.backward_counters_used = bounds, {self.groups}, False")
        saves = ", ".join("None" if s is None else "x" if s[0] == "x" else f"s{s[1]}" for s in self.saves)
        line(f"return y, [{saves}]")
        return code.compile()


def build(runner, x: torch.Tensor, ctx, state, train: bool = False) -> ForwardReplay | None:
    """The replay of the call that just ran (`state`: its run, program.run_forward, in mode `train`), or None where
    the call cannot be replayed: not a fused program on a GPU with a device prologue, or a step without a bound
    launch (steps' `replay_launch`)."""
    program = runner.program
    prologue = program.prologue
    routed = type(prologue) is RoutedPrologue
    if (type(prologue) not in (DevicePrologue, RoutedPrologue) or x.shape[0] == 0 or POISON["on"]
            or ctx.counters is None or not runner.device_checked and (routed or prologue.grouped)
            or routed != (ctx.index is not None) or routed and (ctx.index.numel() == 0
                                                               or not bounds_module.SIZES_FROM_KERNEL)):
        return None
    launches, made, quantized = [], {v(0)}, set()
    for step in program.forward_steps:
        replay_launch = getattr(step, "replay_launch", None)
        launch = None if replay_launch is None else replay_launch(state, train)
        if launch is None:
            return None
        # an FP8-block value feeds only an FP8 GEMM that reads it as is (its codes and scales in the scratch)
        fp8_reader = isinstance(launch, Fp8Launch) and launch.quantize is None
        if launch.input not in (quantized if fp8_reader else made):
            return None
        launches.append(launch)
        if getattr(launch, "quantized", False):
            quantized.add(launch.output)
            made.add(getattr(launch, "saved", None))
        else:
            made.update((launch.output, getattr(launch, "saved", None)))
    last = v(len(program.plan.ops))
    if not launches or launches[-1].output != last or last in quantized:
        return None
    if any(name in quantized for name in program.plan.saves if name is not None):
        return None   # the backward would read a quantized value the replay keeps in scratch only
    if train and any(name not in made and name in state.env for name in program.plan.saves):
        return None   # a saved value that no replayed step makes
    if routed:
        compiled = prologue._compiled.get((ctx.routed_group_sizes.dtype, ctx.index.dtype))
    else:
        compiled = prologue._compiled.get(ctx.routed_group_sizes.dtype if prologue.grouped else None)
    if compiled is None:
        return None
    return ForwardReplay(runner, x, ctx, launches, compiled, train)
