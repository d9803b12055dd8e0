"""Dependencies point one way (ARCHITECTURE.md): no module imports a module of a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvchat"

# Top to bottom. A module may import modules of its own layer or of layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("kvchat.__main__", "kvchat.cli", "kvchat.repl", "kvchat.documents", "kvchat.terminal"),
    ("kvchat.evaluate", "kvchat.report"),
    ("kvchat.batch",),
    ("kvchat.append",),
    ("kvchat.ingest", "kvchat.ask", "kvchat.profile", "kvchat.qa", "kvchat.training", "kvchat.training.pipeline",
     "kvchat.training.chunks", "kvchat.training.teacher", "kvchat.training.indexer_stage",
     "kvchat.training.memory_stage", "kvchat.training.checkpoints"),
    ("kvchat.llm", "kvchat.gguf_header", "kvchat.int8_weights", "kvchat.store", "kvchat.episodes", "kvchat.preflight",
     "kvchat.settings", "kvchat.device"),
    ("kvchat.kv", "kvchat.config"),
    ("kvchat.history", "kvchat.encoder", "kvchat.errors", "kvchat.checked_files", "kvchat.synthetic",
     "kvchat.__init__"),
]


def _layer(module: str) -> int:
    """The index of `module`'s layer: the longest listed name it equals or lies under."""
    best = None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (index, name)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS here and to ARCHITECTURE.md")
    return best[0]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvchat":
            if node.module in ("kvchat", "kvchat.kv"):  # `from kvchat import store`
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "kvchat"}
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_imports_one_above_it(path: Path):
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    own = _layer(module)
    above = sorted(dep for dep in _imports(path) if _layer(dep) < own)
    assert not above, f"{module} (layer {own}) imports {above} from layers above it"


def test_every_package_ships_in_the_wheel():
    """pyproject lists its packages explicitly (profiles/ is mapped in): a package left out of that list
    works in an editable install and is missing from every wheel."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
