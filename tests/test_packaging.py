"""The package layout of pyproject.toml: one import root, every package listed."""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDER_OF = {"patterns": "fusion.patterns", "codegen": "fusion.codegen", "kernels": "fusion.kernels"}


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for top in ["fusion", *FOLDER_OF]:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join([FOLDER_OF.get(top, top), *rel]))
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert not any(name.split(".")[0] != "fusion" for name in listed), "one import root: fusion"


def test_every_package_data_glob_matches_a_file():
    """A glob matching nothing ships nothing: it names a file that moved or never existed."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = config["package-dir"]

    def folder(package: str) -> pathlib.Path:
        parts = package.split(".")
        for n in range(len(parts), 0, -1):  # the longest listed prefix, then the rest as folders
            if ".".join(parts[:n]) in roots:
                return ROOT.joinpath(roots[".".join(parts[:n])], *parts[n:])
        return ROOT.joinpath(*parts)

    for package, globs in config["package-data"].items():
        for glob in globs:
            assert any(folder(package).glob(glob)), f"package-data {package}: {glob!r} matches no file"


def test_subpackages_import_under_fusion():
    import fusion.codegen
    import fusion.kernels
    import fusion.patterns

    assert fusion.patterns.__name__ == "fusion.patterns"


def test_source_checkout_imports_like_the_installed_package():
    """`python -m fusion ...` run from the repository root imports fusion/ from there; its subpackages that live
    in sibling folders must still resolve."""
    import subprocess
    import sys

    code = "import fusion.patterns, fusion.codegen, fusion.kernels; print(fusion.patterns.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fusion.patterns"


def test_demo_runs_on_the_cpu_reference_path():
    """The README's main job (kernel compilation is covered by tests/test_compile_plans.py)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fusion", "demo", "--no-compile", "--device", "cpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[F1] fused    grouped_gemm  <- pattern gemm_act" in out.stdout
    assert "GPT-OSS-like" in out.stdout and "DeepSeek-like" in out.stdout
