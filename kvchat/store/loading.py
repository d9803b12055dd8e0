"""A conversation's files read back (an episode's cache and pages file, the recall entries file): only the
bytes that were committed, by the model that reads them.

Every check happens before the codec decodes anything: the path lies inside the store, the file exists, is a
regular file (a FIFO would block the read forever) and has the recorded size, its sha256 matches, the
safetensors header is sane (before any tensor is allocated), the format version is one the codec reads, and
the model fingerprint is the current model's. What fails is refused with what is wrong (`refuse` words it,
with the command that rebuilds the conversation).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from kvchat.checked_files import read_safetensors_header
from kvchat.errors import UserError
from kvchat.messages import setting
from kvchat.store.files import FileMismatch, check_safetensors_header, read_verified, verify_file
from kvchat.store.layout import show
from kvchat.store.records import EpisodeRecord, FileRecord

if TYPE_CHECKING:
    import torch

    from kvchat.kv.tensorfile import FileRows

Refuse = Callable[[str], UserError]  # the error for what is wrong with a file (a CacheIntegrityError)


def load_episode(
    record: EpisodeRecord, fingerprint: str, *, caches_dir: Path, refuse: Refuse
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One episode's tensors and metadata. The bytes are read once, so the file that was checked is the file
    that is loaded."""
    name = record.path.parent.parent.name
    try:
        data = read_verified(record.path, record.bytes, record.sha256, within=caches_dir)
    except FileMismatch as e:
        raise refuse(str(e)) from None
    except OSError as e:  # no permission, an I/O error: the environment's, not the file's content
        raise UserError(
            f"cannot read the cache of conversation {show(name)} episode {record.index} ({record.path}): "
            f"{e.strerror or e}"
        ) from None
    try:
        header = check_safetensors_header(data)
    except ValueError as e:
        raise refuse(f"is not a valid safetensors file: {e}") from None
    metadata: dict[str, str] = header.get("__metadata__", {})
    # torch only now that a cache is really read: `kvchat list`, `show` and `doctor` never load it.
    import safetensors.torch

    from kvchat.kv.codec import READABLE_FORMAT_VERSIONS  # stamped by the store, checked here

    if metadata.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise refuse(f"has unsupported format version {metadata.get('format_version')!r}")
    check_fingerprint(metadata, fingerprint, refuse)
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # the header passed our checks, so this is unexpected
        raise refuse(f"could not be decoded: {e}") from None
    return tensors, dict(metadata)


def load_pages(
    record: EpisodeRecord, fingerprint: str, *, caches_dir: Path, refuse: Refuse
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An episode's pages file (kvchat.kv.pagefile) as `FileRows` (kvchat.kv.tensorfile) and its metadata
    (`open_side_file`)."""
    if record.pages is None:
        raise refuse(f"does not exist: the conversation was ingested without {setting('offload')}")
    tensors, metadata = open_side_file(record.pages, fingerprint, caches_dir=caches_dir, refuse=refuse,
                                       what="pages file")  # fmt: skip
    # FileRows stand in for the pages' tensors (torch functions read them whole through __torch_function__)
    return cast("dict[str, torch.Tensor]", tensors), metadata


def open_side_file(
    file: FileRecord, fingerprint: str, *, caches_dir: Path, refuse: Refuse, what: str
) -> tuple[dict[str, FileRows], dict[str, str]]:
    """A file beside the episode caches (a pages file, a recall entries file: `what`) as `FileRows`
    (kvchat.kv.tensorfile) and its metadata.

    The same checks as `load_episode`, the file hashed in chunks rather than read into memory; then the
    header is checked and the tensors are opened, not read: they are read from disk only where they are
    gathered, with reads that raise `ShrunkFile` if the file was truncated since.
    """
    try:
        verify_file(file.path, file.bytes, file.sha256, within=caches_dir)
        header = read_safetensors_header(file.path)
    except FileMismatch as e:
        raise refuse(str(e)) from None
    except ValueError as e:  # a bad header
        raise refuse(f"is not a valid safetensors file: {e}") from None
    except OSError as e:  # no permission, an I/O error: the environment's, not the file's content
        raise UserError(f"cannot read the {what} {file.path}: {e.strerror or e}") from None
    metadata: dict[str, str] = header.get("__metadata__", {})
    check_fingerprint(metadata, fingerprint, refuse)
    try:
        from kvchat.kv.tensorfile import open_tensors  # torch, only when the file is read

        return open_tensors(file.path, header)
    except ValueError as e:  # the header passed our checks, so this is unexpected
        raise refuse(f"could not be opened: {e}") from None


def is_legacy_fingerprint(fingerprint: str) -> bool:
    """A model fingerprint of a kvchat before dtype and device left it (`name|w=...|torch.float32|...`): its
    weights hash cannot be compared with today's (kvchat.model.llm.model_fingerprint), so its caches are rebuilt."""
    return "|torch." in fingerprint


def check_fingerprint(metadata: dict[str, str], fingerprint: str, refuse: Refuse) -> None:
    stored = str(metadata.get("fingerprint"))
    if is_legacy_fingerprint(stored) and stored != fingerprint:
        raise refuse("carries a model fingerprint of an older kvchat (one that included the dtype)")
    if stored != fingerprint:
        raise refuse(
            f"was built by a different model (cache {str(metadata.get('fingerprint'))[:24]!r}, "
            f"current {fingerprint[:24]!r})"
        )
