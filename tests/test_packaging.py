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


def test_subpackages_import_under_fusion():
    import fusion.codegen
    import fusion.kernels
    import fusion.patterns

    assert fusion.patterns.__name__ == "fusion.patterns"
