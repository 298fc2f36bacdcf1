""".fpat robustness: whatever a pattern file holds, loading it ends quickly with the file loaded or a
PatternError naming the file, the line and (for a limit) the limit; never a RecursionError, a
UnicodeDecodeError without the file's name, or a hang. patterns/limits.py has the limits."""
from __future__ import annotations

import time

import pytest
import torch

import fusion
from fusion.errors import PatternError
from fusion.patterns.limits import MAX_EXPRESSION_DEPTH, MAX_PREDICATE_EXPONENT
from fusion.patterns.loader import load_ast
from fusion.patterns.parser import parse_text
from fusion.patterns.predicates import PredicateTypeError, evaluate_predicate
from fusion.patterns.registry import activations, fusion_patterns, get_activation, reset_to_builtins


@pytest.fixture(autouse=True)
def _builtins_only(monkeypatch):
    monkeypatch.delenv("FUSION_PATTERNS", raising=False)
    reset_to_builtins()
    yield
    reset_to_builtins()


def load_file(tmp_path, text: str | bytes, name: str = "deep.fpat") -> PatternError | None:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    try:
        fusion.load_patterns(path)
    except PatternError as err:
        assert str(path) in str(err), str(err)
        return err
    return None


def activation(body: str, name: str = "deep") -> str:
    return f"# header\nactivation {name}(x) {{\n    forward = {body}\n}}\n"


# -- deep expressions ---------------------------------------------------------------------------------------------
DEEP = {
    "500-term sum": " + ".join(["x"] * 500),
    "500 nested calls": "tanh(" * 500 + "x" + ")" * 500,
    "500 unary minus": "-" * 500 + "x",
    "500 powers": "x ** " * 500 + "2",
    "500 products in parentheses": "(" * 500 + "x" + " * x)" * 500,
}


@pytest.mark.parametrize("case", sorted(DEEP))
def test_deep_expressions_are_a_pattern_error_with_file_line_and_limit(tmp_path, case):
    err = load_file(tmp_path, activation(DEEP[case]))
    assert err is not None and err.line == 3, str(err)
    assert f"the limit is {MAX_EXPRESSION_DEPTH}" in str(err) and "deep.fpat:3:" in str(err)


def test_deep_predicates_are_a_pattern_error(tmp_path):
    pred = " + ".join(["in_features"] * 300) + " > 0"
    err = load_file(tmp_path, f"fusion f {{\n kernel = grouped_gemm\n chain {{ g: GroupLinear where {pred} }}\n}}\n")
    assert err is not None and err.line == 3 and "limit is" in str(err)


def test_expressions_at_the_limit_load_and_run(tmp_path):
    """The deepest expression allowed works end to end: forward and gradient, emulate equal to reference."""
    terms = [f"x * {k}.5" for k in range(MAX_EXPRESSION_DEPTH - 1)]  # a sum of n products is n + 1 deep
    assert load_file(tmp_path, activation(" + ".join(terms), "at_limit")) is None
    err = load_file(tmp_path, activation(" + ".join(terms + ["x"]), "past_limit"), "past.fpat")
    assert err is not None and f"nested {MAX_EXPRESSION_DEPTH + 1} levels deep" in str(err)
    x = torch.randn(6, 32, dtype=torch.float64)
    grads = []
    for backend in ("reference", "emulate"):
        torch.manual_seed(0)
        mlp = fusion.Sequential(fusion.GroupLinear(2, 32, 64), fusion.Activation("at_limit"),
                                fusion.GroupLinear(2, 64, 32), backend=backend).double()
        xi = x.clone().requires_grad_()
        mlp(xi, group_sizes=torch.tensor([2, 4])).sum().backward()
        grads.append(xi.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-9)


def test_deep_through_lets_names_the_let_and_the_limit(tmp_path):
    """Each let is shallow, but lets are expanded: the one that passes the limit is reported."""
    lets = "\n".join(f"    let t{i} = tanh(t{i - 1})" for i in range(1, 300))
    text = f"activation deep_lets(x) {{\n    let t0 = x\n{lets}\n    forward = t299\n}}\n"
    err = load_file(tmp_path, text)
    assert err is not None and f"the limit is {MAX_EXPRESSION_DEPTH}" in str(err)
    assert "let 't" in str(err) and 3 <= err.line < 300


def test_deep_derived_gradient_is_reported(tmp_path):
    """A forward within the limit whose derived gradient is not: the error says so and points at forward."""
    lets = "\n".join(f"    let t{i} = sigmoid(t{i - 1}) * x" for i in range(1, 40))
    text = f"activation deep_grad(x) {{\n    let t0 = x\n{lets}\n    forward = t39\n}}\n"
    err = load_file(tmp_path, text)
    assert err is not None and "derived gradient of 'x'" in str(err)
    assert err.line == 42


# -- encodings ----------------------------------------------------------------------------------------------------
def test_non_utf8_file_is_a_pattern_error_with_its_name_and_position(tmp_path):
    err = load_file(tmp_path, b"activation a(x) { forward = x }\n# caf\xe9 \xff\n", "latin1.fpat")
    assert err is not None and "latin1.fpat:2:" in str(err) and "not UTF-8" in str(err)
    assert "byte 0xe9" in str(err) and err.line == 2 and err.column == 6


def test_utf8_bom_is_accepted(tmp_path):
    assert load_file(tmp_path, "\ufeffactivation bom_act(x) {\r\n    forward = x * 2\r\n}\r\n".encode()) is None
    assert get_activation("bom_act").forward(torch.ones(1)).item() == 2.0
    assert parse_text("\ufeffactivation a(x) { forward = x }").decls[0].name == "a"


def test_error_positions_after_a_bom_and_crlf_are_right(tmp_path):
    err = load_file(tmp_path, "\ufeffactivation a(x) {\r\n    forward = tahn(x)\r\n}\r\n".encode())
    assert err is not None and (err.line, err.column) == (2, 15) and "tahn" in str(err)


# -- predicate exponents ----------------------------------------------------------------------------------------
def test_huge_literal_exponent_in_a_predicate_is_rejected_at_load(tmp_path):
    start = time.monotonic()
    err = load_file(tmp_path, "fusion f {\n kernel = grouped_gemm\n chain {\n  g: GroupLinear where "
                              "in_features ** 999999999 > 1\n }\n}\n")
    assert time.monotonic() - start < 5
    assert err is not None and err.line == 4 and f"limit of {MAX_PREDICATE_EXPONENT}" in str(err)


@pytest.mark.parametrize("text,attrs", [
    ("2 ** in_features > 1", {"in_features": 999999999}),
    ("(in_features ** 64) ** 64 > 1", {"in_features": 1 << 40}),
    ("in_features ** 2.5 > 1", {"in_features": 10.0 ** 300}),
])
def test_predicate_powers_are_bounded_when_evaluated(text, attrs):
    """Exponents read from attributes, and powers of powers, are bounded at evaluation: a quick
    PredicateTypeError (the matcher reports it as why the pattern does not apply), never a hang."""
    pf = parse_text(f"fusion f {{ kernel = k chain {{ g: GroupLinear where {text} }} }}")
    (pred,) = pf.decls[0].items[1].elements[0].where
    start = time.monotonic()
    with pytest.raises(PredicateTypeError):
        evaluate_predicate(pred.expr, attrs)
    assert time.monotonic() - start < 1


def test_small_predicate_powers_still_work():
    pf = parse_text("fusion f { kernel = k chain { g: GroupLinear where in_features % 2 ** 4 == 0 } }")
    (pred,) = pf.decls[0].items[1].elements[0].where
    assert evaluate_predicate(pred.expr, {"in_features": 4096}) is True


# -- constants ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("default,words", [
    ("10 ** 400", "overflows"),
    ("1e308 * 10", "overflows"),
    ("1e999", "overflows"),
    pytest.param("1" + "0" * 400, "overflows", id="a-400-digit-int"),
    ("exp(1000)", "overflows"),
    ("(-1) ** 0.5", "not a real number"),
])
def test_a_default_that_overflows_says_so(default, words):
    src = f"activation a(x; limit: float = {default}) {{ forward = x * limit }}"
    with pytest.raises(PatternError) as info:
        load_ast(parse_text(src, "c.fpat"), activations(), {p.name: p for p in fusion_patterns()})
    assert words in str(info.value) and "c.fpat:1:" in str(info.value)
    assert "must be a constant" not in str(info.value)


def test_an_overflowing_number_in_an_expression_is_a_pattern_error():
    with pytest.raises(PatternError, match="number 1e400 overflows"):
        parse_text("activation a(x) { forward = x * 1e400 }", "n.fpat")


def test_pattern_files_cannot_execute_code(tmp_path):
    marker = tmp_path / "pwned"
    for body in (f'__import__("os").system("touch {marker}")', f'exec("open(\'{marker}\', \'w\')")',
                 "x.__class__", "x; import os"):
        assert load_file(tmp_path, activation(body, "evil")) is not None
    assert not marker.exists()


def test_to_source_prints_expressions_of_any_depth():
    """fusion.symbolic.to_source (used by ActivationDef.to_source and the round-trip tests) builds the text
    bottom-up: an expression built in Python deeper than the recursion limit prints, and reads back."""
    from fusion.patterns.activation_semantics import expression_from_source
    from fusion.symbolic import Var, to_source

    e = Var("x")
    for k in range(3000):
        e = e + Var("x") * float(k)
    text = to_source(e)
    assert text.startswith("x + x * 0 + x * 1 + x * 2") and text.endswith("x * 2999")
    short = Var("x")
    for k in range(20):
        short = (short - Var("x")) * float(k + 1)
    assert to_source(expression_from_source(to_source(short))) == to_source(short)
