"""A model's int8/int4 Linear weights kept beside the converted models (`$KVCHAT_HOME/models/held/`), so that
a process answering with `--weights auto|int8|int4` reads them instead of quantizing again.

Quantizing the embedded model (finding that its decoder holds 4-bit groups, packing its matrices, an int8 lm_head)
delays a one-shot `kvchat ask`'s first answer token; reading the packed tensors back costs far less
(benchmarks/results/cold_start.md). A file is named by the float weights' fingerprint, the mode, torch's version and
the CPU kernels it runs (the int4 packing is their layout), and says which file of float weights it was made from
(path, size, modification time): a model file changed in place is quantized again. `auto`'s verdict is kept too, so
a model whose weights are not 4-bit groups is not searched again. A file that cannot be read, or that does not fit
the model, is ignored and written again; one that cannot be written (a read-only home, a disk with less than
`SPARE_BYTES` left beside it) is skipped: it only saves time. Written under a temp dir in `models/` and renamed into
place, so a crash leaves what `kvchat doctor` already finds there.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import nn

from kvchat.model import int4_weights, int8_weights
from kvchat.model.int4_weights import Int4Linear
from kvchat.model.int8_weights import Int8Linear
from kvchat.store.files import fsync_dir, new_temp_path, rename, write_file
from kvchat.store.layout import HELD_DIR, held_by_any_torch, held_name, held_source, made_from

FORMAT = "1"
SPARE_BYTES = 1 << 30  # kept only where at least this much (and the file's size again) stays free after it
_KINDS: dict[str, type[Int4Linear] | type[Int8Linear]] = {"int4": Int4Linear, "int8": Int8Linear}
_BUFFERS = {"int4": ("weight", "scale_zero"), "int8": ("weight", "scale")}  # the codes and their scales; a bias besides
QUANTIZERS = {"int8": int8_weights.quantize_linears, "int4": int4_weights.quantize_linears}
_log = logging.getLogger(__name__)


def hold(model: nn.Module, weights: str, fingerprint: str, models_dir: Path | None = None,
         source: Path | None = None) -> str:  # fmt: skip
    """Hold `model`'s Linear weights as `weights` (`auto`: int4 where the decoder already holds 4-bit groups, else
    float; `int8`; `int4`) and return what they are then (float, int8 or int4). With `models_dir` and the float
    weights file `source`, what was kept there for that file is read instead of computed, and what is computed is
    kept there."""
    keeping = models_dir if source is not None else None  # where what is held is kept, if anywhere
    identity = held_source(source) if source is not None and keeping is not None else {}
    if weights == "auto":  # the verdict alone is kept: a file without tensors
        path = path_for(keeping, fingerprint, "auto") if keeping is not None else None
        verdict = restore(model, path, identity) if path else None
        if verdict is None:
            verdict = "int4" if int4_weights.holds_4_bit_groups(model) else "float"
            if path:
                keep(model, path, identity, verdict)
        weights = verdict
    if weights == "float":
        return weights
    path = path_for(keeping, fingerprint, weights) if keeping is not None else None
    if path is None or restore(model, path, identity) != weights:
        QUANTIZERS[weights](model)
        if path:
            keep(model, path, identity, weights)
    return weights


def path_for(models_dir: Path, fingerprint: str, weights: str) -> Path:
    """Where the `weights` form of the model with this float weights' fingerprint is kept: by torch's version and
    the CPU kernels it runs (the int4 packing is theirs)."""
    build = f"{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}"
    return models_dir / HELD_DIR / held_name(fingerprint, weights, build)


def restore(model: nn.Module, path: Path, source: dict[str, str]) -> str | None:
    """Put the quantized Linears kept at `path` into `model`; the weights they hold ("float" for an `auto` verdict
    of float), or None when there is no file made from `source` that fits `model` (then `model` is unchanged)."""
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or not made_from(meta, source):
                return None
            # copies: the tensors safe_open hands out are views of its mapping of the file, gone when it closes
            modules = _modules(model, json.loads(meta["modules"]), {k: f.get_tensor(k).clone() for k in f.keys()})
            weights = meta["weights"]
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as exc:
        _log.debug("held weights %s not used: %s", path, exc)
        return None
    for name, module in modules.items():
        model.set_submodule(name, module)
    _log.debug("%s weights read from %s", weights, path)
    return weights


def keep(model: nn.Module, path: Path, source: dict[str, str], weights: str) -> None:
    """Write `model`'s quantized Linears (none for `weights="float"`) to `path`; skipped where it cannot be."""
    tensors, listed = {}, []
    for name, module in model.named_modules():
        kind = next((k for k, cls in _KINDS.items() if type(module) is cls), None)
        if kind is None:
            continue
        listed.append([name, kind, module.in_features, module.out_features])
        for buffer, tensor in module.named_buffers(recurse=False):
            tensors[f"{name}.{buffer}"] = tensor.contiguous()
    meta = {"format": FORMAT, "weights": weights, "modules": json.dumps(listed), **source}
    data = save(tensors, metadata=meta)
    temp = new_temp_path(path.parent.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < 2 * len(data) + SPARE_BYTES:  # a cache must not fill a disk
            _log.debug("held weights not kept at %s: the disk is nearly full", path)
            return
        temp.mkdir()
        write_file(temp / path.name, data)
        rename(temp / path.name, path)
        fsync_dir(path.parent)
        for stale in path.parent.glob(held_by_any_torch(path.name)):
            if stale != path:  # the same weights packed by another torch: not read again by this one
                stale.unlink(missing_ok=True)
    except OSError as exc:
        _log.debug("held weights not kept at %s: %s", path, exc)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _modules(model: nn.Module, listed: list, tensors: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
    """The quantized modules `listed` describes, built from `tensors`; ValueError or KeyError where they do not
    fit `model` (a Linear of those features, every buffer there with its shape and dtype, no tensor left over)."""
    built: dict[str, nn.Module] = {}
    for name, kind, in_features, out_features in listed:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear) or linear.weight.shape != (out_features, in_features):
            raise ValueError(f"{name} is not a Linear of {in_features} x {out_features}")
        codes, scales = (tensors.pop(f"{name}.{b}") for b in _BUFFERS[kind])
        bias = tensors.pop(f"{name}.bias") if linear.bias is not None else None
        built[name] = _KINDS[kind](in_features, out_features, codes, scales, bias)
    if tensors:
        raise ValueError(f"tensors of no module: {sorted(tensors)[:3]}")
    return built
