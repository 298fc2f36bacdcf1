"""Fused backward: a plan whose backward has fused steps runs the whole block as one autograd node.

Forward runs the plan's forward steps and keeps what the backward steps read (each GEMM's input, each fused
step's GEMM output). Backward then walks the plan's backward steps in order, keeping the gradient of every
op's output it has computed:

  fused dgrad step   one grouped-GEMM launch: d(input of GEMM j) = dy @ W_j, with an epilogue generated from
                     the backward of the elementwise ops before GEMM j (read at the saved GEMM output), which
                     yields the gradient at the previous GEMM's output and the per-element terms of each
                     per-row scale's gradient (reduced here);
  dgrad / wgrad      grouped matmuls (torch._grouped_mm, or the reference loop);
  op backward        the op's reference re-run under autograd at its saved or recomputed input.

Quantize ops pass gradients straight through (their reference does), so they have no backward step.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from fusion.codegen.emit import epilogue_source
from fusion.codegen.spec import spec_from_ops
from fusion.grouped import linear_dgrad, linear_wgrad, row_group_index
from fusion.ops.base import RunContext
from fusion.runtime.fused import ROWS_PER_GROUP_ESTIMATE, RepackedWeight, _kernels, bias_vector, kernel_offsets


def _gemm_without_bias(features: int):
    """Stands in for 'whatever produced the epilogue's input' when that was not a fused GEMM's raw output."""
    spec = SimpleNamespace(kind="gemm", attrs={"out_features": features, "bias": False})
    return SimpleNamespace(spec=spec, describe=lambda: "input")


class FusedDgradStep:
    """A fused backward step: GEMM j's dgrad whose epilogue runs the backward of ops first..j-1."""

    def __init__(self, seq, step, raw_gemm_output: bool):
        self.step = step
        self.gemm_index = next(i for i, part in step.parts if part == "dgrad")
        self.first = min(step.ops)
        self.gemm = seq[self.gemm_index]
        elementwise = [seq[i] for i in range(self.first, self.gemm_index)]
        if any(op.spec.name == "Bias" for op in elementwise[1:]):
            from fusion.codegen.spec import Unsupported

            raise Unsupported(f"pattern {step.pattern}: a Bias inside a fused backward step must be its first op "
                              f"(its gradient is then the step's output summed per group)")
        before = seq[self.first - 1] if self.first > 0 else None
        #: The saved value entering op `first` is the raw output of the previous GEMM (no bias added) when a
        #: fused forward step produced it; the epilogue then adds that GEMM's bias itself.
        producer = before if (raw_gemm_output and before is not None) else _gemm_without_bias(
            _width_into(self.gemm, elementwise))
        self.spec = spec_from_ops([producer, *elementwise]) if elementwise else None
        self.producer = producer
        self.origin = f"pattern {step.pattern} [{step.pattern_loc}] (backward), ops {list(step.ops)}"
        self._packed = RepackedWeight(lambda w: w.transpose(-1, -2))
        self._compiled = {}

    def source(self) -> str:
        spec = self.spec or dataclasses.replace(spec_from_ops([_gemm_without_bias(self.gemm.in_features)]),
                                                save_preactivation=False)
        return epilogue_source(spec, backward=True, origin=self.origin)

    def weight_shape(self):
        w = self.gemm.weight
        G, out_f, in_f = w.shape if w.dim() == 3 else (1, *w.shape)
        return G, in_f, out_f  # B of the dgrad GEMM: (G, N=in, K=out)

    def job(self, dtype: torch.dtype, target: str = "sm_90a", label: str = "dgrad"):
        from fusion.runtime.compile import KernelJob

        G, N, K = self.weight_shape()
        config = _kernels().choose_config(ROWS_PER_GROUP_ESTIMATE * G, N, K, G, False)
        if self.spec is not None and self.spec.save_preactivation:
            # An epilogue reading the saved pre-activation holds twice the values per thread: 128x192 pingpong
            # would spill; 128x128 pingpong does not (tests/test_compile_plans.py checks the SASS) and beat the
            # cooperative 128x128 tile (which prefetches the aux tile under its mainloop) by 16 % on an H200
            # (bench/bench_dgrad_epilogue.py, bench/results_h200_v5_profile.txt).
            config = dataclasses.replace(config, tile_n=128, stages=6, pingpong=True, dynamic=True)
        return KernelJob(step=label, variant="backward", source=self.source(), config=dataclasses.astuple(config),
                         dtype=str(dtype).removeprefix("torch."), N=N, K=K, G=G, target=target)

    def compile(self, dtype: torch.dtype, target: str = "sm_90a"):
        from fusion.runtime.compile import load_compiled

        if dtype not in self._compiled:
            self._compiled[dtype] = load_compiled(self.job(dtype, target))
        return self._compiled[dtype]

    def packed_weight(self) -> torch.Tensor:
        """W_j transposed to (G, in, out), the B operand of the dgrad GEMM."""
        return self._packed(self.gemm.weight)

    def run(self, grad: torch.Tensor, aux: torch.Tensor | None, ctx: RunContext, offsets: torch.Tensor, seq):
        """(gradient at the value entering op `first`, canonical layout; {scale name: row gradient})."""
        k = _kernels()
        compiled = self.compile(grad.dtype)
        M = grad.shape[0]
        G, N, _ = self.weight_shape()
        gated = bool(self.spec and self.spec.gated)
        outs = {}
        for slot in compiled.epilogue.outputs:
            outs[slot.name] = torch.empty(M, 2 * N if slot.paired else N, dtype=grad.dtype, device=grad.device)
        extras = {}
        if self.spec is not None:
            if self.spec.save_preactivation:
                extras["pre"] = aux
            for name, paired in self.spec.group_inputs:
                extras[name] = bias_vector(self._op_for(name, seq), paired, G)
            for name in self.spec.row_inputs:
                extras[f"scale_{name}"] = ctx.extra[name].float().contiguous()
        k.run_grouped_gemm(compiled, grad.contiguous(), self.packed_weight(), offsets, outs, extras)
        dpre = outs["dpre"]
        if gated:
            dpre = k.deinterleave_gated(dpre, dim=-1)
        terms = {name: outs[f"dscale_{name}"].sum(-1, dtype=torch.float32) for name in (self.spec.row_inputs if self.spec else ())}
        return dpre, terms

    def _op_for(self, bias_name: str, seq):
        index = int(bias_name.removeprefix("bias"))
        return self.producer if index == 0 else seq[self.first - 1 + index]


def _width_into(gemm, elementwise) -> int:
    """Features entering the first of `elementwise` (which ends at `gemm`): gated activations halve them."""
    width = gemm.in_features
    for op in elementwise:
        if op.spec.kind == "activation" and op.spec.gated:
            width *= 2
    return width


def _segment_sum(values: torch.Tensor, ctx: RunContext, groups: int | None) -> torch.Tensor:
    """Per-group column sums (groups None: one sum over all rows), on the device, without a host sync."""
    if groups is None or ctx.group_sizes is None:
        return values.sum(0)
    out = values.new_zeros(groups, values.shape[-1], dtype=torch.float32)
    out.index_add_(0, row_group_index(ctx.group_sizes, values.shape[0]), values.float())
    return out.to(values.dtype)


class BlockRun:
    """Forward and backward of a whole block by its plan (see the module docstring)."""

    def __init__(self, seq, plan):
        from fusion.runtime import fused_step

        self.seq, self.plan = seq, plan
        self.ops = seq.ops
        fused_forward = {i: s for s in plan.forward if s.fused for i in s.ops}
        self.forward_steps = [(s, fused_step(seq, s) if s.fused else None) for s in plan.forward]
        self.backward_steps = []
        for s in plan.backward:
            runner = None
            if s.fused:
                first = min(s.ops)
                prev = fused_forward.get(first - 1)
                raw = prev is not None and prev is fused_forward.get(first) and prev.ops[0] == first - 1
                runner = FusedDgradStep(seq, s, raw_gemm_output=raw)
            self.backward_steps.append((s, runner))

    def params(self) -> list[torch.Tensor]:
        return list(self.seq.parameters())

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, x, ctx: RunContext):
        """Run the forward steps; returns (output, values) where values[i] is the input of op i that was
        materialized, and raw[i] marks values that are a fused GEMM's raw (interleaved) output."""
        from fusion.quant import dequantize

        values, raw = {}, {}
        cur = x
        for step, runner in self.forward_steps:
            if runner is not None:
                xin = dequantize(cur)
                outs = runner.launch(xin, ctx, train=True)
                first = step.ops[0]
                values[first] = xin
                if "pre" in outs:
                    raw[first + 1] = outs["pre"]
                cur = runner.wrap_output(outs, xin)
                values[step.ops[-1] + 1] = cur
            else:
                (i,) = step.ops
                values[i] = cur
                cur = self.ops[i].reference(cur, ctx)
                values[i + 1] = cur
        return cur, values, raw

    # -- backward -----------------------------------------------------------------------------------------------
    def value_in(self, i: int, values, raw, ctx):
        """The input of op i: saved, or the saved raw GEMM output (+ bias, de-interleaved), or recomputed."""
        from fusion.quant import dequantize

        if i in values:
            return dequantize(values[i])
        if i in raw:
            v = raw[i]
            runner = self._forward_runner_of(i - 1)
            if runner is not None and runner.spec_train.gated:
                v = _kernels().deinterleave_gated(v, dim=-1)
            gemm = self.ops[i - 1]
            if getattr(gemm, "bias", None) is not None:
                b = gemm.bias
                v = v + (b if b.dim() == 1 else b[row_group_index(ctx.group_sizes, v.shape[0])])
            values[i] = v
            return v
        with torch.no_grad():
            v = self.ops[i - 1].reference(self.value_in(i - 1, values, raw, ctx), ctx)
        values[i] = v
        return dequantize(v)

    def _forward_runner_of(self, op_index: int):
        for step, runner in self.forward_steps:
            if runner is not None and op_index in step.ops:
                return runner
        return None

    def backward(self, dy, ctx: RunContext, values, raw):
        """Gradients of (x, *params, *extra inputs in ctx.extra order)."""
        from fusion.quant import QuantizedTensor

        if isinstance(dy, QuantizedTensor):
            dy = dy.dequantize()
        n = len(self.ops)
        gout = {n - 1: dy}
        pgrad: dict[int, torch.Tensor] = {}
        egrad: dict[str, torch.Tensor] = {}

        def add(store, key, g):
            if g is not None:
                store[key] = g if key not in store else store[key] + g

        def grad_out(k):
            # Quantize ops pass gradients straight through: d(output of k) = d(output of the quantize after k).
            while k not in gout and k + 1 < n and self.ops[k + 1].spec.kind == "quantize":
                k += 1
            return gout[k]

        offsets = kernel_offsets(ctx, dy.shape[0], dy.device)
        for step, runner in self.backward_steps:
            if runner is not None:
                j = runner.gemm_index
                g = grad_out(j)
                aux = raw.get(runner.first) if runner.producer is self.ops[runner.first - 1] else None
                if aux is None and runner.spec is not None and runner.spec.save_preactivation:
                    aux = self.value_in(runner.first, values, raw, ctx)
                    if runner.spec.gated:
                        aux = _kernels().interleave_gated_weight(aux, dim=-1)
                dpre, terms = runner.run(g.contiguous(), aux, ctx, offsets, self.seq)
                gout[runner.first - 1] = dpre
                for name, t in terms.items():
                    add(egrad, name, t)
                for i in range(runner.first, j):  # biases inside the step: their gradient is d(pre) summed
                    op = self.ops[i]
                    if op.spec.name == "Bias":
                        add(pgrad, id(op.bias), _segment_sum(dpre, ctx, op.num_groups))
                continue
            for k, part in step.parts:
                op = self.ops[k]
                if part == "dgrad":
                    gout[k - 1] = linear_dgrad(grad_out(k), op.weight, ctx.group_sizes, ctx.offsets)
                elif part == "wgrad":
                    g = grad_out(k)
                    x = self.value_in(k, values, raw, ctx)
                    add(pgrad, id(op.weight), linear_wgrad(g, x, op.weight, ctx.group_sizes, ctx.offsets))
                    if getattr(op, "bias", None) is not None:
                        add(pgrad, id(op.bias), _segment_sum(g, ctx, op.num_groups if op.weight.dim() == 3 else None))
                elif part == "backward":
                    self._op_backward(k, grad_out(k), values, raw, ctx, gout, pgrad, egrad, add)
        dx = gout.get(-1)
        if dx is None and n and self.ops[0].spec.kind == "quantize":
            dx = grad_out(-1)
        return dx, pgrad, egrad

    def _op_backward(self, k, g, values, raw, ctx, gout, pgrad, egrad, add):
        op = self.ops[k]
        params = list(op.parameters(recurse=False))
        extras = [(name, ctx.extra[name]) for name in op.spec.extra_inputs if name in ctx.extra]
        with torch.enable_grad():
            v = self.value_in(k, values, raw, ctx).detach().requires_grad_()
            leaves = [v, *params, *(t for _, t in extras)]
            out = op.reference(v, ctx)
            grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
        gout[k - 1] = grads[0]
        for p, gp in zip(params, grads[1:1 + len(params)]):
            add(pgrad, id(p), gp)
        for (name, _), ge in zip(extras, grads[1 + len(params):]):
            add(egrad, name, ge)


class _BlockFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: BlockRun, rctx: RunContext, names: tuple, x, *tensors):
        y, values, raw = run.forward(x, rctx)
        ctx.run, ctx.rctx, ctx.names, ctx.values, ctx.raw = run, rctx, names, values, raw
        return y

    @staticmethod
    def backward(ctx, dy):
        run = ctx.run
        dx, pgrad, egrad = run.backward(dy.contiguous(), ctx.rctx, ctx.values, ctx.raw)
        params = run.params()
        grads = [pgrad.get(id(p)) for p in params]
        grads += [egrad.get(name) for name in ctx.names]
        targets = params + [ctx.rctx.extra[n] for n in ctx.names]
        grads = [g.to(t.dtype) if g is not None else None for g, t in zip(grads, targets)]
        ctx.values = ctx.raw = None
        return (None, None, None, dx, *grads)


def block_run(seq, plan) -> BlockRun:
    """The block's run-time object for `plan` (built once per block and plan)."""
    cache = _RUNS.setdefault(seq, {})
    run = cache.get(id(plan))  # plans are immutable and shared; the run keeps its plan alive, so ids stay unique
    if run is None:
        run = cache[id(plan)] = BlockRun(seq, plan)
    return run


def run_block(seq, plan, x, ctx: RunContext):
    """The block's forward as one autograd node whose backward runs the plan's backward steps."""
    run = block_run(seq, plan)
    names = tuple(n for n, t in ctx.extra.items() if t.is_floating_point())
    tensors = [*run.params(), *(ctx.extra[n] for n in names)]
    return _BlockFunction.apply(run, ctx, names, x, *tensors)


import weakref  # noqa: E402

_RUNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
