"""Attention of one layer over its resident entries plus the entries each KV head retrieved.

Softmax attention does not depend on the order of the keys it sees, so attending over resident +
retrieved is attending over their concatenation. Each KV head's retrieved entries are placed between
its cached entries and the tokens of the current forward, and the result goes through kvchat's ragged
attention path (one SDPA per KV head, its own length): cached and retrieved entries are visible to
every new token, new tokens are causal among themselves. Retrieved keys carry the RoPE rotation of
their original positions, like resident ones, so nothing is re-rotated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.kv.attention import HeadList, kvchat_attention
from kvchat.kv.retrieval import Retrieved


def with_retrieved(
    keys: torch.Tensor | Sequence[torch.Tensor],
    values: torch.Tensor | Sequence[torch.Tensor],
    retrieved: Sequence[Retrieved],
    new_tokens: int,
) -> tuple[HeadList, HeadList]:
    """Per KV head: cached entries, then that head's retrieved entries, then the `new_tokens` last ones.

    `keys`/`values` are what a cache layer returns to attention: `[1, kv_heads, n, D]` or one
    `[1, 1, n_h, D]` per head (a ragged layer), the current forward's tokens last.
    """
    heads, vheads = _per_head(keys), _per_head(values)
    if not len(heads) == len(vheads) == len(retrieved):
        raise ValueError(f"{len(heads)} KV heads but entries retrieved for {len(retrieved)}")
    out_k, out_v = [], []
    for k, v, got in zip(heads, vheads, retrieved, strict=True):
        past = k.shape[2] - new_tokens
        extra_k = got.keys.to(k.dtype).view(1, 1, -1, k.shape[-1])
        extra_v = got.values.to(v.dtype).view(1, 1, -1, v.shape[-1])
        out_k.append(torch.cat([k[:, :, :past], extra_k, k[:, :, past:]], dim=2))
        out_v.append(torch.cat([v[:, :, :past], extra_v, v[:, :, past:]], dim=2))
    return HeadList(out_k), HeadList(out_v)


def _per_head(entries: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(entries, torch.Tensor):
        return [entries[:, h : h + 1] for h in range(entries.shape[1])]
    return list(entries)


def attention_with_retrieved(
    query: torch.Tensor,
    keys: torch.Tensor | Sequence[torch.Tensor],
    values: torch.Tensor | Sequence[torch.Tensor],
    retrieved: Sequence[Retrieved],
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention output `[1, q, q_heads, D]` of `query` `[1, q_heads, q, D]` over each KV head's cached
    entries, its retrieved ones and the current tokens (the last `q` entries of `keys`)."""
    all_k, all_v = with_retrieved(keys, values, retrieved, query.shape[2])
    out, _ = kvchat_attention(None, query, all_k, all_v, None, scaling)
    return out
