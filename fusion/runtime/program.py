"""A block's plan made executable: the one forward and backward executor of fused plans.

    program = BlockProgram(seq, plan, backend)        # once per block, plan and backend ("cute" | "emulate")
    y, saved = program.forward(x, ctx, train=True)    # the forward steps; `saved`: plan.saves, in order
    dx, param_grads, extra_grads = program.backward([dy], saved, ctx, rows, needs)

Read it top to bottom: forward runs each forward step's runner (fusion/runtime/steps.py) over one dictionary
of named values (v<i>: the input of op i); the values the plan saves are returned for the backward. Backward
starts from the gradient of the block output and runs each backward step's runner in plan order over the same
kind of dictionary (g<i>: the gradient of v<i>), after recomputing any saved value the forward did not
produce (plan.recomputed). Steps whose results nobody needs are skipped; so is an MoE block's Combine backward
(a copy of the tokens' gradient to every routed row) in a call where every reader of that copy reads the tokens'
gradient through the routing index instead (steps.tokens_grad). The autograd wrappers around it
(eager autograd.Function, torch.library custom ops for torch.compile) live in fusion/runtime/autograd.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusion.dataflow import hands_dy_to_wgrad, index_of, out_grad, v
from fusion.runtime import steps as S
from fusion.runtime.bounds import torch_bounds
from fusion.runtime.kernel import LAUNCHERS


def _recompute_bases(plan) -> dict[str, str]:
    """For each value the backward recomputes, the kept value it is recomputed from (the nearest before it)."""
    kept = [index_of(n) for n in plan.saves if n.startswith("v") and n not in plan.recomputed]
    return {name: v(max(i for i in kept if i < index_of(name))) for name in plan.recomputed}


def _last_reads(steps, keep: set, bases: dict[str, str], also: dict[int, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """For each backward step, the values no later step reads (dropped after it runs), except `keep`. A step
    reading a recomputed value also reads its base (the recompute runs right before that step); step n may also
    read `also[n]` (the tokens' gradient, read through the routing index in place of the Combine's copy)."""
    last = {}
    for n, step in enumerate(steps):
        for name in (*step.reads, *also.get(n, ())):
            last[name] = n
            if name in bases:
                last[bases[name]] = n
    release = [[] for _ in steps]
    for name, n in last.items():
        if name not in keep:
            release[n].append(name)
    return [tuple(r) for r in release]


def _number_slots(runners) -> int:
    """Give each kernel step, and each step whose device method takes a tile counter, its own tile-counter slot;
    returns how many."""
    kernels = [r for r in runners if isinstance(r, S._KernelStep) or getattr(r, "tile_counter", False)]
    for slot, runner in enumerate(kernels):
        runner.slot = slot
    return len(kernels)


@dataclass(frozen=True)
class BackwardSplit:
    """A backward cut in two parts after the last reader of the block output's gradient dY, for a caller that cannot
    free dY (or a saved value only the first part reads) inside one call: torch.compile's custom ops, whose graph
    holds an op's arguments until the op returns (fusion/runtime/custom_ops.py). The first part (steps before `at`)
    reads dY; the second gets the values it needs from the first by name (`carried`: plain tensors, the gradients
    of values v<i>, or a value a dgrad recomputed). Each part makes the gradients at its `*_grads` positions of
    (x, *params, *extra inputs) and no other, and reads the saved values of its `*_saved`."""
    at: int
    carried: tuple[str, ...]
    head_saved: tuple[str, ...]
    tail_saved: tuple[str, ...]
    head_grads: tuple[int, ...]
    tail_grads: tuple[int, ...]


class BlockProgram:
    """`prologue`: a fusion.runtime.bounds.DevicePrologue (RoutedPrologue for a block that starts with a Gather)
    that makes each call's bounds buffer in one launch (fused plans on a GPU), or None (torch ops make it)."""

    def __init__(self, seq, plan, backend: str, prologue=None):
        self.seq, self.plan, self.backend = seq, plan, backend
        self.prologue = prologue
        self.params = list(seq.parameters())
        launcher = LAUNCHERS[backend]
        # backend "cute" also runs device kernels for unfused ops that have one (fusion.op_table.DEVICE_METHODS)
        self.device_kernels = backend == "cute"
        self.forward_steps = []
        for n, step in enumerate(plan.forward, 1):
            if step.fused:
                runner = S.FusedForward(seq, step, launcher, f"F{n}")
            else:
                runner = (S.GemmForward if S.GemmForward.applies(seq[step.ops[0]]) else S.OpForward)(
                    seq, step, self.device_kernels)
            self.forward_steps.append(runner)
        self.backward_steps = []
        for n, step in enumerate(plan.backward, 1):
            self.backward_steps.append(self._backward_runner(seq, step, launcher, f"B{n}"))
        self._feeds_wgrad(plan)
        self.recompute_bases = _recompute_bases(plan)
        # a recomputed op runs as in the forward: its device method where it has one (a Gather: the gather
        # kernel, fusion/runtime/gather.py), else its reference
        self.recompute_methods = {j: S._device_method(seq[j], "forward", self.device_kernels)
                                  for name, base in self.recompute_bases.items()
                                  for j in range(index_of(base), index_of(name))}
        self.combine_copy = self._combine_copy(seq, plan)
        also = {} if self.combine_copy is None else {n: (self.backward_steps[n].dy_tokens,)
                                                       for n in self.combine_copy[1]}
        self.release = _last_reads(plan.backward, {out_grad(plan.ops, -1)}, self.recompute_bases, also)
        # per backward step, what each call reads of it: (step, runner, a weight gradient?, the recomputed values it
        # reads, the values dropped after it)
        self._backward_table = [
            (step, runner, isinstance(runner, S.GemmWgrad),
             tuple(name for name in step.reads if name in plan.recomputed), release)
            for step, runner, release in zip(plan.backward, self.backward_steps, self.release)]
        self.forward_kernels = _number_slots(self.forward_steps)
        self.backward_kernels = _number_slots(self.backward_steps)
        self.counters = self.forward_kernels + self.backward_kernels
        self.output_grad = f"g{len(plan.ops)}"
        self.input_grad = out_grad(plan.ops, -1)
        self.split = self._split(seq, plan)

    def _split(self, seq, plan) -> BackwardSplit | None:
        """Where the backward may be cut in two (BackwardSplit), or None: dY is read up to the last step, the second
        part needs nothing from the first or a value that is not a plain tensor (a quantized dgrad operand), or a
        gradient would be made in both parts."""
        last = next((n for n, done in enumerate(self.release) if self.output_grad in done), None)
        steps = plan.backward
        if last is None or last + 1 >= len(steps):
            return None
        at = last + 1
        head, tail = steps[:at], steps[at:]
        quantized = {getattr(r, "quantized_dinput", None) for r in self.backward_steps[:at]}
        written = dict.fromkeys(w for step in head for w in step.writes)
        carried = tuple(n for n in written if any(n in step.reads for step in tail))
        if not carried or quantized & set(carried) or not all(n[0] in "gv" for n in carried):
            return None
        saved = [n for n in plan.saves if n not in plan.recomputed]

        def reads(part):
            names = {r for step in part for r in step.reads}
            names |= {self.recompute_bases[r] for r in names if r in self.recompute_bases}
            return tuple(n for n in saved if n in names)

        def grads(part):
            made = {0} if any(self.input_grad in step.writes for step in part) else set()
            owners = {j for step in part for j, kind in step.parts if kind in ("wgrad", "backward")}
            for j in owners:
                op = seq[j]
                made |= {1 + k for k, p in enumerate(self.params) if any(p is q for q in op.parameters(recurse=False))}
                made |= {1 + len(self.params) + k for k, name in enumerate(seq.inputs.floats)
                         if name in op.spec.extra_inputs}
            return made

        head_grads, tail_grads = grads(head), grads(tail)
        if head_grads & tail_grads or 0 in head_grads:
            return None
        return BackwardSplit(at, carried, reads(head), reads(tail), tuple(sorted(head_grads)), tuple(sorted(tail_grads)))

    def _backward_runner(self, seq, step, launcher, label):
        if step.fused:
            return S.FusedDgrad(seq, step, launcher, label, self.plan)
        part = step.parts[0][1]
        kind = {"dgrad": S.GemmDgrad, "wgrad": S.GemmWgrad}.get(part)
        return (kind or S.OpBackward)(seq, step, self.plan, self.device_kernels)

    def _feeds_wgrad(self, plan) -> None:
        """Mark each FP8 dgrad step whose dY has exactly one other reader, its op's weight gradient after it
        (fusion.dataflow.hands_dy_to_wgrad): that dgrad makes both GEMMs' FP8 copies of dY where the weight gradient
        takes FP8 (steps.GemmDgrad.feeds_wgrad), and dY goes a step early."""
        for n, runner in enumerate(self.backward_steps):
            if isinstance(runner, S.GemmDgrad) and runner.may_feed_wgrad():
                runner.feeds_wgrad = hands_dy_to_wgrad(plan.backward, n, runner.grad_in, f"g{len(plan.ops)}")

    def _combine_copy(self, seq, plan):
        """(the Combine backward's step, the steps that read its copy of the tokens' gradient) where each of those
        readers may read the tokens' gradient through the routing index instead (an MoE FC2's fused dgrad and
        weight gradient: steps.tokens_grad), else None."""
        last = len(plan.ops) - 1
        at = next((n for n, r in enumerate(self.backward_steps)
                   if isinstance(r, S.OpBackward) and r.index == last and seq[last].spec.kind == "combine"), None)
        if at is None:
            return None
        copy = plan.backward[at].writes[0]
        readers = tuple(n for n, step in enumerate(plan.backward) if copy in step.reads)
        if not readers or not all(getattr(self.backward_steps[n], "dy_tokens", None) for n in readers):
            return None
        return at, readers

    def fused_runners(self):
        return [r for r in self.forward_steps + self.backward_steps if isinstance(r, S._KernelStep)]

    # -- forward ---------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx, train: bool):
        """(block output, saved values in plan.saves order; None for values to recompute)."""
        state = self.run_forward(x, ctx, train)
        y = state.env[v(len(self.plan.ops))]
        saved = [state.env.get(name) for name in self.plan.saves] if train else []
        return y, saved

    def run_forward(self, x: torch.Tensor, ctx, train: bool):
        """The forward steps over x; returns the run's state (every value the forward made, by name): what a
        replay of the call is built from (fusion/runtime/replay.py)."""
        self._bounds(ctx, x.shape[0], x.device)
        state = S.RunState(ctx=ctx, rows=x.shape[0])
        state.env[v(0)] = x
        for runner in self.forward_steps:
            runner.run(state, train)
        return state

    def _bounds(self, ctx, rows: int, device) -> None:
        """The call's bounds buffer (fusion/runtime/bounds.py) into ctx: made once per call, by the forward (or by
        a backward whose context was made for it alone: the torch.compile custom op). Torch GEMMs and reference
        ops read ctx.offsets, a view of it made when first read (fusion/run_context.py)."""
        routed = rows if ctx.index is None else ctx.index.numel()
        if self.prologue is not None and ctx.offsets is None:
            buffer = self.prologue(ctx, routed, device, self.counters)
        else:
            buffer = torch_bounds(ctx, routed, device, self.counters)
        ctx.counters, ctx.groups, ctx.backward_counters_used = buffer, buffer.numel() - 1 - self.counters, False

    # -- backward --------------------------------------------------------------------------------------------------
    def backward(self, output_grad: list, saved, ctx, rows: int, needs: tuple, record: list | None = None):
        """Gradients of (x, *self.params, *ctx.extra values); `needs` says which are wanted (autograd's
        needs_input_grad in that order). `output_grad` is [dY], and it and a `saved` list are emptied: the program
        owns the values from here, and dY is freed after its last reader where the caller holds no other
        reference (the eager autograd node: fusion/runtime/autograd.py). `record`: see :meth:`backward_part`."""
        values = {name: value for name, value in zip(self.plan.saves, saved) if value is not None}
        if isinstance(saved, list):
            saved.clear()  # the env holds them now, and drops each after its last reader
        values[self.output_grad] = output_grad.pop()
        state = self.backward_part(values, ctx, rows, needs, 0, len(self.backward_steps), record)
        return self.gradients(state, needs)

    def backward_part(self, values: dict, ctx, rows: int, needs: tuple, start: int, stop: int,
                      record: list | None = None):
        """Run backward steps start..stop-1 over `values` (emptied into the run's env: the output gradient, saved
        values, and what earlier steps made, by name); returns the run's state. The whole backward is one part;
        under torch.compile a split backward is two (BackwardSplit). A `record` list gets, per step, what it
        launched (its and its recomputes' steps.StepLaunches, None where one cannot say) and the values dropped
        after it: what the backward's replay is built from (fusion/runtime/backward_replay.py)."""
        dy = values.get(self.output_grad)
        if dy is not None and not dy.is_contiguous():
            values[self.output_grad] = dy.contiguous()
        del dy
        if ctx.counters is None:
            self._bounds(ctx, rows, next(t for t in values.values() if isinstance(t, torch.Tensor)).device)
        state = S.RunState(ctx=ctx, rows=rows, counter_base=self.forward_kernels)
        if ctx.backward_counters_used:  # a second backward through the same graph (retain_graph): zero them again
            self.zero_backward_counters(ctx)
        ctx.backward_counters_used = True
        state.env.update(values)
        values.clear()
        need_x = bool(needs[0])
        skip = self._skipped_copy(state, need_x)
        state.dy_through_index = skip is not None
        env = state.env
        for n in range(start, stop):
            step, runner, is_wgrad, recomputed_reads, release = self._backward_table[n]
            if n != skip and self._wanted(step, runner, need_x):
                # (a weight gradient that reads the tokens through the routing index needs no regathered copy, a
                # bias gradient alone no input)
                if recomputed_reads and (not is_wgrad or runner.reads_input(state)):
                    for name in recomputed_reads:
                        if name not in env:
                            self._recompute(state, name)
                            if record is not None:
                                record.append((self._recompute_launch(state, name), ()))
                runner.run(state)
                if record is not None:
                    describe = getattr(runner, "replay_backward", None)
                    record.append((None if describe is None else describe(state), release))
            elif record is not None:
                record.append((S.StepLaunches((), ()), release))
            for name in release:  # free each value after its last reader, as autograd would between nodes
                env.pop(name, None)
        return state

    def zero_backward_counters(self, ctx) -> None:
        """Zero the backward's tile counters in the call's buffer again (one memset, stream-ordered after the
        launches that used them): before a second backward over one forward's buffer, or, where each backward call
        builds its own context over the forward's buffer (the torch.compile ops), after the last part. The counters
        are the kernels' scratch, left as the forward's prologue made them: the buffer's autograd version is kept
        (a compiled graph saves it for the backward, and autograd refuses a saved tensor changed in place, which
        the kernels' own atomics never report either)."""
        if self.backward_kernels:
            with torch.autograd._unsafe_preserve_version_counter(ctx.counters):
                ctx.counters.narrow(0, ctx.groups + 1 + self.forward_kernels, self.backward_kernels).zero_()

    def gradients(self, state, needs: tuple):
        """(dx, parameter gradients, extra-input gradients) a backward run made; None where it made none."""
        dx = state.env.get(self.input_grad) if needs[0] else None
        grads = [state.param_grads.get(id(p)) for p in self.params]
        extra = [state.extra_grads.get(name) for name in state.ctx.extra]
        return dx, grads, extra

    def _skipped_copy(self, state, need_x: bool) -> int | None:
        """The Combine backward's step, to skip in this call, where every wanted reader of its copy reads the
        tokens' gradient through the routing index (each asks the tile policy at the call's routed rows); else
        None."""
        if self.combine_copy is None:
            return None
        at, readers = self.combine_copy
        wanted = [self.backward_steps[n] for n in readers
                  if self._wanted(self.plan.backward[n], self.backward_steps[n], need_x)]
        return at if all(r.gathers_dy(state) for r in wanted) else None

    def _wanted(self, step, runner, need_x: bool) -> bool:
        """Skip what only produces unwanted gradients: the input gradient when x needs none, a weight gradient
        whose parameters need none."""
        if isinstance(runner, S.GemmWgrad):
            op = runner.op
            bias = op.bias
            return op._parameters["weight"].requires_grad or (bias is not None and bias.requires_grad)
        if not need_x and step.writes[:1] == (self.input_grad,):
            if isinstance(runner, S.OpBackward):
                op = runner.op
                if op.input_grad is not None:  # its only gradient is the input's
                    return False
                return any(p.requires_grad for p in op.parameters(recurse=False)) or bool(runner.extra_inputs)
            return isinstance(runner, S.FusedDgrad)
        return True

    def _recompute_launch(self, state, name: str):
        """What :meth:`_recompute` launched for `name`: the gather kernel where it recomputed one Gather's output
        (an MoE FC1's input for its weight gradient), else None."""
        base = self.recompute_bases[name]
        j = index_of(base)
        method = self.recompute_methods[j]
        if index_of(name) != j + 1 or method is not S.gather_method or not method.takes(self.seq[j], state.env[base]):
            return None
        return S.rows_gather(base, state.env[base], ("value", name), state.ctx)

    def _recompute(self, state, name: str) -> None:
        """A value the backward reads that the forward did not keep: rerun the ops from the nearest kept value,
        right before its first reader (it lives from there to its last reader, not through the whole backward).
        An op with a forward device method runs it (one that takes a tile counter excepted: the backward's slots
        belong to its own steps)."""
        base = self.recompute_bases[name]
        with torch.no_grad():
            value = state.env[base]
            for j in range(index_of(base), index_of(name)):
                op, method = self.seq[j], self.recompute_methods[j]
                if method is not None and not getattr(method, "TILE_COUNTER", False) and method.takes(op, value):
                    value = method.run(op, value, state.ctx)
                else:
                    value = op.reference(value, state.ctx)
        state.env[name] = value
