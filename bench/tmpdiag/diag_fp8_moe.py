import copy, torch
from fusion import Gather, GroupLinear, SwiGLU, Scale, QuantizeFP8Block, Combine, Sequential, MoE
torch.manual_seed(0)
T, d, E, k, f = 4096, 512, 8, 2, 1024
def make(fmt):
    ops = [Gather(), GroupLinear(E, d, 2 * f, weight_format=fmt), SwiGLU(), Scale()]
    if fmt == "fp8_block":
        ops.append(QuantizeFP8Block())
    ops += [GroupLinear(E, f, d, weight_format=fmt), Combine()]
    return MoE(d, E, k=k, experts=Sequential(*ops)).cuda().bfloat16()
def rel(a, b):
    a, b = a.double(), b.double(); return ((a - b).norm() / b.norm()).item()
fp8 = make("fp8_block")
ref = copy.deepcopy(fp8); ref.experts.backend = "reference"
x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16); dy = torch.randn_like(x)
def step(m):
    for p in m.parameters(): p.grad = None
    xx = x.clone().requires_grad_(); y = m(xx); y.backward(dy)
    return [y, xx.grad] + [p.grad for p in m.parameters()]
names = ["y", "dx"] + [n for n, _ in fp8.named_parameters()]
a, b = step(fp8), step(ref)
for n, u, v in zip(names, a, b): print(f"auto vs reference {n:24s} {rel(u, v):.3e}")
print(fp8.experts.explain(dtype=torch.bfloat16, target="sm_90a").split("saved for backward")[0][-2500:])
