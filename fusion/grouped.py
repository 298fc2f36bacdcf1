"""Reference grouped matmul: forward, dgrad and per-group wgrad, with `group_sizes` kept on the device.

Two methods, chosen per call by `grouped_mm_method`:
  * "grouped_mm": torch._grouped_mm, one launch for all groups, reading cumulative offsets computed on the
    device. No host copy of the sizes, so a forward+backward can be captured in a CUDA graph. Used on
    Hopper (and newer) GPUs for bf16/fp16 with 16-byte aligned rows.
  * "loop": one matmul per group, which needs the sizes on the host. On CPU that costs nothing; on a GPU it
    is a host sync, and explain() says so. Works in every dtype (float64 for gradcheck) and device.
"""
from __future__ import annotations

import torch

from fusion.targets import cuda_major

#: What the loop method costs on a GPU; explain() attaches it to the steps that take that method.
HOST_SYNC_NOTE = "group sizes are copied to the host (one sync per GroupLinear call)"


def group_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """Cumulative end offsets (int32, on the sizes' device): the layout torch._grouped_mm and our kernels read."""
    return torch.cumsum(group_sizes, 0, dtype=torch.int32)


def row_group_index(group_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """For each row, the index of its group; computed on the device without reading the sizes on the host."""
    groups = torch.arange(group_sizes.numel(), device=group_sizes.device)
    return torch.repeat_interleave(groups, group_sizes, output_size=rows)


def grouped_mm_method(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which reference method a (x, weight) pair takes; see the module docstring."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return "loop"
    if cuda_major(x.device) < 9:
        return "loop"
    elem = x.element_size()
    if (x.shape[-1] * elem) % 16 or (weight.shape[-2] * elem) % 16:
        return "loop"
    return "grouped_mm"


def _split_rows(t: torch.Tensor, group_sizes: torch.Tensor):
    return torch.split(t, group_sizes.tolist(), dim=0)


# The loop method reads the sizes on the host, which torch.compile cannot trace: each loop is a custom op (opaque
# to the compiler, with exact output shapes), so compiled reference blocks have no graph break.
@torch.library.custom_op("fusion::grouped_mm_loop", mutates_args=())
def _loop_forward(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """y[rows of g] = x[rows of g] @ weight[g].T ; weight is (G, out, in)."""
    parts = [xg @ weight[g].T for g, xg in enumerate(_split_rows(x, group_sizes))]
    return torch.cat(parts, 0) if parts else x.new_empty(0, weight.shape[1])


@_loop_forward.register_fake
def _(x, weight, group_sizes):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("fusion::grouped_mm_loop_dgrad", mutates_args=())
def _loop_dgrad(dy: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    parts = [dyg @ weight[g] for g, dyg in enumerate(_split_rows(dy, group_sizes))]
    return torch.cat(parts, 0) if parts else dy.new_empty(0, weight.shape[2])


@_loop_dgrad.register_fake
def _(dy, weight, group_sizes):
    return dy.new_empty(dy.shape[0], weight.shape[2])


@torch.library.custom_op("fusion::grouped_mm_loop_wgrad", mutates_args=())
def _loop_wgrad(dy: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """dW[g] = dy_g.T @ x_g; zero for empty groups."""
    dw = dy.new_zeros(group_sizes.shape[0], dy.shape[1], x.shape[1])
    for g, (dyg, xg) in enumerate(zip(_split_rows(dy, group_sizes), _split_rows(x, group_sizes))):
        if dyg.shape[0]:
            dw[g] = dyg.T @ xg
    return dw


@_loop_wgrad.register_fake
def _(dy, x, group_sizes):
    return dy.new_empty(group_sizes.shape[0], dy.shape[1], x.shape[1])


#: A one-group GroupLinear (a dense layer written as GroupLinear(1, ...)) runs torch's dense matmul (cuBLAS) in place
#: of torch._grouped_mm: the contract's group_sizes sum to the rows, so its one group is every row, and cuBLAS's dense
#: kernels were faster than the grouped one on the dense blocks' GEMMs (H200, torch 2.11: Llama-3-8B's FC2 forward
#: 2.713 against 2.943 ms; docs/benchmarks.md, session u). Read per call (bench/ab_switch.py flips it).
DENSE_MM = True


def _one_group(groups: int, method: str) -> bool:
    return DENSE_MM and method == "grouped_mm" and groups == 1


def grouped_forward(x, weight, offsets):
    """``x @ weight[g].T`` per group by the vendor GEMM, without autograd (the fused runtime's lone forward):
    cuBLAS's dense matmul for one group (:data:`DENSE_MM`), else torch._grouped_mm."""
    return _forward(x, weight, None, offsets, "grouped_mm")


def grouped_wgrad(dy, x, offsets, weight_shape):
    """``dy_g.T @ x_g`` per group by the vendor GEMM, without autograd: cuBLAS's dense matmul for one group
    (:data:`DENSE_MM`), else torch._grouped_mm."""
    return _wgrad(dy, x, None, offsets, "grouped_mm", weight_shape)


def _forward(x, weight, group_sizes, offsets, method):
    """y[rows of g] = x[rows of g] @ weight[g].T ; weight is (G, out, in)."""
    if _one_group(weight.shape[0], method):
        return x @ weight[0].t()
    if method == "grouped_mm":
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return _loop_forward(x, weight, group_sizes)


def _dgrad(dy, weight, group_sizes, offsets, method):
    if _one_group(weight.shape[0], method):
        return dy @ weight[0]
    if method == "grouped_mm":
        return torch._grouped_mm(dy, weight, offs=offsets)
    return _loop_dgrad(dy, weight, group_sizes)


def _wgrad(dy, x, group_sizes, offsets, method, weight_shape):
    """dW[g] = dy_g.T @ x_g; zero for empty groups."""
    if _one_group(weight_shape[0], method):
        return (dy.t() @ x).unsqueeze(0)
    if method == "grouped_mm":
        # 2-D x 2-D with offsets splits the reduction (row) dimension into groups -> (G, out, in).
        return torch._grouped_mm(dy.t(), x, offs=offsets)
    return _loop_wgrad(dy, x, group_sizes)


class GroupedMatmul(torch.autograd.Function):
    """Differentiable grouped matmul over consecutive row groups (bias is added outside, by autograd)."""

    @staticmethod
    def forward(ctx, x, weight, group_sizes, offsets, method):
        ctx.save_for_backward(x, weight, group_sizes, offsets)
        ctx.method = method
        return _forward(x, weight, group_sizes, offsets, method)

    @staticmethod
    def backward(ctx, dy):
        x, weight, group_sizes, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _dgrad(dy, weight, group_sizes, offsets, ctx.method)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(dy, x, group_sizes, offsets, ctx.method, weight.shape)
        return dx, dw, None, None, None


def grouped_matmul(x, weight, group_sizes, offsets=None, method=None):
    """x (M, in), weight (G, out, in), group_sizes (G,) int on x's device -> (M, out)."""
    if offsets is None:
        offsets = group_offsets(group_sizes)
    method = method or grouped_mm_method(x, weight)
    return GroupedMatmul.apply(x.contiguous(), weight, group_sizes, offsets, method)


def linear_dgrad(dy, weight, group_sizes, offsets):
    """Input gradient of a GroupLinear ((G, out, in) weight) or a Linear ((out, in) weight)."""
    if weight.dim() == 2:
        return dy @ weight
    return _dgrad(dy, weight, group_sizes, offsets, grouped_mm_method(dy, weight))


def linear_wgrad(dy, x, weight, group_sizes, offsets):
    """Weight gradient of a GroupLinear (per group) or a Linear."""
    if weight.dim() == 2:
        return dy.t() @ x
    return _wgrad(dy, x, group_sizes, offsets, grouped_mm_method(x, weight), weight.shape)
