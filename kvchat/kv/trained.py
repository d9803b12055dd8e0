"""The trained IndexMem weights file: one safetensors file per base model (never pickle) holding the indexer
(kvchat.kv.indexer) and, when trained, the latent memory's slow weights (kvchat.kv.latent), in half
precision, with where they came from: weights only fit the base weights they were distilled from, so the file
names them, and it carries its recipe and held-out figures so a user can tell what they load.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/trained.py".
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import load, save_file

from kvchat.checked_files import MAX_HEADER_BYTES, FileMismatch, check_safetensors_header, open_regular, read_bounded
from kvchat.kv.config import IndexMemConfig
from kvchat.kv.indexer import Indexer, IndexMemShape
from kvchat.kv.latent import MemoryWeights

KIND = "kvchat-indexmem"
VERSION = "1"
SUFFIX = ".indexmem.safetensors"


@dataclass
class TrainedIndexMem:
    """An indexer (and optionally memory weights) trained for one model's weights."""

    shape: IndexMemShape
    indexer: Indexer
    memory: MemoryWeights | None
    weights: str                              # the base model's weights fingerprint
    model: str = ""                           # its display name
    config: IndexMemConfig = IndexMemConfig()  # the memory's update rule
    recipe: dict = field(default_factory=dict)
    data_hash: str = ""
    metrics: dict = field(default_factory=dict)
    path: Path | None = None                  # where it was loaded from

    def tensors(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """The weights as the file holds them: on the CPU, in `dtype`."""
        modules = {"indexer": self.indexer} | ({"memory": self.memory} if self.memory is not None else {})
        return {f"{name}.{k}": v.detach().to("cpu", dtype).contiguous() for name, module in modules.items()
                for k, v in module.state_dict().items()}

    def metadata(self) -> dict[str, str]:
        return {
            "kind": KIND, "version": VERSION, "weights": self.weights, "model": self.model,
            "shape": json.dumps(self.shape.to_dict()), "config": json.dumps(self.config.stored()),
            "recipe": json.dumps(self.recipe), "data_hash": self.data_hash, "metrics": json.dumps(self.metrics),
        }

    def save(self, path: Path) -> None:
        """Write atomically (a temp file renamed into place), in half precision."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(self.tensors(), str(tmp), metadata=self.metadata())
        tmp.chmod(0o644)  # a file to ship and share, not a private one
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> TrainedIndexMem:
        """Read a file written by `save`; ValueError saying why when it is not one. The file is read once, as
        a regular file of bounded size whose header is checked before anything is allocated by it, and the
        tensors are compared with the shape its metadata claims before modules of that shape are built."""
        data = _read(path)
        meta = _metadata(path, data)
        shape = _shape(path, meta)
        try:
            config = IndexMemConfig.from_stored(_json(path, meta, "config"))
        except TypeError as exc:
            raise ValueError(f"{path}: unknown memory settings ({exc})") from None
        stored = {k: v for k, v in check_safetensors_header(data).items() if k != "__metadata__"}
        has_memory = any(name.startswith("memory.") for name in stored)
        with torch.device("meta"):  # the shapes the metadata implies, nothing allocated
            try:
                wanted = {f"indexer.{k}": v.shape for k, v in Indexer(shape).state_dict().items()}
                if has_memory:
                    shaped = MemoryWeights(shape, config.readout)
                    wanted |= {f"memory.{k}": v.shape for k, v in shaped.state_dict().items()}
            except (RuntimeError, ValueError, ZeroDivisionError) as exc:
                raise ValueError(f"{path}: impossible shape in its metadata ({exc})") from None
        found = {k: torch.Size(v["shape"]) for k, v in stored.items()}
        if found != wanted:
            wrong = sorted(set(found) ^ set(wanted)) or sorted(k for k in found if found[k] != wanted[k])
            raise ValueError(f"{path}: tensors do not match the shape in its metadata ({wrong[0]})")
        tensors = load(data)
        if not all(torch.isfinite(t).all() for t in tensors.values()):
            raise ValueError(f"{path}: holds NaN or infinite weights (a diverged training run or a damaged file)")
        indexer = Indexer(shape)
        _load(indexer, tensors, "indexer.", path)
        memory: MemoryWeights | None = None
        if has_memory:
            memory = MemoryWeights(shape, config.readout)
            _load(memory, tensors, "memory.", path)
        return cls(
            shape=shape, indexer=indexer.eval(), memory=None if memory is None else memory.eval(),
            weights=meta["weights"], model=meta.get("model", ""),
            config=config,
            recipe=_json(path, meta, "recipe"), data_hash=meta.get("data_hash", ""),
            metrics=_json(path, meta, "metrics"), path=Path(path),
        )


MAX_FILE_BYTES = 1 << 32  # an indexer is a small fraction of its model; a larger file is not one
MAX_DIM = 1 << 20  # no model dimension comes near this


def read_metadata(path: Path) -> dict[str, str]:
    """The file's metadata, read from its header alone; ValueError when it is not an IndexMem weights file.
    `shape` is checked too (`read_shape` parses it)."""
    with _reading(path, ""):
        with open_regular(path) as f:  # never a FIFO: a blocking open would hang
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            if size > MAX_FILE_BYTES or n > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("not a safetensors file (its header claims more than the file holds)")
            header = f.read(n)
    try:
        meta = json.loads(header).get("__metadata__") or {}
    except (ValueError, AttributeError, RecursionError):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)") from None
    if not isinstance(meta, dict) or meta.get("kind") != KIND or meta.get("version") != VERSION \
            or not isinstance(meta.get("weights"), str) or "shape" not in meta:
        raise ValueError(f"{path}: not a kvchat IndexMem weights file (version {VERSION})")
    _shape(path, meta)
    return meta


def read_shape(meta: dict[str, str]) -> dict[str, int]:
    """The shape in metadata `read_metadata` returned (and checked), as a dict."""
    return json.loads(meta["shape"])


def _shape(path: Path, meta: dict[str, str]) -> IndexMemShape:
    """The shape in the metadata: a JSON object with exactly `IndexMemShape`'s fields, each 1..MAX_DIM."""
    shape = _json(path, meta, "shape")
    names = {f.name for f in fields(IndexMemShape)}
    if set(shape) != names:
        raise ValueError(f"{path}: its shape metadata names {sorted(set(shape) ^ names)[0]!r} wrongly")
    bad = [k for k, v in shape.items() if not (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_DIM)]
    if bad or shape["q_heads"] % shape["kv_heads"]:
        raise ValueError(f"{path}: impossible shape in its metadata ({(bad or ['q_heads'])[0]})")
    return IndexMemShape(**shape)


def _json(path: Path, meta: dict[str, str], key: str) -> dict:
    """Metadata entry `key` parsed as a JSON object ({} when absent); ValueError when it is not one."""
    try:
        value = json.loads(meta.get(key, "{}"))
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: its {key} metadata is not a JSON object")
    return value


def _read(path: Path) -> bytes:
    with _reading(path, "not a safetensors file: "):
        data = read_bounded(Path(path), MAX_FILE_BYTES)
        check_safetensors_header(data)
    return data


@contextmanager
def _reading(path: Path, invalid: str) -> Iterator[None]:
    """Reading `path`: every failure a ValueError naming it (`invalid` prefixes what a bad header says)."""
    try:
        yield
    except FileMismatch as exc:
        raise ValueError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {invalid}{exc}") from None


def _metadata(path: Path, data: bytes) -> dict[str, str]:
    meta = check_safetensors_header(data).get("__metadata__", {})
    if meta.get("kind") != KIND or meta.get("version") != VERSION or not isinstance(meta.get("weights"), str):
        raise ValueError(f"{path}: not a kvchat IndexMem weights file (version {VERSION})")
    return meta


def _load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str, path: Path) -> None:
    own = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    try:
        module.load_state_dict(own, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ValueError(f"{path}: tensors do not match the shape in its metadata ({first})") from None
