"""fusion.symbolic: evaluate vs autograd, derivative rules, simplification, CSE, printers."""
from __future__ import annotations

import math
import random
import types

import pytest
import torch
import torch.nn.functional as F

from fusion.patterns.activation_semantics import expression_from_source
from fusion.patterns.expr_ast import render_expression
from fusion.patterns.parser import parse_expression
from fusion.patterns.registry import activations, reset_to_builtins
from fusion.runtime import torch_math
from fusion.symbolic import (
    BinOp, Call, FUNCTIONS, Neg, Num, Param, Var, call, cmp, cse, differentiate, evaluate, gradient, postorder,
    simplify, to_cute, to_source, where,
)

x, y = Var("x"), Var("y")


def autograd_grads(expr, names, env):
    leaves = {n: env[n].clone().requires_grad_(True) for n in names}
    out = evaluate(expr, {**env, **leaves})
    if not out.requires_grad:
        return [torch.zeros_like(env[n]) for n in names]
    grads = torch.autograd.grad(out.sum(), [leaves[n] for n in names], allow_unused=True)
    return [torch.zeros_like(env[n]) if g is None else g for n, g in zip(names, grads)]


def assert_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, equal_nan=True)


# ------------------------------------------------------------------------------------------ built-in activations
@pytest.fixture(scope="module")
def builtin_acts():
    reset_to_builtins()
    return activations()


def test_every_builtin_derivative_matches_autograd(builtin_acts):
    gen = torch.Generator().manual_seed(0)
    assert len(builtin_acts) >= 10
    for name, act in builtin_acts.items():
        env = {a: torch.randn(257, generator=gen, dtype=torch.float64) * 4 for a in act.args}
        dy = torch.randn(257, generator=gen, dtype=torch.float64)
        for a, want in zip(act.args, autograd_grads(act.forward_expr, act.args, env)):
            got = evaluate(act.grad_exprs[a], {**env, "dy": dy})
            assert_close(got, want * dy)
        derived = [gradient(act.forward_expr, a) for a in act.args]  # derived == given (srelu gives its own)
        for a, g in zip(act.args, derived):
            assert_close(evaluate(g, {**env, "dy": dy}), evaluate(act.grad_exprs[a], {**env, "dy": dy}))


def test_builtins_equal_torch_formulas(builtin_acts):
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(100, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    cases = {
        "swiglu": (F.silu(a) * b, (a, b)),
        "geglu": (F.gelu(a, approximate="tanh") * b, (a, b)),
        "geglu_erf": (F.gelu(a) * b, (a, b)),
        "reglu": (F.relu(a) * b, (a, b)),
        "srelu": (F.relu(a) ** 2, (a,)),
        "relu": (F.relu(a), (a,)),
        "silu": (F.silu(a), (a,)),
        "gelu_tanh": (F.gelu(a, approximate="tanh"), (a,)),
        "gelu_erf": (F.gelu(a), (a,)),
    }
    for name, (want, args) in cases.items():
        assert_close(builtin_acts[name].forward(*args), want)
    # GPT-OSS reference formulation (first half = gate)
    gate = a.clamp(max=7.0)
    up = b.clamp(-7.0, 7.0)
    assert_close(builtin_acts["gptoss_swiglu"].forward(a * 3, b * 3),
                 (a * 3).clamp(max=7.0) * torch.sigmoid(1.702 * (a * 3).clamp(max=7.0)) * ((b * 3).clamp(-7, 7) + 1))
    assert_close(builtin_acts["gptoss_swiglu"].forward(a, b), gate * torch.sigmoid(1.702 * gate) * (up + 1))
    # xIELU (Apertus) with its effective parameters
    xv = a
    ap, an, beta, eps = 0.8, 0.8, 0.5, -1e-6
    want = torch.where(xv > 0, ap * xv * xv + beta * xv, an * (torch.expm1(torch.clamp(xv, max=eps)) - xv) + beta * xv)
    torch.testing.assert_close(builtin_acts["xielu"].forward(xv), want, rtol=1e-9, atol=1e-12)


def test_gptoss_gradient_at_the_limit_follows_clamp(builtin_acts):
    act = builtin_acts["gptoss_swiglu"]
    gate = torch.tensor([7.0, -7.0, 8.0], dtype=torch.float64, requires_grad=True)
    up = torch.tensor([7.0, -7.0, 8.0], dtype=torch.float64, requires_grad=True)
    g = gate.clamp(max=7.0)
    ref = g * torch.sigmoid(1.702 * g) * (up.clamp(-7.0, 7.0) + 1)
    want = torch.autograd.grad(ref.sum(), [gate, up])
    got = act.backward(torch.ones(3, dtype=torch.float64), gate.detach(), up.detach())
    for w, h in zip(want, got):
        assert_close(h, w)


# ------------------------------------------------------------------------------------------ random expressions
SAFE_UNARY = ["abs", "exp", "sigmoid", "tanh", "softplus", "erf", "relu", "gelu_tanh", "silu"]


def random_expr(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.2:
        r = rng.random()
        if r < 0.4:
            return x
        if r < 0.7:
            return y
        if r < 0.85:
            return Param("p", 0.75)
        return Num(rng.choice([0.5, 2.0, -1.5, 3.0, 0.044715]))
    k = rng.randrange(10)
    a = random_expr(rng, depth - 1)
    if k == 0:
        return Call(rng.choice(SAFE_UNARY), (a,))
    if k == 1:
        return BinOp(rng.choice("+-*"), a, random_expr(rng, depth - 1))
    if k == 2:  # division by something positive
        return BinOp("/", a, BinOp("+", Num(1.0), BinOp("*", random_expr(rng, depth - 1), random_expr(rng, 0)) ** 2))
    if k == 3:  # log / sqrt of something positive
        return Call(rng.choice(["log", "sqrt"]), (BinOp("+", Call("softplus", (a,)), Num(0.25)),))
    if k == 4:
        return BinOp("**", Call("exp", (Call("tanh", (a,)),)), Num(rng.choice([2.0, 3.0, 0.5, -1.0, 1.5])))
    if k == 5:
        return Call(rng.choice(["min", "max"]), (a, random_expr(rng, depth - 1)))
    if k == 6:
        return Call("clamp", (a, Num(-1.0), Param("p", 0.75)))
    if k == 7:
        return where(cmp(rng.choice(["<", ">", "<=", ">="]), a, random_expr(rng, 0)), a, random_expr(rng, depth - 1))
    if k == 8:
        return Neg(a)
    return BinOp("*", a, Call(rng.choice(SAFE_UNARY), (random_expr(rng, depth - 1),)))


RANDOM = [random_expr(random.Random(seed), 4) for seed in range(60)]


def test_random_expressions_derivative_matches_autograd():
    gen = torch.Generator().manual_seed(2)
    env = {"x": torch.randn(64, generator=gen, dtype=torch.float64) * 2,
           "y": torch.randn(64, generator=gen, dtype=torch.float64) * 2}
    checked = 0
    for e in RANDOM:
        want = autograd_grads(e, ["x", "y"], env)
        for name, w in zip(["x", "y"], want):
            got = evaluate(differentiate(e, name), env).expand_as(w)
            assert_close(got, w)
        checked += 1
    assert checked >= 50


def test_random_expressions_round_trip_through_the_parser():
    for e in RANDOM:
        text = to_source(e)
        back = expression_from_source(text, args=("x", "y"), params={"p": 0.75})
        assert back == e or simplify(back) == simplify(e), text
        d = differentiate(e, "x")
        assert expression_from_source(to_source(d), args=("x", "y"), params={"p": 0.75}) == d


def test_pattern_ast_and_expressions_print_alike():
    """One printer: an expression's text, parsed into the .fpat AST and printed from there (as explain() prints
    predicates), is the same text."""
    for e in RANDOM + [differentiate(e, "x") for e in RANDOM[:10]]:
        text = to_source(e)
        assert render_expression(parse_expression(text)) == text


def test_to_source_precedence():
    P = Param("p", 0.75)
    cases = {
        Neg(x ** 2): "-x ** 2",
        Neg(x) ** 2: "(-x) ** 2",
        x ** Neg(P): "x ** -p",
        (x ** P) ** 2: "(x ** p) ** 2",
        x ** (P ** 2): "x ** p ** 2",
        x - (y - 1): "x - (y - 1)",
        (x - y) - 1: "x - y - 1",
        x / (y * 2): "x / (y * 2)",
        Num(-2.0) ** P: "(-2) ** p",
        where(cmp("<", x + 1, y), x, Num(0.5)): "where(x + 1 < y, x, 0.5)",
    }
    for e, text in cases.items():
        assert to_source(e) == text
        assert expression_from_source(text, args=("x", "y"), params={"p": 0.75}) == e


# ------------------------------------------------------------------------------------------ simplification
def test_simplification_basics():
    S = simplify
    assert S(x * 1) == x and S(1 * x) == x
    assert S(x * 0) == Num(0) and S(x + 0) == x and S(0 + x) == x and S(x - 0) == x
    assert S(0 - x) == Neg(x) and S(Neg(Neg(x))) == x and S(x - x) == Num(0)
    assert S(x / 1) == x and S(Num(0) / x) == Num(0) and S(x ** 1) == x and S(x ** 0) == Num(1)
    assert S(Num(2) * 3 + 1) == Num(7)
    assert S(call("exp", Num(0.0))) == Num(1.0)
    assert S(where(cmp("<", Num(1), Num(2)), x, y)) == x
    assert S(where(cmp("<", x, y), x, x)) == x
    assert S(x * 2 * 3) == BinOp("*", Num(6), x)
    assert S(x + Neg(y)) == BinOp("-", x, y)
    assert S(Neg(x) * Neg(y)) == BinOp("*", x, y)
    # a derivative is simplified: d(3x + 1)/dx == 3, d(p*x)/dx == p
    assert differentiate(3 * x + 1, "x") == Num(3)
    assert differentiate(Param("p", 2.0) * x, "x") == Param("p", 2.0)
    assert differentiate(y * y, "x") == Num(0)


def test_nodes_are_hashable_immutable_and_structural():
    a, b = call("sigmoid", x * 2), call("sigmoid", x * 2)
    assert a == b and hash(a) == hash(b) and a is not b
    assert len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.fn = "tanh"
    with pytest.raises(ValueError):
        Call("tanh", (x, y))
    with pytest.raises(ValueError):
        Call("nope", (x,))
    assert set(FUNCTIONS) >= {"min", "max", "clamp", "abs", "exp", "log", "sqrt", "sigmoid", "tanh",
                              "softplus", "erf", "relu", "gelu_tanh", "silu", "where"}


def test_deep_expressions_do_not_recurse():
    e = x
    for i in range(3000):
        e = e * 1.0001 + y
    out = evaluate(e, {"x": torch.tensor(0.0, dtype=torch.float64), "y": torch.tensor(1e-6, dtype=torch.float64)})
    assert torch.isfinite(out)
    assert differentiate(e, "x") is not None


# ------------------------------------------------------------------------------------------ evaluate conventions
def test_evaluate_conventions():
    t = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    for fn, want in [("relu", [0.0, 0.0, 1.0]), ("abs", [-1.0, 0.0, 1.0])]:
        (g,) = torch.autograd.grad(evaluate(call(fn, x), {"x": t}).sum(), [t])
        assert g.tolist() == want
        assert evaluate(differentiate(call(fn, x), "x"), {"x": t.detach()}).tolist() == want
    # softplus: stable for large |x|, exact (no threshold cut-off)
    big = torch.tensor([-800.0, 0.0, 30.0, 800.0], dtype=torch.float64)
    sp = evaluate(call("softplus", x), {"x": big})
    assert torch.isfinite(sp).all() and sp[3] == 800.0 and sp[2] == 30.0 + math.log1p(math.exp(-30.0))
    # min/max ties go to the first argument; clamp keeps the gradient on [lo, hi] like torch.clamp
    e = call("min", x, y)
    assert evaluate(differentiate(e, "x"), {"x": 1.0, "y": 1.0}).item() == 1.0
    assert evaluate(differentiate(e, "y"), {"x": 1.0, "y": 1.0}).item() == 0.0
    c = call("clamp", x, Num(-1.0), Num(1.0))
    pts = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(torch.clamp(pts, -1.0, 1.0).sum(), [pts])
    assert evaluate(differentiate(c, "x"), {"x": pts.detach()}).tolist() == g.tolist()
    # a Param reads env, else its default; constants follow the env's dtype
    assert evaluate(Param("p", 2.0) * x, {"x": torch.ones(2, dtype=torch.float32)}).dtype == torch.float32
    assert evaluate(Param("p", 2.0) * x, {"x": 1.0, "p": 3.0}).item() == 3.0


# ------------------------------------------------------------------------------------------ cse
def test_cse_shares_repeated_subexpressions():
    s = call("sigmoid", x)
    f = x * s * y
    g = differentiate(f, "x")
    bindings, outs = cse([f, g])
    bound = dict(bindings)
    assert s in bound.values()
    name = next(n for n, e in bindings if e == s)
    # every later use goes through the temporary
    for n, e in bindings:
        assert s not in set(postorder(e)) or e == s
    for o in outs:
        assert s not in set(postorder(o))
        assert Var(name) in set(postorder(o)) or o == Var(name)
    # evaluating through the bindings gives the same values
    env = {"x": torch.linspace(-3, 3, 7, dtype=torch.float64), "y": torch.full((7,), 0.5, dtype=torch.float64)}
    for n, e in bindings:
        env[n] = evaluate(e, env)
    for o, ref in zip(outs, [f, g]):
        assert_close(evaluate(o, env), evaluate(ref, env))
    # temporaries never collide with existing names
    b2, _ = cse([call("exp", Var("t0")) + call("exp", Var("t0"))])
    assert b2[0][0] != "t0"


def test_cse_leaves_single_uses_and_leaves_alone():
    bindings, outs = cse([x * y + call("exp", x)])
    assert bindings == [] and outs == [x * y + call("exp", x)]


# ------------------------------------------------------------------------------------------ cute printer
def em_namespace():
    """The epilogue math module as backend="emulate" gives it to generated code (torch on whole tensors)."""
    return types.SimpleNamespace(**torch_math.functions())


def test_to_cute_runs_and_matches_evaluate(builtin_acts):
    gen = torch.Generator().manual_seed(3)
    for name, act in builtin_acts.items():
        bindings, outs = act.expressions()
        lines = to_cute(bindings, outs, out_names=["y"] + [f"d_{a}" for a in act.args],
                        params={"alpha": 1.702} if "alpha" in dict(act.params) else None)
        env = {a: torch.randn(50, generator=gen, dtype=torch.float64) * 3 for a in act.args}
        env["dy"] = torch.randn(50, generator=gen, dtype=torch.float64)
        scope = {"em": em_namespace(), **env}
        exec("\n".join(lines), scope)  # the generated code is plain Python
        want = [act.forward(*[env[a] for a in act.args])] + list(act.backward(env["dy"], *[env[a] for a in act.args]))
        for got, w in zip([scope["y"]] + [scope[f"d_{a}"] for a in act.args], want):
            torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64).expand_as(w), w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_to_cute_calls_each_function_through_its_registry_entry(fn):
    f = FUNCTIONS[fn]
    args = [Var(f"a{i}") for i in range(f.arity)]
    assert to_cute([], [call(fn, *args)]) == [f"out0 = em.{f.kernel}({', '.join(a.name for a in args)})"]
    assert f.kernel in torch_math.functions()  # the emulation runs it (tests/test_epi_math.py: the kernel too)


def test_to_cute_powers_parameters_and_hoisting():
    # short forms of constant powers; a base they read twice is computed once, into a temporary
    assert to_cute([], [x ** 2]) == ["out0 = x * x"]
    assert to_cute([], [(x * y) ** 3]) == ["_v0 = x * y", "out0 = _v0 * _v0 * _v0"]
    assert to_cute([], [(x + y) ** -1]) == ["out0 = 1.0 / (x + y)"]
    assert to_cute([], [(x + y) ** 0.5 * 2]) == ["out0 = em.sqrt(x + y) * 2.0"]
    assert to_cute([], [x ** 1.5]) == ["out0 = em.pow_const(x, 1.5)"]
    assert to_cute([], [Neg(x ** 2), y / x ** 2]) == ["out0 = -(x * x)", "out1 = y / (x * x)"]
    # parameters: inlined from `params`, else renamed through `names`, else their default
    e = Param("limit", 7.0) * x
    assert to_cute([], [e]) == ["out0 = 7.0 * x"]
    assert to_cute([], [e], params={"limit": 10.0}) == ["out0 = 10.0 * x"]
    assert to_cute([], [e], names={"limit": "self.limit", "x": "acc"}) == ["out0 = self.limit * acc"]
