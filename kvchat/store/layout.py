"""A kvchat home's layout: where the index, the caches and converted models live, what a conversation may be
called (names become directory names), and whether the home can be written at all."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvchat.errors import UserError

DB_NAME = "kvchat.db"
CACHES_DIR = "caches"
MODELS_DIR = "models"  # converted models (kvchat.model_files.convert_gguf); its dead temp dirs are leftovers
EPISODE_SUFFIX = ".safetensors"
PAGES_SUFFIX = ".pages.safetensors"

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
# Names Windows reserves for devices, with or without an extension: not portable as directory names.
_RESERVED_RE = re.compile(r"(CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])(\..*)?", re.IGNORECASE)


def show(name: str) -> str:
    """A name quoted for a one-line message, whatever it contains."""
    return repr(name if len(name) <= 40 else name[:40] + "...")


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
