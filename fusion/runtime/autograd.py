"""The autograd node of a fused block: the program's forward, and its backward as the node's backward.

Eagerly the block is one torch.autograd.Function (the cheapest way into autograd); under torch.compile it is
the custom op pair `fusion::block_forward` / `fusion::block_backward` (fusion/runtime/custom_ops.py), so
dynamo sees an opaque op with exact output shapes instead of tracing into the launcher.
"""
from __future__ import annotations

import torch

from fusion.errors import SecondBackwardError
from fusion.quant import QuantizedTensor


#: The node takes dY out of autograd's hands (_OutputGradient) so it is freed after its last reader. Read per call:
#: bench/ab_switch.py's A/B (off: autograd keeps dY until the whole block backward returns).
FREE_OUTPUT_GRAD = True


class _OutputGradient:
    """The node's pre-hook: takes the block output's gradient dY out of autograd's hands before the node's backward
    runs, and gives the backward None in its place. Autograd keeps a node's incoming gradients until the node
    returns; the hook leaves the program the only reference, so dY is freed after its last backward reader (FC2's
    backward) instead of living through FC1's, as it does in an unfused torch chain, where FC2's node returns
    first. (A node pre-hook may replace the gradients; this one replaces dY by None, the node does not
    materialize it: set_materialize_grads(False).)"""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None

    def __call__(self, grads):
        self.value = grads[0]
        return (None,)

    def take(self, passed):
        """dY: the hooked one (this box then holds none), else what autograd passed."""
        value, self.value = self.value, None
        return passed if value is None else value


def forward_node(fctx, runner, ctx, x):
    """The block's forward inside an autograd node (`fctx`): the program's forward (or its replay), its output and
    input kept for the backward through save_for_backward, the intermediates as a plain list the backward empties.
    Returns the block output. (_BlockFunction's forward; fusion/runtime/moe_node.py's node runs route first.)"""
    y, saved = runner.forward_train(x, ctx)   # the program's forward, or its replay (fusion/runtime/replay.py)
    fctx.runner, fctx.ctx, fctx.rows = runner, ctx, x.shape[0]
    fctx.output_grad = _OutputGradient()
    fctx.set_materialize_grads(False)
    # The block's input and output go through save_for_backward (autograd's version checks; no reference
    # cycle through the output). Intermediates are held as a plain list instead, which the backward empties
    # so each is freed after its last backward reader, not when the whole node finishes.
    fctx.kinds = ["input" if t is x else "output" if t is y else "none" if t is None else "held" for t in saved]
    fctx.save_for_backward(*(t for t in saved if t is x or t is y))
    fctx.held = [t for t, k in zip(saved, fctx.kinds) if k == "held"]
    return y


def backward_node(fctx, box: list, needs: tuple):
    """The block's backward inside the node forward_node filled: (dx, [each parameter's and then each extra input's
    gradient, in their dtypes]), or None where no gradient reached the output. `box`: [the gradient autograd passed
    the node], emptied here (so that no caller's frame keeps dY alive); `needs`: whether x, each parameter and each
    extra input needs a gradient."""
    grad = [fctx.output_grad.take(box.pop())]  # a list the program empties: no frame here keeps dY alive
    if grad[0] is None:  # no gradient reached the output: autograd reads None as zeros
        return None
    if isinstance(grad[0], QuantizedTensor):
        grad[0] = grad[0].dequantize()
    if fctx.held is None:
        raise SecondBackwardError(
            "fusion: a second backward through a fused block (retain_graph=True, or autograd.grad twice over the "
            "same graph): the first backward freed the block's saved intermediates as it went (each after its "
            "last reader, for a lower peak). Run the forward again before each backward, or build the block "
            "with backend='reference' where the graph must be differentiated twice")
    io, held = iter(fctx.saved_tensors), iter(fctx.held)
    saved = [None if k == "none" else next(held) if k == "held" else next(io) for k in fctx.kinds]
    fctx.held = None
    del io, held  # the iterators hold the lists: drop them, or the intermediates live to the end
    # the program's backward, or its replay (fusion/runtime/backward_replay.py)
    dx, grads, extra = fctx.runner.backward(grad, saved, fctx.ctx, fctx.rows, needs)
    targets = fctx.runner.params + list(fctx.ctx.extra.values())
    return dx, [g.to(t.dtype) if g is not None and g.dtype != t.dtype else g for g, t in zip(grads + extra, targets)]


class _BlockFunction(torch.autograd.Function):
    @staticmethod
    def forward(fctx, runner, ctx, x, *tensors):
        return forward_node(fctx, runner, ctx, x)

    @staticmethod
    def backward(fctx, dy):
        box = [dy]
        del dy
        made = backward_node(fctx, box, fctx.needs_input_grad[2:])
        if made is None:
            return (None,) * len(fctx.needs_input_grad)
        return (None, None, made[0], *made[1])


#: torch.autograd.Function.apply's C implementation for _BlockFunction. Function.apply is a Python wrapper around it
#: that, outside functorch transforms, only unwraps dead functorch wrappers among the arguments: about 4 µs of host
#: time per call (measured on the CPU; a fused forward recording for autograd costs about 100 µs). Under a functorch
#: transform the wrapper runs (`_are_functorch_transforms_active`).
_APPLY = super(torch.autograd.Function, _BlockFunction).apply


def run_program(runner, x: torch.Tensor, ctx, records: bool):
    """The block's output, with autograd through the program where the call `records` (anything needs a gradient:
    BlockRunner._records). (Eager only: under torch.compile, Sequential.forward takes the custom ops of
    fusion/runtime/custom_ops.py instead.)"""
    program = runner.program
    if not records:
        return program.forward(x, ctx, train=False)[0]
    apply = _BlockFunction.apply if torch._C._are_functorch_transforms_active() else _APPLY
    return free_output_grad(apply(runner, ctx, x, *runner.params, *ctx.extra.values()))


def free_output_grad(y: torch.Tensor) -> torch.Tensor:
    """y, its node (forward_node's) taking dY out of autograd's hands before its backward (_OutputGradient)."""
    if FREE_OUTPUT_GRAD:
        node = y.grad_fn
        node.register_prehook(node.output_grad)
    return y
