"""What a batch ingests: its history files and manifests, each the conversation it becomes, checked before Ray or
torch loads."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import UserError
from kvchat.messages import option
from kvchat.store.layout import name_from_file, validate_name


@dataclass(frozen=True)
class HistorySource:
    """One history of a batch and the conversation it becomes."""

    name: str
    path: Path
    format: str | None = None  # forced (`--format`), else detected
    pick: str | None = None    # the conversation of a file holding several (`--pick`)


def histories(files: Sequence[Path] = (), manifests: Sequence[Path] = (), *, format: str | None = None,
              pick: str | None = None) -> list[HistorySource]:
    """The batch's histories: each file named after its own name (`name_from_file`), then each manifest's pairs,
    every one read with `format` and `pick` when given. Names are checked and must be unique, and every file must
    exist, before anything runs (a file that does not read as a history fails alone, the others going on)."""
    found: list[HistorySource] = []
    for path in files:
        found.append(HistorySource(name_from_file(path), path))
    for manifest in manifests:
        found += read_manifest(manifest)
    if not found:
        raise UserError(f"no histories: give history files or {option('manifest', 'FILE')}")
    paths: dict[str, Path] = {}
    for source in found:
        if source.name in paths:
            raise UserError(f"two histories would be conversation {source.name!r} ({paths[source.name]} and "
                            f"{source.path}); name them in a {option('manifest')}")  # fmt: skip
        paths[source.name] = source.path
    for source in found:
        if not source.path.exists():
            raise UserError(f"{source.path}: no such file (expected a chat history file)")
    return [dataclasses.replace(source, format=format, pick=pick) for source in found]


def read_manifest(path: Path) -> list[HistorySource]:
    """`NAME PATH` per line (separated by whitespace; the path may contain spaces, and a relative one is
    relative to the manifest's directory); blank lines and lines starting with `#` are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read manifest {path}: {getattr(exc, 'strerror', None) or exc}") from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2:
            raise UserError(f"{path}:{number}: expected NAME PATH, got {line[:60]!r}")
        name, file = parts
        try:
            validate_name(name)
        except UserError as exc:
            raise UserError(f"{path}:{number}: {exc}") from None
        found.append(HistorySource(name, path.parent / Path(file).expanduser()))
    return found
