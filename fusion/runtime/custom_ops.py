"""torch.compile: the block as graph-friendly code.

A block that runs the fused program (a Hopper GPU with fused kernels in its plan, or backend="emulate") is the
custom op pair `fusion::block_forward` / `fusion::block_backward`: opaque to the compiler, with exact output
shapes (register_fake) and the program's backward as its autograd formula (register_autograd). Planning,
compiling kernels and the input checks run inside the op (eagerly, at run time), so nothing data-dependent is
traced. The reference path is traced op by op, so inductor fuses its elementwise ops; its data-dependent parts
are custom ops (fusion/grouped.py) or asynchronous device asserts.

The ops take the block by a key (an int attribute of the Sequential, fresh for every copy) and return plain
tensors: the block output and the values saved for the backward, each QuantizedTensor flattened into its
buffers (`__tensor_flatten__`). A QuantizedTensor block output is rebuilt outside the op (inference only: a
block ending in a quantize op cannot be trained under torch.compile; see docs/user-guide.md).
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Optional

import torch

from fusion.errors import FusionError
from fusion.grouped import group_offsets
from fusion.inputs import _absorb_padding, _check_group_sizes
from fusion.quant import QuantizedTensor
from fusion.run_context import RunContext
from fusion.runtime import runner_for
from fusion.runtime.program import BlockProgram

_BLOCKS: dict[int, weakref.ref] = {}
_KEYS = itertools.count(1)

#: The ops make a call's row bounds as the eager call does, by the program's device prologue (one launch) where
#: it has one, instead of torch ops (a cumsum and a pad per op call). Read per call: bench/ab_switch.py's A/B.
DEVICE_BOUNDS = True

#: The backward as two ops where the program can be cut after dY's last reader (program.BackwardSplit). Read when
#: the backward is traced: bench/ab_switch.py's A/B with --plan, tests.
SPLIT_BACKWARD = True


def register(seq) -> int:
    """A fresh key for `seq` (a Sequential); the ops find the block by it."""
    key = next(_KEYS)
    _BLOCKS[key] = weakref.ref(seq, lambda _, k=key: _BLOCKS.pop(k, None))
    return key


def _block(key: int):
    seq = _BLOCKS.get(key, lambda: None)()
    if seq is None:
        raise FusionError(f"fusion: block {key} of a compiled graph no longer exists; recompile the model")
    return seq


@torch._dynamo.assume_constant_result
def _runs_program(backend: str, device_type: str, device_index: int) -> bool:
    """Whether a call runs the fused program (an opaque op) rather than the reference ops (traced)."""
    if backend == "emulate":
        return True
    if backend == "reference" or device_type != "cuda":
        return False
    return torch.cuda.get_device_capability(device_index)[0] == 9


@torch._dynamo.assume_constant_result
def _checks_sizes(key: int, device_type: str, device_index: int, dtype: torch.dtype) -> bool:
    """Whether the ops' program validates the group sizes' values on the device itself (the runner's device prologue,
    with DEVICE_BOUNDS): then the traced graph checks only what reads no data. A block that starts with a Gather
    keeps the traced checks (a call with no routed rows has nothing for the routed prologue to launch on)."""
    seq = _block(key)
    if seq.inputs.gathers or "group_sizes" not in seq.inputs.names or not DEVICE_BOUNDS:
        return False
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    probe = torch.empty(0, seq.features[0] or 1, dtype=dtype, device=device)
    return runner_for(seq, probe).device_checked


# -- what the ops return ---------------------------------------------------------------------------------------------
def _quantize_op_of(seq, name: str):
    """The quantize op whose output value `name` (v<i>) is, or None for a plain tensor. Kept per block: the op calls
    ask for every saved value, and `seq[i]` and `op.spec` cost microseconds each."""
    per_block = _QUANTIZE_OPS.get(seq)
    if per_block is None:
        per_block = _QUANTIZE_OPS[seq] = {}
    if name not in per_block:
        i = int(name[1:])
        op = seq[i - 1] if i else None
        per_block[name] = op if op is not None and op.spec.kind == "quantize" else None
    return per_block[name]


#: Per block: {value name: its quantize op or None} (_quantize_op_of).
_QUANTIZE_OPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _buffer_names(value) -> list[str]:
    """A QuantizedTensor's buffers the ops pass: all but group_sizes (an input of the op, re-attached)."""
    names, _ = value.__tensor_flatten__()
    return [n for n in names if n != "group_sizes"]


def _flatten(value) -> list[torch.Tensor]:
    if isinstance(value, QuantizedTensor):
        return [getattr(value, n) for n in _buffer_names(value)]
    return [value]


def _layout(op, dtype) -> tuple[list[str], tuple]:
    """(the buffers the ops pass, the flatten metadata) of the quantize op's output: what `__tensor_flatten__` of
    its QuantizedTensor gives, read from the op's attributes alone. The traced side (compiled_forward) needs it,
    and may run nothing to find it: dynamo cannot enter a meta-device context (tests check it equals the meta
    run's)."""
    names = [n for n in QuantizedTensor._BUFFER_NAMES
             if n != "group_sizes" and (op.columnwise or not n.startswith("columnwise"))]
    return names, (op.format, dtype)


def _unflatten(seq, name: str, tensors: list, rows: int, features: int, dtype, group_sizes=None):
    """(value, tensors left) rebuilt from the front of `tensors`."""
    op = _quantize_op_of(seq, name)
    if op is None:
        return tensors[0], tensors[1:]
    names, meta = _layout(op, dtype)
    inner = dict(zip(names, tensors[:len(names)]))
    if op.columnwise and group_sizes is not None:  # the columnwise blocks are per group
        inner["group_sizes"] = group_sizes
    return QuantizedTensor.__tensor_unflatten__(inner, meta, torch.Size((rows, features)), None), tensors[len(names):]


def _meta_quantized(op, rows: int, features: int, dtype, group_sizes=None):
    """The quantize op's output for an input of this shape, on the meta device: its buffers' shapes (the
    columnwise blocks' capacity depends on the number of groups only)."""
    sizes = None if group_sizes is None else torch.empty(group_sizes.shape, dtype=group_sizes.dtype, device="meta")
    with torch.device("meta"):
        return op.reference(torch.empty(rows, features, dtype=dtype, device="meta"), RunContext(group_sizes=sizes))


def _as_promised(tensors: list, plain: list, inputs: list) -> list[torch.Tensor]:
    """The op's outputs as its fake promises them: a plain value row-major contiguous (the fake allocates each as
    a new (rows, features) tensor), and no output sharing memory with an input or another output (torch forbids
    a custom op to alias). A program value may be neither, e.g. a saved value that is one half of a gated input
    (stride 2f where the fake says f) or the same tensor saved twice: it is copied; others are returned as is.
    A QuantizedTensor's buffer keeps its strides (its fake copies the quantize op's own meta buffers)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    out = []
    for t, is_plain in zip(tensors, plain):
        if is_plain and t.stride() != _row_major(t.shape):  # (not is_contiguous(): an empty view passes that)
            t = t.clone(memory_format=torch.contiguous_format)
        elif t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out.append(t)
    return out


@functools.lru_cache(maxsize=1024)
def _row_major(shape) -> tuple[int, ...]:
    """The strides of a new tensor of `shape` (what torch.empty gives, empty dimensions included); kept per shape
    (the loop costs a microsecond or two, and every output of every op call asks)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _rows(seq, i: int, x_rows: int, index: Optional[torch.Tensor]) -> int:
    """Rows of value v<i>: the tokens before a Gather and after a Combine, the routed rows in between."""
    if index is None or i == 0 or (i == len(seq.ops) and seq[i - 1].spec.kind == "combine"):
        return x_rows
    return index.shape[0]


#: The name of the forward op's last output in training: the call's bounds buffer (fusion/runtime/bounds.py), which
#: the backward ops take instead of making their own (_backward_context).
BOUNDS = "bounds"


def _outputs(seq, program, train: bool) -> list[str]:
    """The values the forward op returns: the block output, then (training) the saved values it keeps and, where
    the backward takes it (_passes_bounds), the call's bounds buffer."""
    out = [f"v{len(seq.ops)}"]
    if train:
        out += _kept(program)
        if _passes_bounds(seq):
            out.append(BOUNDS)
    return out


def _passes_bounds(seq) -> bool:
    """Whether the forward op hands its bounds buffer to the backward ops: a block without a Gather (the buffer is
    then all a backward call's context needs from the forward; a routed prologue's other products, its int32 index
    and the sizes with the padding absorbed, are made again by each backward op)."""
    return not seq.inputs.gathers


def _bounds_size(seq, program, group_sizes) -> int:
    """Elements of the bounds buffer (int32): G + 1 row bounds, then the forward's and the backward's counters."""
    groups = 1 if group_sizes is None else group_sizes.shape[0]
    return groups + 1 + program.counters


#: Per program, per `train`: what the forward op returns, worked out once (op.spec costs host time per call).
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _output_layout(seq, program, train: bool) -> tuple[tuple[str, bool], ...]:
    """(value name, whether it is a quantize op's QuantizedTensor) of each value the forward op returns, in order."""
    per_train = _LAYOUTS.get(program)
    if per_train is None:
        per_train = _LAYOUTS[program] = {}
    layout = per_train.get(train)
    if layout is None:
        layout = per_train[train] = tuple((name, name != BOUNDS and _quantize_op_of(seq, name) is not None)
                                          for name in _outputs(seq, program, train))
    return layout


def _kept(program) -> list[str]:
    """The saved values the forward op returns: all but the recomputed ones and x (saved as an input)."""
    return [n for n in program.plan.saves if n not in program.plan.recomputed and n != "v0"]


def _op_context(runner, x, group_sizes, index, floats):
    """An op call's RunContext (see _context) for the block's runner: its device prologue makes the bounds where it
    has one and DEVICE_BOUNDS is on; where it has one but the switch is off, the graph may have been traced to leave
    the sizes' values to it (_checks_sizes), so they are checked here."""
    device_bounds = DEVICE_BOUNDS and runner.device_checked
    return _context(runner.seq, x, group_sizes, index, floats, device_bounds,
                    check_values=runner.device_checked and not device_bounds)


def _context(seq, x, group_sizes, index, floats, device_checked: bool = False, check_values: bool = False):
    """The RunContext of one call from the op's inputs (already checked outside, on the traced side).
    `device_checked` (the runner's: a program with a device prologue, fusion/runtime/bounds.py): the offsets, and
    after a Gather the padding absorbed into the last group, are left to that one launch, as in the eager call
    (the torch path costs 50-100 µs of host per op call: a cumsum here, then a pad in the program's bounds); an
    MoE call with no routed rows has nothing for the routed prologue to launch on, so torch ops make them.
    `check_values`: also check the sizes' values (an asynchronous device assert) where torch ops make the bounds."""
    ctx = RunContext(extra=dict(zip(seq.inputs.floats, floats)))
    if index is not None:
        ctx.index, ctx.tokens = index, x.shape[0]
        device_checked = device_checked and index.numel() > 0
    if group_sizes is not None:
        ctx.group_sizes = ctx.routed_group_sizes = group_sizes
        if not device_checked:
            if index is not None:
                ctx.group_sizes = _absorb_padding(group_sizes, index.shape[0])
            elif check_values:
                _check_group_sizes(seq.inputs.num_groups, group_sizes, x, False, x.shape[0], None)
            ctx.offsets = group_offsets(ctx.group_sizes)
    return ctx


def _saved_group_sizes(seq, names: list[str], ctx, index: Optional[torch.Tensor]):
    """The group sizes the saved values `names` are rebuilt with (a QuantizedTensor's per-group columnwise blocks
    count the sizes the forward's ops saw): ctx's, except where a routed prologue will absorb the padding rows into
    the last group only when the backward runs (ctx.offsets still unset after a Gather): then absorbed here, by
    torch ops, if a saved value needs them at all (None otherwise)."""
    if index is None or ctx.group_sizes is None or ctx.offsets is not None:
        return ctx.group_sizes
    if not any(_quantize_op_of(seq, n) is not None for n in names):
        return None
    return _absorb_padding(ctx.routed_group_sizes, index.shape[0])


def _runner(seq, x):
    """The block's runner for x, with a program: a plan with nothing fused gets one that runs its unfused steps."""
    runner = runner_for(seq, x)
    if runner.program is None:  # a plan with nothing fused: the same executor runs its unfused steps
        runner.program = BlockProgram(seq, runner.plan, "emulate")
        runner.program_unfused = True
    return runner


def _program(seq, x):
    return _runner(seq, x).program


def _without_grad(fn, *args):
    """fn(*args) with autograd off: the ops' programs launch kernels and record nothing. In a compiled graph it is
    off already (entering torch.no_grad costs a few microseconds per call)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    with torch.no_grad():
        return fn(*args)


def _backward_context(runner, x, group_sizes, index, floats, bounds):
    """A backward op call's RunContext: over the forward's bounds buffer where the forward op passed it (its
    values were checked and its counters zeroed by the forward's prologue), else made afresh as the forward's is
    (_op_context: a prologue launch)."""
    if bounds is None:
        return _op_context(runner, x, group_sizes, index, floats)
    ctx = RunContext(extra=dict(zip(runner.seq.inputs.floats, floats)))
    if group_sizes is not None:
        ctx.group_sizes = ctx.routed_group_sizes = group_sizes
    ctx.counters, ctx.groups = bounds, bounds.numel() - 1 - runner.program.counters
    return ctx


# -- registration ------------------------------------------------------------------------------------------------------
_LIB = torch.library.Library("fusion", "FRAGMENT")

#: Each op's implementation, by name: what the dispatcher calls (bench/host_split.py wraps entries to time them).
IMPLEMENTATIONS: dict = {}

#: The ops' overload name: a new one whenever what the ops take or return changes. torch's on-disk caches of compiled
#: graphs (AOTAutograd's, inductor's) key a training graph by its traced forward, which names the forward op only;
#: a graph cached under the old contract would otherwise call the backward ops with the old arguments. v2: the
#: forward returns its bounds buffer in training, the backward ops take it.
CONTRACT = "v2"


def _op(schema: str):
    """Register the decorated function as the implementation of the custom op `fusion::<schema>` on every device,
    with torch.library's low-level API; returns the op (an OpOverload, called like the function).

    Why not ``torch.library.custom_op``: its wrapper adds Python layers to every call (an output-aliasing check and a
    dynamo-disabling wrapper): a trivial op cost 29.5 µs of host time per call that way on the H200 machine, 18.8
    registered here (`python bench/probes/custom_op_cost.py`), and a compiled training step makes three calls. (Most
    of the rest is register_autograd's Python autograd kernel: 13.4 µs without it.) The aliasing rule it checks is
    kept by construction instead: every implementation returns its tensors through `_as_promised`, which copies any
    that would alias.

    Each op is defined as overload CONTRACT of its name (fusion::block_forward.v2, ...), so that a compiled graph that
    torch cached on disk under an earlier contract is not reused with these ops."""
    name, signature = schema.split("(", 1)
    qualified = f"{name}.{CONTRACT}"

    def register(fn):
        IMPLEMENTATIONS[name] = fn
        _LIB.define(f"{qualified}({signature}")
        _LIB.impl(qualified, lambda *args, **kwargs: IMPLEMENTATIONS[name](*args, **kwargs), "CompositeExplicitAutograd")
        return getattr(getattr(torch.ops.fusion, name), CONTRACT)

    return register


def _fake(op):
    """Register the decorated function as `op`'s fake (meta) implementation: its outputs' shapes for tracing."""
    def register(fn):
        torch.library.register_fake(op, fn, lib=_LIB)
        return fn

    return register


# -- the ops -----------------------------------------------------------------------------------------------------------
@_op("block_forward(int key, Tensor x, Tensor[] params, Tensor? group_sizes, Tensor? index, Tensor[] floats, "
     "bool train) -> Tensor[]")
def block_forward(key: int, x: torch.Tensor, params: list[torch.Tensor], group_sizes: Optional[torch.Tensor],
                  index: Optional[torch.Tensor], floats: list[torch.Tensor], train: bool) -> list[torch.Tensor]:
    seq = _block(key)
    runner = _runner(seq, x)
    program = runner.program
    ctx = _op_context(runner, x, group_sizes, index, floats)
    y, saved = _without_grad(program.forward, x, ctx, train)
    values = dict(zip(program.plan.saves, saved))
    values[f"v{len(seq.ops)}"] = y
    values[BOUNDS] = ctx.counters
    tensors, plain = [], []
    for name, quantized in _output_layout(seq, program, train):
        flat = _flatten(values[name]) if quantized else [values[name]]
        tensors += flat
        plain += [not quantized] * len(flat)
    return _as_promised(tensors, plain, [x, *params, group_sizes, index, *floats])


@_fake(block_forward)
def _(key, x, params, group_sizes, index, floats, train):
    seq = _block(key)
    program = _program(seq, x)
    out = []
    for name in _outputs(seq, program, train):
        if name == BOUNDS:
            out.append(x.new_empty(_bounds_size(seq, program, group_sizes), dtype=torch.int32))
            continue
        i = int(name[1:])
        rows, feats = _rows(seq, i, x.shape[0], index), seq.features[i]
        op = _quantize_op_of(seq, name)
        if op is None:
            out.append(x.new_empty(rows, feats))
        else:
            meta = _meta_quantized(op, rows, feats, x.dtype, group_sizes)
            out += [torch.empty_like(t, device=x.device) for t in _flatten(meta)]
    return out


def _saved_values(seq, program, names: list[str], saved: list, x, ctx, index, dtype) -> dict:
    """{name: value} of the saved values `names` (x as v0), rebuilt from their flattened tensors `saved`."""
    values, rest = {"v0": x} if "v0" in names else {}, list(saved)
    kept = [n for n in names if n != "v0"]
    sizes = _saved_group_sizes(seq, kept, ctx, index)
    for name in kept:
        i = int(name[1:])
        values[name], rest = _unflatten(seq, name, rest, _rows(seq, i, x.shape[0], index), seq.features[i], dtype,
                                        sizes)
    return values


def _grad_shapes(x, params, floats, dtype) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of each gradient of (x, *params, *floats)."""
    return [(tuple(x.shape), dtype)] + [(tuple(t.shape), t.dtype) for t in [*params, *floats]]


def _grads_out(made: list, positions, shapes, needs, like: torch.Tensor) -> list[torch.Tensor]:
    """The gradients at `positions` as the ops return them: zeros where one is wanted and none was made, an empty
    tensor where none is wanted."""
    out = []
    for i in positions:
        (shape, dt), g = shapes[i], made[i]
        out.append(torch.zeros(shape, dtype=dt, device=like.device) if g is None and needs[i] else
                   like.new_empty(0) if g is None else g if g.dtype == dt else g.to(dt))
    return out


def _part_grads(state, program, needs, positions) -> list:
    """A backward part's gradients of (x, *params, *floats), after checking that it made none outside `positions`
    (the split's static account of which part makes which: a gradient outside it would be dropped)."""
    dx, grads, extra = program.gradients(state, needs)
    made = [dx] + grads + extra
    stray = [i for i, g in enumerate(made) if g is not None and i not in positions]
    if stray:
        raise FusionError(f"fusion: a part of a split backward made gradients {stray} outside its own {positions} "
                          "(program.BackwardSplit); set fusion.runtime.custom_ops.SPLIT_BACKWARD = False and report "
                          "the block")
    return made


def _fake_grads(positions, shapes, needs, like: torch.Tensor) -> list[torch.Tensor]:
    return [like.new_empty(shapes[i][0], dtype=shapes[i][1]) if needs[i] else like.new_empty(0) for i in positions]


@_op("block_backward(int key, Tensor dy, Tensor[] saved, Tensor x, Tensor[] params, Tensor? group_sizes, "
     "Tensor? index, Tensor[] floats, Tensor? bounds, bool[] needs) -> Tensor[]")
def block_backward(key: int, dy: torch.Tensor, saved: list[torch.Tensor], x: torch.Tensor, params: list[torch.Tensor],
                   group_sizes: Optional[torch.Tensor], index: Optional[torch.Tensor], floats: list[torch.Tensor],
                   bounds: Optional[torch.Tensor], needs: list[bool]) -> list[torch.Tensor]:
    seq = _block(key)
    runner = _runner(seq, x)
    program = runner.program
    ctx = _backward_context(runner, x, group_sizes, index, floats, bounds)
    values = _saved_values(seq, program, ["v0", *_kept(program)], saved, x, ctx, index, dy.dtype)
    saved_values = [values.get(n) for n in program.plan.saves]
    dx, grads, extra = _without_grad(program.backward, [dy], saved_values, ctx, x.shape[0], tuple(needs))
    if bounds is not None:  # the forward's buffer: its counters zeroed again for another backward over it
        program.zero_backward_counters(ctx)
    made = [dx] + grads + extra
    out = _grads_out(made, range(len(made)), _grad_shapes(x, params, floats, dy.dtype), needs, dy)
    return _as_promised(out, [True] * len(out), [dy, *saved, x, *params, group_sizes, index, *floats, bounds])


@_fake(block_backward)
def _(key, dy, saved, x, params, group_sizes, index, floats, bounds, needs):
    shapes = _grad_shapes(x, params, floats, dy.dtype)
    return _fake_grads(range(len(shapes)), shapes, needs, dy)


# A backward cut after the last reader of dY (program.BackwardSplit): two ops, so the compiled graph frees dY, and the
# saved values only the first part reads, between them (a graph holds an op's arguments until the op returns).
@_op("block_backward_head(int key, Tensor dy, Tensor[] saved, Tensor x, Tensor[] params, Tensor? group_sizes, "
     "Tensor? index, Tensor[] floats, Tensor? bounds, bool[] needs) -> Tensor[]")
def block_backward_head(key: int, dy: torch.Tensor, saved: list[torch.Tensor], x: torch.Tensor,
                        params: list[torch.Tensor], group_sizes: Optional[torch.Tensor], index: Optional[torch.Tensor],
                        floats: list[torch.Tensor], bounds: Optional[torch.Tensor],
                        needs: list[bool]) -> list[torch.Tensor]:
    """The first part: (the values carried to the second part, then the gradients at split.head_grads)."""
    seq = _block(key)
    runner = _runner(seq, x)
    program, split = runner.program, runner.program.split
    ctx = _backward_context(runner, x, group_sizes, index, floats, bounds)
    values = _saved_values(seq, program, list(split.head_saved), saved, x, ctx, index, dy.dtype)
    values[program.output_grad] = dy
    state = _without_grad(program.backward_part, values, ctx, x.shape[0], tuple(needs), 0, split.at)
    carried = [state.env[name] for name in split.carried]
    made = _part_grads(state, program, needs, split.head_grads)
    out = _grads_out(made, split.head_grads, _grad_shapes(x, params, floats, dy.dtype), needs, dy)
    plain = [True] * (len(carried) + len(out))
    return _as_promised(carried + out, plain, [dy, *saved, x, *params, group_sizes, index, *floats, bounds])


@_fake(block_backward_head)
def _(key, dy, saved, x, params, group_sizes, index, floats, bounds, needs):
    seq = _block(key)
    split = _program(seq, x).split
    carried = [dy.new_empty(_rows(seq, int(n[1:]), x.shape[0], index), seq.features[int(n[1:])])
               for n in split.carried]
    return carried + _fake_grads(split.head_grads, _grad_shapes(x, params, floats, dy.dtype), needs, dy)


@_op("block_backward_tail(int key, Tensor[] carried, Tensor[] saved, Tensor x, Tensor[] params, "
     "Tensor? group_sizes, Tensor? index, Tensor[] floats, Tensor? bounds, bool[] needs) -> Tensor[]")
def block_backward_tail(key: int, carried: list[torch.Tensor], saved: list[torch.Tensor], x: torch.Tensor,
                        params: list[torch.Tensor], group_sizes: Optional[torch.Tensor], index: Optional[torch.Tensor],
                        floats: list[torch.Tensor], bounds: Optional[torch.Tensor],
                        needs: list[bool]) -> list[torch.Tensor]:
    """The second part: the gradients at split.tail_grads."""
    seq = _block(key)
    runner = _runner(seq, x)
    program, split = runner.program, runner.program.split
    dtype = carried[0].dtype
    ctx = _backward_context(runner, x, group_sizes, index, floats, bounds)
    values = _saved_values(seq, program, list(split.tail_saved), saved, x, ctx, index, dtype)
    values.update(zip(split.carried, carried))
    state = _without_grad(program.backward_part, values, ctx, x.shape[0], tuple(needs), split.at,
                          len(program.backward_steps))
    if bounds is not None:  # the last part: the forward's counters zeroed again for another backward over it
        program.zero_backward_counters(ctx)
    made = _part_grads(state, program, needs, split.tail_grads)
    out = _grads_out(made, split.tail_grads, _grad_shapes(x, params, floats, dtype), needs, carried[0])
    return _as_promised(out, [True] * len(out), [*carried, *saved, x, *params, group_sizes, index, *floats, bounds])


@_fake(block_backward_tail)
def _(key, carried, saved, x, params, group_sizes, index, floats, bounds, needs):
    split = _program(_block(key), x).split
    return _fake_grads(split.tail_grads, _grad_shapes(x, params, floats, carried[0].dtype), needs, carried[0])


def _setup(ctx, inputs, output):
    key, x, params, group_sizes, index, floats, train = inputs
    seq = _block(key)
    n_out = len(_flatten_count(seq, x, output))
    ctx.key, ctx.rows, ctx.n_params, ctx.n_out = key, x.shape[0], len(params), n_out
    ctx.needs = [x.requires_grad, *(p.requires_grad for p in params), *(f.requires_grad for f in floats)]
    ctx.has_gs, ctx.has_index = group_sizes is not None, index is not None
    ctx.save_for_backward(*output[n_out:], x, *params, *floats,
                          *([group_sizes] if group_sizes is not None else []),
                          *([index] if index is not None else []))
    ctx.n_saved, ctx.n_floats = len(output) - n_out, len(floats)
    ctx.has_bounds = train and _passes_bounds(seq)   # the last saved output: the forward's bounds buffer


def _flatten_count(seq, x, output) -> list:
    """The tensors of the block output among the op's outputs (one, or a QuantizedTensor's buffers)."""
    op = _quantize_op_of(seq, f"v{len(seq.ops)}")
    return output[:1] if op is None else output[:len(_layout(op, x.dtype)[0])]


def _backward(ctx, grads):
    if ctx.n_out != 1:
        raise FusionError("fusion: a block ending in a quantize op cannot be trained under torch.compile (its "
                          "output is a QuantizedTensor); end the block with the GEMM that consumes it")
    tensors = list(ctx.saved_tensors)
    saved, tensors = tensors[:ctx.n_saved], tensors[ctx.n_saved:]
    bounds = saved.pop() if ctx.has_bounds else None
    x, tensors = tensors[0], tensors[1:]
    params, tensors = tensors[:ctx.n_params], tensors[ctx.n_params:]
    floats, tensors = tensors[:ctx.n_floats], tensors[ctx.n_floats:]
    group_sizes = tensors.pop(0) if ctx.has_gs else None
    index = tensors.pop(0) if ctx.has_index else None
    dy = grads[0].contiguous()
    inputs = (x, params, group_sizes, index, floats, bounds, ctx.needs)
    seq = _block(ctx.key)
    program = _program(seq, x)
    split = None if not SPLIT_BACKWARD else program.split
    if split is None:
        out = block_backward(ctx.key, dy, saved, x, *inputs[1:])
    else:  # two ops: dY and what only the first part reads are freed between them
        by_name = _split_saved(seq, program, saved, x.dtype)
        head = [t for n in split.head_saved for t in by_name.get(n, [])]
        tail = [t for n in split.tail_saved for t in by_name.get(n, [])]
        del saved, by_name
        first = block_backward_head(ctx.key, dy, head, x, *inputs[1:])
        del dy, head
        carried, made = first[:len(split.carried)], dict(zip(split.head_grads, first[len(split.carried):]))
        del first
        made.update(zip(split.tail_grads, block_backward_tail(ctx.key, carried, tail, x, *inputs[1:])))
        out = [made.get(i) for i in range(len(ctx.needs))]
    keep = [g if need else None for g, need in zip(out, ctx.needs)]
    dx, rest = keep[0], keep[1:]
    return None, dx, rest[:ctx.n_params], None, None, rest[ctx.n_params:], None


def _split_saved(seq, program, saved: list, dtype) -> dict[str, list]:
    """The forward op's saved tensors (flattened, in _kept order) by value name."""
    out, rest = {}, list(saved)
    for name in _kept(program):
        op = _quantize_op_of(seq, name)
        count = 1 if op is None else len(_layout(op, dtype)[0])
        out[name], rest = rest[:count], rest[count:]
    return out


torch.library.register_autograd(block_forward, _backward, setup_context=_setup, lib=_LIB)


# -- the traced side ------------------------------------------------------------------------------------------------
def compiled_forward(seq, x: torch.Tensor, extra: dict):
    """Sequential.forward under torch.compile. The input checks are traced: what reads no data runs at trace time,
    and the group sizes' values are checked by an asynchronous device assert in the graph, except where the op's
    program checks them itself on the device (`_checks_sizes`: its prologue launch, as in the eager call), so the
    graph launches no kernel of its own around the op."""
    device_index = x.device.index if x.device.index is not None else -1
    runs_program = _runs_program(seq.backend, x.device.type, device_index)
    checked = runs_program and _checks_sizes(seq._fusion_key, x.device.type, device_index, x.dtype)
    ctx = seq.inputs.context(x, extra, check_sum=False, host=False, device_checked=checked)
    if not runs_program:
        for op in seq.ops:
            x = op.reference(x, ctx)
        return x
    params = list(seq.parameters())
    floats = [extra[name] for name in seq.inputs.floats]
    train = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)
                                         or any(f.requires_grad for f in floats))
    out = block_forward(seq._fusion_key, x, params, extra.get("group_sizes"), extra.get("index"), floats, train)
    name = f"v{len(seq.ops)}"
    if _quantize_op_of(seq, name) is None:
        return out[0]
    value, _ = _unflatten(seq, name, list(out), _rows(seq, len(seq.ops), x.shape[0], extra.get("index")),
                          seq.features[-1], x.dtype, ctx.group_sizes)
    return value
