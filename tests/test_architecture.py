"""Dependencies point one way (ARCHITECTURE.md): no module imports a module of a layer above its own, and no
modules import each other in a circle, inside a package (`kv/`, `features/`, `store/`) too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvchat"

# Top to bottom. A module may import modules of its own layer or of layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("kvchat.__main__", "kvchat.cli", "kvchat.repl", "kvchat.documents", "kvchat.terminal", "kvchat.serve"),
    ("kvchat.evaluate", "kvchat.gold", "kvchat.report"),
    ("kvchat.batch",),
    ("kvchat.batch_worker",),
    ("kvchat.append",),
    ("kvchat.ingest", "kvchat.plan", "kvchat.ask", "kvchat.recall", "kvchat.recall_entries", "kvchat.rag",
     "kvchat.profile", "kvchat.qa",
     "kvchat.training", "kvchat.training.pipeline", "kvchat.training.chunks", "kvchat.training.teacher",
     "kvchat.training.indexer_stage", "kvchat.training.memory_stage", "kvchat.training.checkpoints"),
    ("kvchat.llm", "kvchat.echo", "kvchat.model_files", "kvchat.native_llama", "kvchat.decode_step",
     "kvchat.cuda_graph_step", "kvchat.gguf_header", "kvchat.int8_weights", "kvchat.int4_weights",
     "kvchat.held_weights", "kvchat.store", "kvchat.episodes", "kvchat.preflight", "kvchat.settings", "kvchat.device",
     "kvchat.features", "kvchat.sources", "kvchat.packed_text", "kvchat.history_tokens"),
    ("kvchat.config",),
    ("kvchat.kv",),
    ("kvchat.history", "kvchat.encoder", "kvchat.native_bert", "kvchat.lexical", "kvchat.synthetic", "kvchat.__init__"),
    ("kvchat.formats", "kvchat.errors", "kvchat.checked_files"),
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


def _module_table() -> dict[str, str]:
    """ARCHITECTURE.md's module table: its module column (the names in backticks, `store/layout.py`,
    `store/errors.py` in one cell counted apart) -> that row's description."""
    rows: dict[str, str] = {}
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    table = text.split("## Modules, in layers", 1)[1].split("\n## ", 1)[0]
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].startswith("`"):
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            rows[name] = cells[2]
    return rows


def test_every_module_is_in_the_architecture_table():
    """A module missing from ARCHITECTURE.md's table is one a newcomer cannot place. A package's row
    (`serve/`, `features/`) may name its modules in its description instead of a row each; an empty
    `__init__.py` only marks a package."""
    table = _module_table()
    missing = []
    for path in MODULES:
        relative = path.relative_to(PACKAGE).as_posix()
        package = f"{path.parent.relative_to(PACKAGE).as_posix()}/"
        if relative in table or (path.name == "__init__.py" and not path.read_text().strip()):
            continue
        if package in table and (f"`{path.name}`" in table[package] or f"`{relative}`" in table[package]):
            continue
        missing.append(relative)
    assert missing == [], f"add these to ARCHITECTURE.md's module table: {missing}"
