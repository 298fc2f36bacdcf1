"""The runners of plan steps: each reads and writes the named values its plan step declares (fusion/dataflow.py).

Forward:  FusedForward (a generated GEMM kernel)           OpForward (an op's reference, no autograd)
Backward: FusedDgrad (a dgrad kernel with a generated       GemmDgrad, GemmWgrad (grouped matmuls; an fp8_block
          d-epilogue)                                       GEMM's: its FP8 kernels or its recipe's reference)
                                                            OpBackward (autograd through one op's reference)

A fused kernel's mainloop is the bound GEMM's weight format's: bf16/fp16 wgmma, or for fp8_block weights the FP8
block-scaled kernel, whose operands are BlockScaled (codes and scales: the input quantized 1x128, the weight's
cached 128x128 blocks; fusion/runtime/fp8_gemm.py's `operand` and `weight_operand` make them).

A runner is built once per block and plan; `run(state)` does one call's work. `state.env` maps value names to
tensors; backward runners add parameter gradients (by parameter) and extra-input gradients (by name).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from fusion.codegen import slots
from fusion.codegen.emit import epilogue_source
from fusion.codegen.spec import EpilogueSpec, Unsupported, backward_spec, forward_spec
from fusion.dataflow import g, index_of, out_grad, qg, v
from fusion.kernels import tile_policy
from fusion.kernels.tile_policy import WGRAD_GATHER_ROWS, gather_dy, gathers_in_kernel
from fusion.grouped import grouped_forward, grouped_matmul, grouped_mm_method, linear_dgrad, linear_wgrad
from fusion.op_table import op_device_method
from fusion.ops.base import RunContext
from fusion.quant import dequantize
from fusion.runtime import fp8_gemm
from fusion.runtime import gather as gather_method
from fusion.runtime.bounds import row_bounds
from fusion.runtime.gather import gather_index
from fusion.runtime.kernel import make_job
from fusion.runtime.row_sums import kernel_launch as row_sums_launch
from fusion.runtime.row_sums import row_sums


@dataclass
class RunState:
    """One call's values, gradients and inputs."""

    ctx: RunContext        # ctx.counters: the call's buffer of G+1 int32 row bounds, then the tile counters
    rows: int = 0          # rows of the block's input x
    counter_base: int = 0  # the first counter of this pass (the backward's follow the forward's)
    env: dict = field(default_factory=dict)
    # an MoE FC2's backward reads the tokens' gradient through the routing index this call (`tokens_grad`; the
    # program then skips the Combine's backward copy)
    dy_through_index: bool = False
    param_grads: dict = field(default_factory=dict)  # id(parameter) -> gradient
    extra_grads: dict = field(default_factory=dict)  # extra input name -> gradient

    @property
    def bounds(self) -> torch.Tensor:
        """The (G+1,) int32 group row bounds on the device (one group [0, M) for a dense block): the head of the
        buffer, which the kernels read as is (a view costs host time, so only reductions ask for this)."""
        return self.ctx.counters[:self.ctx.groups + 1]

    def counter_ptr(self, slot: int) -> int:
        """The address of kernel step `slot`'s zeroed tile counter (the spare tail of the bounds buffer)."""
        return self.ctx.counters.data_ptr() + 4 * (self.ctx.groups + 1 + self.counter_base + slot)

    def add(self, store: dict, key, grad) -> None:
        if grad is not None:
            store[key] = grad if key not in store else store[key] + grad


class BoundLaunch(NamedTuple):
    """A forward step's launch as a call made it, bound at that call's shape: what the forward's replay repeats
    (fusion/runtime/replay.py). `tensors`: the epilogue's tensors in pointer order, each ("out", None) for
    the step's output, ("saved", None) for the value a training kernel saves, or ("extra", name) for an extra input
    of the call."""

    bound: object          # kernels.api.BoundGemm
    job: object            # its KernelJob, counted in LAUNCHES as the step's launch; None for a lone GEMM
    input: str             # the value read as A
    output: str            # the value written, `width` columns
    width: int
    op: object             # the GEMM op whose weight is B
    tensors: tuple
    slot: int              # its tile counter in the call's buffer
    saved: str | None = None   # a training kernel's second output ("saved"), `saved_width` columns
    saved_width: int = 0
    index: bool = False        # the kernel loads A's rows through the call's gather index (an MoE FC1)


class StepLaunches(NamedTuple):
    """What a backward step launched in a call, for the backward's replay (fusion/runtime/backward_replay.py).

    `made`: the tensors the step allocated, each (target, shape, dtype); target ("value", name) for a value it
    wrote, ("param", parameter) or ("extra", name) for a gradient, None for scratch only its own launches read.
    `calls`: its launches in order, each (launch function, arguments, KernelJob counted in LAUNCHES or None). An
    argument is a constant int, a source, or a list of sources (passed as a tuple): ("value", name) a value's
    pointer; ("made", k) the step's k-th tensor's; ("weight", op) the op's weight's; ("bounds", bytes) the call's
    bounds buffer's plus bytes; ("gather_index",) the call's int32 gather index's; ("index",) the routing index's;
    ("extra", name) an extra input's; ("layout", 0 | 1) the token layout's rows or offsets; ("stream",) the
    current stream; ("fp8_weight", op, part) the op's cached FP8 weight blocks as a dgrad reads them (transposed:
    part 0 the codes, 1 the scales), asked of the cache at each call."""

    made: tuple
    calls: tuple


def _plain(t) -> bool:
    """A plain contiguous tensor (what a replayed launch may read by pointer alone)."""
    return type(t) is torch.Tensor and t.is_contiguous()


def weight_of(op) -> torch.Tensor:
    """The op's weight parameter, read from the module's parameter table: nn.Module attribute lookup costs about
    a microsecond per access on the call path, the dictionary a tenth of that (and it is never stale)."""
    return op._parameters["weight"]


def _weight_as_b(weight: torch.Tensor) -> torch.Tensor:
    """A GroupLinear weight (G, out, in) as is; a Linear weight (out, in) as one group. No copy, and no detach:
    the kernel reads the pointer only (an aten op per weight per call is host time)."""
    w = weight if weight.dim() == 3 else weight.detach().unsqueeze(0)
    return w if w.is_contiguous() else w.contiguous()


class _SharedBias:
    """A bias shared by all groups as the kernel's (G, n) group vector: one expanded copy, redone only when the
    parameter changes (G x n elements; a per-group bias or a dense block's is read as is)."""

    def __init__(self):
        self._key, self._value = None, None

    def __call__(self, bias: torch.Tensor, groups: int) -> torch.Tensor:
        b = bias.detach()
        if b.dim() == 2:
            return b
        if groups == 1:
            return b.unsqueeze(0)
        key = (b.data_ptr(), b._version, groups, b.dtype)
        if self._key != key:
            self._key, self._value = key, b.expand(groups, b.shape[0]).contiguous()
        return self._value


def tokens_grad(seq, plan, j: int) -> str | None:
    """The gradient GEMM j's backward may read through the routing index in place of its output's gradient: the
    block output's (the tokens' dY, T x d), where op j is a GroupLinear whose output goes straight into the block's
    last op, a Combine (an MoE FC2), whose backward only copies it to every routed row (zeros at padding rows, as
    the gathering kernels read them). None elsewhere."""
    last = len(seq) - 1
    if last < 1 or seq[last].spec.kind != "combine" or out_grad(plan.ops, j) != g(last):
        return None
    return out_grad(plan.ops, last) if seq[j].weight.dim() == 3 else None


def segment_sum(values: torch.Tensor, bounds: torch.Tensor, per_group: bool) -> torch.Tensor:
    """Column sums per group (or over all rows), deterministic and without a host sync, in values' dtype."""
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    if not per_group:
        return values.sum(0, dtype=acc).to(values.dtype)
    out = torch.segment_reduce(values.to(acc), "sum", offsets=bounds.long(), axis=0, unsafe=True)
    return out.to(values.dtype)


class _KernelStep:
    """What fused runners share: their kernels, per (dtype, variant), made by the block's launcher."""

    def __init__(self, launcher, label: str):
        self.launcher = launcher
        self.label = label
        self.slot = 0  # which of the call's tile counters its launches use (set by BlockProgram)
        self._kernels: dict = {}

    def kernel(self, dtype: torch.dtype, variant: str):
        key = (dtype, variant)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = self.launcher.make(self, dtype, variant)
        return k


# -- forward ---------------------------------------------------------------------------------------------------------
class FusedForward(_KernelStep):
    """A GEMM and its epilogue ops in one kernel; in training it also writes the value its pattern saves."""

    def __init__(self, seq, step, launcher, label: str):
        super().__init__(launcher, label)
        self.step = step
        ops = [seq[i] for i in step.ops]
        # A Gather before the GEMM is the kernel's A loads (row r reads x[index[r]]), not an epilogue stage.
        lead = next((k for k, op in enumerate(ops) if op.spec.kind != "gather"), len(ops))
        if lead > 1:
            raise Unsupported(f"pattern {step.pattern}: {lead} Gather ops before the GEMM; a kernel's A loads take "
                              f"one index")
        self.gathers = lead == 1
        self.gather_op = ops[0] if self.gathers else None
        self.ops = ops[lead:]
        self.gemm = self.ops[0] if self.ops else None
        if self.gemm is None or self.gemm.spec.kind != "gemm":
            raise Unsupported(f"pattern {step.pattern}: ops {list(step.ops)} do not start with a GEMM (after an "
                              f"optional Gather); a forward kernel is a GEMM with an epilogue")
        # a wide GEMM's Gather runs as a copy first, then the TMA kernel (kernels/tile_policy.py gathers_in_kernel)
        self.copies_rows = self.gathers and not gathers_in_kernel(self.weight_shape()[1])
        self.reads_index = self.gathers and not self.copies_rows   # the kernel's A loads go through the index
        self.fp8 = _is_fp8(self.gemm)
        if self.fp8 and self.gathers:
            raise Unsupported(f"pattern {step.pattern}: the FP8 kernel does not gather its A rows")
        gemm_index = step.ops[lead]
        self.input, self.output = v(step.ops[0]), v(step.ops[-1] + 1)
        # What the pattern's `save` names (fusion/dataflow.py): the training kernel writes exactly that.
        wanted = [name for name in step.writes if name != self.output]
        if len(wanted) > 1:
            raise Unsupported(f"pattern {step.pattern} saves {', '.join(wanted)}; its kernel writes one value for "
                              f"the backward")
        self.saved = wanted[0] if wanted else None
        self.spec: EpilogueSpec = forward_spec(self.ops, None if self.saved is None else
                                               index_of(self.saved) - gemm_index)
        self.gated, self.b_major = self.spec.gated, "K"
        self.writes_saved = self.saved is not None
        self.origin = f"pattern {step.pattern} [{step.pattern_loc}], ops {list(step.ops)}"
        self._shared_bias = {}
        self._in_slots = self.spec.forward_slots(False)[0]
        self._out_slots = {variant: self.spec.forward_slots(variant == "train")[1] for variant in ("train", "inference")}
        self._saved_width = None if self.spec.saved is None else self.spec.width_at(self.spec.saved)
        self._plain = {variant: self._plain_outputs(variant) for variant in self._out_slots}
        self._quant_format = self.spec.quant_format   # (a property that walks the stages: once, not per call)

    def weight_shape(self) -> tuple[int, int, int]:
        w = self.gemm.weight
        return tuple(w.shape) if w.dim() == 3 else (1, *w.shape)

    def source(self, dtype: torch.dtype, train: bool) -> str:
        return epilogue_source(self.spec, str(dtype).removeprefix("torch."), train=train and self.writes_saved,
                               origin=self.origin)

    def job(self, dtype: torch.dtype, variant: str, tiles: bool = True):
        G, N, K = self.weight_shape()
        return make_job(self.source(dtype, variant == "train"), dtype, N, K, G, self.spec.gated, "K", False,
                        self.label, variant, tiles=tiles, gather=self.reads_index,
                        mainloop="fp8_block" if self.fp8 else "bf16",
                        col_block=self.spec.col_block)

    def _inputs(self, ctx: RunContext, groups: int) -> dict:
        tensors = {}
        for slot in self._in_slots:
            if isinstance(slot, slots.GroupBias):
                shared = self._shared_bias.setdefault(slot.position, _SharedBias())
                tensors[slot.kernel_name] = shared(self.ops[slot.position].bias, groups)
            else:
                tensors[slot.kernel_name] = ctx.extra[slot.name]
        return tensors

    def _plain_outputs(self, variant: str) -> tuple | None:
        """The variant's output tensors as (kernel name, width) where every one is a plain (M, width) tensor in the
        input's dtype, else None (a quantized store: its data and scales): the common case's allocations, worked out
        once."""
        plain = []
        for slot in self._out_slots[variant]:
            if isinstance(slot, (slots.Quantized, slots.QuantizedFP8Block)):
                return None
            plain.append(("saved", self._saved_width) if isinstance(slot, slots.SavedOut)
                         else (slot.kernel_name, self.spec.out_features))
        return tuple(plain)

    def _allocate(self, variant: str, M: int, dtype: torch.dtype, device) -> dict:
        """This call's output tensors by kernel name."""
        plain = self._plain[variant]
        if plain is not None:
            return {name: torch.empty(M, width, dtype=dtype, device=device) for name, width in plain}
        out_w = self.spec.out_features
        outs = {}
        for slot in self._out_slots[variant]:
            if isinstance(slot, slots.Quantized):
                outs["out"] = torch.empty(M, out_w, dtype=torch.float8_e4m3fn, device=device)
                outs["out_scale"] = torch.empty(M, out_w // 32, dtype=torch.uint8, device=device)
            elif isinstance(slot, slots.QuantizedFP8Block):
                from fusion.kernels.api import fp8_block_outputs
                from fusion.kernels.epilogue import FP8BlockOutput

                outs.update(fp8_block_outputs(FP8BlockOutput("out"), M, out_w, device))
            elif isinstance(slot, slots.SavedOut):
                outs["saved"] = torch.empty(M, self._saved_width, dtype=dtype, device=device)
            else:
                outs[slot.kernel_name] = torch.empty(M, out_w, dtype=dtype, device=device)
        return outs

    def run(self, state: RunState, train: bool) -> None:
        x = state.env[self.input]
        if self.fp8:
            a = fp8_gemm.operand(x)
        else:
            if type(x) is not torch.Tensor:
                x = dequantize(x)
            a = x = x if x.is_contiguous() else x.contiguous()
        variant = "train" if train and self.writes_saved else "inference"
        kernel = self.kernel(x.dtype, variant)
        weight = weight_of(self.gemm)
        index = gather_index(state.ctx) if self.reads_index else None
        if self.copies_rows:   # the routed rows copied by the gather kernel, read by TMA; freed after this step
            a = x = gather_method.run(self.gather_op, x, state.ctx)
        M = x.shape[0] if index is None else index.shape[0]
        tensors = self._inputs(state.ctx, weight.shape[0] if weight.dim() == 3 else 1)
        outs = self._allocate(variant, M, x.dtype, x.device)
        if POISON["on"]:
            _poison(outs)
        tensors.update(outs)
        b = fp8_gemm.weight_operand(self.gemm) if self.fp8 else _weight_as_b(weight)
        kernel.run(a, b, state.ctx.counters, tensors, state.counter_ptr(self.slot), index=index)
        env = state.env
        if self._quant_format == "fp8_block":
            env[self.output] = _fp8_block_quantized(outs, M, self.spec.out_features, x.dtype)
        elif self._quant_format is not None:
            env[self.output] = _quantized(self.ops[-1], outs, state.ctx)
        else:
            env[self.output] = outs["out"]
        if "saved" in outs:
            env[self.saved] = outs["saved"]

    def replay_launch(self, state: RunState, train: bool) -> BoundLaunch | None:
        """This step's launch in the call `state` ran (in mode `train`), or None where a replay cannot repeat it: a
        wide GEMM's gather copy, a quantized output, a shared bias (its expanded copy is checked per call). An FP8
        kernel's: `_fp8_replay_launch`."""
        if self.fp8:
            return self._fp8_replay_launch(state, train)
        x = state.env.get(self.input)
        variant = "train" if train and self.writes_saved else "inference"
        kernel = None if type(x) is not torch.Tensor else self._kernels.get((x.dtype, variant))
        plain = self._plain[variant]
        index = state.ctx.derived.get("gather_index") if self.reads_index else None
        if (kernel is None or self.copies_rows or self._quant_format is not None or plain is None
                or self.reads_index and index is None):
            return None
        widths = dict(plain)
        bound = getattr(kernel, "_bound", {}).get((x.shape[0], -1 if index is None else index.numel()))
        extras = {slot.kernel_name: slot.name for slot in self._in_slots if not isinstance(slot, slots.GroupBias)}
        if (bound is None or len(extras) != len(self._in_slots) or "out" not in widths
                or not widths.keys() <= {"out", "saved"}):
            return None
        tensors = tuple((n, None) if n in widths else ("extra", extras.get(n)) for n in bound.names)
        if any(kind == "extra" and name is None for kind, name in tensors):
            return None
        saved = self.saved if "saved" in widths else None
        return BoundLaunch(bound, kernel.job, self.input, self.output, widths["out"], self.gemm, tensors, self.slot,
                           saved, widths.get("saved", 0), self.reads_index)

    def _fp8_replay_launch(self, state: RunState, train: bool) -> fp8_gemm.Fp8Launch | None:
        """The FP8 kernel's launch (and its input's rowwise quantization) in the call `state` ran, or None where a
        replay cannot repeat it: an input that is not a plain tensor, an MXFP8 output, a shared bias, a kernel or a
        quantization not bound at the call's rows."""
        x = state.env.get(self.input)
        variant = "train" if train and self.writes_saved else "inference"
        kernel = None if type(x) is not torch.Tensor else self._kernels.get((x.dtype, variant))
        if kernel is None or not getattr(kernel, "fp8", False) or self._quant_format not in (None, "fp8_block"):
            return None
        bound = kernel.bound_fp8(x.shape[0])
        from fusion.kernels.fp8_quantize_api import rowwise_launch

        quantize = rowwise_launch(x)
        extras = {slot.kernel_name: slot.name for slot in self._in_slots if not isinstance(slot, slots.GroupBias)}
        if bound is None or quantize is None or len(extras) != len(self._in_slots):
            return None
        own = {"out": ("out", None), "out_scale": ("scale", None), "out_amax": ("amax", None),
               "saved": ("saved", None)}
        tensors = tuple(own[n] if n in own else ("extra", extras.get(n)) for n in bound.names)
        if any(kind == "extra" and name is None for kind, name in tensors) or ("out", None) not in tensors:
            return None
        quantized = self._quant_format == "fp8_block"
        if quantized != (("scale", None) in tensors):
            return None
        saved = self.saved if ("saved", None) in tensors else None
        return fp8_gemm.Fp8Launch(bound, kernel.job, self.input, self.output, self.spec.out_features, self.gemm, tensors,
                         self.slot, quantize, saved, self._saved_width if saved else 0, quantized)


def _quantized(op, outs: dict, ctx: RunContext):
    """The fused step's MXFP8 output as the reference returns it: the kernel's rowwise bytes, and the columnwise
    copy (per-group blocks) and amax from its high-precision output."""
    from fusion.quant import QuantizedTensor

    hp = outs["hp"]
    ref = op.reference(hp, ctx)
    return QuantizedTensor(ref.format, outs["out"].view(torch.uint8), outs["out_scale"], ref.amax, hp.shape,
                           hp.dtype, columnwise_data=ref.columnwise_data, columnwise_scale=ref.columnwise_scale,
                           group_sizes=ref.group_sizes)


def _fp8_block_quantized(outs: dict, M: int, width: int, dtype: torch.dtype):
    """The fused step's FP8-block output as QuantizeFP8Block(columnwise=False)'s reference returns it, all from the
    kernel: the rowwise codes, the k-block-major scales and the finite amax (its float32 bits)."""
    from fusion.quant import QuantizedTensor

    return QuantizedTensor("fp8_block", outs["out"].view(torch.uint8), outs["out_scale"],
                           outs["out_amax"].view(torch.float32), (M, width), dtype)


#: No keyword arguments (read only: passed as **_NO_ARGS)
_NO_ARGS: dict = {}

#: Tests set it: fill kernel outputs with NaN before each launch, so an unwritten element shows up.
POISON = {"on": False}


def _poison(outs: dict) -> None:
    if POISON["on"]:
        for name, t in outs.items():
            if not name.endswith("_amax"):   # an atomic max's zero, not an output to overwrite
                t.view(torch.uint8).fill_(0xFF)


def _device_method(op, part: str, device_kernels: bool):
    """The device method module standing in for `op`'s `part`, or None (the reference runs)."""
    entry = op_device_method(op, part) if device_kernels else None
    return None if entry is None else importlib.import_module(f"fusion.runtime.{entry[0]}")


class _DeviceMethodStep:
    """A step whose device method may launch a dynamically scheduled kernel (its module sets TILE_COUNTER): the
    step then holds a tile-counter slot of the call's buffer like a fused step (`tile_counter`, `slot`, set by
    BlockProgram), and passes its address."""

    tile_counter = False
    slot = 0

    def _claim_counter(self) -> None:
        self.tile_counter = bool(getattr(self.device, "TILE_COUNTER", False))

    def _counter(self, state: RunState) -> dict:
        return {"counter": state.counter_ptr(self.slot)} if self.tile_counter else _NO_ARGS


class OpForward(_DeviceMethodStep):
    """An op outside any fused kernel: its reference implementation (autograd is the block's), or the device
    kernel fusion.op_table.DEVICE_METHODS names for it when the block runs kernels (`device_kernels`)."""

    part = "forward"

    def __init__(self, seq, step, device_kernels: bool = False):
        (self.index,) = step.ops
        self.op = seq[self.index]
        self.input, self.output = v(self.index), v(self.index + 1)
        self.device = _device_method(self.op, "forward", device_kernels)
        self._claim_counter()

    def run(self, state: RunState, train: bool) -> None:
        x = state.env[self.input]
        if self.device is not None and self.device.takes(self.op, x):
            state.env[self.output] = self.device.run(self.op, x, state.ctx, **self._counter(state))
            return
        state.env[self.output] = self.op.reference(x, state.ctx)

    def replay_launch(self, state: RunState, train: bool):
        """The device kernel's launch in the call `state` ran, where the device method can say what it launched (an
        MoE Combine's: fusion/runtime/combine.py `replay_launch`; a lone FP8 GEMM's: fusion/runtime/fp8_gemm.py),
        else None (the reference, or a method that cannot)."""
        x = state.env.get(self.input)
        describe = getattr(self.device, "replay_launch", None)
        if describe is None or x is None or not self.device.takes(self.op, x):
            return None
        launch = describe(self.op, x, state.ctx, self.input, self.output)
        # (a launch reading a tile counter gets this step's slot of the call's buffer)
        return launch._replace(slot=self.slot) if self.tile_counter and launch is not None else launch


class GemmForward(OpForward):
    """A lone bf16/fp16 GEMM without bias: where the block runs kernels and its device method takes the call (a
    GroupLinear at few rows per group: fusion/runtime/lone_gemm.py), our varlen-M kernel; else the vendor grouped
    GEMM called directly (the program is the autograd node, so the reference's autograd wrapper would only cost
    host time). Anything else (a quantized input, a bias, fp8 weights) takes the op's reference."""

    def __init__(self, seq, step, device_kernels: bool = False):
        super().__init__(seq, step, device_kernels)
        self._method: dict = {}

    @staticmethod
    def applies(op) -> bool:
        return (op.spec.kind == "gemm" and getattr(op, "bias", None) is None
                and getattr(op, "weight_format", "bf16") == "bf16")

    def run(self, state: RunState, train: bool) -> None:
        x = state.env[self.input]
        w = weight_of(self.op)  # read, never differentiated here: the program is the autograd node (no detach op)
        if type(x) is not torch.Tensor:
            return super().run(state, train)  # a QuantizedTensor: the reference dequantizes it
        x = x if x.is_contiguous() else x.contiguous()
        if self.device is not None and self.device.takes(self.op, x):
            y = self.device.run(self.op, x, state.ctx, **self._counter(state))
        elif w.dim() == 2:
            y = torch.nn.functional.linear(x, w)
        else:
            key = (x.device, x.dtype)
            method = self._method.get(key)
            if method is None:
                method = self._method[key] = grouped_mm_method(x, w)
            if method == "grouped_mm":
                y = grouped_forward(x, w, state.ctx.offsets)
            else:
                y = grouped_matmul(x, w, state.ctx.group_sizes, state.ctx.offsets, method)
        state.env[self.output] = y

    def replay_launch(self, state: RunState, train: bool) -> BoundLaunch | None:
        """The varlen-M kernel's launch in the call `state` ran (its device method's, bound at the call's rows,
        reading the call's bounds buffer; the same in either mode), or None: torch's GEMM or the reference ran it."""
        x = state.env.get(self.input)
        bound_launch = getattr(self.device, "bound_launch", None)
        if (bound_launch is None or not self.tile_counter or type(x) is not torch.Tensor
                or not self.device.takes(self.op, x)
                or row_bounds(self.op, x.shape[0], state.ctx, x.device) is not state.ctx.counters):
            return None
        bound = bound_launch(self.op, "forward", x)
        if bound is None or bound.names != ("out",):
            return None
        return BoundLaunch(bound, None, self.input, self.output, weight_of(self.op).shape[1], self.op,
                           (("out", None),), self.slot)


# -- backward --------------------------------------------------------------------------------------------------------
class FusedDgrad(_KernelStep):
    """GEMM j's dgrad whose epilogue runs the backward of the elementwise ops a..j-1 (reading the saved value),
    and, when the plan asks, recomputes GEMM j's input for its wgrad. An MoE FC2's (`dy_tokens`) may read the
    tokens' gradient through the routing index (its "backward_gather" kernel loads dY's rows as the forward's
    gathering kernel loads x's) where the program says so for the call (RunState.dy_through_index)."""

    def __init__(self, seq, step, launcher, label: str, plan):
        super().__init__(launcher, label)
        self.step = step
        self.first, self.j = step.ops[0], step.ops[-1]
        self.gemm = seq[self.j]
        self.elementwise = [seq[i] for i in step.ops[:-1]]
        for op in self.elementwise[1:]:
            if op.spec.name == "Bias":
                raise Unsupported(f"pattern {step.pattern}: a Bias inside a fused backward step must be its first "
                                  f"op (its gradient is then the step's output summed per group)")
        self.spec = backward_spec(self.elementwise, seq.features[self.first])
        # FP8 wgmma reads B K-major: the FP8 dgrad reads the weight's transposed blocks (G, in, out)
        self.fp8 = _is_fp8(self.gemm)
        self.gated, self.b_major = False, "K" if self.fp8 else "MN"
        self.grad_in = out_grad(plan.ops, self.j)
        self.saved = next((r for r in step.reads if r.startswith("v")), None)
        self.postact = v(self.j) in step.writes
        # the input gradient also quantized 1x128 rowwise: the FP8 dgrad operand of the GEMM before the chain
        self.quantized_dinput = qg(self.first) if qg(self.first) in step.writes else None
        self.dy_tokens = None if self.fp8 else tokens_grad(seq, plan, self.j)
        self._gathers_dy: dict = {}
        self.origin = f"pattern {step.pattern} [{step.pattern_loc}] (backward), ops {list(step.ops)}"
        self._shared_bias = {}
        self._quantized_format = "fp8_block" if self.quantized_dinput else None
        self._slots = self.spec.backward_slots(self.postact, self._quantized_format)
        self._biases = [op for op in self.elementwise if op.spec.name == "Bias"]  # (op.spec costs us per call)
        # (partials' kernel name, the scale input's name) of each scale gradient the kernel's row sums make
        self._scale_grads = tuple((slot.kernel_name, slot.name) for slot in self._slots[1]
                                  if isinstance(slot, slots.DScale))

    def weight_shape(self) -> tuple[int, int, int]:
        """(G, N, K) of the dgrad GEMM: N = the GEMM's in_features, K = its out_features."""
        w = self.gemm.weight
        G, out_f, in_f = w.shape if w.dim() == 3 else (1, *w.shape)
        return G, in_f, out_f

    def variants(self) -> tuple[str, ...]:
        """The kernels this step may launch: "backward", and an MoE FC2's "backward_gather" (dY through the index)
        where the tile policy's rule can apply at some row count."""
        G, N, _ = self.weight_shape()
        if self.dy_tokens is not None and gather_dy(G, WGRAD_GATHER_ROWS * G, N):
            return ("backward", "backward_gather")
        return ("backward",)

    def job(self, dtype: torch.dtype, variant: str = "backward", tiles: bool = True):
        G, N, K = self.weight_shape()
        # a dequantized FP8-block output: 128 logical columns (any FP8 dgrad tile), on 128 rows where the policy
        # says; a quantized input gradient: a 128-column block of each half whole in the tile, so 128 x 128
        block_output = (self.spec.dequantizes(self.postact) and tile_policy.FP8_DEQUANT_128) or self.quantized_dinput
        col_block = 128 if block_output else 8
        source = epilogue_source(self.spec, str(dtype).removeprefix("torch."), backward=True, postact=self.postact,
                                 origin=self.origin, quantized_dinput=self._quantized_format)
        return make_job(source, dtype, N, K, G, False, self.b_major, self.spec.saved is not None, self.label, variant,
                        tiles=tiles, gather=variant == "backward_gather", mainloop="fp8_block" if self.fp8 else "bf16",
                        col_block=col_block)

    def gathers_dy(self, state: RunState) -> bool:
        """Whether this call's kernel can read the tokens' gradient through the routing index (the tile policy's
        rule at the call's routed rows: kernels/tile_policy.py `gather_dy`), kept per (routed rows, the tokens'
        gradient's type and rank): this runs on every backward."""
        if self.dy_tokens is None:
            return False
        tokens = state.env.get(self.dy_tokens)
        key = (state.ctx.index.numel(), type(tokens), None if tokens is None else tokens.dim())
        hit = self._gathers_dy.get(key)
        if hit is None:
            from fusion.quant import QuantizedTensor

            G, N, _ = self.weight_shape()
            hit = self._gathers_dy[key] = (tokens is not None and not isinstance(tokens, QuantizedTensor)
                                           and tokens.dim() == 2 and gather_dy(G, key[0], N))
        return hit

    def _allocate(self, M: int, dtype: torch.dtype, device) -> dict:
        """This call's output tensors by kernel name: the input gradient (and its FP8 copy), the row-sum partials of a
        scale's gradient (float32; float64 under emulation in float64), the recomputed post-activation value."""
        outs = {}
        for slot in self._slots[1]:
            if isinstance(slot, slots.QuantizedDInput):   # codes, k-block-major scales, the amax's zeroed int32
                from fusion.kernels.api import fp8_block_outputs
                from fusion.kernels.epilogue import FP8BlockOutput

                outs.update(fp8_block_outputs(FP8BlockOutput(slot.kernel_name, slot.paired), M, self.spec.in_features,
                                              device))
            else:
                shape, out_dtype = self._plain_output(slot, M, dtype)
                outs[slot.kernel_name] = torch.empty(shape, dtype=out_dtype, device=device)
        return outs

    def _plain_output(self, slot, M: int, dtype: torch.dtype) -> tuple:
        """(shape, dtype) of an output slot's tensor other than a quantized input gradient's: the row-sum partials
        of a scale's gradient (kernels.epilogue.RowSumOutput; float32, float64 under emulation in float64), the input
        gradient, the recomputed post-activation value."""
        spec = self.spec
        if isinstance(slot, slots.DScale):
            return (M, slot.parts(spec.out_features)), torch.float64 if dtype == torch.float64 else torch.float32
        return (M, spec.in_features if isinstance(slot, slots.DInput) else spec.out_features), dtype

    def run(self, state: RunState) -> None:
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
                shared = self._shared_bias.setdefault(slot.position, _SharedBias())
                tensors[slot.kernel_name] = shared(self.elementwise[slot.position].bias, G)
            else:
                tensors[slot.kernel_name] = ctx.extra[slot.name]
        outs = self._allocate(M, dy.dtype, dy.device)
        if POISON["on"]:
            _poison(outs)
        tensors.update(outs)
        if self.fp8:
            a, b = fp8_gemm.operand(dy), fp8_gemm.weight_operand(self.gemm, transposed=True)
        else:
            a, b = dy, _weight_as_b(weight)
        kernel.run(a, b, state.ctx.counters, tensors, state.counter_ptr(self.slot), index=index)
        env = state.env
        dinput = outs["dinput"]
        env[f"g{self.first}"] = dinput
        if self.quantized_dinput is not None:
            from fusion.runtime.kernel import BlockScaled

            env[self.quantized_dinput] = BlockScaled(outs["dinput_q"].view(torch.uint8), outs["dinput_q_scale"])
        for kernel_name, name in self._scale_grads:
            # the kernel's float32 partial row sums, added in a fixed order, then cast to the scale's dtype
            state.add(state.extra_grads, name, row_sums(outs[kernel_name], ctx.extra[name].dtype,
                                                        self.launcher.name == "cute"))
        for op in self._biases:  # first in the chain: d bias = d(chain input) summed per group
            state.add(state.param_grads, id(op.bias), segment_sum(dinput, state.bounds, op.num_groups is not None))
        if self.postact:
            env[v(self.j)] = outs["postact"]

    def replay_backward(self, state: RunState) -> StepLaunches | None:
        """What :meth:`run` launched in the call `state` ran: the bf16 kernel at the call's shape and the scale
        gradients' row-sum kernel; or None (a quantized input gradient, a bias gradient or a shared bias: torch ops
        or per-call copies). An FP8 kernel's: dY's rowwise quantization first (the quantize kernel's launch bound at
        its shape, into scratch freed with the step), then the kernel on those codes and the weight's cached
        transposed blocks."""
        index = state.dy_through_index and self.dy_tokens is not None
        a = self.dy_tokens if index else self.grad_in
        dy = state.env.get(a)
        if self.quantized_dinput is not None or self._biases or not _plain(dy):
            return None
        kernel = self._kernels.get((dy.dtype, "backward_gather" if index else "backward"))
        sources = {}
        if self.fp8:
            from fusion.kernels.fp8_quantize_api import rowwise_launch

            bound = None if kernel is None or index else kernel.bound_fp8(dy.shape[0])
            quantize = rowwise_launch(dy)
            if bound is None or quantize is None or not bound.M:
                return None
        else:
            rows = state.ctx.index.numel() if index else -1
            bound = getattr(kernel, "_bound", {}).get((dy.shape[0], rows))
            if bound is None or not bound.M:
                return None
        # an FP8 kernel's A: dY's rowwise copy, the step's first two tensors (scratch)
        made, calls = _rowwise_quantization(("value", a), quantize, bound) if self.fp8 else ([], [])
        for slot in self._slots[0]:
            if isinstance(slot, slots.SavedIn):
                sources["saved"] = ("value", self.saved)
            elif isinstance(slot, slots.GroupBias):
                return None
            else:
                sources[slot.kernel_name] = ("extra", slot.name)
        for slot in self._slots[1]:
            target = (("value", f"g{self.first}") if isinstance(slot, slots.DInput) else
                      ("value", v(self.j)) if isinstance(slot, slots.PostAct) else None)
            sources[slot.kernel_name] = ("made", len(made))
            made.append((target, *self._plain_output(slot, bound.M, dy.dtype)))
        if any(name not in sources for name in bound.names):
            return None
        counter = ("bounds", 4 * (state.ctx.groups + 1 + state.counter_base + self.slot))
        outs = [sources[n] for n in bound.names]
        if self.fp8:
            calls.append(_fp8_dgrad_call(bound, self.gemm, counter, outs, kernel.job))
        else:
            calls.append((bound.launch, (("value", a), ("weight", self.gemm), ("bounds", 0), counter,
                                         ("gather_index",) if index else ("bounds", 0), outs, bound.M, bound.T,
                                         bound.num_ctas, ("stream",)), kernel.job))
        for kernel_name, name in self._scale_grads:
            partials = made[sources[kernel_name][1]]
            dtype = state.ctx.extra[name].dtype
            launch = row_sums_launch(partials[1][1], partials[2], dtype) if self.launcher.name == "cute" else None
            if launch is None:
                return None
            calls.append((launch, (sources[kernel_name], ("made", len(made)), bound.M, ("stream",)), None))
            made.append((("extra", name), (bound.M,), dtype))
        return StepLaunches(tuple(made), tuple(calls))


class GemmDgrad(_DeviceMethodStep):
    """GEMM j's input gradient alone: where the block runs kernels and the op's device method takes dY, its kernel
    (bf16/fp16 GroupLinear at few rows per group: fusion/runtime/lone_gemm.py; fp8_block weights: the FP8 kernel,
    fusion/runtime/fp8_gemm.py); else the vendor grouped GEMM, or the fp8_block recipe's reference."""

    part = "dgrad"

    def __init__(self, seq, step, plan, device_kernels: bool = False):
        (self.index,) = step.ops
        self.op = seq[self.index]
        self.grad_in = out_grad(plan.ops, self.index)
        self.fp8 = _is_fp8(self.op)
        # dY already quantized as the FP8 dgrad reads it, by the fused dgrad before (fusion/dataflow.py)
        self.quantized_in = next((r for r in step.reads if r.startswith("qg")), None)
        self.device = _device_method(self.op, "dgrad", device_kernels)
        # a device method whose dgrad rule differs from its forward's says so with takes_dgrad (fusion.op_table)
        self.takes = None if self.device is None else getattr(self.device, "takes_dgrad", self.device.takes)
        # set by BlockProgram where dY's only later reader is this op's weight gradient (`feeds_wgrad`)
        self.feeds_wgrad = False
        self._claim_counter()

    def may_feed_wgrad(self) -> bool:
        """Whether this step can quantize dY for its op's FP8 weight gradient too (an FP8 GEMM on its kernel that
        quantizes dY itself): BlockProgram then sets `feeds_wgrad` where no other step reads dY."""
        return self.device is fp8_gemm and self.quantized_in is None

    def run(self, state: RunState) -> None:
        ctx, op = state.ctx, self.op
        dy = state.env[self.grad_in]
        if type(dy) is not torch.Tensor:
            dy = dequantize(dy)
        dy = dy if dy.is_contiguous() else dy.contiguous()
        quantized = _NO_ARGS if self.quantized_in is None else {"quantized": state.env[self.quantized_in]}
        if self.takes is not None and self.takes(op, dy):
            if self.feeds_wgrad and fp8_gemm.quantizes_for_wgrad(op, state.env.get(v(self.index)), dy, ctx):
                # both GEMMs' FP8 copies of dY now; the weight gradient's slot copy takes dY's place, so dY itself
                # is freed before the dgrad's GEMM instead of after the weight gradient
                a, state.env[self.grad_in] = fp8_gemm.quantize_for_backward(dy, ctx)
                dtype = dy.dtype
                del dy
                dx = fp8_gemm.dgrad_quantized(op, a, dtype, ctx, **self._counter(state))
            else:
                dx = self.device.dgrad(op, dy, ctx, **self._counter(state), **quantized)
        elif not self.fp8:
            dx = linear_dgrad(dy, weight_of(op), ctx.group_sizes, ctx.offsets)
        else:
            from fusion.quant.fp8_linear import fp8_block_dgrad

            dx = fp8_block_dgrad(dy, op.quantized_weight(), _groups(op, ctx), **quantized)
        state.env[f"g{self.index}"] = dx

    def replay_backward(self, state: RunState) -> StepLaunches | None:
        """What :meth:`run` launched in the call `state` ran: the varlen-M kernel (fusion/runtime/lone_gemm.py) at
        the call's rows, reading the call's bounds buffer; an FP8 GEMM's (fusion/runtime/fp8_gemm.py
        `dgrad_launches`: dY's rowwise quantization, then the FP8 kernel on the weight's cached transposed blocks);
        or None (torch's GEMM, an FP8 dgrad that made its weight gradient's copy of dY too, or read the fused dgrad's
        quantization)."""
        dy, out = state.env.get(self.grad_in), state.env.get(f"g{self.index}")
        if self.fp8:
            return self._fp8_replay_backward(state, dy, out)
        bound_launch = getattr(self.device, "bound_launch", None)
        if (bound_launch is None or not self.tile_counter or self.quantized_in is not None or not _plain(dy)
                or not self.takes(self.op, dy) or type(out) is not torch.Tensor
                or row_bounds(self.op, dy.shape[0], state.ctx, dy.device) is not state.ctx.counters):
            return None
        bound = bound_launch(self.op, "dgrad", dy)
        if bound is None or bound.names != ("out",) or not bound.M:
            return None
        counter = ("bounds", 4 * (state.ctx.groups + 1 + state.counter_base + self.slot))
        return StepLaunches(((("value", f"g{self.index}"), tuple(out.shape), out.dtype),),
                            ((bound.launch, (("value", self.grad_in), ("weight", self.op), ("bounds", 0), counter,
                                             ("bounds", 0), [("made", 0)], bound.M, bound.T, bound.num_ctas,
                                             ("stream",)), None),))

    def _fp8_replay_backward(self, state: RunState, dy, out) -> StepLaunches | None:
        """The FP8 dgrad's launches in the call `state` ran (see replay_backward)."""
        if (self.device is not fp8_gemm or not self.tile_counter or self.quantized_in is not None or not _plain(dy)
                or type(out) is not torch.Tensor or not self.takes(self.op, dy)):
            return None   # (dY a SlotGradient now: this dgrad quantized it for the weight gradient too)
        found = fp8_gemm.dgrad_launches(self.op, dy, state.ctx)
        if found is None:
            return None
        quantize, bound = found
        counter = ("bounds", 4 * (state.ctx.groups + 1 + state.counter_base + self.slot))
        made, calls = _rowwise_quantization(("value", self.grad_in), quantize, bound)
        made.append((("value", f"g{self.index}"), tuple(out.shape), out.dtype))
        calls.append(_fp8_dgrad_call(bound, self.op, counter, [("made", 2)], None))
        return StepLaunches(tuple(made), tuple(calls))


class GemmWgrad:
    """GEMM j's weight (and bias) gradient at its saved input: where the block runs kernels, its device method's
    (a GroupLinear's varlen-K kernel, fusion/runtime/wgrad_gemm.py; fp8_block weights: fusion/runtime/fp8_gemm.py);
    else the vendor grouped GEMM, or the fp8_block recipe's reference.

    A GroupLinear after a Gather whose output the backward recomputes (an MoE FC1: its input is x's rows through the
    routing index) may instead have the kernel read the block's tokens through the index (`gathers`, asked by the
    program once per call: fusion/runtime/wgrad_gemm.py); the program then skips the recompute, and `run` finds
    the gathered rows absent. A GroupLinear before a final Combine (an MoE FC2: `dy_tokens`) may read the tokens'
    gradient through the index (`gathers_dy`; the program then skips the Combine's backward copy). A padding row
    (index -1) reads zeros through the kernel's index, as the copies hold there."""

    part = "wgrad"

    def __init__(self, seq, step, plan, device_kernels: bool = False):
        (self.index,) = step.ops
        self.op = seq[self.index]
        self.input = v(self.index)
        self.grad_in = out_grad(plan.ops, self.index)
        self.fp8 = _is_fp8(self.op)
        self.device = _device_method(self.op, "wgrad", device_kernels)
        # the tokens the Gather before this GEMM reads, where the kernel may read them through the index instead
        before, tokens = (seq[self.index - 1], v(self.index - 1)) if self.index > 0 else (None, None)
        self.tokens = (tokens if before is not None and before.spec.kind == "gather" and hasattr(self.device, "gathers")
                       and self.op.weight.dim() == 3 and v(self.index) in plan.recomputed and tokens in plan.saves
                       and tokens not in plan.recomputed else None)
        # (an fp8_block weight's gradient has no kernel that reads dY through the index)
        self.dy_tokens = None if self.fp8 else tokens_grad(seq, plan, self.index)
        self._gathers: dict = {}

    def reads_input(self, state: RunState) -> bool:
        """Whether this call reads GEMM j's input (the program recomputes it first if the forward did not keep
        it): not for a bias gradient alone, nor where the kernel reads the tokens through the index instead."""
        return weight_of(self.op).requires_grad and not self.gathers(state)

    def gathers(self, state: RunState) -> bool:
        """Whether this call's weight gradient reads the tokens through the routing index (not the recomputed
        gathered rows): the tile policy's rule at the call's routed rows, and the kernel takes the tokens. Kept
        per (routed rows, tokens' dtype and device): the rule reads only those, and this runs on every backward."""
        if self.tokens is None or not weight_of(self.op).requires_grad:
            return False
        tokens = state.env[self.tokens]
        key = (state.ctx.index.numel(), tokens.dtype, tokens.device, tokens.dim())
        hit = self._gathers.get(key)
        if hit is None:
            hit = self._gathers[key] = bool(self.device.gathers(self.op, key[0]) and self.device.takes(self.op, tokens))
        return hit

    def gathers_dy(self, state: RunState) -> bool:
        """Whether this call's weight gradient can read the tokens' gradient through the routing index (not the
        Combine backward's copy): the tile policy's rule at the call's routed rows, the kernel takes the tokens'
        gradient, and no bias gradient (a per-group sum of the routed rows) wants the copy."""
        op = self.op
        if self.dy_tokens is None or (op.bias is not None and op.bias.requires_grad):
            return False
        if not weight_of(op).requires_grad:
            return True   # nothing read
        if not hasattr(self.device, "gathers_dy"):
            return False
        tokens = state.env[self.dy_tokens]
        key = ("dy", state.ctx.index.numel(), tokens.dtype, tokens.device, tokens.dim())
        hit = self._gathers.get(key)
        if hit is None:
            hit = self._gathers[key] = bool(self.device.gathers_dy(op, key[1]) and self.device.takes(op, tokens))
        return hit

    def run(self, state: RunState) -> None:
        ctx, op = state.ctx, self.op
        if isinstance(state.env.get(self.grad_in), fp8_gemm.SlotGradient):
            # the FP8 dgrad before quantized dY for this weight gradient (GemmDgrad.feeds_wgrad): only its slot copy
            dw = self.device.wgrad(op, state.env[self.input], state.env[self.grad_in], ctx)
            state.add(state.param_grads, id(op.weight), dw)
            return
        dy_index = gather_index(ctx) if state.dy_through_index and self.dy_tokens is not None else None
        dy = state.env[self.grad_in if dy_index is None else self.dy_tokens]
        if type(dy) is not torch.Tensor:
            dy = dequantize(dy)
        dy = dy if dy.is_contiguous() else dy.contiguous()
        weight, bias = weight_of(op), op.bias
        # the program skipped the gathered rows' recompute because `gathers` said so (asked once per call)
        if weight.requires_grad and self.tokens is not None and self.input not in state.env:
            dw = self.device.wgrad(op, state.env[self.tokens], dy, ctx, index=gather_index(ctx))
            state.add(state.param_grads, id(weight), dw)
        elif weight.requires_grad:
            x = state.env[self.input]
            if dy_index is not None:   # `gathers_dy` said so for this call
                dw = self.device.wgrad(op, x, dy, ctx, dy_index=dy_index)
            elif self.device is not None and self.device.takes(op, x):
                dw = self.device.wgrad(op, x, dy, ctx)
            elif not self.fp8:
                dw = linear_wgrad(dy, dequantize(x).contiguous(), weight, ctx.group_sizes, ctx.offsets)
            else:
                from fusion.quant.fp8_linear import fp8_block_wgrad

                dw = fp8_block_wgrad(dy, x, weight, _groups(op, ctx))  # x as saved: its columnwise copy counts
            state.add(state.param_grads, id(weight), dw)
        if bias is not None and bias.requires_grad:
            state.add(state.param_grads, id(bias), segment_sum(dy, state.bounds, weight.dim() == 3))

    def replay_backward(self, state: RunState) -> StepLaunches | None:
        """What :meth:`run` launched in the call `state` ran: the varlen-K kernel (fusion/runtime/wgrad_gemm.py) at
        the call's rows, reading x or dY through the gather index where the call did (an fp8_block GEMM's
        where its recipe took the high-precision operands: fusion/runtime/fp8_gemm.py `wgrad_in_bf16_kernel`); or
        None (a bias gradient, torch's GEMM, the FP8 varlen-K kernel)."""
        op, ctx, env = self.op, state.ctx, state.env
        weight, bias = weight_of(op), op.bias
        bound_launch = getattr(self.device, "bound_launch", None)
        if self.fp8:   # the bf16 varlen-K kernel ran where the recipe's rule took dY and X in high precision
            bound_launch = fp8_gemm.wgrad_in_bf16_kernel(op, env.get(self.input), env.get(self.grad_in))
        if (bound_launch is None or not weight.requires_grad or bias is not None and bias.requires_grad
                or isinstance(env.get(self.grad_in), fp8_gemm.SlotGradient)):
            return None
        dy_index = state.dy_through_index and self.dy_tokens is not None
        dy_name = self.dy_tokens if dy_index else self.grad_in
        tokens = self.tokens is not None and self.input not in env
        x_name = self.tokens if tokens else self.input
        dy, x = env.get(dy_name), env.get(x_name)
        if not (_plain(dy) and _plain(x)) or not (tokens or dy_index or self.fp8 or self.device.takes(op, x)):
            return None
        rows = ctx.index.numel() if tokens or dy_index else dy.shape[0]
        bound = bound_launch(op, x, dy, rows, tokens, dy_index)
        if bound is None or row_bounds(op, rows, ctx, x.device) is not ctx.counters:
            return None
        index = ("gather_index",) if tokens or dy_index else ("bounds", 0)
        return StepLaunches(((("param", weight), tuple(weight.shape), x.dtype),),
                            ((bound.launch, (("value", dy_name), ("value", x_name), ("bounds", 0), index, ("made", 0),
                                             bound.M, bound.a_shape[0], bound.b_shape[0], bound.num_ctas,
                                             ("stream",)), None),))


def _rowwise_quantization(dy, quantize, bound) -> tuple[list, list]:
    """(made, calls) of an FP8 dgrad's first launch in a replay: dY (the source `dy`) quantized 1x128 rowwise by the
    launch kernels.fp8_quantize_api.rowwise_launch bound (`quantize`) into two scratch tensors of the step, made 0
    (codes, A's shape) and made 1 (scales)."""
    launch, grid, k_blocks = quantize
    M, K = bound.a_shape
    return ([(None, (M, K), torch.uint8), (None, (k_blocks, M), torch.float32)],
            [(launch, (dy, ("made", 0), ("made", 1), 0, 0, 0, 0, M, grid, ("stream",)), None)])


def _fp8_dgrad_call(bound, op, counter, outs, job) -> tuple:
    """An FP8 dgrad kernel's launch in a replay: A the step's made 0 and 1 (`_rowwise_quantization`), B op's cached
    transposed weight blocks, writing `outs`."""
    return (bound.launch, (("made", 0), ("fp8_weight", op, 0), ("made", 1), ("fp8_weight", op, 1), ("bounds", 0),
                           counter, outs, bound.M, bound.num_ctas, ("stream",)), job)


def _is_fp8(op) -> bool:
    return op.spec.attrs.get("weight_format") == "fp8_block"


def _groups(op, ctx: RunContext):
    """The group sizes a GEMM's recipe reads: None for a dense Linear (one group)."""
    return None if op.weight.dim() == 2 else ctx.group_sizes


def _autograd_dispatch():
    """Autograd's dispatch keys back on. Under torch.compile the program runs inside a torch.library custom op,
    whose implementation runs with them excluded (below autograd), so autograd through a reference there would
    record nothing: "element 0 of tensors does not require grad"."""
    from torch._C import DispatchKey, DispatchKeySet

    autograd = DispatchKeySet(DispatchKey.AutogradFunctionality) | DispatchKeySet(DispatchKey.AutogradOther) | \
        DispatchKeySet(DispatchKey.AutogradNestedTensor)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - autograd)


class OpBackward:
    """Autograd through one op's reference at its saved input: the gradients of its input, its parameters and
    the extra inputs it reads; or, for an op whose only gradient is its input's, the device method's
    (fusion.op_table) when the block runs kernels."""

    part = "backward"

    def __init__(self, seq, step, plan, device_kernels: bool = False):
        (self.index,) = step.ops
        self.op = seq[self.index]
        self.grad_in = out_grad(plan.ops, self.index)
        self.features = plan.ops[self.index].in_features
        self.extra_inputs = self.op.spec.extra_inputs
        self.device = _device_method(self.op, "backward", device_kernels)

    def run(self, state: RunState) -> None:
        from fusion.quant import QuantizedTensor, dequantize

        op, ctx = self.op, state.ctx
        if op.input_grad is not None:
            dy = state.env[self.grad_in]
            with torch.no_grad():
                if self.device is not None and self.device.takes(op, dy):
                    state.env[f"g{self.index}"] = self.device.run(op, dy, ctx)
                else:
                    state.env[f"g{self.index}"] = op.input_grad(dy, ctx)
            return
        value = state.env.get(v(self.index))
        params = [p for p in op.parameters(recurse=False) if p.requires_grad]
        extras = [(name, ctx.extra[name]) for name in self.extra_inputs
                  if name in ctx.extra and ctx.extra[name].requires_grad]
        with torch.enable_grad(), _autograd_dispatch():
            if value is None:  # its gradient reads no input value: a zero of the input's shape stands in
                dy = state.env[self.grad_in]
                # the plan may not know a first op's input width (a Gather's is x's): such ops keep the width
                value = dy.new_zeros(()).expand(self._rows(state), self.features or dy.shape[-1])
            # A quantized input stays quantized: an op that consumes its buffers (an fp8_block GEMM reads the
            # columnwise copy for its wgrad) must see what it saw in the forward. The gradient is plain.
            x = (value if isinstance(value, QuantizedTensor) else dequantize(value)).detach().requires_grad_()
            out = op.reference(x, ctx)
            out = dequantize(out)
            grads = torch.autograd.grad(out, [x, *params, *(t for _, t in extras)], state.env[self.grad_in],
                                        allow_unused=True)
        state.env[f"g{self.index}"] = grads[0]
        for p, gp in zip(params, grads[1:1 + len(params)]):
            state.add(state.param_grads, id(p), gp)
        for (name, _), ge in zip(extras, grads[1 + len(params):]):
            state.add(state.extra_grads, name, ge)

    def replay_backward(self, state: RunState) -> StepLaunches | None:
        """What :meth:`run` launched in the call `state` ran, where its device method says (an MoE Gather's
        backward: the combine kernel; a Combine's: the gather kernel), else None (autograd through a reference)."""
        op, ctx = self.op, state.ctx
        dy = state.env.get(self.grad_in)
        if op.input_grad is None or self.device is None or not _plain(dy) or not self.device.takes(op, dy):
            return None
        made = ("value", f"g{self.index}")
        if self.device is gather_method:   # a Combine's backward: each routed row copies its token's gradient
            return rows_gather(self.grad_in, dy, made, ctx)
        describe = getattr(self.device, "replay_launch", None)   # a Gather's backward: each token's rows summed
        launch = None if describe is None else describe(op, dy, ctx, self.grad_in, made[1])
        if launch is None:
            return None
        return StepLaunches(((made, (launch.T, launch.width), dy.dtype),),
                            ((launch.launch, (("value", self.grad_in), ("layout", 0), ("layout", 1), ("made", 0),
                                              launch.M, launch.T, ("stream",)), None),))

    def _rows(self, state: RunState) -> int:
        """Rows entering this op: the block's tokens before a Gather, the routed rows after it."""
        index = state.ctx.index
        if index is None or self.index == 0:
            return state.rows
        return index.numel()


def rows_gather(source: str, x: torch.Tensor, made: tuple, ctx: RunContext) -> StepLaunches | None:
    """The gather kernel's launch (fusion/runtime/gather.py) of value `source` (x) into a new value `made`, as the
    call ran it, or None where the reference ran (gather.replay_launch)."""
    launch = gather_method.replay_launch(x, ctx) if _plain(x) else None
    if launch is None:
        return None
    return StepLaunches(((made, (launch.M, launch.width), x.dtype),),
                        ((launch.launch, (("value", source), ("index",), ("made", 0), launch.T, launch.M,
                                          ("stream",)), None),))
