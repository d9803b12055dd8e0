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
    """Boolean mask [q, kv]: all cached entries visible, new tokens causal among themselves."""
    if q_len == 1:
        return None
    past = kv_len - q_len
    new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    cached = torch.ones(q_len, past, dtype=torch.bool, device=device)
    return torch.cat([cached, new], dim=1)


def grouped_attention_weights(
    query: torch.Tensor, key: torch.Tensor, scaling: float, mask: torch.Tensor | None, softcap: float | None = None
) -> torch.Tensor:
    """Softmax attention weights for batch 1, shaped [kv_heads, group, q, kv] (GQA groups explicit).
    `softcap` (Gemma2's attention logit softcapping): logits become softcap * tanh(logits / softcap)."""
    logits = attention_logits(query, key, scaling, softcap)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits.softmax(dim=-1)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention output `[1, q_heads, q, D]` of `query` over `key`/`value` `[1, kv_heads, n, D]` (GQA): one
    decode token through flashinfer where it runs (kvchat.kv.backends), else `decode_attention` or SDPA,
    whichever is faster there (`_sdpa_decodes_faster`); more tokens through torch's SDPA; with a logit softcap,
    which SDPA cannot apply, softmax(softcap(QK^T)) V by hand."""
    fast = backends.flashinfer_decode(query, key, value, scale, softcap) if mask is None else None
    if fast is not None:
        return fast
    if mask is None and query.shape[2] == 1 and not softcap and not _sdpa_decodes_faster(key):
        return decode_attention(query, key, value, scale)
    if not softcap:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    weights = grouped_attention_weights(query, key, scale, mask, softcap)
    return _weighted_values(weights, value)


# Entries per head up to which torch's SDPA CPU kernel beats `decode_attention` for one float32 query when torch
# runs more than one intra-op thread; beyond it, and on one thread, the grouped matmuls win
# (benchmarks/decode_attention.py).
SDPA_DECODE_ENTRIES = 2048


def _sdpa_decodes_faster(key: torch.Tensor) -> bool:
    """Whether one query over `key` runs faster through SDPA (CPU, float32, several threads, not too many
    entries; in bfloat16 the grouped matmuls are faster)."""
    return (key.device.type == "cpu" and key.dtype == torch.float32 and key.shape[2] <= SDPA_DECODE_ENTRIES
            and torch.get_num_threads() > 1)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one new token, `query [1, q_heads, 1, D]` over `key/value [1, kv_heads, n, D]`, as
    `[1, q_heads, 1, D]`: each GQA group's queries as one matrix against its KV head, so every key and value
    is read once (on one thread faster than SDPA's CPU kernel beyond a few hundred entries:
    benchmarks/results/decode_attention.md). Softmax in float32."""
    kv_heads, dim = key.shape[1], query.shape[-1]
    q = query.reshape(kv_heads, -1, dim)                                   # [kv_heads, group, D]
    logits = torch.matmul(q, key[0].transpose(1, 2)).float()                # [kv_heads, group, n]
    weights = logits.mul_(scale).softmax(dim=-1).to(value.dtype)
    return torch.matmul(weights, value[0]).reshape(1, -1, 1, dim)


def _weighted_values(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`weights [kv_heads, group, q, n]` applied to `value [1, kv_heads, n, D]`: `[1, q_heads, q, D]`."""
    kv_heads, group, q_len = weights.shape[:3]
    return torch.matmul(weights.to(value.dtype), value[0].unsqueeze(1)).reshape(1, kv_heads * group, q_len, -1)


def kvchat_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvchat_recorder: Recorder | None = None,
    kvchat_hidden: dict[int, torch.Tensor] | None = None,
    kvchat_memory: MemoryReadout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with a per-layer causal mask; optionally records attention for scoring, and adds a latent
    memory's readout (IndexMem eq. 4: o = o_attn + g(q) m(q); or the mass readout, which also reads
    attention's log-sum-exp, kvchat.kv.latent) when one is passed. A `softcap` keyword
    (Gemma2's attention logit softcapping, passed by the model's attention module) is applied."""
    softcap = kwargs.get("softcap")
    if query.shape[0] != 1:
        raise ValueError("kvchat attention runs one sequence at a time (batch size 1)")
    if isinstance(key, PagedKeys):
        retrieved = key.pool.retrieved(query, scaling)
        paged = key.pool.paged
        if paged is not None and query.shape[2] == 1 and attention_mask is None and kvchat_recorder is None and (
                kvchat_memory is None):  # a latent memory reads the joined entries (mass: their log-sum-exp)
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return paged(query, key, value, retrieved, scale, softcap), None
        key, value = with_retrieved(key, value, retrieved, query.shape[2])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(key, HeadList):
        out, _ = _ragged_attention(
            module, query, key, value, attention_mask, scaling, kvchat_recorder, kvchat_hidden, softcap
        )
        return _with_memory(out, module, query, kvchat_memory, key, scale, None, softcap), None
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = causal_mask(q_len, kv_len, query.device) if attention_mask is None else _as_bool(attention_mask)
    if kvchat_recorder is not None:
        rows = min(kvchat_recorder.query_rows or q_len, q_len)
        weights = grouped_attention_weights(
            query[:, :, q_len - rows :], key, scale, None if mask is None else mask[q_len - rows :], softcap
        )
    if kvchat_recorder is not None and weights.shape[-2] == q_len:
        # The weights of every query are at hand (a probe pass): the output is one matmul away, no second softmax.
        out = _weighted_values(weights, value)
    else:
        out = attend(query, key, value, mask, scale, softcap)
    if kvchat_recorder is not None:  # after this layer's attention: the recorder may evict from its cache
        kvchat_recorder.record(_view(module.layer_idx, weights, kv_len - q_len, query, kvchat_hidden, scale,
                                          softcap))
    return _with_memory(out.transpose(1, 2).contiguous(), module, query, kvchat_memory, key, scale, mask, softcap), None


def _with_memory(
    out: torch.Tensor,
    module: torch.nn.Module,
    query: torch.Tensor,
    memory: MemoryReadout | None,
    key: torch.Tensor | HeadList,
    scale: float,
    mask: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """`out [1, q, q_heads, head_dim]` plus the memory's readout, when there is a memory; a mass readout also
    gets attention's output and log-sum-exp over the layer's `key`s (`mask`: the uniform path's)."""
    if memory is None:
        return out
    layer = module.layer_idx
    if not memory.needs_log_mass(layer):
        return out + memory(layer, query).transpose(1, 2).to(out.dtype)
    log_mass = attention_log_mass(query, key, scale, mask, softcap)
    return out + memory(layer, query, out.transpose(1, 2), log_mass).transpose(1, 2).to(out.dtype)


def attention_log_mass(
    query: torch.Tensor, key: torch.Tensor | HeadList, scale: float, mask: torch.Tensor | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """log sum_k exp(logit(q, k)) over the keys each query attends to, `[1, q_heads, q, 1]` float32: the
    entries resident (plus retrieved) and the forward's own tokens, causally (`mask [q, kv]` for a uniform
    layer, the causal rule per head for a ragged one). One extra q.K^T over the resident entries."""
    q_len = query.shape[2]
    if isinstance(key, HeadList):
        kv_heads = len(key)
        group = query.shape[1] // kv_heads
        parts = []
        for h in range(kv_heads):
            logits = attention_logits(query[:, h * group : (h + 1) * group], key[h], scale, softcap)
            head_mask = causal_mask(q_len, key[h].shape[2], query.device)
            if head_mask is not None:
                logits = logits.masked_fill(~head_mask, float("-inf"))
            parts.append(logits.logsumexp(-1, keepdim=True).flatten(0, 1))
        return torch.cat(parts)[None]
    logits = attention_logits(query, key, scale, softcap)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits.logsumexp(-1, keepdim=True).flatten(0, 1)[None]


def attention_logits(query: torch.Tensor, key: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """Attention logits `[kv_heads, group, q, n]` (float32) of `query [1, q_heads, q, D]` over `key [1, kv, n, D]`."""
    _, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    q = query[0].reshape(kv_heads, q_heads // kv_heads, q_len, dim).float()
    logits = torch.matmul(q, key[0].float().transpose(-1, -2).unsqueeze(1)) * scale
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def _view(
    layer_idx: int, weights: torch.Tensor, past: int, query: torch.Tensor, hidden: dict[int, torch.Tensor] | None,
    scale: float, softcap: float | None,
) -> LayerView:
    """The recorder's view of a layer: the last `rows` queries (those `weights` cover) and the hidden states."""
    rows = weights.shape[-2]
    layer_hidden = hidden.pop(layer_idx, None) if hidden is not None else None
    return LayerView(layer_idx, weights, past, query[:, :, query.shape[2] - rows :], layer_hidden, scale, softcap)


def _ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: HeadList,
    value: HeadList,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    recorder: Recorder | None,
    hidden: dict[int, torch.Tensor] | None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, None]:
    """Attention of a ragged layer: per KV head h, its group of query heads attends over that head's own
    `n_h` entries only. Same causal rule as the uniform path: cached entries visible, new tokens causal.

    With a recorder, the per-head weights are laid out as the uniform path's `[kv_heads, group, q, kv]`
    (cached columns first, then the new tokens' columns) with zero columns filling the shorter heads'
    cached part up to the longest, so any recorder reads `weights[..., :past]` the same way. Those
    transient scores are padded (a few floats per entry, during prefill only); keys and values never are.
    """
    if attention_mask is not None:
        raise ValueError("a prepared attention mask does not apply to a layer with per-head lengths")
    kv_heads, q_len = len(key), query.shape[2]
    group = query.shape[1] // kv_heads
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    rows = q_len if recorder is None else min(recorder.query_rows or q_len, q_len)
    outs, weights = [], []
    for h in range(kv_heads):
        q = query[:, h * group : (h + 1) * group]
        mask = causal_mask(q_len, key[h].shape[2], query.device)
        if recorder is not None:
            last = None if mask is None else mask[q_len - rows :]
            # [group, rows, n_h]
            weights.append(grouped_attention_weights(q[:, :, q_len - rows :], key[h], scale, last, softcap)[0])
        outs.append(attend(q, key[h], value[h], mask, scale, softcap))
    if recorder is not None:
        past = max(w.shape[-1] for w in weights) - q_len
        padded = weights[0].new_zeros(kv_heads, group, rows, past + q_len)
        for h, w in enumerate(weights):
            own = w.shape[-1] - q_len
            padded[h, ..., :own] = w[..., :own]
            padded[h, ..., past:] = w[..., own:]
        recorder.record(_view(module.layer_idx, padded, past, query, hidden, scale, softcap))
    return torch.cat(outs, dim=1).transpose(1, 2).contiguous(), None


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
        joined = (_joined(h, retrieved, new_tokens, total, part) for h, part in ((heads, "keys"), (vheads, "values")))
        return tuple(joined)
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
