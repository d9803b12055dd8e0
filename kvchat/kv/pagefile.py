"""The pages file: an episode's offloaded entries, grouped into pages, as a second safetensors file.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/pagefile.py".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import cast

import torch

from kvchat.kv.pages import HeadPages
from kvchat.kv.tensorfile import FileRows, SafetensorsWriter, open_tensors

PAGES_FORMAT = "1"  # keys rotated for their original positions
COMPACT_PAGES_FORMAT = "2"  # keys rotated for positions beside a compacted cache's (`at.{l}`, metadata positions)
READABLE_PAGES_FORMATS = (PAGES_FORMAT, COMPACT_PAGES_FORMAT)
LayerPages = Sequence[HeadPages]  # one per KV head


def layer_tensors(index: int, layer: LayerPages, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The six tensors of layer `index` (see the module docstring), and `at.{index}` where the keys are rotated
    for other positions than the original ones."""
    placed = any(h.at is not None for h in layer)
    return ({f"at.{index}": torch.cat([h.rotated_for for h in layer]).to(torch.int32)} if placed else {}) | {
        f"k.{index}": torch.cat([h.keys for h in layer]).to(dtype),
        f"v.{index}": torch.cat([h.values for h in layer]).to(dtype),
        f"pos.{index}": torch.cat([h.positions for h in layer]).to(torch.int32),
        f"page_len.{index}": torch.cat([h.lengths for h in layer]).to(torch.int32),
        f"head_pages.{index}": torch.tensor([h.num_pages for h in layer], dtype=torch.int32),
        f"centroid.{index}": torch.cat([h.centroids for h in layer]).to(dtype),
    }


def pages_metadata(layers: int, kv_heads: int, head_dim: int, page_size: int, positions: str = "original"
                   ) -> dict[str, str]:  # fmt: skip
    """`positions`: "original" (keys rotated for `pos`, format "1") or "compact" (for `at`, format "2")."""
    compact = {"pages_format": COMPACT_PAGES_FORMAT, "positions": "compact"} if positions == "compact" else {}
    return {
        "pages_format": PAGES_FORMAT, "layers": str(layers), "kv_heads": str(kv_heads),
        "head_dim": str(head_dim), "page_size": str(page_size),
    } | compact


def encode(
    layers: Sequence[LayerPages], *, page_size: int, dtype: torch.dtype = torch.float16
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a pages file for `layers` (one `HeadPages` per KV head each)."""
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        tensors.update(layer_tensors(i, layer, dtype))
    first = layers[0]
    return tensors, pages_metadata(len(layers), len(first), first[0].keys.shape[-1], page_size)


def write_layers(
    path: Path,
    layers: Iterable[LayerPages],
    metadata: Mapping[str, str],
    *,
    dtype: torch.dtype = torch.float16,
) -> tuple[int, str]:
    """Stream `layers` (an iterable, e.g. a generator building one layer at a time) into a pages file at
    `path`; fsynced. Returns (bytes, sha256 hex). On any error nothing is left at `path`."""
    writer = SafetensorsWriter(path)
    try:
        for i, layer in enumerate(layers):
            for name, tensor in layer_tensors(i, layer, dtype).items():
                writer.add(name, tensor)
        return writer.finish(metadata)
    except BaseException:
        writer.discard()
        raise


def decode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> list[list[HeadPages]]:
    """The inverse of `encode`. Page tables and centroids are copied into memory; keys, values and positions
    stay views of `tensors` (`FileRows` stay on disk). Raises ValueError when they disagree."""
    layout = metadata.get("pages_format")
    if layout not in READABLE_PAGES_FORMATS:
        raise ValueError(f"unsupported pages format {layout!r}")
    try:
        num_layers, kv_heads, head_dim = (int(metadata[k]) for k in ("layers", "kv_heads", "head_dim"))
    except (KeyError, ValueError):
        raise ValueError("pages metadata lacks layers, kv_heads or head_dim") from None
    placed = layout == COMPACT_PAGES_FORMAT
    return [_decode_layer(tensors, i, kv_heads, head_dim, placed) for i in range(num_layers)]


def _decode_layer(
    tensors: Mapping[str, torch.Tensor], i: int, kv_heads: int, head_dim: int, placed: bool
) -> list[HeadPages]:
    try:
        keys, values, positions, page_len, head_pages, centroids = (
            tensors[f"{name}.{i}"] for name in ("k", "v", "pos", "page_len", "head_pages", "centroid")
        )
        at = tensors[f"at.{i}"] if placed else None
    except KeyError as e:
        raise ValueError(f"pages file lacks tensor {e.args[0]!r}") from None
    page_len, head_pages, centroids = (_in_memory(t) for t in (page_len, head_pages, centroids))
    lengths = page_len.to(torch.long)
    per_head = head_pages.to(torch.long)
    n, pages = keys.shape[0], lengths.shape[0]
    if (
        keys.shape != (n, head_dim) or values.shape != keys.shape or positions.shape != (n,)
        or (at is not None and at.shape != (n,))
        or centroids.shape != (pages, head_dim) or per_head.shape != (kv_heads,)
        or bool((per_head < 0).any()) or int(per_head.sum()) != pages
        or bool((lengths < 1).any()) or int(lengths.sum()) != n
    ):
        raise ValueError(f"layer {i}: page table does not match its tensors")
    out, page, row = [], 0, 0
    for count in per_head.tolist():
        rows = int(lengths[page : page + count].sum())
        out.append(
            HeadPages(
                keys[row : row + rows], values[row : row + rows], positions[row : row + rows],
                lengths[page : page + count].clone(), centroids[page : page + count].clone(),
                None if at is None else at[row : row + rows],
            )
        )
        page, row = page + count, row + rows
    return out


def _in_memory(tensor: torch.Tensor | FileRows) -> torch.Tensor:
    return tensor.read() if isinstance(tensor, FileRows) else tensor


def open_pages(path: Path) -> list[list[HeadPages]]:
    """A pages file opened for answering: per layer, per KV head, its `HeadPages` whose keys, values and
    positions are read from disk (`FileRows`) only where retrieval gathers them."""
    tensors, metadata = open_tensors(path)
    # FileRows stand in for tensors (torch functions read them whole through __torch_function__; HeadPages)
    return decode(cast("dict[str, torch.Tensor]", tensors), metadata)
