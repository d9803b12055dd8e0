"""kvchat's attention function, attached through transformers' public AttentionInterface.

Why our own: (1) each layer may hold a different number of cached entries (per-layer budgets), so the
causal mask must be built per layer from that layer's own length — transformers sizes one mask from
layer 0; (2) scoring needs the patched prompt's attention weights over the cache, which SDPA does not
return. The matching mask function returns None so transformers builds no mask at all; causality is
enforced here: every cached entry precedes every new token, and new tokens see each other causally.
A caller may still pass a prepared 4D `attention_mask` (transformers returns those as they are); it
then replaces the causal mask.

Ragged layers (head-wise budgets, see kvchat.kv.heads): `cache.update` then returns a `HeadList` per
keys and values, one tensor per KV head holding only that head's entries. Attention runs per KV head
over that head's own length (one SDPA call per KV head, its GQA group of query heads together), so no
head is padded to the longest. Models have few KV heads (3 on SmolLM2-135M), so the loop is short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTENTION_NAME = "kvchat"


class HeadList(tuple):
    """Keys (or values) of a ragged layer: one tensor `[1, 1, n_h, head_dim]` per KV head, in head order.

    What `EpisodeCache.update` returns for a layer whose heads keep different numbers of entries; the
    attention function recognises it by type. A plain tuple subclass, so it costs nothing to build.
    """

    __slots__ = ()


@dataclass
class AttentionRecorder:
    """Collects, per layer, the max attention each cached entry receives from the current queries.

    Passed to a model forward as the `kvchat_recorder` keyword; transformers hands it to every attention
    call. `scores[layer]` is `[kv_heads, past_len]`: max over the queries and over the query heads of each
    GQA group (EpiCache eq. 3). Only entries cached before this forward are scored.

    Any object with `record(layer_idx, weights, past)` and `query_rows` can be passed instead (CAKE's
    block window, kvchat.kv.cascade): `query_rows` limits the weights to the last queries (None: all), and
    `record` is called once the layer's attention output is computed, so it may evict from the cache.
    """

    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    query_rows: int | None = None

    def record(self, layer_idx: int, weights: torch.Tensor, past: int) -> None:
        # weights: [kv_heads, group, q, kv]; keep columns of the entries cached before this forward.
        self.scores[layer_idx] = weights[..., :past].amax(dim=(1, 2))


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask [q, kv]: all cached entries visible, new tokens causal among themselves."""
    if q_len == 1:
        return None
    past = kv_len - q_len
    new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    cached = torch.ones(q_len, past, dtype=torch.bool, device=device)
    return torch.cat([cached, new], dim=1)


def grouped_attention_weights(
    query: torch.Tensor, key: torch.Tensor, scaling: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention weights for batch 1, shaped [kv_heads, group, q, kv] (GQA groups explicit)."""
    _, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    q = query[0].reshape(kv_heads, q_heads // kv_heads, q_len, dim).float()
    logits = torch.matmul(q, key[0].float().transpose(-1, -2).unsqueeze(1)) * scaling
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits.softmax(dim=-1)


def kvchat_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvchat_recorder: AttentionRecorder | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with a per-layer causal mask; optionally records attention for scoring."""
    if query.shape[0] != 1:
        raise ValueError("kvchat attention runs one sequence at a time (batch size 1)")
    if isinstance(key, HeadList):
        return _ragged_attention(module, query, key, value, attention_mask, scaling, kvchat_recorder)
    q_len, kv_len = query.shape[2], key.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = causal_mask(q_len, kv_len, query.device) if attention_mask is None else _as_bool(attention_mask)
    if kvchat_recorder is not None:
        rows = min(kvchat_recorder.query_rows or q_len, q_len)
        weights = grouped_attention_weights(
            query[:, :, q_len - rows :], key, scale, None if mask is None else mask[q_len - rows :]
        )
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    if kvchat_recorder is not None:  # after this layer's attention: the recorder may evict from its cache
        kvchat_recorder.record(module.layer_idx, weights, kv_len - q_len)
    return out.transpose(1, 2).contiguous(), None


def _ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: HeadList,
    value: HeadList,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    recorder: AttentionRecorder | None,
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
    outs, weights = [], []
    for h in range(kv_heads):
        q = query[:, h * group : (h + 1) * group]
        mask = causal_mask(q_len, key[h].shape[2], query.device)
        if recorder is not None:
            weights.append(grouped_attention_weights(q, key[h], scale, mask)[0])  # [group, q, n_h]
        outs.append(F.scaled_dot_product_attention(q, key[h], value[h], attn_mask=mask, scale=scale, enable_gqa=True))
    if recorder is not None:
        past = max(w.shape[-1] for w in weights) - q_len
        padded = weights[0].new_zeros(kv_heads, group, q_len, past + q_len)
        for h, w in enumerate(weights):
            own = w.shape[-1] - q_len
            padded[h, ..., :own] = w[..., :own]
            padded[h, ..., past:] = w[..., own:]
        recorder.record(module.layer_idx, padded, past)
    return torch.cat(outs, dim=1).transpose(1, 2).contiguous(), None


def _as_bool(attention_mask: torch.Tensor) -> torch.Tensor:
    """A prepared 4D mask passed by the caller (transformers hands those through unchanged), as [q, kv]
    booleans. Used by layer profiling to simulate block prefill."""
    mask = attention_mask[0, 0]
    return mask if mask.dtype == torch.bool else mask == 0


def _no_mask(*args, **kwargs) -> None:
    """Masks are built per layer inside kvchat_attention."""
    return None


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, kvchat_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
