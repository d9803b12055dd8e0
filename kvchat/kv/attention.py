"""kvchat's attention function, attached through transformers' public AttentionInterface.

Why our own: each layer may hold a different number of entries (per-layer budgets, per-head
lengths, retrieved pages), so masks are per layer, and scoring needs attention weights SDPA does not return.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/attention.py".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvchat.kv import backends

ATTENTION_NAME = "kvchat"


class HeadList(tuple):
    """Keys (or values) of a ragged layer: one tensor `[1, 1, n_h, head_dim]` per KV head, in head order.

    What `EpisodeCache.update` returns for a layer whose heads keep different numbers of entries; the
    attention function recognises it by type. A plain tuple subclass, so it costs nothing to build.
    """

    __slots__ = ()


@dataclass(frozen=True)
class Retrieved:
    """The entries one KV head loaded: keys/values `[r, D]`, original positions `[r]`, and their rows in the
    head's pages (best first)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor


class PageSource(Protocol):
    """What a paged layer's keys carry: each KV head's retrieved entries for a forward's queries, until
    `clear` (kvchat.kv.retrieval.PagePool)."""

    def retrieved(self, query: torch.Tensor, scale: float | None = None) -> Sequence[Retrieved]: ...

    # One decode token's attention `[1, 1, q_heads, D]` over each head's cached and retrieved entries as one
    # paged decode (kvchat.kv.paged_decode.PagedDecode: called with query, keys, values, retrieved, scale,
    # softcap), or None: the per-head path attends.
    paged: Callable[..., torch.Tensor] | None

    def clear(self) -> None: ...


class PagedKeys(HeadList):
    """Keys of a paged layer: the resident entries, one tensor per KV head as in a `HeadList`, and `pool`,
    the `PageSource` that gives each head's retrieved entries for the current queries."""

    pool: PageSource  # set on every instance (no __slots__: a tuple subclass carries attributes this way)

    @classmethod
    def of(cls, heads: Sequence[torch.Tensor], pool: PageSource) -> PagedKeys:
        keys = cls(heads)
        keys.pool = pool
        return keys


@dataclass(frozen=True)
class LayerView:
    """What a recorder sees of one layer during a forward, right after that layer's attention ran.

    `weights`: softmax attention `[kv_heads, group, rows, kv]` of the forward's last `rows` queries over all
    the layer's keys (the `past` cached entries first, then the forward's own tokens; GQA groups explicit).
    `queries`: those queries `[1, q_heads, rows, head_dim]`, after RoPE. `hidden`: the layer's attention
    input (after its norm) for every token of the forward, `[1, q, hidden]`, when the recorder asked
    (`needs_hidden`): a learned scorer computes its own keys and queries from them (kvchat.kv.indexer).
    `scale` and `softcap`: what the model passed to attention, so a recorder can compute its logits as
    attention does (`attention_logits`; the indexer's teacher, kvchat.training.teacher).
    """

    layer_idx: int
    weights: torch.Tensor
    past: int
    queries: torch.Tensor
    hidden: torch.Tensor | None = None
    scale: float | None = None
    softcap: float | None = None


class Recorder(Protocol):
    """Passed to a model forward as the `kvchat_recorder` keyword; kvchat's attention calls `record` once
    per layer after that layer's attention output is computed, so it may evict from the cache. The prefill
    loop's recorders are `AttentionRecorder` (probe passes) and `kvchat.kv.cascade.BlockWindow` (scores
    and CAKE budgets inside the block's forward)."""

    query_rows: int | None  # the last queries whose weights it needs (None: all)

    def record(self, view: LayerView) -> None: ...


class MemoryReadout(Protocol):
    """Passed to a model forward as the `kvchat_memory` keyword (kvchat.kv.latent): what a memory of evicted
    entries adds to a layer's attention output, per query head, before `o_proj`."""

    def needs_log_mass(self, layer_idx: int) -> bool:
        """Whether the layer's readout needs attention's output and log-sum-exp (the mass readout)."""
        ...

    def __call__(self, layer_idx: int, query: torch.Tensor, attended: torch.Tensor | None = None,
                 log_mass: torch.Tensor | None = None) -> torch.Tensor:
        """`query [1, q_heads, q, head_dim]` (after RoPE) -> the addition, same shape; when `needs_log_mass`,
        also attention's output `attended` (same shape) and `log_mass [1, q_heads, q, 1]`, the log-sum-exp of
        each query's attention logits over the entries it attends to."""
        ...


@dataclass
class AttentionRecorder:
    """Collects, per layer, the max attention each cached entry receives from the current queries.

    `scores[layer]` is `[kv_heads, past_len]`: max over the queries and over the query heads of each GQA
    group (EpiCache eq. 3). Only entries cached before this forward are scored.
    """

    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    query_rows: int | None = None

    def record(self, view: LayerView) -> None:
        self.scores[view.layer_idx] = view.weights[..., : view.past].amax(dim=(1, 2))


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask [q, kv]: all cached entries visible, new tokens causal among themselves (None for one token,
    which sees everything). The one mask attention builds: per layer, and per KV head of a ragged layer."""
    if q_len == 1:
        return None
    past = kv_len - q_len
    new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    cached = torch.ones(q_len, past, dtype=torch.bool, device=device)
    return torch.cat([cached, new], dim=1)


# The shared pieces: GQA groups as rows, logits, their softmax or log-sum-exp, the weighted values.


def attention_logits(query: torch.Tensor, key: torch.Tensor, scale: float, softcap: float | None = None
                     ) -> torch.Tensor:  # fmt: skip
    """Attention logits `[kv_heads, group, q, n]` in float32 of `query [1, q_heads, q, D]` over `key [1, kv, n, D]`,
    scaled, then softcapped (Gemma2: softcap * tanh(logits / softcap)). Each KV head's group of query heads is one
    matrix against its keys (every key read once); the product is computed in the operands' dtype, so callers
    wanting exact scores pass float32 ones."""
    _, q_heads, q_len, dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    rows = query[0].reshape(kv_heads, q_heads // kv_heads * q_len, dim)          # [kv_heads, group * q, D]
    logits = torch.matmul(rows, key[0].transpose(1, 2)).float().mul_(scale).view(kv_heads, -1, q_len, n)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def _masked(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return logits if mask is None else logits.masked_fill(~mask, float("-inf"))


def grouped_attention_weights(
    query: torch.Tensor, key: torch.Tensor, scaling: float, mask: torch.Tensor | None, softcap: float | None = None
) -> torch.Tensor:
    """Softmax attention weights `[kv_heads, group, q, kv]` for batch 1 (GQA groups explicit), from float32 logits
    of float32 operands: the weights recorders and scorers read."""
    return _masked(attention_logits(query.float(), key.float(), scaling, softcap), mask).softmax(dim=-1)


def weighted_values(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`weights [kv_heads, group, q, n]` applied to `value [1, kv_heads, n, D]`: `[1, q_heads, q, D]`."""
    kv_heads, group, q_len, n = weights.shape
    out = torch.matmul(weights.to(value.dtype).reshape(kv_heads, group * q_len, n), value[0])
    return out.view(1, kv_heads * group, q_len, -1)


def softmax_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(mask(softcap(Q K^T scale))) V by hand, `[1, q_heads, q, D]`, softmax in float32: what SDPA cannot do
    (a softcap), and one decode token on the CPU where its grouped matmuls beat SDPA (`_sdpa_decodes_faster`)."""
    return weighted_values(_masked(attention_logits(query, key, scale, softcap), mask).softmax(dim=-1), value)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention output `[1, q_heads, q, D]` of `query` over `key`/`value` `[1, kv_heads, n, D]` (GQA), the kernel
    chosen here: one decode token through flashinfer where it runs (kvchat.kv.backends); under a logit softcap,
    which SDPA cannot apply, `softmax_attention` from float32 operands; one token on the CPU where the grouped
    matmuls are faster, `softmax_attention`; else torch's SDPA."""
    fast = backends.flashinfer_decode(query, key, value, scale, softcap) if mask is None else None
    if fast is not None:
        return fast
    if softcap:
        return softmax_attention(query.float(), key.float(), value, scale, mask, softcap)
    if mask is None and query.shape[2] == 1 and not _sdpa_decodes_faster(key):
        return softmax_attention(query, key, value, scale)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)


# Entries per head up to which torch's SDPA CPU kernel beats the grouped matmuls (`softmax_attention`) for one
# float32 query when torch runs more than one intra-op thread; beyond it, and on one thread, the grouped matmuls
# win (benchmarks/decode_attention.py).
SDPA_DECODE_ENTRIES = 2048


def _sdpa_decodes_faster(key: torch.Tensor) -> bool:
    """Whether one query over `key` runs faster through SDPA (CPU, float32, several threads, not too many
    entries; in bfloat16 the grouped matmuls are faster)."""
    return (key.device.type == "cpu" and key.dtype == torch.float32 and key.shape[2] <= SDPA_DECODE_ENTRIES
            and torch.get_num_threads() > 1)


@dataclass(frozen=True)
class _Attended:
    """One dense attention call's results: the output `[1, heads, q, D]`, the recorder's weights
    `[kv_heads, group, rows, n]` (None without a recorder) and the log-sum-exp `[1, heads, q, 1]` a mass readout
    reads (None unless asked)."""

    out: torch.Tensor
    weights: torch.Tensor | None
    log_mass: torch.Tensor | None

    def recorded(self) -> torch.Tensor:
        """The recorder's weights (the call was given rows)."""
        if self.weights is None:
            raise RuntimeError("attention ran without rows for a recorder")
        return self.weights

    def mass(self) -> torch.Tensor:
        """The log-sum-exp (the call was asked for it)."""
        if self.log_mass is None:
            raise RuntimeError("attention ran without its log-sum-exp")
        return self.log_mass


def _dense(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None, rows: int, log_mass: bool,
) -> _Attended:
    """Attention over one tensor of entries (a uniform layer, or one KV head of a ragged one) with what the
    recorder (`rows`: its last queries, 0 for none) and the memory (`log_mass`) ask for. A recorder's weights of
    every query give the output by one matmul, no second softmax (a probe pass)."""
    q_len = query.shape[2]
    weights = None
    if rows:
        last = None if mask is None else mask[q_len - rows :]
        weights = grouped_attention_weights(query[:, :, q_len - rows :], key, scale, last, softcap)
    if weights is not None and rows == q_len:
        out = weighted_values(weights, value)
    else:
        out = attend(query, key, value, mask, scale, softcap)
    mass = None
    if log_mass:  # one extra q.K^T over the entries: each query's log-sum-exp over those it attends to
        logits = _masked(attention_logits(query.float(), key.float(), scale, softcap), mask)
        mass = logits.logsumexp(-1, keepdim=True).flatten(0, 1)[None]
    return _Attended(out, weights, mass)


def _ragged(
    query: torch.Tensor, key: HeadList, value: HeadList, scale: float, softcap: float | None, rows: int,
    log_mass: bool,
) -> _Attended:
    """A ragged layer: per KV head, its group of query heads over that head's own `n_h` entries only (the causal
    rule of `causal_mask` per head), then the heads' results side by side.

    A recorder's weights are laid out as a uniform layer's `[kv_heads, group, rows, kv]` (cached columns first,
    then the forward's own tokens') with zero columns filling the shorter heads' cached part up to the longest,
    so any recorder reads `weights[..., :past]` the same way. Those transient scores are padded (a few floats per
    entry, during prefill only); keys and values never are."""
    kv_heads, q_len = len(key), query.shape[2]
    group = query.shape[1] // kv_heads
    parts = [
        _dense(query[:, h * group : (h + 1) * group], key[h], value[h], causal_mask(q_len, key[h].shape[2],
               query.device), scale, softcap, rows, log_mass)
        for h in range(kv_heads)
    ]  # fmt: skip
    weights = None
    if rows:
        recorded = [p.recorded() for p in parts]
        own = [w.shape[-1] - q_len for w in recorded]
        past = max(own)
        weights = recorded[0].new_zeros(kv_heads, group, rows, past + q_len)
        for h, (w, n) in enumerate(zip(recorded, own, strict=True)):
            weights[h, ..., :n] = w[0, ..., :n]
            weights[h, ..., past:] = w[0, ..., n:]
    mass = torch.cat([p.mass() for p in parts], dim=1) if log_mass else None
    return _Attended(torch.cat([p.out for p in parts], dim=1), weights, mass)


def kvchat_attention(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor | HeadList,
    value: torch.Tensor | HeadList,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvchat_recorder: Recorder | None = None,
    kvchat_hidden: dict[int, torch.Tensor] | None = None,
    kvchat_memory: MemoryReadout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention `[1, q, q_heads, D]` with a per-layer causal mask over whatever the layer's cache returned: one
    tensor (a uniform layer, or a paged one whose heads ended equal), a `HeadList` (ragged: per head), or
    `PagedKeys` (retrieved entries joined in, or one decode token through the pool's paged decode). Records the
    weights for a recorder, and adds a latent memory's readout (IndexMem eq. 4: o = o_attn + g(q) m(q); or the mass
    readout, which also reads attention's log-sum-exp, kvchat.kv.latent) when one is passed. A `softcap` keyword
    (Gemma2's attention logit softcapping, passed by the model's attention module) is applied."""
    softcap = kwargs.get("softcap")
    if query.shape[0] != 1:
        raise ValueError("kvchat attention runs one sequence at a time (batch size 1)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # -1: a call without a module (attention_with_retrieved), for which nothing records or reads a memory
    layer: int = getattr(module, "layer_idx", -1)
    if isinstance(key, PagedKeys):
        retrieved = key.pool.retrieved(query, scaling)
        paged = key.pool.paged
        if paged is not None and query.shape[2] == 1 and attention_mask is None and kvchat_recorder is None and (
                kvchat_memory is None):  # a latent memory reads the joined entries (mass: their log-sum-exp)
            return paged(query, key, value, retrieved, scale, softcap), None
        key, value = with_retrieved(key, value, retrieved, query.shape[2])
    q_len = query.shape[2]
    rows = 0 if kvchat_recorder is None else min(kvchat_recorder.query_rows or q_len, q_len)
    log_mass = kvchat_memory is not None and kvchat_memory.needs_log_mass(layer)
    if isinstance(key, HeadList) and isinstance(value, HeadList):
        if attention_mask is not None:
            raise ValueError("a prepared attention mask does not apply to a layer with per-head lengths")
        attended = _ragged(query, key, value, scale, softcap, rows, log_mass)
    elif isinstance(key, HeadList) or isinstance(value, HeadList):
        raise ValueError("a layer's keys and values come per head together, or together as one tensor")
    else:
        mask = causal_mask(q_len, key.shape[2], query.device) if attention_mask is None else _as_bool(attention_mask)
        attended = _dense(query, key, value, mask, scale, softcap, rows, log_mass)
    out = attended.out
    if kvchat_memory is not None:
        readout = kvchat_memory(layer, query, out, attended.mass()) if log_mass else kvchat_memory(layer, query)
        out = out + readout.to(out.dtype)
    if kvchat_recorder is not None:  # after this layer's attention: the recorder may evict from its cache
        weights = attended.recorded()
        kvchat_recorder.record(_view(layer, weights, weights.shape[-1] - q_len, query, kvchat_hidden, scale, softcap))
    return out.transpose(1, 2).contiguous(), None


def _view(
    layer_idx: int, weights: torch.Tensor, past: int, query: torch.Tensor, hidden: dict[int, torch.Tensor] | None,
    scale: float, softcap: float | None,
) -> LayerView:
    """The recorder's view of a layer: the last `rows` queries (those `weights` cover) and the hidden states."""
    rows = weights.shape[-2]
    layer_hidden = hidden.pop(layer_idx, None) if hidden is not None else None
    return LayerView(layer_idx, weights, past, query[:, :, query.shape[2] - rows :], layer_hidden, scale, softcap)


def with_retrieved(
    keys: torch.Tensor | Sequence[torch.Tensor],
    values: torch.Tensor | Sequence[torch.Tensor],
    retrieved: Sequence[Retrieved],
    new_tokens: int,
) -> tuple[torch.Tensor | HeadList, torch.Tensor | HeadList]:
    """Per KV head: cached entries, then that head's retrieved entries, then the `new_tokens` last ones.

    `keys`/`values` are what a cache layer returns to attention: `[1, kv_heads, n, D]` or one `[1, 1, n_h, D]`
    per head, the current forward's tokens last. Retrieved entries are cast to the cache's dtype. When every
    head ends with as many entries (equal resident heads, R read by each: the usual case), the result is one
    `[1, kv_heads, n, D]` tensor, which attention takes in one call for all heads; otherwise a `HeadList`.
    """
    heads, vheads = _per_head(keys), _per_head(values)
    if not len(heads) == len(vheads) == len(retrieved):
        raise ValueError(f"{len(heads)} KV heads but entries retrieved for {len(retrieved)}")
    totals = {k.shape[2] + got.keys.shape[0] for k, got in zip(heads, retrieved, strict=True)}
    if len(totals) == 1:
        total = totals.pop()
        return (_joined(heads, retrieved, new_tokens, total, "keys"),
                _joined(vheads, retrieved, new_tokens, total, "values"))
    out_k, out_v = [], []
    for k, v, got in zip(heads, vheads, retrieved, strict=True):
        past = k.shape[2] - new_tokens
        extra_k = got.keys.to(k.device, k.dtype).view(1, 1, -1, k.shape[-1])
        extra_v = got.values.to(v.device, v.dtype).view(1, 1, -1, v.shape[-1])
        out_k.append(torch.cat([k[:, :, :past], extra_k, k[:, :, past:]], dim=2))
        out_v.append(torch.cat([v[:, :, :past], extra_v, v[:, :, past:]], dim=2))
    return HeadList(out_k), HeadList(out_v)


def _joined(
    heads: Sequence[torch.Tensor], retrieved: Sequence[Retrieved], new_tokens: int, total: int, part: str
) -> torch.Tensor:
    """Every head's cached, retrieved (`part`: their keys or values) and new entries in one `[1, H, total, D]`."""
    first = heads[0]
    out = first.new_empty(1, len(heads), total, first.shape[-1])
    for h, (entries, got) in enumerate(zip(heads, retrieved, strict=True)):
        past = entries.shape[2] - new_tokens
        extra = getattr(got, part)
        out[0, h, :past] = entries[0, 0, :past]
        out[0, h, past : past + extra.shape[0]] = extra
        out[0, h, past + extra.shape[0] :] = entries[0, 0, past:]
    return out


def attention_with_retrieved(
    query: torch.Tensor,
    keys: torch.Tensor | Sequence[torch.Tensor],
    values: torch.Tensor | Sequence[torch.Tensor],
    retrieved: Sequence[Retrieved],
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention output `[1, q, q_heads, D]` of `query` `[1, q_heads, q, D]` over each KV head's cached
    entries, its `retrieved` ones and the current tokens (the last `q` entries of `keys`)."""
    all_k, all_v = with_retrieved(keys, values, retrieved, query.shape[2])
    out, _ = kvchat_attention(None, query, all_k, all_v, None, scaling)
    return out


def _per_head(entries: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(entries, torch.Tensor):
        return [entries[:, h : h + 1] for h in range(entries.shape[1])]
    return list(entries)


def _as_bool(attention_mask: torch.Tensor) -> torch.Tensor:
    """A prepared 4D mask passed by the caller (transformers hands those through unchanged), as [q, kv]
    booleans. Used by layer profiling to simulate block prefill."""
    mask = attention_mask[0, 0]
    return mask if mask.dtype == torch.bool else mask == 0


def _no_mask(*args, **kwargs) -> None:
    """Masks are built per layer inside kvchat_attention."""
    return None


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name. Imported here:
    transformers' attention registries come with its model code, which answering natively never imports."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvchat_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
