"""Sequential: a chain of ops run as one planned block, with one autograd graph through all of it.

The top of the layers with MoE: it imports the planner, explain() and the runtime, and none of them imports it.
"""
from __future__ import annotations

from typing import Iterable

import torch

from fusion.errors import OpArgumentError, ShapeError
from fusion.explain import explain
from fusion.inputs import BlockInputs, make_context  # noqa: F401 - make_context: for callers of one op list
from fusion.ops.base import Op
from fusion.planner import plan_for
from fusion.runtime import execute
from fusion.runtime.aot import compile_plan
from fusion.shapes import feature_chain

BACKENDS = ("auto", "reference", "fused", "emulate")


class Sequential(torch.nn.Module):
    """A block of ops run in order; matched patterns run fused, every other op runs its reference.

    backend: "auto" (fused where a pattern matches on this device, reference elsewhere), "reference"
    (every op unfused), "fused" (raise FallbackError, with the reasons, if any op would fall back),
    "emulate" (the Hopper plan, each kernel executed in torch: any device and dtype; how the fused runtime
    is tested without a GPU).
    """

    def __init__(self, *ops: Op, backend: str = "auto"):
        super().__init__()
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        if not ops:
            raise OpArgumentError("Sequential needs at least one op, e.g. Sequential(GroupLinear(E, d, 2 * f), "
                                  "SwiGLU(), GroupLinear(E, f, d))")
        for i, op in enumerate(ops):
            if not isinstance(op, Op):
                raise OpArgumentError(f"Sequential: argument {i} is {type(op).__name__}, not a fusion op; use "
                                      f"the ops of fusion (GroupLinear, SwiGLU, Scale, ...)")
            self.add_module(str(i), op)
        if backend not in BACKENDS:
            raise OpArgumentError(f"Sequential: backend must be one of {BACKENDS}, got {backend!r}; 'auto' (the "
                                  f"default) fuses where it can")
        self.backend = backend
        groups = {op.spec.attrs["num_groups"] for op in ops if "group_sizes" in op.spec.extra_inputs}
        if len(groups) > 1:
            raise ShapeError(f"all grouped ops of one Sequential share group_sizes, but they declare different "
                             f"group counts {sorted(groups)}")
        self.features = feature_chain(list(ops))
        self.inputs = BlockInputs(ops)
        self._register()

    def _register(self) -> None:
        """A key of this block for the torch.compile custom ops (fusion/runtime/custom_ops.py): fresh for
        every copy, so a deep copy never runs as the original. The module is imported here, at the first
        block, not with fusion: it imports torch._dynamo (about a second), and it must be loaded before
        torch.compile traces forward()."""
        from fusion.runtime.custom_ops import register

        self._fusion_key = register(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._register()

    # -- container protocol -------------------------------------------------------------------------
    @property
    def ops(self) -> list[Op]:
        return list(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> Op:
        return self.ops[i]

    def __iter__(self) -> Iterable[Op]:
        return iter(self.ops)

    # -- running --------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            from fusion.runtime.custom_ops import compiled_forward

            return compiled_forward(self, x, extra)
        return execute(self, x, extra)

    # -- planning -------------------------------------------------------------------------------------
    def plan(self, dtype: torch.dtype = torch.bfloat16, target: str = "sm_90"):
        """The fusion plan for this block at `dtype` on `target` (computable on any machine); with
        backend="reference" nothing is fused, and the plan says why."""
        return plan_for(self, dtype=dtype, target=target, backend=self.backend)

    def explain(self, format: str = "text", dtype: torch.dtype | None = None, target: str | None = None) -> str:
        """What the plan launches, forward and backward, and why anything was left unfused."""
        return explain(self, format=format, dtype=dtype, target=target)

    def compile(self, dtype: torch.dtype = torch.bfloat16, target: str = "sm_90a"):
        """Compile every fused kernel of the plan ahead of time (no GPU needed); returns the kernels (none, with
        a warning, for backend="reference": such a block never launches one)."""
        return compile_plan(self, dtype=dtype, target=target)  # (warns and compiles nothing for "reference")
