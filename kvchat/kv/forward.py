"""Running tokens through the model on top of an EpisodeCache, at the cache's logical positions."""

from __future__ import annotations

import torch

from kvchat.kv.attention import AttentionRecorder
from kvchat.kv.cache import EpisodeCache


@torch.inference_mode()
def forward(
    model: torch.nn.Module,
    cache: EpisodeCache,
    ids: torch.Tensor,
    *,
    recorder: AttentionRecorder | None = None,
    last_logits_only: bool = True,
) -> torch.Tensor:
    """Feed `ids` [1, n]; returns logits (of the last token only, by default) and advances the cache.

    Position ids are passed explicitly: after eviction the physical cache is shorter than the logical
    position, and transformers would otherwise infer positions from the physical length.
    """
    n = ids.shape[-1]
    extra = {"kvchat_recorder": recorder} if recorder is not None else {}
    out = model(
        input_ids=ids,
        position_ids=cache.position_ids(n),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1 if last_logits_only else 0,
        **extra,
    )
    cache.advance(n)
    return out.logits
