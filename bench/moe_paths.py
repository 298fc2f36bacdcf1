"""The paths bench_moe.py measures: one whole MoE layer, x (T, d) -> router -> top-k routing -> experts ->
weighted combine -> y (T, d), every path on the same weights (the fusion.MoE's parameters).

- FusionLayer  fusion.MoE as is (`fusion`), or inside torch.compile(fullgraph=True) (`fusion_compiled`), or
               with token rounding (`fusion_rounded`: the same module's routing with round_to, rounded_moe).
- TorchLayer   `torch_compiled`, what a user writes with PyTorch alone: router F.linear, softmax / topk /
               renormalize, a stable sort of the routed rows by expert, index_select of the token rows,
               torch._grouped_mm (with its autograd) for both GEMMs on int32 offsets, a torch.compile'd
               silu(g) * u * probs[:, None], and a weighted combine (index_add, or the scatter-free gather + sum
               over k). Variant "parts" compiles only the elementwise function; "whole" compiles the layer.
- SonicLayer   `sonicmoe` (Dao-AILab/sonic-moe) when it imports: its MoE module with our weights copied in (its
               FC1 interleaves gate and up rows; ours holds the gate half, then the up half).

Each path has `params` (the tensors whose .grad a training step makes), `forward(x)`, `clear()` and `grads()`
(the weight gradients in fusion's layout: dw1 (E, 2f, d), dw2 (E, d, f), drouter (E, d)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerPath:
    params: list

    def forward(self, x):
        raise NotImplementedError

    def clear(self) -> None:
        for p in self.params:
            p.grad = None

    def grads(self) -> dict:
        w1, w2, router = self.params[:3]
        return {"dw1": w1.grad, "dw2": w2.grad, "drouter": router.grad}


def expert_weights(moe):
    """(W1 (E, 2f, d), W2 (E, d, f)): the two GroupLinear weights of a fusion.MoE's experts block."""
    from fusion import GroupLinear

    w1, w2 = (op.weight for op in moe.experts.ops if isinstance(op, GroupLinear))
    return w1, w2


def rounded_moe(moe, round_to: int):
    """The same layer (the same parameters and experts block: a shallow copy) routing with token rounding to
    multiples of `round_to` rows per expert (SonicMoE's token rounding; fusion.moe.route)."""
    import copy

    rounded = copy.copy(moe)
    rounded.round_to = round_to
    return rounded


def twin_layer(moe):
    """A copy of the layer sharing every parameter whose experts block is a distinct Sequential, so that it gets its
    own plan and kernels (bench/ab_switch.py --moe --plan builds them with a tile-policy switch off)."""
    import copy

    twin = copy.copy(moe)
    twin._modules = dict(moe._modules)
    twin._modules["experts"] = copy.copy(moe.experts)
    return twin


class FusionLayer(LayerPath):
    def __init__(self, moe, compiled=False, compile_backend="inductor"):
        w1, w2 = expert_weights(moe)
        self.params = [w1, w2, moe.router.weight]
        self.call = torch.compile(moe, fullgraph=True, backend=compile_backend) if compiled else moe

    def forward(self, x):
        return self.call(x)


# -- torch_compiled -----------------------------------------------------------------------------------------------
def swiglu_scale(h, probs):
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u * probs[:, None]


_COMPILED_ACT: dict = {}


def compiled_swiglu_scale(backend: str):
    """One torch.compile'd swiglu_scale per compile backend, for static shapes (a graph per config's rows, as a user's
    at a fixed token count; dynamic in the rows until session t, whose kernels ran 1.6-3.0x slower on the training
    step's blocks: docs/benchmarks.md)."""
    if backend not in _COMPILED_ACT:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED_ACT[backend] = torch.compile(swiglu_scale, dynamic=False, backend=backend)
    return _COMPILED_ACT[backend]


def topk_route(x, router_w, k):
    """Softmax over the experts in fp32, top-k, renormalize: (top_probs (T, k) fp32, top_experts (T, k))."""
    scores = torch.softmax(F.linear(x, router_w).float(), dim=-1)
    top_p, top_e = torch.topk(scores, k, dim=-1)
    return top_p / top_p.sum(dim=-1, keepdim=True), top_e


def torch_moe_layer(x, router_w, w1, w2, k: int, act, combine: str):
    """The whole layer in plain PyTorch, on the device with no host sync (offsets by searchsorted, not bincount's
    data-dependent size)."""
    tokens, experts = x.shape[0], w1.shape[0]
    top_p, top_e = topk_route(x, router_w, k)
    expert_sorted, order = torch.sort(top_e.reshape(-1), stable=True)  # routed rows grouped by expert
    token = torch.div(order, k, rounding_mode="floor")
    probs = top_p.reshape(-1).index_select(0, order).to(x.dtype)
    ends = torch.arange(1, experts + 1, device=x.device, dtype=expert_sorted.dtype)
    offsets = torch.searchsorted(expert_sorted, ends).to(torch.int32)
    h = torch._grouped_mm(x.index_select(0, token), w1.transpose(-2, -1), offs=offsets)
    y = torch._grouped_mm(act(h, probs), w2.transpose(-2, -1), offs=offsets)
    if combine == "index_add":
        return torch.zeros_like(x).index_add(0, token, y)
    # scatter-free: routed row of (token t, slot j) is order's inverse at t * k + j; sum the k rows of each token
    return y.index_select(0, torch.argsort(order)).view(tokens, k, -1).sum(dim=1)


_COMBINES = ("index_add", "gather_sum")


class TorchLayer(LayerPath):
    VARIANTS = ("parts", "whole")

    def __init__(self, moe, k, variant="parts", combine="index_add", compile_backend="inductor"):
        if variant not in self.VARIANTS or combine not in _COMBINES:
            raise SystemExit(f"torch_compiled: variant in {self.VARIANTS}, combine in {_COMBINES}")
        w1, w2 = expert_weights(moe)
        self.params = [w1, w2, moe.router.weight]
        self.k, self.combine, self.variant = k, combine, variant
        if variant == "parts":
            self.act, self.layer = compiled_swiglu_scale(compile_backend), torch_moe_layer
        else:
            self.act = swiglu_scale
            self.layer = torch.compile(torch_moe_layer, fullgraph=True, backend=compile_backend)

    def forward(self, x):
        w1, w2, router = self.params
        return self.layer(x, router, w1, w2, self.k, self.act, self.combine)


def routing_agreement(moe, x, k) -> float:
    """The share of (token, expert) choices that fusion.moe.route and torch.topk agree on. bf16 logits tie now
    and then and topk breaks ties in no promised order (route: the lower expert), so the two paths may route a
    few tokens differently; their output errors are then not all rounding."""
    with torch.no_grad():
        r = moe.route(x)
        _, top_e = topk_route(x, moe.router.weight, k)
        tokens, experts = x.shape[0], moe.num_experts
        ours = torch.zeros(tokens, experts, dtype=torch.bool, device=x.device)
        ours[r.index.clamp_min(0), r.expert.clamp_min(0)] = r.index >= 0
        theirs = torch.zeros_like(ours).scatter_(1, top_e, True)
        return round((ours & theirs).sum().item() / (tokens * k), 6)


# -- sonicmoe -----------------------------------------------------------------------------------------------------
class SonicLayer(LayerPath):
    """sonicmoe.MoE with our weights. Raises whatever its import or construction raises (the caller records it)."""

    def __init__(self, moe, k):
        from sonicmoe import KernelBackendMoE, MoE
        from sonicmoe.enums import ActivationType

        w1, w2 = expert_weights(moe)
        experts, f2, d = w1.shape
        f = f2 // 2
        layer = MoE(num_experts=experts, num_experts_per_tok=k, hidden_size=d, intermediate_size=f,
                    activation_function=ActivationType.SWIGLU, add_bias=False, std=0.02)
        layer = layer.to(device=w1.device, dtype=w1.dtype)
        fc1, fc2, router = layer.c_fc.weight, layer.c_proj.weight, layer.router.weight
        if fc1.shape != w1.shape or fc2.shape != w2.shape or router.shape != moe.router.weight.shape:
            raise RuntimeError(f"sonicmoe weight shapes {tuple(fc1.shape)}, {tuple(fc2.shape)}, "
                               f"{tuple(router.shape)} differ from ours {tuple(w1.shape)}, {tuple(w2.shape)}")
        with torch.no_grad():  # sonicmoe's SwiGLU: gate in the even rows, up in the odd rows
            fc1[:, 0::2].copy_(w1[:, :f])
            fc1[:, 1::2].copy_(w1[:, f:])
            fc2.copy_(w2)
            router.copy_(moe.router.weight)
        self.layer, self.backend = layer, KernelBackendMoE.sonicmoe
        self.params = [fc1, fc2, router]

    def forward(self, x):
        return self.layer(x, kernel_backend_moe=self.backend)[0]

    def grads(self) -> dict:
        out = super().grads()
        g = out["dw1"]
        out["dw1"] = None if g is None else torch.cat([g[:, 0::2], g[:, 1::2]], dim=1)
        return out


def sonicmoe_status() -> str | None:
    """None when sonicmoe imports, else "not available: <why>"."""
    try:
        import sonicmoe  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the path cannot run here
        return f"not available: {type(exc).__name__}: {str(exc)[:200]}"
    return None
