"""fusion.MoE: a whole MoE layer as one module: router Linear, device-side routing, the experts block."""
from __future__ import annotations

import torch

from fusion.errors import OpArgumentError, ShapeError
from fusion.moe.routing import SCORES, _validate, route
from fusion.ops.args import positive_int
from fusion.ops import Combine, Gather, GroupLinear, Scale, SwiGLU
from fusion.runtime import moe_node
from fusion.sequential import Sequential


def _probs_input(experts: Sequential, num_experts: int, d: int) -> str:
    """The keyword the experts block reads the router probs from (its per-row Scale); raise ShapeError if
    the block is not Gather ... Scale ... Combine over `num_experts` groups, d features in and out."""
    if not isinstance(experts, Sequential):
        raise ShapeError(f"MoE: experts must be a fusion.Sequential, got {type(experts).__name__}; build it as "
                         f"fusion.Sequential(Gather(), GroupLinear(E, d, 2*f), SwiGLU(), Scale(), "
                         f"GroupLinear(E, f, d), Combine()) or use MoE.swiglu(d, E, f, k)")
    ops = experts.ops
    if not isinstance(ops[0], Gather) or not isinstance(ops[-1], Combine):
        raise ShapeError(f"MoE: the experts block must start with Gather() and end with Combine() (they move "
                         f"token rows to routed rows and back); it is {[op.describe() for op in ops]}")
    names = sorted({name for op in ops if isinstance(op, Scale) for name in op.spec.extra_inputs})
    if len(names) != 1:
        raise ShapeError(f"MoE: the experts block must hold per-row Scale() ops reading one input (the router "
                         f"probs), found inputs {names}; add Scale() before the last GroupLinear")
    extra = {n for op in ops for n in op.spec.extra_inputs} - {"index", "group_sizes", names[0]}
    if extra:
        raise ShapeError(f"MoE: the experts block reads inputs {sorted(extra)} that the layer cannot give "
                         f"(it passes index, group_sizes and the probs)")
    groups = {op.spec.attrs["num_groups"] for op in ops if "group_sizes" in op.spec.extra_inputs}
    if groups and groups != {num_experts}:
        raise ShapeError(f"MoE: the experts block has {min(groups)} groups but the layer has {num_experts} "
                         f"experts; give its GroupLinears num_groups={num_experts}")
    if experts.features[0] not in (None, d) or experts.features[-1] not in (None, d):
        raise ShapeError(f"MoE: the experts block maps {experts.features[0]} to {experts.features[-1]} "
                         f"features; an MoE layer of width d={d} needs d to d")
    return names[0]


class MoE(torch.nn.Module):
    """router (Linear(d, E, bias=False)) -> fusion.moe.route -> experts (Gather ... Scale ... Combine).

    y = moe(x) for x of shape (T, d) or (..., d). k, score, normalize and round_to are route's. bias=True
    adds a selection bias buffer `expert_bias` (E,), zeros, float32 (DeepSeek-V3's aux-loss-free balancing:
    update it outside the layer; it changes which experts are chosen, not the probabilities). Gradients
    reach x, the expert weights and, through the probs, the router weight.
    """

    def __init__(self, d: int, E: int, k: int = 8, *, experts: Sequential, score: str = "softmax",
                 normalize: bool = True, bias: bool = False, round_to: int | None = None, device=None,
                 dtype=None):
        super().__init__()
        d, E = positive_int("MoE", "d", d, "the hidden size"), positive_int("MoE", "E", E, "the number of experts")
        k = positive_int("MoE", "k", k, "experts per token")
        if not k <= E:
            raise ShapeError(f"MoE: k must be in [1, E={E}], got {k}")
        if score not in SCORES:
            raise OpArgumentError(f"MoE: score must be one of {sorted(SCORES)}, got {score!r}")
        if round_to is not None:
            round_to = positive_int("MoE", "round_to", round_to, "a tile size such as 128, or None")
        self.d, self.num_experts, self.k = d, E, k
        self.score, self.normalize, self.round_to = score, normalize, round_to
        self.probs_input = _probs_input(experts, E, d)
        self.router = torch.nn.Linear(d, E, bias=False, device=device, dtype=dtype)
        self.experts = experts
        if bias:
            self.register_buffer("expert_bias", torch.zeros(E, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None

    @classmethod
    def swiglu(cls, d: int, E: int, f: int, k: int = 8, device=None, dtype=None, backend: str = "auto", **kwargs):
        """The standard block: Gather, GroupLinear(E, d, 2f), SwiGLU, Scale, GroupLinear(E, f, d), Combine."""
        factory = {"device": device, "dtype": dtype}
        experts = Sequential(Gather(), GroupLinear(E, d, 2 * f, **factory), SwiGLU(), Scale(),
                             GroupLinear(E, f, d, **factory), Combine(), backend=backend)
        return cls(d, E, k, experts=experts, device=device, dtype=dtype, **kwargs)

    def route(self, x: torch.Tensor):
        """The RouteResult for x (T, d): what forward feeds the experts block."""
        return route(self.router(x), self.k, score=self.score, bias=self.expert_bias, normalize=self.normalize,
                     round_to=self.round_to)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d:
            raise ShapeError(f"MoE: x has {x.shape[-1]} features but the layer has d={self.d}")
        flat = x.dim() != 2   # (a 2-D x goes through as is: each reshape is a view node for autograd to run)
        tokens = x.reshape(-1, self.d) if flat else x
        logits = self.router(tokens)
        runner = moe_node.takes(self, logits, tokens)
        if runner is not None:   # training on the GPU: route and the experts block in one autograd node
            _validate(logits, self.k, self.score, self.expert_bias, self.round_to)   # (as route() checks them)
            y = moe_node.run(self, runner, logits, tokens)
        else:
            r = route(logits, self.k, score=self.score, bias=self.expert_bias, normalize=self.normalize,
                      round_to=self.round_to)
            y = self.experts(tokens, index=r.index, group_sizes=r.group_sizes, **{self.probs_input: r.probs})
        return y.reshape(*x.shape[:-1], y.shape[-1]) if flat else y

    def extra_repr(self) -> str:
        return (f"d={self.d}, E={self.num_experts}, k={self.k}, score={self.score!r}, normalize={self.normalize}, "
                f"round_to={self.round_to}")
