"""The package's modules form layers: every import goes down (or stays in its layer), and no module is in an
import cycle.

Imports are read with ast, at module level and inside functions alike: a function-level import that only
postpones a cycle to run time is still a cycle. The layers are the ones docs/architecture.md draws; a new
module inside a package listed below is in that package's layer, a new module elsewhere must be added to LAYERS
(and to the docs).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The package's source folders, by the name they import as (pyproject's package-dir).
FOLDERS = {"fusion": "fusion", "fusion.patterns": "patterns", "fusion.codegen": "codegen", "fusion.kernels": "kernels"}

#: Bottom to top. A module may import from its own layer and the layers below it. An entry names a module and
#: everything inside it, and the longest matching entry wins; "fusion" is the package's __init__ alone.
LAYERS = [
    ("errors", ["fusion.errors", "fusion.version"]),
    ("core types", ["fusion.symbolic", "fusion.quant", "fusion.grouped", "fusion.run_context", "fusion.shapes",
                    "fusion.op_table", "fusion.targets", "fusion.kernel_templates"]),
    ("patterns", ["fusion.patterns"]),
    ("ops", ["fusion.ops", "fusion.inputs"]),
    ("planning", ["fusion.graph", "fusion.matcher", "fusion.dataflow", "fusion.plan", "fusion.planner"]),
    ("codegen", ["fusion.codegen"]),
    ("kernels", ["fusion.kernels"]),
    ("runtime", ["fusion.runtime"]),
    ("user objects", ["fusion.sequential", "fusion.explain", "fusion.moe"]),
    ("package and command line", ["fusion", "fusion.demo", "fusion.__main__"]),
]

#: Import cycles allowed: none (test_no_allowed_cycle_is_stale keeps an entry here from outliving its cycle).
ALLOWED_CYCLES: list[set] = []


# -- reading the package ---------------------------------------------------------------------------------------
def package_sources(root: Path = ROOT) -> dict[str, tuple[bool, str]]:
    """Every module of the package: name -> (is it a package's __init__, its source)."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *parts[:-1]] if is_package else [package, *parts])
            out.setdefault(name, (is_package, path.read_text()))
    return out


def _packages_of(name: str, modules) -> list[str]:
    """The packages `name` lies in, outermost first (Python runs their __init__ before it)."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules]


def _known(name: str, modules) -> str | None:
    """The module an import of `name` runs: `name` itself, or the module that defines it as an attribute."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, is_package: bool, node, modules) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    out = set()
    for name in names:
        target = _known(name, modules)
        if target is not None:
            out.update([target, *_packages_of(target, modules)])
    return out


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules):
        self.module, self.is_package, self.modules = module, is_package, modules
        self.where: dict[str, list[str]] = {}
        self.functions: list[str] = []

    def visit_FunctionDef(self, node):
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
        place = f"line {node.lineno}" + (f" in {self.functions[-1]}()" if self.functions else "")
        for target in _imported(self.module, self.is_package, node, self.modules):
            self.where.setdefault(target, []).append(place)

    visit_ImportFrom = visit_Import


def import_graph(sources: dict[str, tuple[bool, str]]) -> dict[str, dict[str, list[str]]]:
    """module -> {module its imports run -> where}. Importing a.b.c runs a and a.b first, so they count as
    imported too. A package's imports of its own modules, and a module's of its own packages, are left out:
    that is how packages work, not a dependency between layers."""
    graph = {}
    for module, (is_package, text) in sources.items():
        visitor = _Imports(module, is_package, sources)
        visitor.visit(ast.parse(text))
        own = set(_packages_of(module, sources))
        graph[module] = {t: w for t, w in visitor.where.items()
                         if t != module and t not in own and not t.startswith(module + ".")}
    return graph


# -- the checks ------------------------------------------------------------------------------------------------
def cycles(graph) -> list[set[str]]:
    """The import cycles: the groups of two or more modules each of which imports (runs) the others."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for t in graph[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        reach[start] = seen
    groups = []
    for m in sorted(graph):
        if m in reach[m] and not any(m in g for g in groups):
            groups.append({n for n in reach[m] if m in reach[n]})
    return groups


def layer_of(module: str, layers=LAYERS) -> int | None:
    best, index = -1, None
    for i, (_, names) in enumerate(layers):
        for name in names:
            inside = module == name or (name != "fusion" and module.startswith(name + "."))
            if inside and len(name) > best:
                best, index = len(name), i
    return index


def upward_imports(graph, layers=LAYERS) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        for target, where in sorted(targets.items()):
            if layer_of(target, layers) > layer_of(module, layers):
                out.append(f"{module} (layer {layers[layer_of(module, layers)][0]!r}) imports {target} (layer "
                           f"{layers[layer_of(target, layers)][0]!r}, above it) at {', '.join(where)}")
    return out


def _cycle_text(group: set[str], graph) -> str:
    edges = [f"    {m} -> {t} ({', '.join(graph[m][t])})" for m in sorted(group) for t in sorted(graph[m]) if t in group]
    return "cycle of " + ", ".join(sorted(group)) + ":\n" + "\n".join(edges)


GRAPH = import_graph(package_sources())


# -- the package ---------------------------------------------------------------------------------------------------
def test_no_module_is_in_an_import_cycle():
    found = [g for g in cycles(GRAPH) if g not in ALLOWED_CYCLES]
    assert not found, ("import cycles (move what both sides need into a module below them):\n"
                       + "\n".join(_cycle_text(g, GRAPH) for g in found))


def test_no_allowed_cycle_is_stale():
    found = cycles(GRAPH)
    stale = [sorted(g) for g in ALLOWED_CYCLES if g not in found]
    assert not stale, f"these modules are no longer in a cycle: delete their entry from ALLOWED_CYCLES: {stale}"


def test_every_module_is_in_a_layer():
    missing = sorted(m for m in GRAPH if layer_of(m) is None)
    assert not missing, f"modules in no layer: add them to LAYERS (and to docs/architecture.md): {missing}"


def test_imports_go_down_the_layers():
    upward = upward_imports(GRAPH)
    assert not upward, ("imports of a higher layer (move the shared definition down, or the module up in "
                        "LAYERS and docs/architecture.md):\n  " + "\n  ".join(upward))


# -- the checker itself: it finds what it is meant to find ---------------------------------------------------------
def synthetic(**modules: str) -> dict[str, tuple[bool, str]]:
    """Sources by name (dots as `__`); `fusion` and `fusion.pkg` are packages."""
    out = {"fusion": (True, ""), "fusion.pkg": (True, "from fusion.pkg import low\n")}
    out.update({name.replace("__", "."): (False, text) for name, text in modules.items()})
    return out


def test_a_cycle_through_a_function_level_import_is_found():
    graph = import_graph(synthetic(fusion__a="import fusion.b\n",
                                   fusion__b="def f():\n    from fusion import a\n    return a\n"))
    assert cycles(graph) == [{"fusion.a", "fusion.b"}]
    assert "fusion.b -> fusion.a (line 2 in f())" in _cycle_text(cycles(graph)[0], graph)


def test_a_cycle_through_a_package_init_is_found():
    """fusion.a imports a module of fusion.pkg, which runs the package's __init__ first, and that imports fusion.a
    (the tool that counts only the names written misses it)."""
    sources = synthetic(fusion__a="from fusion.pkg.low import value\n", fusion__pkg__low="from . import sibling\n",
                        fusion__pkg__sibling="")
    assert not cycles(import_graph(sources))  # a package importing its own modules is no cycle
    sources["fusion.pkg"] = (True, "from fusion.pkg import low\nimport fusion.a\n")
    assert cycles(import_graph(sources)) == [{"fusion.a", "fusion.pkg"}]


def test_an_upward_import_is_found():
    layers = [("low", ["fusion.a"]), ("high", ["fusion", "fusion.b", "fusion.pkg"])]
    graph = import_graph(synthetic(fusion__a="def f():\n    import fusion.b\n", fusion__b="import fusion.a\n"))
    assert upward_imports(graph, layers) == [
        "fusion.a (layer 'low') imports fusion.b (layer 'high', above it) at line 2 in f()"]
    assert layer_of("fusion.pkg.low", layers) == 1 and layer_of("fusion.c", layers) is None
