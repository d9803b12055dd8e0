"""A kvchat home's layout: where the index, the caches and converted models live, what a conversation may be
called (names become directory names), and whether the home can be written at all."""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

from kvchat.errors import UserError

DB_NAME = "kvchat.db"
CACHES_DIR = "caches"
MODELS_DIR = "models"  # converted models (kvchat.model.files.convert_gguf); its dead temp dirs are leftovers
HELD_DIR = "held"  # in MODELS_DIR: int8/int4 weights kept by kvchat.model.held_weights
HELD_SUFFIX = ".safetensors"
_TORCH = ".torch-"  # in a held file's name: the torch build that packed it follows
EPISODE_SUFFIX = ".safetensors"
PAGES_SUFFIX = ".pages.safetensors"
RECALL_ENTRIES_NAME = "recall-entries.safetensors"  # a conversation's, in its ingest dir beside the episodes'

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
# Names Windows reserves for devices, with or without an extension: not portable as directory names.
_RESERVED_RE = re.compile(r"(CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])(\..*)?", re.IGNORECASE)


def is_episode_file(name: str) -> bool:
    """Whether a file name in an ingest dir is an episode's cache (`<index>.safetensors`), not a pages file, the
    recall entries file or the manifest."""
    stem = name.removesuffix(EPISODE_SUFFIX)
    return stem != name and stem.isascii() and stem.isdigit()


def show(name: str) -> str:
    """A name quoted for a one-line message, whatever it contains."""
    return repr(name if len(name) <= 40 else name[:40] + "...")


def held_name(fingerprint: str, weights: str, torch_build: str) -> str:
    """The file name of held weights (kvchat.model.held_weights): the float weights' fingerprint, the mode (int8, int4,
    or auto for its verdict) and the torch build that packed them (its version and CPU kernels, as
    `torch_build_tag` writes them)."""
    return f"{fingerprint}.{weights}{_TORCH}{torch_build_tag(torch_build)}{HELD_SUFFIX}"


def held_source(weights_file: Path) -> dict[str, str]:
    """What identifies the float weights file held weights were made from, as their metadata records it."""
    stat = weights_file.stat()
    return {"source": str(weights_file.resolve()), "source_size": str(stat.st_size),
            "source_mtime_ns": str(stat.st_mtime_ns)}  # fmt: skip


def made_from(meta: dict, source: dict[str, str]) -> bool:
    """Whether held weights whose metadata is `meta` were made from the float weights file `source` identifies
    (`held_source`) as it is now."""
    return all(meta.get(key) == value for key, value in source.items())


def held_by_any_torch(name: str) -> str:
    """A glob of the held files holding the same weights as the file `name`, packed by any torch build."""
    return f"{name.partition(_TORCH)[0]}{_TORCH}*{HELD_SUFFIX}"


def held_by_torch(name: str, torch_version: str) -> bool:
    """Whether the held weights file `name` was packed by torch `torch_version` (its CPU kernels aside)."""
    return name.partition(_TORCH)[2].startswith(torch_build_tag(torch_version) + "-")


def torch_build_tag(build: str) -> str:
    """`build` as a file name allows it: letters, digits, '.', '_' and '-' kept, anything else '_'."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in build)


def validate_name(name: str) -> str:
    """Names become directory names, so only a safe, portable subset is allowed."""
    if (not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.endswith(".")
            or _RESERVED_RE.fullmatch(name)):
        shown = show(name) if isinstance(name, str) else repr(name)
        raise UserError(
            f"invalid conversation name {shown}: use 1 to 100 letters, digits, '.', '_' or '-', "
            "starting with a letter, digit or '_', not ending with '.', and not a device name (CON, NUL, ...)"
        )
    return name


def name_from_file(path: str | os.PathLike[str]) -> str:
    """A valid conversation name made from a history file's name: its stem, accents dropped, every run of other
    characters (spaces, "(1)") one '-', cut to 100 ("WhatsApp Chat with Dana.txt": "WhatsApp-Chat-with-Dana").
    A stem with nothing usable (all emoji) gives "chat"; a device name gets a '_' ("CON_")."""
    stem = Path(path).stem
    ascii_stem = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode()
    name = re.sub(r"[^A-Za-z0-9._]+", "-", ascii_stem).strip("-.")[:100].rstrip("-.")
    if not name:
        return "chat"
    if _RESERVED_RE.fullmatch(name):
        name = name[:99] + "_"
    return validate_name(name)


def read_only_reason(home: Path) -> str | None:
    """Why `home` cannot be written (a read-only file system, no permission), or None when it can.
    A home that does not exist yet is writable if it can be created (opening says otherwise if not)."""
    existing = next((p for p in (home, *home.parents) if p.exists()), None)
    if existing is None or existing != home:
        return None
    if hasattr(os, "statvfs") and os.statvfs(home).f_flag & getattr(os, "ST_RDONLY", 1):
        return "read-only file system"
    for path in (home, home / DB_NAME, home / CACHES_DIR):
        if path.exists() and not os.access(path, os.W_OK):
            return f"no permission to write {path}"
    return None
