"""Block prefill: the one loop that appends a block, scores the cache, and evicts back to budget.

Peak entries per layer stay below protected prefix + budget + block + scorer's transient tokens,
whatever the history's length (EpiCache Fig. 1c).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.scoring import Scorer


@dataclass(frozen=True)
class PrefillResult:
    cache: EpisodeCache
    peak_tokens: int   # most entries any layer had in attention at once, transient scorer tokens included
    blocks: int


def block_prefill(
    model: torch.nn.Module,
    prefix_ids: torch.Tensor,
    context_ids: torch.Tensor,
    *,
    block_size: int,
    budgets: Sequence[int] | None,
    scorer: Scorer | None,
    compact: bool = False,
    on_block: Callable[[int, int], None] | None = None,
    heads: HeadBudgets = HeadBudgets(),
) -> PrefillResult:
    """Build an episode cache: `prefix_ids` (never evicted), then `context_ids` in blocks.

    `budgets=None` keeps everything (the full-KV reference). `compact` re-rotates kept keys to
    contiguous positions after each eviction so the cache fits a short context window.
    `on_block(done, total)` reports progress. `heads` shares each layer's budget among its KV heads
    (uniform, or adaptive: heads keep different counts and the layer becomes ragged; sizes and the peak
    then count entries per head averaged over the layer's heads).
    """
    num_layers = model.config.num_hidden_layers
    cache = EpisodeCache(num_layers)
    forward(model, cache, prefix_ids)
    cache.protected = prefix_ids.shape[-1]
    peak = max(cache.sizes)
    blocks = list(context_ids.split(block_size, dim=-1))
    rotary = model.model.rotary_emb
    for done, block in enumerate(blocks, start=1):
        forward(model, cache, block)
        peak = max(peak, *cache.sizes)
        if budgets is not None and any(n > b for n, b in zip(cache.sizes, budgets, strict=True)):
            assert scorer is not None, "a budget needs a scorer"
            peak = max(peak, max(cache.sizes) + scorer.transient_tokens)
            scores = scorer(model, cache, block)
            cache.keep(
                [
                    heads.select(s, b, cache.protected, layer.lengths)
                    for s, b, layer in zip(scores, budgets, cache.layers, strict=True)
                ]
            )
            if compact:
                cache.compact(rotary)
        if on_block is not None:
            on_block(done, len(blocks))
    return PrefillResult(cache=cache, peak_tokens=peak, blocks=len(blocks))
