"""Resumable training: a stage's weights, optimizer state and step in one safetensors file beside the output.

Training on a CPU takes long enough to be interrupted, and a seeded run is deterministic, so a rerun with the
same settings (the `key`: config, data hash, base weights, shape, readout) continues from the last checkpoint
and ends with the same weights as an uninterrupted run. Anything else starts over.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvchat.kv.indexer import Indexer


def save_checkpoint(path: Path, key: str, stage: str, step: int, module: torch.nn.Module, optimizer,
                    indexer: Indexer) -> None:
    tensors = {f"param.{k}": _host(v) for k, v in module.state_dict().items()}
    if module is not indexer:  # the memory stage: the finished indexer rides along
        tensors |= {f"indexer.{k}": _host(v) for k, v in indexer.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"opt.{index}.{name}"] = _host(torch.as_tensor(value))
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"key": key, "stage": stage, "step": str(step)})
    tmp.replace(path)


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU, where the file is written from (the training may run on a GPU)."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def restore_checkpoint(path: Path, key: str, stage: str, module: torch.nn.Module, optimizer, indexer: Indexer,
                       steps: int) -> int:
    """The step a matching checkpoint of this stage reached (its weights and optimizer state loaded), else 0.
    A checkpoint of the memory stage means the indexer stage finished: the indexer's weights come from it."""
    if not path.is_file():
        return 0
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("key") != key:
        return 0
    tensors = load_file(str(path))
    if meta.get("stage") == "memory" and stage == "indexer":
        indexer.load_state_dict({k[8:]: v for k, v in tensors.items() if k.startswith("indexer.")})
        return steps
    if meta.get("stage") != stage:
        return 0
    module.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("param.")})
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("opt."):
            _, index, field_name = name.split(".", 2)
            state.setdefault(int(index), {})[field_name] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return int(meta["step"])
