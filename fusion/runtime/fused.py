"""A fused forward plan step: one grouped-GEMM kernel whose epilogue codegen wrote from the step's ops.

The backward of a fused forward step is computed from what the kernel saved (the GEMM output, i.e. the
activation's input): the epilogue ops' reference implementations are re-run on it under autograd, which
gives the gradients of the pre-activation, the router scales and the biases exactly as the reference path
defines them; the GEMM's dgrad and wgrad then run as grouped matmuls.
"""
from __future__ import annotations

import dataclasses
import os
import threading

import torch

from fusion.codegen.emit import epilogue_source
from fusion.codegen.spec import EpilogueSpec, spec_from_ops
from fusion.grouped import linear_dgrad, linear_wgrad, row_group_index
from fusion.ops.base import RunContext

#: Debugging aid (tests set it): fill kernel outputs with NaN before each launch.
POISON_OUTPUTS = os.environ.get("FUSION_POISON_OUTPUTS") == "1"

#: A fixed row estimate per group for the tile heuristic: kernels must not depend on the row count, so one
#: compile serves every batch (API.md).
ROWS_PER_GROUP_ESTIMATE = 512


def _kernels():
    import fusion.kernels as kernels  # imports cutlass: only when a fused step is built

    return kernels


def bias_vector(op, paired: bool, groups: int) -> torch.Tensor:
    """An op's bias as the kernel's GroupVector input: fp32 (groups, n), interleaved when paired."""
    bias = op.bias.detach().float()
    bias = bias.expand(groups, bias.shape[-1]) if bias.dim() == 1 else bias
    if paired:
        bias = _kernels().interleave_gated_weight(bias, dim=-1)
    return bias.contiguous()


def kernel_offsets(ctx: RunContext, rows: int, device) -> torch.Tensor:
    """The kernel's (G+1,) int32 group offsets, computed on the device; a dense Linear is one group."""
    if ctx.group_sizes is None:
        return torch.tensor([0, rows], dtype=torch.int32, device=device)
    return _kernels().offsets_from_group_sizes(ctx.group_sizes)


class RepackedWeight:
    """A weight in a kernel's layout, redone only when the parameter changed (its version counter moves on every
    in-place update, e.g. an optimizer step), never visible in state_dict()."""

    def __init__(self, transform):
        self.transform = transform
        self._cached: tuple | None = None
        self._lock = threading.Lock()

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        with self._lock:
            if self._cached is None or self._cached[0] != key:
                data = weight.detach() if weight.dim() == 3 else weight.detach().unsqueeze(0)
                self._cached = (key, self.transform(data).contiguous())
            return self._cached[1]


class FusedForwardStep:
    """Everything one fused forward step needs at run time: generated epilogues, compiled kernels, the
    repacked weight. Built once per (block, plan step) and reused across calls."""

    def __init__(self, seq, step):
        self.step = step
        self.ops = [seq[i] for i in step.ops]
        self.gemm = self.ops[0]
        self.spec_train: EpilogueSpec = spec_from_ops(self.ops)
        self.spec_infer = dataclasses.replace(self.spec_train, save_preactivation=False)
        self.origin = f"pattern {step.pattern} [{step.pattern_loc}], ops {list(step.ops)}"
        gated = self.spec_train.gated
        self._packed = RepackedWeight(lambda w: _kernels().interleave_gated_weight(w) if gated else w)
        self._compiled: dict = {}

    # -- code ---------------------------------------------------------------------------------------------
    def spec(self, train: bool) -> EpilogueSpec:
        return self.spec_train if train else self.spec_infer

    def source(self, train: bool) -> str:
        return epilogue_source(self.spec(train), origin=self.origin)

    def weight_shape(self) -> tuple[int, int, int]:
        w = self.gemm.weight
        return tuple(w.shape) if w.dim() == 3 else (1, *w.shape)

    def job(self, dtype: torch.dtype, train: bool, target: str = "sm_90a", label: str = "step"):
        """The compile job of this step's kernel (plain data; see fusion.runtime.compile)."""
        from fusion.runtime.compile import KernelJob

        G, N, K = self.weight_shape()
        config = _kernels().choose_config(ROWS_PER_GROUP_ESTIMATE * G, N, K, G, self.spec_train.gated)
        return KernelJob(step=label, variant="train" if train else "inference", source=self.source(train),
                         config=dataclasses.astuple(config), dtype=str(dtype).removeprefix("torch."),
                         N=N, K=K, G=G, target=target)

    def compile(self, dtype: torch.dtype, train: bool, target: str = "sm_90a"):
        """The runnable kernel: from memory, the disk cache, or compiled now (needs no GPU)."""
        from fusion.runtime.compile import load_compiled

        key = (dtype, train, target)
        hit = self._compiled.get(key)
        if hit is None:
            hit = self._compiled[key] = load_compiled(self.job(dtype, train, target))
        return hit

    # -- data ---------------------------------------------------------------------------------------------
    def packed_weight(self) -> torch.Tensor:
        """The weight as (G, N, K), gate/up rows interleaved when gated."""
        return self._packed(self.gemm.weight)

    def _extras(self, spec: EpilogueSpec, ctx: RunContext, groups: int) -> dict:
        extras = {}
        for name, paired in spec.group_inputs:
            extras[name] = bias_vector(self.ops[int(name.removeprefix("bias"))], paired, groups)
        for name in spec.row_inputs:
            extras[f"scale_{name}"] = ctx.extra[name].float().contiguous()
        return extras

    def tuned(self, x: torch.Tensor, ctx: RunContext, train: bool):
        """The kernel for this launch: the heuristic's, or in autotune mode the fastest measured on this GPU
        model (fusion/runtime/autotune.py), chosen on the first launch and recorded on disk."""
        from fusion.runtime import autotune
        from fusion.runtime.compile import load_compiled

        key = (x.dtype, train, "tuned")
        if not autotune.enabled():
            return self.compile(x.dtype, train)
        if key not in self._compiled:
            job = self.job(x.dtype, train)
            device = torch.cuda.get_device_name(x.device)
            config = autotune.recorded(job, device)
            if config is None:
                config = autotune.tune(job, device, lambda cfg: self._time(job, cfg, x, ctx, train))
            self._compiled[key] = load_compiled(dataclasses.replace(job, config=dataclasses.astuple(config)))
        return self._compiled[key]

    def _time(self, job, config, x, ctx, train, reps: int = 5) -> float:
        from fusion.runtime.compile import load_compiled

        compiled = load_compiled(dataclasses.replace(job, config=dataclasses.astuple(config)))
        self._run(compiled, x, ctx, train)  # warm up (module load)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            self._run(compiled, x, ctx, train)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps / 1e3

    def launch(self, x: torch.Tensor, ctx: RunContext, train: bool) -> dict:
        """Run the kernel; returns its outputs by name (out / out_scale / hp / pre)."""
        return self._run(self.tuned(x, ctx, train), x, ctx, train)

    def _run(self, compiled, x: torch.Tensor, ctx: RunContext, train: bool) -> dict:
        k = _kernels()
        spec = self.spec(train)
        M = x.shape[0]
        G, N, _ = self.weight_shape()
        width = N // 2 if spec.gated else N
        outs = {}
        for slot in compiled.epilogue.outputs:
            cols = 2 * width if slot.paired else width
            if isinstance(slot, k.MXFP8Output):
                outs[slot.name] = torch.empty(M, cols, dtype=torch.float8_e4m3fn, device=x.device)
                outs[slot.scale_name] = torch.empty(M, cols // 32, dtype=torch.uint8, device=x.device)
            else:
                outs[slot.name] = torch.empty(M, cols, dtype=x.dtype, device=x.device)
        if POISON_OUTPUTS:
            for t in outs.values():
                t.view(torch.uint8).fill_(0xFF)  # NaN in every float format: unwritten elements show up
        offsets = kernel_offsets(ctx, x.shape[0], x.device)
        k.run_grouped_gemm(compiled, x.contiguous(), self.packed_weight(), offsets, outs,
                           self._extras(spec, ctx, G))
        return outs

    def wrap_output(self, outs: dict, x: torch.Tensor) -> torch.Tensor:
        """The step's result as the reference returns it: a tensor, or a QuantizedTensor."""
        if not self.spec_train.quantized:
            return outs["out"]
        from fusion.quant import QuantizedTensor
        from fusion.quant._common import finite_amax
        from fusion.quant.mxfp8 import mxfp8_quantize_2d

        hp = outs["hp"]
        quant_op = self.ops[-1]
        cw_data = cw_scale = None
        if quant_op.columnwise:
            # 32-row blocks of the transpose span tiles of different groups: quantized outside the kernel.
            cw_data, cw_scale = mxfp8_quantize_2d(hp.float().t().contiguous())
        return QuantizedTensor("mxfp8", outs["out"].view(torch.uint8), outs["out_scale"],
                               finite_amax(hp.float()), hp.shape, hp.dtype,
                               columnwise_data=cw_data, columnwise_scale=cw_scale)

    # -- autograd -----------------------------------------------------------------------------------------
    def grad_inputs(self, ctx: RunContext) -> list[torch.Tensor]:
        """Tensors whose gradients this step produces, after x: the GEMM weight (and bias), the epilogue
        ops' parameters, the row scales."""
        tensors = [p for op in self.ops for p in op.parameters(recurse=False)]
        tensors += [ctx.extra[name] for name in self.spec_train.row_inputs]
        return tensors

    def backward(self, ctx: RunContext, grad: torch.Tensor, x: torch.Tensor, pre: torch.Tensor, needs: tuple):
        """Gradients of (x, *grad_inputs) from the saved pre-activation; see the module docstring."""
        if pre is None:  # no stage's gradient depends on the GEMM output (see spec_from_ops)
            pre = grad.new_zeros(grad.shape[0], self.weight_shape()[1])
        elif self.spec_train.gated:
            pre = _kernels().deinterleave_gated(pre, dim=-1)
        targets = self.grad_inputs(ctx)
        weight = self.gemm.weight
        rest = [t for t, need in zip(targets, needs[1:]) if need and t is not weight]
        with torch.enable_grad():
            h = pre.detach().requires_grad_()
            y = h
            if getattr(self.gemm, "bias", None) is not None:
                bias = self.gemm.bias
                y = y + (bias if bias.dim() == 1 else bias[row_group_index(ctx.group_sizes, h.shape[0])])
            for op in self.ops[1:]:
                if op.spec.kind != "quantize":
                    y = op.reference(y, ctx)
            found = torch.autograd.grad(y, [h, *rest], grad, allow_unused=True)
        dh, by_tensor = found[0], dict(zip(map(id, rest), found[1:]))
        dx = linear_dgrad(dh, weight, ctx.group_sizes, ctx.offsets) if needs[0] else None
        dw = linear_wgrad(dh, x, weight, ctx.group_sizes, ctx.offsets) if needs[1] else None
        grads = [dx]
        for t, need in zip(targets, needs[1:]):
            grads.append(dw if t is weight else (by_tensor.get(id(t)) if need else None))
        return grads


class _FusedForwardFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: FusedForwardStep, rctx: RunContext, train: bool, x, *tensors):
        outs = step.launch(x, rctx, train)
        if train:
            ctx.save_for_backward(x, outs.get("pre"))
            ctx.step, ctx.rctx = step, rctx
        return step.wrap_output(outs, x)

    @staticmethod
    def backward(ctx, grad):
        from fusion.quant import QuantizedTensor

        if isinstance(grad, QuantizedTensor):
            grad = grad.dequantize()
        x, pre = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        return (None, None, None, *ctx.step.backward(ctx.rctx, grad.contiguous(), x, pre, needs))


def run_fused_forward(step: FusedForwardStep, x: torch.Tensor, ctx: RunContext):
    from fusion.quant import dequantize

    x = dequantize(x)
    tensors = step.grad_inputs(ctx)
    train = torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in tensors))
    return _FusedForwardFunction.apply(step, ctx, train, x, *tensors)
