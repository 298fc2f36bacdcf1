"""torch.compile on a Hopper GPU: the fused program inside compiled graphs (fusion::block_forward/backward custom
ops), equal to the eager fused block, with zero graph breaks, the fused kernels really launched, and
mode="reduce-overhead" (CUDA graphs) replaying a training step with new group sizes."""
import copy

import pytest
import torch

from fusion import GroupLinear, Linear, QuantizeMXFP8, Scale, Sequential, SwiGLU
from fusion.runtime.kernel import LAUNCHES

pytestmark = pytest.mark.gpu

E, D, F, ROWS = 8, 256, 512, 1000


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not hopper():
        pytest.skip("needs a Hopper (sm_90) GPU")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_block(quantize=False):
    ops = [GroupLinear(E, D, 2 * F), SwiGLU(), Scale()]
    ops += [QuantizeMXFP8(columnwise=False)] if quantize else []
    ops += [GroupLinear(E, F, D)]
    return Sequential(*ops).cuda().bfloat16()


def make_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, ROWS, (E - 1,), generator=gen).sort().values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([ROWS])]))  # some groups may be empty
    x = torch.randn(ROWS, D, generator=gen).cuda().bfloat16()
    probs = torch.rand(ROWS, generator=gen).cuda().bfloat16()
    return x, sizes.cuda(), probs


def step(block, x, sizes, probs, dy):
    xi = x.clone().requires_grad_()
    pi = probs.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    y = block(xi, group_sizes=sizes, scale=pi)
    y.backward(dy)
    return [y.detach(), xi.grad, pi.grad, *(p.grad for p in block.parameters())]


def test_fullgraph_training_step_equals_eager_and_runs_fused():
    torch.manual_seed(0)
    block = make_block()
    x, sizes, probs = make_inputs()
    dy = torch.randn_like(x)
    explanation = torch._dynamo.explain(block)(x, group_sizes=sizes, scale=probs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = step(block, x, sizes, probs, dy)
    compiled = torch.compile(block, fullgraph=True)
    LAUNCHES.reset()
    got = step(compiled, x, sizes, probs, dy)
    torch.cuda.synchronize()
    assert LAUNCHES.by_step.get("F1", 0) >= 1 and LAUNCHES.by_step.get("B1", 0) >= 1, LAUNCHES.by_step
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernels on the same inputs: bitwise


def test_compiled_second_backward_over_one_forward():
    """retain_graph: the backward ops run over the forward op's bounds buffer, whose backward tile counters the
    kernels' dynamic schedules count up; the last backward op zeroes them again, so a second backward over the
    same forward gives the first's gradients bitwise (unzeroed counters would skip tiles)."""
    torch.manual_seed(0)
    block = make_block()
    x, sizes, probs = make_inputs(3)
    dy = torch.randn_like(x)
    eager = step(block, x, sizes, probs, dy)
    compiled = torch.compile(block, fullgraph=True)
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    LAUNCHES.reset()
    y = compiled(xi, group_sizes=sizes, scale=pi)
    grads = []
    for _ in range(2):
        y.backward(dy, retain_graph=True)
        grads.append([xi.grad.clone(), pi.grad.clone(), *(p.grad.clone() for p in block.parameters())])
        xi.grad = pi.grad = None
        block.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    assert LAUNCHES.by_step.get("B1", 0) == 2, LAUNCHES.by_step
    for got in grads:
        for a, b in zip(got, eager[1:]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fullgraph_quantized_inference_block():
    block = make_block(quantize=True)
    x, sizes, probs = make_inputs(1)
    with torch.no_grad():
        eager = block(x, group_sizes=sizes, scale=probs)
        LAUNCHES.reset()
        got = torch.compile(block, fullgraph=True)(x, group_sizes=sizes, scale=probs)
    torch.cuda.synchronize()
    assert LAUNCHES.total >= 1
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_model_with_blocks_compiles_fullgraph():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(D)
            self.moe = make_block()
            self.dense = Sequential(Linear(D, 2 * F), SwiGLU(), Linear(F, D)).cuda().bfloat16()

        def forward(self, x, sizes, probs):
            h = self.norm(x)
            h = x + self.moe(h, group_sizes=sizes, scale=probs)
            return h + self.dense(h)

    torch.manual_seed(0)
    model = Model().cuda().bfloat16()
    x, sizes, probs = make_inputs(2)
    ref = copy.deepcopy(model)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xe, sizes, probs).float().square().mean().backward()
    torch.compile(model, fullgraph=True)(xc, sizes, probs).float().square().mean().backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=2e-2, atol=2e-3)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3, msg=name)


def test_reduce_overhead_training_step_replays_with_new_group_sizes():
    torch.manual_seed(0)
    block = make_block()
    eager = copy.deepcopy(block)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # the first calls record the CUDA graph; later ones replay it with new sizes/values
        x, sizes, probs = make_inputs(seed)
        dy = torch.randn_like(x)
        got = [t.clone() for t in step(compiled, x, sizes, probs, dy)]
        want = step(eager, x, sizes, probs, dy)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
