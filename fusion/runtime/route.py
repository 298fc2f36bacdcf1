"""route() on the GPU: top-k routing by the kernels of fusion/kernels/route.py, as one autograd node.

fusion.moe.route calls `route_top_k` where `takes` says the kernels run the call (a CUDA tensor of a kernel dtype
on a Hopper GPU, E <= 1024, k <= 32, no token rounding, not under torch.compile, which traces the torch ops);
everywhere else it runs its torch ops, which stay the reference. The forward is two launches (top-k per token,
then the stable counting sort by expert, which also writes the token layout that the Combine and the Gather's
backward read: fusion.ops.routing.call_layout), the backward one (the chain rule per token, the scores recomputed
from the logits): three launches where torch's routing runs about twenty ops forward and a dozen backward, each
costing host time that a small batch cannot hide.

FUSION_ROUTE_KERNEL=0 (read at import) sends every call to the torch ops: the A/B switch of bench/.
"""
from __future__ import annotations

import os

import torch

from fusion.ops.routing import remember_token_layout
from fusion.targets import cuda_major

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ENABLED = os.environ.get("FUSION_ROUTE_KERNEL", "1") != "0"


def takes(logits: torch.Tensor, k: int, bias: torch.Tensor | None) -> bool:
    """Whether the kernels run this route() call (its arguments already validated)."""
    if not (ENABLED and logits.is_cuda and logits.dtype in KERNEL_DTYPES and logits.shape[0] > 0
            and (bias is None or bias.device == logits.device) and not torch.compiler.is_compiling()
            and cuda_major(logits.device) == 9):
        return False
    if not _LIMITS:
        from fusion.kernels.route import MAX_EXPERTS, MAX_K   # (loads the DSL: only for a CUDA tensor)

        _LIMITS.extend((MAX_EXPERTS, MAX_K))
    return logits.shape[1] <= _LIMITS[0] and k <= _LIMITS[1]


_LIMITS: list = []   # (MAX_EXPERTS, MAX_K) of the kernels, once they are imported


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kernel_bias(bias):
    """The bias as the kernels read it (float32, contiguous), or None."""
    if bias is None:
        return None
    b = bias.detach()
    return b if b.dtype == torch.float32 and b.is_contiguous() else b.to(torch.float32).contiguous()


#: (kernel, logits dtype, E, k, score, normalize, has_bias) -> its launch function: one dictionary lookup per launch
#: instead of compile_once's locked cache (host time: a small batch waits for it)
_LAUNCHES: dict = {}


def _launch_of(kernel: str, dtype: torch.dtype, E: int, k: int, score: str, normalize: bool, has_bias: bool):
    key = (kernel, dtype, E, k, score, normalize, has_bias)
    launch = _LAUNCHES.get(key)
    if launch is None:
        from fusion.kernels import route as kernels

        name = _dtype_name(dtype)
        compiled = (kernels.compile_route_sort(name, E, k) if kernel == "sort" else
                    getattr(kernels, f"compile_route_{kernel}")(name, E, k, score, normalize, has_bias))
        launch = _LAUNCHES[key] = compiled.launch
    return launch


def forward(logits: torch.Tensor, k: int, score: str, bias32, normalize: bool):
    """(index, group_sizes, probs, expert, slots, layout): route's results, what the backward reads (`slots`: per
    token-major slot its score (float32; the sort's input), its routed row (int32, pos) and its expert (int16, top),
    in that order in one int32 buffer: one allocation instead of three), and the index's token layout
    (fusion.ops.routing.token_layout's (rows_by_token, token_offsets), which the sort writes too). The caller
    records the layout where the index leaves its hands (remember_token_layout); the merged MoE node hands it to
    the block's context instead. `bias32`: the bias as kernel_bias gives it (a kernel without one reads the logits'
    address in its place, never the values)."""
    logits = logits if logits.is_contiguous() else logits.contiguous()
    T, E = logits.shape
    S, dev = T * k, logits.device
    key = (logits.dtype, E, k, score, normalize, bias32 is not None)
    stream = torch._C._cuda_getCurrentRawStream(dev.index)
    slots = torch.empty(2 * S + (S + 1) // 2, dtype=torch.int32, device=dev)
    offsets = torch.empty(T + 2, dtype=torch.int64, device=dev)
    w, pos, top = _slot_pointers(slots.data_ptr(), S)
    logits_ptr = logits.data_ptr()
    _launch_of("topk", *key)(logits_ptr, logits_ptr if bias32 is None else bias32.data_ptr(), top, w,
                             offsets.data_ptr(), T, stream)
    index = torch.empty(S, dtype=torch.int64, device=dev)
    expert = torch.empty(S, dtype=torch.int64, device=dev)
    probs = torch.empty(S, dtype=logits.dtype, device=dev)
    sizes = torch.empty(E, dtype=torch.int32, device=dev)
    rows_by_token = torch.empty(S, dtype=torch.int64, device=dev)
    _launch_of("sort", *key)(top, w, index.data_ptr(), expert.data_ptr(), probs.data_ptr(), sizes.data_ptr(), pos,
                             rows_by_token.data_ptr(), S, stream)
    return index, sizes, probs, expert, slots, (rows_by_token, offsets)


def _slot_pointers(base: int, S: int) -> tuple[int, int, int]:
    """(w, pos, top): the addresses of the slots buffer's three arrays (see forward)."""
    return base, base + 4 * S, base + 8 * S


class _KernelRoute(torch.autograd.Function):
    """logits -> (index, group_sizes, probs, expert); only probs is differentiable."""

    @staticmethod
    def forward(fctx, logits, k: int, score: str, bias32, normalize: bool):
        index, sizes, probs, expert, slots, layout = forward(logits, k, score, bias32, normalize)
        remember_token_layout(index, logits.shape[0], layout)
        fctx.save_for_backward(logits, slots)
        fctx.k, fctx.score, fctx.normalize, fctx.bias = k, score, normalize, bias32
        fctx.mark_non_differentiable(index, sizes, expert)
        return index, sizes, probs, expert

    @staticmethod
    def backward(fctx, _index, _sizes, dprobs, _expert):
        logits, slots = fctx.saved_tensors
        return backward(logits, slots, dprobs, fctx.k, fctx.score, fctx.normalize, fctx.bias), None, None, None, None


def backward(logits: torch.Tensor, slots: torch.Tensor, dprobs: torch.Tensor, k: int, score: str, normalize: bool,
             bias32) -> torch.Tensor:
    """dlogits (T, E) from the probs' gradient dprobs (M,): one launch of the chain rule per token (`slots`: what
    forward kept for it)."""
    logits = logits if logits.is_contiguous() else logits.contiguous()
    T, E = logits.shape
    _, pos, top = _slot_pointers(slots.data_ptr(), T * k)
    dprobs = dprobs.to(logits.dtype).contiguous()
    dlogits = torch.empty_like(logits)
    b = logits if bias32 is None else bias32
    _launch_of("grad", logits.dtype, E, k, score, normalize, bias32 is not None)(
        logits.data_ptr(), b.data_ptr(), top, pos, dprobs.data_ptr(), dlogits.data_ptr(), T, dprobs.shape[0],
        torch._C._cuda_getCurrentRawStream(logits.device.index))
    return dlogits


#: torch.autograd.Function.apply's C implementation for _KernelRoute (as fusion/runtime/autograd.py's _APPLY: the
#: Python wrapper only unwraps dead functorch wrappers, outside functorch transforms)
_APPLY = super(torch.autograd.Function, _KernelRoute).apply


def route_top_k(logits: torch.Tensor, k: int, score: str, bias, normalize: bool):
    """(index, group_sizes, probs, expert) of route() without token rounding, by the kernels."""
    bias32 = kernel_bias(bias)
    if torch.is_grad_enabled() and logits.requires_grad:
        apply = _KernelRoute.apply if torch._C._are_functorch_transforms_active() else _APPLY
        return apply(logits, k, score, bias32, normalize)
    index, sizes, probs, expert, _slots, layout = forward(logits, k, score, bias32, normalize)
    remember_token_layout(index, logits.shape[0], layout)
    return index, sizes, probs, expert
