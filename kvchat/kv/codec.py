"""The episode file format, in one place: the tensors and metadata an episode cache is stored as.

One safetensors file per episode (never pickle): per-layer keys, values and positions, the 8- and 4-bit
codes with their scales, an optional latent memory, each entry's original position where compaction moved it
(`orig.{l}`), and `EpisodeMeta` as string metadata. Keeping every
tensor name and format version here means a new layer type changes one module. kvchat writes the oldest
format version that describes a file, so older kvchat keeps reading what it can; the store stamps and
checks it before anything is decoded. The tensors, shapes and versions "1" to "7" are described in
ARCHITECTURE.md, "The episode file format".

Importing this module loads torch only (the cache classes load transformers, which takes seconds), so
the store and `kvchat list` can use the format versions without it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvchat.kv.quantize import PRECISION_BITS, SCALE_DTYPES, QuantizedEntries

if TYPE_CHECKING:
    from kvchat.kv.cache import EpisodeCache
    from kvchat.kv.latent import LatentMemory
    from kvchat.kv.layers import CacheLayer, QuantizedLayer, RaggedLayer, UniformLayer

FORMAT_VERSION = "4"  # written for full-precision and 8-bit caches
INT4_FORMAT_VERSION = "5"  # written for 4-bit caches
MASS_MEMORY_FORMAT_VERSION = "6"  # written for caches whose latent memory has the mass readout
ORIGINS_FORMAT_VERSION = "7"  # written for compacted caches that keep their entries' original positions
READABLE_FORMAT_VERSIONS = ("1", "2", "3", "4", "5", "6", "7")


def format_version(metadata: dict[str, str]) -> str:
    """The version a file of this metadata is stamped with (the store stamps it): the oldest that reads it."""
    if "next_origin" in metadata:
        return ORIGINS_FORMAT_VERSION
    if "memory" in metadata and json.loads(metadata["memory"])["config"].get("readout", "additive") == "mass":
        return MASS_MEMORY_FORMAT_VERSION
    return INT4_FORMAT_VERSION if metadata.get("precision") == "int4" else FORMAT_VERSION


@dataclass(frozen=True)
class EpisodeMeta:
    """What an episode file says about its cache, besides the tensors."""

    fingerprint: str            # the model that built it (kvchat.model.llm.model_fingerprint)
    method: str                 # the eviction method (kvchat.kv.methods)
    positions: str              # original | compact (keys re-rotated to 0..n-1)
    next_position: int          # logical position of the next token fed after the history
    protected: int              # leading entries of every head (the system prompt) never evicted
    budgets: tuple[int, ...] = ()  # per layer, kept entries per KV head (ragged: the mean, rounded up)
    precision: str = "full"     # full | int8 (8-bit layers; format "4") | int4 (4-bit layers; format "5")
    next_origin: int | None = None  # with `orig.{l}` tensors (format "7"): the next token's original position

    def to_metadata(self) -> dict[str, str]:
        origin = {} if self.next_origin is None else {"next_origin": str(self.next_origin)}
        return origin | {
            "precision": self.precision,
            "fingerprint": self.fingerprint,
            "method": self.method,
            "positions": self.positions,
            "next_position": str(self.next_position),
            "protected": str(self.protected),
            "budgets": ",".join(map(str, self.budgets)),
        }

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> EpisodeMeta:
        """Parse file metadata; raises ValueError naming what is missing or malformed."""
        try:
            budgets = metadata.get("budgets", "")
            return cls(
                fingerprint=metadata["fingerprint"],
                method=metadata.get("method", "epicache"),
                positions=metadata.get("positions", "original"),
                next_position=int(metadata["next_position"]),
                protected=int(metadata.get("protected", "0")),
                budgets=tuple(int(b) for b in budgets.split(",")) if budgets else (),
                precision=metadata.get("precision", "full"),
                next_origin=int(metadata["next_origin"]) if "next_origin" in metadata else None,
            )
        except KeyError as e:
            raise ValueError(f"episode metadata has no {e.args[0]!r}") from None
        except ValueError as e:
            raise ValueError(f"episode metadata is malformed: {e}") from None


def meta_of(cache: EpisodeCache, *, fingerprint: str, method: str, positions: str) -> EpisodeMeta:
    """The metadata of a freshly built cache."""
    return EpisodeMeta(
        fingerprint, method, positions, cache.next_position, cache.protected, tuple(cache.sizes), cache.precision,
        next_origin=None if cache.origins is None else cache.next_origin,
    )


def encode(cache: EpisodeCache, meta: EpisodeMeta) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of an episode file (the store adds `format_version`)."""
    tensors, metadata = encode_layers(cache), meta.to_metadata()
    if cache.origins is not None:
        tensors |= {f"orig.{i}": torch.cat(heads).to(torch.int32) for i, heads in enumerate(cache.origins)}
    if cache.memory is not None:
        memory_tensors, metadata["memory"] = _encode_memory(cache.memory)
        tensors |= memory_tensors
    return tensors, metadata


def decode(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    origins: bool = False,
) -> tuple[EpisodeCache, EpisodeMeta]:
    """The cache an episode file holds, its keys and values converted to `dtype` and everything moved to
    `device` (None: as stored, on the CPU): a cache built on a GPU in bfloat16 answers on a CPU in float32 and
    the other way round (the fingerprint leaves dtype and device out, kvchat.model.llm). With `origins`, a file that
    keeps its entries' original positions gives them back as tracked origins (`EpisodeCache.track_origins`: to
    continue it); answering needs none (`stored_origins` reads them without tracking them). Raises ValueError
    when the tensors or metadata do not describe one."""
    meta = EpisodeMeta.from_metadata(metadata)
    layers = {k: _placed(v, k, dtype, device) for k, v in tensors.items() if not k.startswith(("mem.", "orig."))}
    cache = decode_layers(
        layers, next_position=meta.next_position, protected=meta.protected, bits=PRECISION_BITS.get(meta.precision, 8)
    )
    if cache.precision != meta.precision:
        raise ValueError(f"metadata says {meta.precision} precision, the layers are {cache.precision}")
    if origins and meta.next_origin is not None:
        cache.origins = _decode_origins(tensors, cache, device)
        cache.next_origin = meta.next_origin
    if "memory" in metadata:
        cache.memory = _decode_memory(tensors, metadata["memory"], len(cache.layers))
        if device is not None:
            cache.memory.to(device)
    return cache, meta


def stored_origins(tensors: dict[str, torch.Tensor], meta: EpisodeMeta, cache: EpisodeCache
                   ) -> list[list[torch.Tensor]] | None:  # fmt: skip
    """Per layer and KV head of `cache` (decoded from `tensors`), each entry's original position on the CPU, where
    the file keeps them (format "7"), else None; the cache does not track them (`EpisodeCache.track_origins` would
    grow them at every answer token), so a receipt maps entries to turns at no cost to an answer without one."""
    return None if meta.next_origin is None else _decode_origins(tensors, cache, None)


def _decode_origins(tensors: dict[str, torch.Tensor], cache: EpisodeCache, device: torch.device | str | None
                    ) -> list[list[torch.Tensor]]:  # fmt: skip
    out = []
    for i, layer in enumerate(cache.layers):
        stored = tensors.get(f"orig.{i}")
        if stored is None or stored.dim() != 1 or stored.shape[0] != sum(layer.lengths):
            raise ValueError(f"layer {i}: original positions do not match its {sum(layer.lengths)} entries")
        stored = stored.to(torch.long) if device is None else stored.to(device, torch.long)
        out.append(list(stored.split(layer.lengths)))
    return out


def _placed(tensor: torch.Tensor, name: str, dtype: torch.dtype | None, device: torch.device | str | None
            ) -> torch.Tensor:  # fmt: skip
    """Keys and values in `dtype` (positions and lengths keep theirs), on `device`."""
    if dtype is not None and name.startswith(("k.", "v.")):
        tensor = tensor.to(dtype)
    return tensor if device is None else tensor.to(device)


def _encode_memory(memory: LatentMemory) -> tuple[dict[str, torch.Tensor], str]:
    out: dict[str, torch.Tensor] = {}
    for i in range(memory.shape.layers):
        phi, gate = memory.weights.phi_of(i), memory.weights.gate_of(i)
        out |= {
            f"mem.m.{i}": memory.m[i].float().contiguous(), f"mem.b.{i}": memory.b[i].float().contiguous(),
            f"mem.phi.{i}": phi.weight.detach().float().contiguous(),
            f"mem.gate_w.{i}": gate.weight.detach().float().contiguous(),
            f"mem.gate_b.{i}": gate.bias.detach().float().contiguous(),
        }
    if memory.weights.readout == "mass":
        out["mem.log_scale"] = memory.weights.log_scale.detach().float().contiguous()
        out["mem.decay_rate"] = memory.weights.decay_rate.detach().float().contiguous()
        out["mem.ref"] = memory.ref.float().contiguous()
    config = dataclasses.replace(memory.config, readout=memory.weights.readout)  # what the weights read as
    described = {"shape": dataclasses.asdict(memory.shape), "config": config.stored()}
    return out, json.dumps(described)


def _decode_memory(tensors: dict[str, torch.Tensor], described: str, layers: int) -> LatentMemory:
    from kvchat.kv.config import IndexMemConfig
    from kvchat.kv.indexer import IndexMemShape
    from kvchat.kv.latent import LatentMemory, MemoryWeights

    try:
        info = json.loads(described)
        shape, config = IndexMemShape(**info["shape"]), IndexMemConfig.from_stored(info["config"])
        if shape.layers != layers:
            raise ValueError(f"a memory of {shape.layers} layers for a cache of {layers}")
        weights = MemoryWeights(shape, config.readout)
        ref = None
        if config.readout == "mass":
            weights.log_scale.data.copy_(tensors["mem.log_scale"])
            weights.decay_rate.data.copy_(tensors["mem.decay_rate"])
            ref = tensors["mem.ref"].float()
            if ref.shape != (layers,):
                raise ValueError(f"memory reference positions of shape {list(ref.shape)}")
        for i in range(layers):
            weights.phi_of(i).weight.data.copy_(tensors[f"mem.phi.{i}"])
            weights.gate_of(i).weight.data.copy_(tensors[f"mem.gate_w.{i}"])
            weights.gate_of(i).bias.data.copy_(tensors[f"mem.gate_b.{i}"])
        m = [tensors[f"mem.m.{i}"].float() for i in range(layers)]
        b = [tensors[f"mem.b.{i}"].float() for i in range(layers)]
        for i in range(layers):
            if m[i].shape != (shape.kv_heads, shape.memory_dim, shape.head_dim) or b[i].shape != m[i].shape[:2]:
                raise ValueError(f"layer {i}: memory state of shapes {list(m[i].shape)}, {list(b[i].shape)}")
    except KeyError as e:
        raise ValueError(f"latent memory is incomplete: no {e.args[0]}") from None
    except (TypeError, RuntimeError, json.JSONDecodeError) as e:
        raise ValueError(f"latent memory is malformed: {e}") from None
    return LatentMemory(weights, config, m, b, ref)


def encode_layers(cache: EpisodeCache) -> dict[str, torch.Tensor]:
    """Every layer's tensors, named as the module docstring says."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        out.update(_encode_layer(layer, i))
    return out


def decode_layers(
    tensors: dict[str, torch.Tensor], *, next_position: int, protected: int, bits: int = 8
) -> EpisodeCache:
    """The inverse of `encode_layers`; a layer with a `len.{l}` tensor is ragged, one with `qlen.{l}` quantized
    in `bits` (the metadata's `precision`). Raises ValueError when the tensors do not describe a cache."""
    num_layers = sum(1 for name in tensors if name.startswith("k."))
    if any(f"{n}.{i}" not in tensors for i in range(num_layers) for n in ("k", "v", "pos")):
        raise ValueError(f"cache tensors are incomplete: {sorted(tensors)}")
    from kvchat.kv.cache import EpisodeCache  # transformers, only when a cache is built (module docstring)

    layers = [_decode_layer(tensors, i, bits) for i in range(num_layers)]
    return EpisodeCache.of_layers(layers, next_position=next_position, protected=protected)


def _encode_layer(layer: CacheLayer, i: int) -> dict[str, torch.Tensor]:
    from kvchat.kv.layers import QuantizedLayer, RaggedLayer, UniformLayer

    if isinstance(layer, QuantizedLayer):
        return _encode_quantized(layer, i)
    if isinstance(layer, RaggedLayer):
        return {
            f"k.{i}": torch.cat([k[0, 0] for k in layer.keys]),
            f"v.{i}": torch.cat([v[0, 0] for v in layer.values]),
            f"pos.{i}": torch.cat(layer.positions).to(torch.int32),
            f"len.{i}": torch.tensor(layer.lengths, dtype=torch.int32),
        }
    if not isinstance(layer, UniformLayer):
        raise TypeError(f"no file format for a {type(layer).__name__}")
    return {
        f"k.{i}": layer.keys[0].contiguous(),
        f"v.{i}": layer.values[0].contiguous(),
        f"pos.{i}": layer.positions.to(torch.int32).contiguous(),
    }


_QUANTIZED = ("kq", "ks", "kz", "vq", "vs", "vz")  # QuantizedEntries' tensors, in its field order


def _encode_quantized(layer: QuantizedLayer, i: int) -> dict[str, torch.Tensor]:
    residual = _encode_layer(layer.residual, i)
    entries, positions = layer.body, layer.positions
    if isinstance(entries, QuantizedEntries):  # uniform: one body for every head
        if not isinstance(positions, torch.Tensor):  # never: a uniform body has a uniform residual
            raise TypeError("a uniform quantized layer with a ragged residual")
        body = list(entries.tensors())
        residual[f"pos.{i}"] = positions.to(torch.int32).contiguous()
    else:
        body = [torch.cat(parts) for parts in zip(*(b.tensors() for b in entries), strict=True)]
        residual[f"pos.{i}"] = torch.cat(tuple(positions)).to(torch.int32)
        residual[f"len.{i}"] = torch.tensor(layer.lengths, dtype=torch.int32)
    return residual | {f"qlen.{i}": torch.tensor(layer.quantized, dtype=torch.int32)} | {
        f"{name}.{i}": t.contiguous() for name, t in zip(_QUANTIZED, body, strict=True)
    }  # fmt: skip


def _decode_layer(tensors: dict[str, torch.Tensor], i: int, bits: int) -> CacheLayer:
    keys, values, positions = (tensors[f"{n}.{i}"] for n in ("k", "v", "pos"))
    lengths = tensors.get(f"len.{i}")
    if f"qlen.{i}" in tensors:
        return _decode_quantized(tensors, i, keys, values, positions, lengths, bits)
    return _full_layer(i, keys, values, positions.to(torch.long), lengths)


def _full_layer(
    i: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None
) -> UniformLayer | RaggedLayer:
    """A uniform layer (`lengths` None) or a ragged one from its tensors as stored."""
    from kvchat.kv.layers import RaggedLayer, UniformLayer

    if lengths is None:
        if keys.dim() != 3 or values.shape != keys.shape or positions.shape != keys.shape[:2]:
            raise ValueError(f"layer {i}: keys {list(keys.shape)}, values {list(values.shape)} and positions "
                             f"{list(positions.shape)} do not describe a uniform layer")
        return UniformLayer.of(keys.unsqueeze(0), values.unsqueeze(0), positions)
    split = [int(n) for n in lengths.tolist()]
    rows = keys.shape[0]
    if (
        lengths.dim() != 1 or min(split, default=-1) < 0 or sum(split) != rows
        or keys.dim() != 2 or values.shape != keys.shape or positions.shape != (rows,)
    ):
        raise ValueError(f"layer {i}: per-head lengths {split} do not match tensors of {rows} rows")
    return RaggedLayer(
        [k.unsqueeze(0).unsqueeze(0) for k in keys.split(split)],
        [v.unsqueeze(0).unsqueeze(0) for v in values.split(split)],
        list(positions.split(split)),
    )


def _decode_quantized(
    tensors: dict[str, torch.Tensor], i: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    lengths: torch.Tensor | None, bits: int,
) -> CacheLayer:
    """An 8- or 4-bit layer (the module docstring's layout); raises ValueError when its tensors do not fit
    together."""
    from kvchat.kv.layers import QuantizedLayer

    try:
        body = [tensors[f"{name}.{i}"] for name in _QUANTIZED]
    except KeyError as e:
        raise ValueError(f"layer {i}: {bits}-bit tensors are incomplete: no {e.args[0]}") from None
    quantized = [int(n) for n in tensors[f"qlen.{i}"].tolist()]
    scale_dtype = SCALE_DTYPES[bits]
    if (
        body[0].dtype != torch.uint8 or body[3].dtype != torch.uint8 or min(quantized, default=-1) < 0
        or any(t.dtype != scale_dtype for t in (body[1], body[2], body[4], body[5]))
    ):
        raise ValueError(f"layer {i}: {bits}-bit codes must be uint8, scales and minima {scale_dtype} and lengths "
                         f">= 0 (got {quantized})")  # fmt: skip
    if any(t.dim() < 2 for t in body):
        raise ValueError(f"layer {i}: {bits}-bit tensors of shapes {[list(t.shape) for t in body]}")
    groups = body[1].shape[-2]
    key_group = body[0].shape[-2] // groups if groups else 0
    positions = positions.to(torch.long)
    try:
        if lengths is None:  # uniform: every head holds the same count in 8 bits
            q = quantized[0] if quantized else 0
            if len(set(quantized)) > 1:
                raise ValueError(f"layer {i}: per-head 8-bit lengths {quantized} in a uniform layer")
            residual = _full_layer(i, keys, values, positions[:, q:], None)
            entries = QuantizedEntries.of_tensors(body, keys.dtype, bits)
            _check_entries(entries, (len(quantized), q), key_group, keys.shape[-1], f"layer {i}")
            return QuantizedLayer(entries, positions[:, :q], residual)
        totals = [int(n) for n in lengths.tolist()]
        if len(totals) != len(quantized) or any(q > n for q, n in zip(quantized, totals, strict=True)):
            raise ValueError(f"layer {i}: 8-bit lengths {quantized} do not fit per-head lengths {totals}")
        per_head = positions.split(totals)
        residual = _full_layer(
            i, keys, values, torch.cat([p[q:] for p, q in zip(per_head, quantized, strict=True)]),
            torch.tensor([n - q for n, q in zip(totals, quantized, strict=True)]),
        )
        key_rows = [q // key_group if key_group else 0 for q in quantized]
        splits = [quantized, key_rows, key_rows, quantized, quantized, quantized]
        heads = [
            QuantizedEntries.of_tensors(parts, keys.dtype, bits)
            for parts in zip(*(t.split(n) for t, n in zip(body, splits, strict=True)), strict=True)
        ]
        for h, (entries, q) in enumerate(zip(heads, quantized, strict=True)):
            _check_entries(entries, (q,), key_group, keys.shape[-1], f"layer {i} head {h}")
        return QuantizedLayer(heads, [p[:q] for p, q in zip(per_head, quantized, strict=True)], residual)
    except (RuntimeError, IndexError) as e:
        raise ValueError(f"layer {i}: {bits}-bit tensors do not fit together ({e})") from None


def _check_entries(entries: QuantizedEntries, lead: tuple[int, ...], key_group: int, dim: int, where: str) -> None:
    """The shapes of `entries` holding `lead` (`(heads, q)` or `(q,)`) entries of dimension `dim` (the
    residual's) in key groups of `key_group`; 4-bit codes packed, `dim / 2` bytes a row."""
    *heads, q = lead
    width = dim * entries.bits // 8
    vgroups = entries.value_scale.shape[-1]
    key_rows = q // key_group if key_group else 0
    if width * 8 != dim * entries.bits:
        raise ValueError(f"{where}: a head dimension of {dim} cannot be packed in {entries.bits} bits")
    expected = {
        "key codes": (entries.key_codes, (*heads, q, width)),
        "key scales": (entries.key_scale, (*heads, key_rows, dim)),
        "key minima": (entries.key_min, (*heads, key_rows, dim)),
        "value codes": (entries.value_codes, (*heads, q, width)),
        "value scales": (entries.value_scale, (*heads, q, vgroups)),
        "value minima": (entries.value_min, (*heads, q, vgroups)),
    }
    for what, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{where}: {what} of shape {list(tensor.shape)}, expected {list(shape)}")
    if (q and (not key_group or q % key_group)) or not vgroups or dim % vgroups:
        raise ValueError(f"{where}: {q} entries of dimension {dim} do not fill whole groups")
