"""Block prefill: the one loop that appends a block, scores the cache, and evicts back to budget.

Peak entries per layer stay below protected prefix + budget + block + scorer's transient tokens,
whatever the history's length (EpiCache Fig. 1c). Eviction happens after the block, once a scorer's
probe pass has scored every layer, or during the block's forward when CAKE's window supplies the
scores (kvchat.kv.cascade, which also computes `cake` budgets from the block's attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvchat.kv.cache import EpisodeCache
from kvchat.kv.cascade import BlockWindow, CakeBudgets, block_evicts
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.scoring import CakeScorer, Scorer


@dataclass(frozen=True)
class PrefillResult:
    cache: EpisodeCache
    peak_layer_entries: int   # most entries any layer had in attention at once, transient scorer tokens included
    blocks: int
    peak_total_entries: int = 0  # most entries all layers held together at once, counted the same way


def block_prefill(
    model: torch.nn.Module,
    prefix_ids: torch.Tensor,
    context_ids: torch.Tensor,
    *,
    block_size: int,
    budgets: Sequence[int] | CakeBudgets | None,
    scorer: Scorer | CakeScorer | None,
    compact: bool = False,
    on_block: Callable[[int, int], None] | None = None,
    heads: HeadBudgets = HeadBudgets(),
) -> PrefillResult:
    """Build an episode cache: `prefix_ids` (never evicted), then `context_ids` in blocks.

    `budgets=None` keeps everything (the full-KV reference); `CakeBudgets` recomputes them every block
    from the block's attention. `compact` re-rotates kept keys to contiguous positions after each
    eviction so the cache fits a short context window. `on_block(done, total)` reports progress.
    `heads` shares each layer's budget among its KV heads (uniform, or adaptive: heads keep different
    counts and the layer becomes ragged; sizes and the peak then count entries per head averaged over
    the layer's heads).
    """
    num_layers = model.config.num_hidden_layers
    cache = EpisodeCache(num_layers)
    forward(model, cache, prefix_ids)
    cache.protected = prefix_ids.shape[-1]
    blocks = list(context_ids.split(block_size, dim=-1))
    rotary = model.model.rotary_emb
    in_block = isinstance(scorer, CakeScorer)
    for done, block in enumerate(blocks, start=1):
        evict = budgets is not None and block_evicts(cache, block.shape[-1], budgets)
        window = None
        if budgets is not None and (in_block or isinstance(budgets, CakeBudgets)):
            caps = [n + block.shape[-1] for n in cache.sizes]
            window = BlockWindow(cache, budgets, scorer if in_block else None, evict, caps)
        forward(model, cache, block, recorder=window)
        if evict and not in_block:  # the scorer's pass comes after the block: evict every layer once
            assert scorer is not None, "a budget needs a scorer"
            final = window.final_budgets() if window is not None else budgets
            scores = scorer(model, cache, block)
            cache.keep(
                [
                    heads.select(s, b, cache.protected, layer.lengths)
                    for s, b, layer in zip(scores, final, cache.layers, strict=True)
                ]
            )
        if evict and compact:
            cache.compact(rotary)
        if on_block is not None:
            on_block(done, len(blocks))
    return PrefillResult(
        cache=cache, peak_layer_entries=cache.peak_layer_entries, blocks=len(blocks),
        peak_total_entries=cache.peak_total_entries,
    )
