"""The README and docs/ say what kvchat does today.

- Every code block marked `<!-- run -->` runs as written (on the tiny model instead of the default one:
  `--model` is added to `ingest`), in order within its file, each command exiting as its comment says
  (`# exit N`, else 0); a `--json` command prints only JSON lines with `"schema": 1`.
- Every other `kvchat` command shown, in code blocks and in inline code, names a command and options that
  exist; every benchmark script, results file, make target, extra and `kvchat` import shown exists.
- Every block marked `<!-- example-history NAME -->` loads as a history (written to a file named NAME).
- Every relative link points to a file that exists, and every `#anchor` to a heading in it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_helpers import run_main

from kvchat.history.loading import load_history
from kvchat.history.synthetic import planted_conversation

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

_BLOCK = re.compile(r"(?:<!--\s*([a-z-]+)\s*([^>]*?)\s*-->\s*\n)?^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
_INLINE = re.compile(r"`([^`\n]+)`")
_OPTION = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    marker: str  # "run", "example-history" or "" (none)
    argument: str
    language: str
    body: str


@dataclass(frozen=True)
class Command:
    text: str
    exit_code: int


def _blocks(path: Path) -> list[Block]:
    return [Block(m.group(1) or "", m.group(2) or "", m.group(3), m.group(4))
            for m in _BLOCK.finditer(path.read_text())]


def _commands(block: Block) -> list[Command]:
    """One per line (`a; b` is two); a trailing `  # exit N` comment gives the expected exit status."""
    commands = []
    for line in block.body.splitlines():
        found_comment = re.search(r"\s#(\s|$)", line)
        code, comment = (line[: found_comment.start()], line[found_comment.end():]) if found_comment else (line, "")
        found = re.search(r"\bexit (\d+)", comment)
        for part in code.split("; "):
            if part.strip():
                commands.append(Command(part.strip(), int(found.group(1)) if found else 0))
    return commands


def _prose(path: Path) -> str:
    return _BLOCK.sub("", path.read_text())


def _all_commands(path: Path) -> list[str]:
    """Every command shown in a file: the lines of its sh blocks and its inline code spans."""
    shown = [c.text for b in _blocks(path) if b.language == "sh" for c in _commands(b)]
    return shown + _INLINE.findall(_prose(path))


def _words(command: str) -> list[str]:
    """The command's words without leading VAR=value assignments, up to a pipe or redirection."""
    words = command.split()
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    for stop in ("|", "<", ">", "&&"):
        if stop in words:
            words = words[: words.index(stop)]
    return words


# ---------------------------------------------------------------------------------------------- running blocks


def _runnable(path: Path) -> list[Command]:
    return [c for b in _blocks(path) if b.marker == "run" for c in _commands(b)]


RUNNABLE = [p for p in DOCS if _runnable(p)]


@pytest.mark.parametrize("path", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_runnable_blocks_run_as_written(path, tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    messages, _ = planted_conversation(seed=4, topics=2, turns_per_topic=12)
    (tmp_path / "history.json").write_text(json.dumps(messages[: len(messages) * 3 // 4]))
    (tmp_path / "more.json").write_text(json.dumps(messages[len(messages) * 3 // 4:]))
    questions = ["Which gate does the flight leave from?", "How many tomato plants?"]
    (tmp_path / "questions.txt").write_text("\n".join(questions) + "\n")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # what a clone has: the tour's files
    home = tmp_path / "home"
    commands = _runnable(path)
    assert all(c.text.startswith("kvchat ") for c in commands), commands
    for command in commands:
        words = shlex.split(command.text)[1:]
        stdin = ""  # not a terminal: `kvchat ask` alone reads questions from stdin (none here)
        if "<" in words:
            stdin = (tmp_path / words[words.index("<") + 1]).read_text()
            words = words[: words.index("<")]
        if words[0] == "ingest" and "--append" not in words:  # an append uses the stored model
            words += ["--model", str(tiny_model_dir)]
        result = run_main(home, *words, stdin=stdin)
        assert result.returncode == command.exit_code, (command, result.stderr)
        asked = stdin.splitlines()
        if command.exit_code:
            assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, (command, result)
        elif "--json" in words:
            records = [json.loads(line) for line in result.stdout.splitlines()]
            assert records and all(r["schema"] == 1 for r in records), command
            if words[0] == "ask" and stdin:
                assert [r["question"] for r in records] == asked
        elif words[0] == "ask" and stdin:
            assert len(result.stdout.splitlines()) == len(asked), command  # an answer per line
    assert json.loads(run_main(home, "list", "--json").stdout)["conversations"] == [], path  # blocks clean up


def test_the_tours_first_question_has_its_answer_in_the_example_history():
    """examples/questions.txt asks examples/planted_facts.json the facts planted in it (kvchat.history.synthetic,
    seed 7), the first one's answer written in the history."""
    messages, facts = planted_conversation(7, topics=4, turns_per_topic=24)
    assert json.loads((ROOT / "examples" / "planted_facts.json").read_text()) == messages
    questions = (ROOT / "examples" / "questions.txt").read_text().splitlines()
    answers = {fact.question: fact.answer for fact in facts}
    assert questions and set(questions) <= set(answers)
    assert any(answers[questions[0]] in m["content"] for m in messages)
    assert "examples/questions.txt" in README.read_text()


def test_readme_tour_is_runnable():
    commands = _runnable(README)
    assert len(commands) >= 10 and all(c.text.startswith("kvchat ") for c in commands), commands
    assert {"ingest", "ask", "list", "show", "logs", "doctor", "rm"} <= {c.text.split()[1] for c in commands}


# ---------------------------------------------------------------------------------------------- stale commands


def _cli():
    import typer.main

    from kvchat.cli import app

    return typer.main.get_command(app)


def _options(command) -> set[str]:
    return {"--help"} | {name for p in command.params for name in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_kvchat_commands_shown_exist(path):
    group = _cli()
    stale = []
    for command in _all_commands(path):
        words = _words(command)
        if not words or words[0] != "kvchat":
            continue
        sub = words[1] if len(words) > 1 and re.fullmatch(r"[a-z][a-z-]*", words[1]) else None
        if sub is not None and sub not in group.commands:
            stale.append(f"{command!r}: no command {sub!r}")
            continue
        known = _options(group) | (_options(group.commands[sub]) if sub else set())
        stale += [f"{command!r}: no option {o}" for o in _OPTION.findall(" ".join(words)) if o not in known]
    assert not stale, stale


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_scripts_files_targets_and_extras_shown_exist(path):
    text = path.read_text()
    makefile = (ROOT / "Makefile").read_text()
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    stale = []
    for command in _all_commands(path):
        words = _words(command)
        script = next((w for w in words if re.fullmatch(r"benchmarks/\w+\.py", w)), None)
        if script and words[0].endswith("python"):
            source = (ROOT / script).read_text() if (ROOT / script).is_file() else ""
            stale += [f"{command!r}: {script} has no {o}" for o in _OPTION.findall(command)
                      if f'"{o}"' not in source]
        if words[:1] == ["make"] and len(words) > 1 and not re.search(rf"^{words[1]}:", makefile, re.M):
            stale.append(f"{command!r}: no make target")
        if words[:2] == ["pip", "install"]:
            for wanted in re.findall(r"\[([a-z,]+)\]", command):
                stale += [f"{command!r}: no extra {e}" for e in wanted.split(",") if e not in extras]
    for name in set(re.findall(r"(?<![\w/])((?:benchmarks|tests|examples|profiles|kvchat)/[\w./{},*-]*[\w*])", text)):
        for expanded in _braces(name):
            if not (list(ROOT.glob(expanded)) if "*" in expanded else (ROOT / expanded).exists()):
                stale.append(f"no file {expanded}")
    assert not stale, stale


def _braces(name: str) -> list[str]:
    """`a_{b,c}.md` -> [`a_b.md`, `a_c.md`] (one level, as the docs write it)."""
    found = re.search(r"\{([^{}]*)\}", name)
    if not found:
        return [name]
    return [n for part in found.group(1).split(",") for n in _braces(name[: found.start()] + part + name[found.end():])]


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_python_imports_shown_exist(path):
    for block in _blocks(path):
        if block.language == "python":
            for line in block.body.splitlines():
                if re.match(r"(from|import) kvchat\b", line):
                    exec(line, {})  # the doc's own import lines: each name still importable


# ---------------------------------------------------------------------------------------------- histories, links


def test_readme_shows_an_example_of_each_history_format(tmp_path):
    assert len([b for b in _blocks(README) if b.marker == "example-history"]) >= 4
    examples = [b for path in DOCS for b in _blocks(path) if b.marker == "example-history"]  # docs/formats.md's too
    for i, block in enumerate(examples):
        path = tmp_path / str(i) / (block.argument or "history.json")
        path.parent.mkdir()
        path.write_text(block.body)
        assert len(load_history(path)) >= 2, block.body


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", _prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_links_resolve(path):
    broken = []
    for target in _LINK.findall(_prose(path)):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, broken


def test_every_doc_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _LINK.findall(README.read_text())}
    assert {p.resolve() for p in DOCS[1:]} <= linked
