"""Dependencies point one way (ARCHITECTURE.md): no module imports a module of a layer above its own, and no
modules import each other in a circle, inside a package (`kv/`, `features/`, `store/`) too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvchat"

# Top to bottom: a package per stage, each importing only packages below it (and its own modules).
LAYERS: list[tuple[str, ...]] = [
    ("kvchat.__main__", "kvchat.cli"),
    ("kvchat.serve",),
    ("kvchat.documents",),
    ("kvchat.eval",),
    ("kvchat.training",),
    ("kvchat.ingest",),
    ("kvchat.answer",),
    ("kvchat.model",),
    ("kvchat.store",),
    ("kvchat.settings",),
    ("kvchat.features",),
    ("kvchat.history",),
    ("kvchat.settings_table",),
    ("kvchat.config",),
    ("kvchat.kv",),
    ("kvchat.errors", "kvchat.checked_files", "kvchat.packed_text", "kvchat.untrusted_text", "kvchat.__init__"),
]


def _layer(module: str) -> int:
    """The index of `module`'s layer: the longest listed name it equals or lies under."""
    module = "kvchat.__init__" if module == "kvchat" else module
    best = None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (index, name)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS here and to ARCHITECTURE.md")
    return best[0]


def _module_name(path: Path) -> str:
    """`kvchat.kv.cache` for kvchat/kv/cache.py; a package's `__init__.py` is the package itself."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(PACKAGE.rglob("*.py"))
NAMES = {_module_name(path) for path in MODULES}


def _imports(path: Path, *, type_only: bool = True) -> set[str]:
    """Every kvchat module `path` imports, wherever the import sits (module level, in a function, and unless
    `type_only` is False under TYPE_CHECKING): `from kvchat.kv import codec` is `kvchat.kv.codec`."""
    found = set()
    tree = ast.parse(path.read_text())
    skipped = set() if type_only else {
        id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }  # fmt: skip
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvchat":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in NAMES else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "kvchat"}
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_imports_one_above_it(path: Path):
    module = _module_name(path)
    own = _layer(module)
    above = sorted(dep for dep in _imports(path) if _layer(dep) < own)
    assert not above, f"{module} (layer {own}) imports {above} from layers above it"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    """Not even through a package's own modules (kv/, features/, store/) or a function-level import: a
    module depends on the ones it imports, never the other way round too. (Imports for type annotations only,
    under TYPE_CHECKING, are left out here; the layer test above counts them.)"""
    graph = {_module_name(p): (_imports(p, type_only=False) & NAMES) - {_module_name(p)} for p in MODULES}
    assert _circles(graph) == []


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_every_package_ships_in_the_wheel():
    """pyproject lists its packages explicitly (profiles/ is mapped in): a package left out of that list
    works in an editable install and is missing from every wheel."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def _package_table() -> list[str]:
    """ARCHITECTURE.md's package table: the first column's names, in order (`store/` -> `kvchat.store`,
    `settings.py` -> `kvchat.settings`)."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    table = text.split("## Packages, in import order", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in (line for line in table.splitlines() if line.startswith("|")):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]) if cells and cells[0].startswith("`") else ():
            names.append("kvchat." + name.removesuffix("/").removesuffix(".py"))
    return names


def test_the_architecture_table_lists_every_package_in_import_order():
    """ARCHITECTURE.md's package table is the order this test checks: the same names, top to bottom."""
    layers = [name for layer in LAYERS for name in layer if name not in ("kvchat.__init__", "kvchat.__main__")]
    assert _package_table() == layers


def test_every_module_says_what_it_does():
    """The tree is the module table: every module opens with a docstring (a package's `__init__.py` too)."""
    missing = [str(p.relative_to(PACKAGE)) for p in MODULES if p.read_text().strip() and ast.get_docstring(
        ast.parse(p.read_text())) is None]  # fmt: skip
    assert missing == []
