"""The registry: built-ins, user files from a path, a folder, FUSION_PATTERNS; API.md's examples end to end."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion.errors import PatternError
from fusion.patterns import registry
from fusion.patterns.registry import (
    activations, fusion_patterns, get_activation, load_patterns, loaded_files, register_activation,
    reset_to_builtins,
)

API_EXAMPLE = """\
# my_acts.fpat
activation mish_glu(gate, up) {
    forward = gate * tanh(softplus(gate)) * up
}

activation clamped_swiglu(gate, up; limit: float = 7.0, alpha: float = 1.702) {
    let g = min(gate, limit)
    let u = clamp(up, -limit, limit)
    forward = g * sigmoid(alpha * g) * (u + 1)
}
"""

USER_FUSION = """\
fusion my_gemm_relu {
    kernel = grouped_gemm
    arch >= sm_90
    chain {
        gemm: GroupLinear where in_features % 8 == 0
        act:  activation where activation == "relu"
    }
    save = act.in
}
"""


@pytest.fixture(autouse=True)
def _builtins_only(monkeypatch):
    monkeypatch.delenv("FUSION_PATTERNS", raising=False)
    reset_to_builtins()
    yield
    reset_to_builtins()


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * 3


def test_builtins_are_loaded_from_fpat_files():
    names = set(activations())
    assert {"swiglu", "geglu", "srelu", "relu", "gelu_tanh", "gelu_erf", "silu", "gptoss_swiglu", "xielu"} <= names
    pats = [p.name for p in fusion_patterns()]
    assert pats == ["fp8_gemm_act", "fp8_dgrad_dact",  # patterns/fp8.fpat, then patterns/moe.fpat
                    "gemm_quantize", "gemm_act", "gemm_scale", "gemm_bias", "gemm_scale_const", "dgrad_dact",
                    "dgrad_scale", "gather_gemm_act", "gemm_combine"]
    assert all(f.endswith(".fpat") for f in loaded_files())
    assert get_activation("swiglu").loc.file.endswith("activations.fpat")
    with pytest.raises(KeyError, match="unknown activation 'swiglo' \\(did you mean 'swiglu'\\?\\)"):
        get_activation("swiglo")


def check_mish_and_clamped(tmp_user_file_loaded=True):
    x = rand(6, 16)
    gate, up = x.chunk(2, -1)
    mish = get_activation("mish_glu")
    assert mish.gated and mish.args == ("gate", "up")
    # forward vs an independent torch formulation
    torch.testing.assert_close(mish.reference(x), F.mish(gate) * up, rtol=1e-12, atol=1e-12)
    # backward vs autograd of the independent formulation
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    dy = rand(6, 8, seed=1)
    want = torch.autograd.grad((F.mish(g) * u * dy).sum(), [g, u])
    got = mish.backward(dy, gate, up)
    for w, h in zip(want, got):
        torch.testing.assert_close(h, w, rtol=1e-10, atol=1e-10)
    # clamped_swiglu with a parameter override
    cs = get_activation("clamped_swiglu")
    assert cs.param_defaults() == {"limit": 7.0, "alpha": 1.702}
    gg = gate.clamp(max=10.0)
    want = gg * torch.sigmoid(1.702 * gg) * (up.clamp(-10.0, 10.0) + 1)
    torch.testing.assert_close(cs.reference(x * 4, limit=10.0), (x * 4).chunk(2, -1)[0].clamp(max=10.0) *
                               torch.sigmoid(1.702 * (x * 4).chunk(2, -1)[0].clamp(max=10.0)) *
                               ((x * 4).chunk(2, -1)[1].clamp(-10.0, 10.0) + 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cs.forward(gate, up, limit=10.0), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="has no parameter"):
        cs.forward(gate, up, limt=1.0)


def test_load_a_user_file_from_a_path(tmp_path):
    f = tmp_path / "my_acts.fpat"
    f.write_text(API_EXAMPLE + USER_FUSION)
    assert load_patterns(str(f)) == [str(f.resolve())]
    check_mish_and_clamped()
    assert [p.name for p in fusion_patterns()][-1] == "my_gemm_relu"  # user patterns after the built-ins
    p = fusion_patterns()[-1]
    assert p.loc.file == str(f) and p.loc.line == 11


def test_load_a_folder_in_name_order(tmp_path):
    (tmp_path / "b.fpat").write_text("activation b(x) {\n  forward = a(x) * 2\n}\n")  # uses a from a.fpat
    (tmp_path / "a.fpat").write_text("activation a(x) {\n  forward = x + 1\n}\n" + USER_FUSION)
    (tmp_path / "notes.txt").write_text("not a pattern file")
    loaded = load_patterns(tmp_path)
    assert [p.rsplit("/", 1)[1] for p in loaded] == ["a.fpat", "b.fpat"]
    assert get_activation("b").forward(torch.tensor([1.0], dtype=torch.float64)).item() == 4.0


def test_env_var_is_read_at_first_use(tmp_path, monkeypatch):
    d = tmp_path / "dir"
    d.mkdir()
    (d / "acts.fpat").write_text(API_EXAMPLE)
    f = tmp_path / "fus.fpat"
    f.write_text(USER_FUSION)
    monkeypatch.setenv("FUSION_PATTERNS", f"{d}:{f}")
    monkeypatch.setattr(registry, "_state", None)  # as in a fresh process
    check_mish_and_clamped()
    assert "my_gemm_relu" in [p.name for p in fusion_patterns()]
    reset_to_builtins()
    assert "mish_glu" not in activations()
    reset_to_builtins(read_env=True)
    assert "mish_glu" in activations()


def test_env_var_error_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_PATTERNS", str(tmp_path / "missing.fpat"))
    monkeypatch.setattr(registry, "_state", None)
    with pytest.raises(PatternError, match="while loading FUSION_PATTERNS="):
        activations()


def test_loading_is_atomic_and_redefinition_is_an_error(tmp_path):
    good = tmp_path / "good.fpat"
    good.write_text(API_EXAMPLE)
    load_patterns(good)
    bad = tmp_path / "bad.fpat"
    bad.write_text("activation fine(x) {\n  forward = x\n}\nactivation mish_glu(gate, up) {\n  forward = gate\n}\n")
    with pytest.raises(PatternError) as info:
        load_patterns(bad)
    assert info.value.line == 4 and "activation 'mish_glu' is already defined (at " in str(info.value)
    assert "fine" not in activations()  # nothing of the bad file was registered
    builtin = tmp_path / "builtin_clash.fpat"
    builtin.write_text("activation swiglu(x) {\n  forward = x\n}\n")
    with pytest.raises(PatternError, match="a built-in, at .*activations.fpat"):
        load_patterns(builtin)


def test_reloading_a_file_replaces_its_own_declarations(tmp_path):
    f = tmp_path / "acts.fpat"
    f.write_text("activation twice(x) {\n  forward = 2 * x\n}\n")
    load_patterns(f)
    f.write_text("activation twice(x) {\n  forward = x + x + 0\n}\n")
    load_patterns(f)
    assert get_activation("twice").forward(torch.tensor([3.0])).item() == 6.0
    assert loaded_files().count(str(f.resolve())) == 1


def test_missing_paths_and_empty_folders(tmp_path):
    with pytest.raises(PatternError, match="no such pattern file or folder"):
        load_patterns(tmp_path / "nope.fpat")
    with pytest.raises(PatternError, match="the folder has no .fpat files"):
        load_patterns(tmp_path)


def test_register_activation_from_python():
    d = get_activation("relu")
    with pytest.raises(PatternError, match="already defined"):
        register_activation(d)
    register_activation(d, replace=True)
    assert get_activation("relu") is d


def test_reference_of_gated_and_plain(tmp_path):
    x = rand(4, 10)
    torch.testing.assert_close(get_activation("swiglu").reference(x), F.silu(x[:, :5]) * x[:, 5:])
    torch.testing.assert_close(get_activation("srelu").reference(x), F.relu(x) ** 2)
    with pytest.raises(Exception, match="even feature count"):
        get_activation("swiglu").reference(rand(4, 7))


def test_given_grad_is_used(tmp_path):
    f = tmp_path / "g.fpat"
    f.write_text("activation sq(x) {\n  forward = x * x\n  grad(x) = 3 * dy\n}\n")  # deliberately not the derivative
    load_patterns(f)
    sq = get_activation("sq")
    assert sq.grad_given == {"x": True}
    assert sq.backward(torch.tensor([2.0]), torch.tensor([5.0]))[0].item() == 6.0
    assert "grad(x) = 3 * dy" in sq.to_source()


def test_to_source_of_a_definition_reads_back(tmp_path):
    for name in ("gptoss_swiglu", "xielu", "srelu", "geglu"):
        d = get_activation(name)
        f = tmp_path / f"{name}.fpat"
        f.write_text(d.to_source().replace(f"activation {name}(", f"activation copy_{name}("))
        load_patterns(f)
        c = get_activation(f"copy_{name}")
        assert c.forward_expr == d.forward_expr and c.params == d.params


def test_expressions_for_codegen_share_work():
    bindings, outs = get_activation("gptoss_swiglu").expressions()
    assert len(outs) == 3 and bindings  # forward, d gate, d up; min(gate, limit) and sigmoid(...) shared
    bound = [e for _, e in bindings]
    assert any(getattr(e, "fn", None) == "sigmoid" for e in bound)
