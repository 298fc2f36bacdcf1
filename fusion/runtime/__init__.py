"""Executes a Sequential by its plan: fused steps through generated kernels (or their torch emulation), every
other op through its reference implementation.

Per call, only what depends on the call is done: a dictionary lookup finds the block's runner for (device,
dtype, backend, pattern library), which holds the plan, the program (fusion/runtime/program.py) with its
kernels, and the block's input checks; the checks read no data on a GPU; the program launches.
"""
from __future__ import annotations

import weakref

import torch

from fusion.errors import DeviceError, DTypeError, ShapeError
from fusion.patterns import registry  # (both loaded by `import fusion` already: imported here, not on every call)
from fusion.runtime import autograd
from fusion.runtime import backward_replay
from fusion.runtime import replay as replay_module

#: Run-time objects per block, outside the module so copies and state_dicts never carry them.
_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

#: Dtypes each backend runs on each device type. Fused kernels: bf16/fp16 on Hopper (fp32 runs unfused).
SUPPORTED_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16, torch.float64),
    "cuda": (torch.bfloat16, torch.float16, torch.float32),
}
EMULATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class BlockRunner:
    """A block's plan, program and checks for one (device, dtype, backend)."""

    def __init__(self, seq, x: torch.Tensor, library):
        from fusion.planner import plan_for_run

        self.seq = seq
        self.library = library
        self.backend = seq.backend
        self.params = list(seq.parameters())
        self.plan = plan_for_run(seq, x)
        # fused steps run through the program, and so does an op with a device method (fusion.op_table)
        use_program = (any(step.fused for step in self.plan.forward + self.plan.backward)
                       or (seq.backend in ("auto", "fused") and x.device.type == "cuda" and _has_device_method(seq)))
        self.program = None
        # The group sizes' values are checked, and the call's bounds made, by one prologue launch on the device
        # (fusion/runtime/bounds.py) when fused kernels run on a GPU; otherwise by torch ops.
        self.device_checked = False
        if use_program:
            from fusion.runtime.bounds import DevicePrologue, RoutedPrologue
            from fusion.runtime.program import BlockProgram

            backend = "emulate" if seq.backend == "emulate" else "cute"
            prologue = None
            grouped = "group_sizes" in seq.inputs.names
            if backend == "cute" and x.device.type == "cuda" and not seq.inputs.gathers:
                prologue = DevicePrologue(seq.inputs.num_groups[0] if grouped else 1, grouped)
                self.device_checked = grouped
            elif backend == "cute" and x.device.type == "cuda" and grouped:
                prologue = RoutedPrologue(seq.inputs.num_groups[0])
                self.device_checked = True
            self.program = BlockProgram(seq, self.plan, backend, prologue)
        # The sum check reads the sizes on the host: free on the CPU, asked for by backend="reference"; on a
        # GPU it is an asynchronous device assert, so a whole forward can be captured in a CUDA graph.
        self.check_sum = x.device.type == "cpu" or seq.backend == "reference"
        allowed = EMULATE_DTYPES if seq.backend == "emulate" else SUPPORTED_DTYPES.get(x.device.type,
                                                                                        SUPPORTED_DTYPES["cuda"])
        self.allowed = allowed
        # no-grad forwards replayed as their launches, per rows (fusion/runtime/replay.py): fused plans on a GPU;
        # the autograd node's forwards (training), per rows; its backwards, per (rows, routed rows, wanted
        # gradients): fusion/runtime/backward_replay.py
        self.replays = self.train_replays = self.backward_replays = None
        if self.program is not None:
            from fusion.dataflow import v

            self.output = v(len(self.plan.ops))
            if self.program.prologue is not None:
                from fusion.runtime.kernel import ShapeCache

                self.replays, self.train_replays, self.backward_replays = ShapeCache(64), ShapeCache(64), ShapeCache(64)

    def check(self, x: torch.Tensor) -> None:
        """What no plan can take: wrong rank or width, dtype or device mismatches (reads no data)."""
        if x.dim() != 2:
            raise ShapeError(f"Sequential: x must be 2-D (rows, features), got shape {tuple(x.shape)}; "
                             f"flatten leading dims with x.reshape(-1, x.shape[-1])")
        width = self.seq.features[0]
        if width is not None and x.shape[1] != width:
            from fusion.shapes import feature_chain

            feature_chain(self.seq.ops, x.shape[-1])  # raises, naming the op
        dtype, device = x.dtype, x.device
        if dtype not in self.allowed:
            self._error(x)
        for p in self.params:
            if p.dtype != dtype or p.device != device:
                self._error(x)

    def _error(self, x):
        for name, p in self.seq.named_parameters():
            if p.device != x.device:
                raise DeviceError(f"Sequential: x is on {x.device} but parameter {name!r} is on {p.device}; "
                                  f"move the block with mlp.to({str(x.device)!r})")
        if x.dtype not in self.allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.allowed)
            raise DTypeError(f"Sequential: x has dtype {x.dtype}; on {x.device.type} the supported dtypes are "
                             f"{names}" + ("" if self.backend == "emulate" else
                                           " (backend='emulate' also runs float64)"))
        for name, p in self.seq.named_parameters():
            if p.dtype != x.dtype:
                raise DTypeError(f"Sequential: x has dtype {x.dtype} but parameter {name!r} has {p.dtype}; "
                                 f"convert the block with mlp.to({x.dtype}) (or x.to({p.dtype}))")

    def __call__(self, x: torch.Tensor, extra: dict):
        replay = None
        records = self.program is not None and self._records(x, extra)
        if not records and self.replays is not None:
            replay = self.replays.get(x.shape[0])
            if replay:
                y = replay(x, extra)
                if y is not None:
                    return y
        self.check(x)
        ctx = self.seq.inputs.context(x, extra, check_sum=self.check_sum, device_checked=self.device_checked)
        if self.program is None:
            for op in self.seq.ops:
                x = op.reference(x, ctx)
            return x
        if replay is None and not records and self.replays is not None and replay_module.ENABLED:
            # the first no-grad call at these rows: run it, and keep its launches (False: it cannot be replayed)
            state = self.program.run_forward(x, ctx, train=False)
            self.replays.keep(x.shape[0], replay_module.build(self, x, ctx, state) or False)
            return state.env[self.output]
        return autograd.run_program(self, x, ctx, records)

    def _records(self, x: torch.Tensor, extra: dict) -> bool:
        """Whether the call records for autograd: under no_grad or inference_mode never; else where x, a parameter or
        a float input needs a gradient (asked once per call, before the checks make a context; run_program takes
        the answer)."""
        return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.params) or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in extra.values()))

    def forward_train(self, x: torch.Tensor, ctx):
        """The autograd node's forward over a checked call (as program.forward(train=True)): replayed where an
        earlier call at these rows was (fusion/runtime/replay.py), else the program's steps."""
        replays = self.train_replays
        replay = None if replays is None else replays.get(x.shape[0])
        if replay:
            made = replay.train(x, ctx)
            if made is not None:
                return made
        state = self.program.run_forward(x, ctx, train=True)
        if replay is None and replays is not None and replay_module.ENABLED:
            replays.keep(x.shape[0], replay_module.build(self, x, ctx, state, train=True) or False)
        env = state.env
        return env[self.output], [env.get(name) for name in self.plan.saves]

    def backward(self, output_grad: list, saved: list, ctx, rows: int, needs: tuple):
        """The autograd node's backward, as program.backward ((dx, parameter gradients, extra-input gradients);
        `output_grad` and `saved` emptied): replayed where an earlier backward of this call shape was
        (fusion/runtime/backward_replay.py), else the program's steps."""
        replays = self.backward_replays
        if replays is None:
            return self.program.backward(output_grad, saved, ctx, rows, needs)
        key = (rows, -1 if ctx.index is None else ctx.index.numel(), needs)
        replay = replays.get(key)
        if replay:
            made = replay(output_grad, saved, ctx)
            if made is not None:
                return made
        if replay is not None or not backward_replay.ENABLED:
            return self.program.backward(output_grad, saved, ctx, rows, needs)
        # the first backward of this shape: run it recording what each step launches, and keep its replay (False:
        # it cannot be replayed)
        record, call = [], backward_replay.CallShape.of(output_grad[0], saved)   # (shapes only: no reference kept)
        made = self.program.backward(output_grad, saved, ctx, rows, needs, record)
        replays.keep(key, backward_replay.build(self.program, ctx, record, call, needs) or False)
        return made


def _has_device_method(seq) -> bool:
    from fusion.op_table import op_device_method

    return any(op_device_method(op, part) is not None for op in seq.ops
               for part in ("forward", "backward", "dgrad", "wgrad"))


def runner_for(seq, x: torch.Tensor) -> BlockRunner:
    """The block's runner for x's device and dtype, and the block's backend and the pattern library now."""
    runners = _RUNNERS.get(seq)
    if runners is None:
        runners = _RUNNERS[seq] = {}
    library = registry.library()
    key = (x.device, x.dtype, seq.backend)
    runner = runners.get(key)
    if runner is None or runner.library is not library:
        runner = runners[key] = BlockRunner(seq, x, library)
    return runner


def execute(seq, x: torch.Tensor, extra: dict):
    """Run `seq` on x by the plan for x's device and dtype (see fusion.planner.plan_for_run)."""
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"Sequential: x must be a torch.Tensor, got {type(x).__name__}; convert it with "
                         f"torch.as_tensor(x)")
    return runner_for(seq, x)(x, extra)
