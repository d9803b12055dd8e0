"""The trained IndexMem weights file: one safetensors file per base model (never pickle) holding the indexer
(kvchat.kv.indexer) and, when trained, the latent memory's slow weights (kvchat.kv.latent), in half
precision, with where they came from: weights only fit the base weights they were distilled from, so the file
names them, and it carries its recipe and held-out figures so a user can tell what they load.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/trained.py".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

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
        out = {f"indexer.{k}": v.detach().to(dtype).contiguous() for k, v in self.indexer.state_dict().items()}
        if self.memory is not None:
            out |= {f"memory.{k}": v.detach().to(dtype).contiguous() for k, v in self.memory.state_dict().items()}
        return out

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
        """Read a file written by `save`; ValueError saying why when it is not one."""
        meta = read_metadata(path)
        shape = IndexMemShape(**json.loads(meta["shape"]))
        try:
            config = IndexMemConfig.from_stored(json.loads(meta.get("config", "{}")))
        except TypeError as exc:
            raise ValueError(f"{path}: unknown memory settings ({exc})") from None
        tensors = load_file(str(path))
        indexer = Indexer(shape)
        _load(indexer, tensors, "indexer.", path)
        memory = None
        if any(name.startswith("memory.") for name in tensors):
            memory = MemoryWeights(shape, config.readout)
            _load(memory, tensors, "memory.", path)
        return cls(
            shape=shape, indexer=indexer.eval(), memory=None if memory is None else memory.eval(),
            weights=meta["weights"], model=meta.get("model", ""),
            config=config,
            recipe=json.loads(meta.get("recipe", "{}")), data_hash=meta.get("data_hash", ""),
            metrics=json.loads(meta.get("metrics", "{}")), path=Path(path),
        )


def read_metadata(path: Path) -> dict[str, str]:
    """The file's metadata, read from its header alone; ValueError when it is not an IndexMem weights file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"{path}: not a safetensors file ({exc})") from None
    if meta.get("kind") != KIND or meta.get("version") != VERSION or "weights" not in meta or "shape" not in meta:
        raise ValueError(f"{path}: not a kvchat IndexMem weights file (version {VERSION})")
    return meta


def _load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str, path: Path) -> None:
    own = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    try:
        module.load_state_dict(own, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ValueError(f"{path}: tensors do not match the shape in its metadata ({first})") from None
