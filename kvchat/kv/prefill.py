"""Block prefill: the one loop that appends a block, scores the cache, and evicts back to budget.

Peak entries per layer stay below protected prefix + budget + block + scorer's transient tokens,
whatever the history's length (EpiCache Fig. 1c). Eviction happens after the block, once a scorer's
probe pass has scored every layer, or during the block's forward when the scorer reads the block there
(`Scorer.in_forward`, kvchat.kv.scoring) or CAKE budgets are computed from it (kvchat.kv.cascade).

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/prefill.py".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvchat.kv.cache import EpisodeCache, EvictionObserver
from kvchat.kv.cascade import BlockWindow, CakeBudgets, block_evicts
from kvchat.kv.causal_lm import config_of, decoder_of
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.scoring import Scorer, scores_in_forward


@dataclass(frozen=True)
class PrefillResult:
    cache: EpisodeCache
    peak_layer_entries: int   # most entries any layer had in attention at once, transient scorer tokens included
    blocks: int
    peak_total_entries: int = 0  # most entries all layers held together at once, counted the same way


def block_prefill(
    model: nn.Module,
    prefix_ids: torch.Tensor | None,
    context_ids: torch.Tensor,
    *,
    block_size: int,
    budgets: Sequence[int] | CakeBudgets | None,
    scorer: Scorer | None,
    compact: bool = False,
    on_block: Callable[[int, int], None] | None = None,
    heads: HeadBudgets = HeadBudgets(),
    resume: EpisodeCache | None = None,
    on_evict: EvictionObserver | None = None,
    recent: int = 0,
    origins: bool = False,
) -> PrefillResult:
    """Build an episode cache: `prefix_ids` (never evicted), then `context_ids` in blocks.

    `budgets=None` keeps everything (the full-KV reference); `CakeBudgets` recomputes them every block
    from the block's attention. `compact` re-rotates kept keys to contiguous positions after each
    eviction so the cache fits a short context window. `on_block(done, total)` reports progress.
    `heads` shares each layer's budget among its KV heads (uniform, or adaptive: heads keep different
    counts and the layer becomes ragged; sizes and the peak then count entries per head averaged over
    the layer's heads). `resume` continues that cache (its prefix is already in; `prefix_ids` must be
    None) and extends it in place; its peaks keep counting from where they were. `on_evict` becomes the
    cache's `EpisodeCache.on_evict` (a latent memory's writer, kvchat.kv.latent). `recent` entries at the end
    of every head are kept at every eviction whatever the scorer says, inside the budgets: a window that
    slides with the blocks, so the finished cache holds the history's last `recent` tokens (IceCache's
    window pages under offload; `EpisodeCache.recent`). `origins` keeps every entry's original position
    beside its compacted one (`EpisodeCache.track_origins`; a resumed cache that tracks them goes on doing so).
    """
    if resume is None:
        if prefix_ids is None:
            raise ValueError("a new cache starts with its prefix: pass prefix_ids")
        cache = EpisodeCache(config_of(model).num_hidden_layers)
        cache.on_evict = on_evict
        forward(model, cache, prefix_ids)
        cache.protected = prefix_ids.shape[-1]
    elif prefix_ids is not None:
        raise ValueError("a resumed cache already holds its prefix: pass prefix_ids=None")
    else:
        cache = resume
        cache.on_evict = on_evict or cache.on_evict
    if origins:
        cache.track_origins()
    cache.recent = recent
    blocks = [b for b in context_ids.split(block_size, dim=-1) if b.shape[-1]]  # none: nothing new to feed
    rotary = decoder_of(model).rotary_emb
    in_forward = scorer is not None and scores_in_forward(scorer)
    for done, block in enumerate(blocks, start=1):
        evict = budgets is not None and block_evicts(cache, block.shape[-1], budgets)
        window = None
        if budgets is not None and (in_forward or isinstance(budgets, CakeBudgets)):
            caps = [n + block.shape[-1] for n in cache.sizes]
            window = BlockWindow(cache, budgets, scorer if in_forward else None, evict, caps, heads=heads)
        # Recorder.query_rows (kvchat.kv.attention) is settable; BlockWindow computes it (read-only)
        forward(model, cache, block, recorder=window)  # type: ignore[arg-type]
        if evict and not in_forward:  # the scorer reads the cache after the block: evict every layer once
            assert scorer is not None, "a budget needs a scorer"
            final: Sequence[int]
            if window is not None:
                final = window.final_budgets()
            else:  # fixed budgets (cake budgets have a window): evict is False without any
                assert budgets is not None and not isinstance(budgets, CakeBudgets)
                final = budgets
            scores = scorer(model, cache, block)
            cache.keep(
                [
                    heads.select(s, b, cache.protected, layer.lengths, recent)
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


def select_from(
    model: nn.Module,
    full: EpisodeCache,
    last_block: torch.Tensor,
    *,
    budgets: Sequence[int],
    scorer: Scorer,
    heads: HeadBudgets = HeadBudgets(),
    compact: bool = False,
    on_evict: EvictionObserver | None = None,
    recent: int = 0,
    origins: bool = False,
) -> EpisodeCache:
    """An episode cache chosen from `full` (everything kept, e.g. `block_prefill(budgets=None)`): `scorer`
    reads it once, as after the history's last block (`last_block`, its ids), and each layer keeps its top
    `budgets[l]` entries, shared among heads by `heads`, its last `recent` among them whatever they score
    (as `block_prefill`'s). `full` is left whole for the next episode; its peaks count the scorer's probe.
    `on_evict` sees what the selection drops (`full` itself evicts nothing); `origins` as `block_prefill`'s."""
    if scores_in_forward(scorer):
        raise ValueError("selecting from a full cache needs a scorer that reads it after the block")
    scores = scorer(model, full, last_block)
    cache = full.copy()
    if origins:
        cache.track_origins()
    cache.on_evict = on_evict
    cache.recent = recent
    cache.keep(
        [heads.select(s, b, cache.protected, layer.lengths, recent)
         for s, b, layer in zip(scores, budgets, cache.layers, strict=True)]
    )  # fmt: skip
    if compact:
        cache.compact(decoder_of(model).rotary_emb)
    return cache


def keep_sink_and_window(cache: EpisodeCache, window: int, first_layer: int = 0) -> None:
    """In every layer from `first_layer` on, keep the protected system prompt and the last `window` entries
    of each head and evict the rest, through `cache.on_evict` (IceCache over a full cache: everything
    between sink and window is paged)."""
    for i in range(first_layer, len(cache.layers)):
        index = []
        for n in cache.layers[i].lengths:
            tail = max(cache.protected, n - window)
            index.append(torch.cat([torch.arange(min(cache.protected, n)), torch.arange(tail, n)]))
        cache.keep_layer(i, torch.stack(index) if len({len(x) for x in index}) == 1 else index)
