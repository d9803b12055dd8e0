"""Each baseline scorer's ranking on hand-made caches, and every method end to end on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from kvchat.answer.session import Session
from kvchat.config import METHODS, CacheConfig, EpisodeConfig, IngestConfig
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.methods import REGISTRY
from kvchat.kv.scoring import BlockPromptScorer, CakeScorer, KeyDiffScorer, RecencyScorer
from kvchat.store import Store


def _cache(keys: torch.Tensor, protected: int = 0) -> EpisodeCache:
    """One layer holding `keys` [heads, n, dim] at positions 0..n-1."""
    heads, n, _ = keys.shape
    cache = EpisodeCache(1)
    cache.layers[0].append(keys[None], keys[None].clone(), torch.arange(n).expand(heads, n))
    cache.protected = protected
    return cache


def test_streaming_keeps_sink_then_the_most_recent():
    cache = _cache(torch.randn(2, 10, 4), protected=2)
    scores = RecencyScorer(sink=3)(None, cache, torch.zeros(1, 4, dtype=torch.long))[0]
    ranked = scores[0].argsort(descending=True).tolist()
    assert set(ranked[:3]) == {2, 3, 4}          # the sink right after the protected prefix
    assert ranked[3:6] == [9, 8, 7]              # then recency


def test_keydiff_prefers_keys_unlike_the_blocks_mean():
    anchor = torch.tensor([1.0, 0.0, 0.0])
    keys = torch.stack([anchor, -anchor, torch.tensor([0.0, 1.0, 0.0]), anchor, anchor])[None]  # block = last 2
    scores = KeyDiffScorer()(None, _cache(keys), torch.zeros(1, 2, dtype=torch.long))[0][0]
    assert scores.argmax().item() == 1           # opposite of the block's direction: most distinct
    assert scores[2] > scores[0]                 # orthogonal beats aligned
    assert torch.allclose(scores[[0, 3, 4]], torch.tensor(-1.0))


def test_snapkv_and_kvzip_prompts_come_from_the_block():
    block = torch.arange(100, 200).unsqueeze(0)
    empty = torch.zeros(1, 0, dtype=torch.long)
    snap = BlockPromptScorer(empty, empty, tail=64, block_size=100)
    assert snap.prompt(block).tolist() == [list(range(136, 200))] and snap.transient_tokens == 64
    kvzip = BlockPromptScorer(torch.tensor([[1, 2]]), torch.tensor([[3]]), tail=None, block_size=100)
    assert kvzip.prompt(block)[0].tolist() == [1, 2, *range(100, 200), 3] and kvzip.transient_tokens == 103


def test_cake_indicator_ranks_bursts_above_steady_attention():
    """Eq. 11 on a hand-made window: 3 queries, 5 earlier entries, then the window's own 3 entries."""
    weights = torch.zeros(1, 2, 3, 8)                              # 1 KV head, a GQA group of 2 query heads
    weights[0, 0, :, 0] = torch.tensor([0.2, 0.2, 0.2])            # steady: mean 0.2, no variance
    weights[0, 0, :, 1] = torch.tensor([0.0, 0.0, 0.45])           # a burst: mean 0.15, variance 0.0675
    weights[0, 0, :, 2] = 0.01                                     # barely attended
    weights[0, 1, :, 3] = 0.3                                      # attended by the group's other head only
    scores = CakeScorer(window=3, gamma=200.0, pool_kernel=1).window_scores(weights)[0]
    assert scores[:5].tolist() == pytest.approx([0.2, 0.15 + 200 * 0.0675, 0.01, 0.3, 0.0])
    assert scores.argsort(descending=True)[3:].tolist() == [1, 3, 0, 2, 4]  # after the window
    assert torch.isinf(scores[5:]).all()                           # the window itself is always kept
    mean_only = CakeScorer(window=3, gamma=0.0, pool_kernel=1).window_scores(weights)[0]
    assert mean_only[0] > mean_only[1]                             # without the variance the burst loses
    pooled = CakeScorer(window=3, gamma=200.0, pool_kernel=3).window_scores(weights)[0]
    assert pooled[4] == pytest.approx(0.1)                         # entry 4 borrows from its neighbour 3
    assert pooled[0] > 4 and pooled[2] > 4                         # the burst spreads to both neighbours


@pytest.mark.parametrize("method", [m for m in METHODS if m != "full" and not REGISTRY[m].episodic
                                    and not REGISTRY[m].trained])  # episodic ones: tests/test_routed.py too
def test_every_baseline_ingests_and_answers_within_its_bound(method, tmp_path, tiny_lm, encoder):
    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=4, topics=2, turns_per_topic=16)[0]))
    store = Store(tmp_path / "home")
    config = IngestConfig(
        cache=CacheConfig(method=method, budget=96, block_size=48, prefill="block"),
        episodes=EpisodeConfig(patched_prompt_tokens=48),
    )
    report = ingest(history, name="h", config=config, store=store, lm=tiny_lm, encoder=encoder)
    assert report.episodes == 1 and report.budgets == [96, 96]  # baselines build one query-agnostic cache
    transient = {"snapkv": 64, "kvzip": 48 + 40, "infinipot": 40}.get(method, 0)
    assert report.peak_layer_entries <= 96 + 48 + transient
    if method == "cake":  # evicts each layer during the block's forward: one layer holds the block at a time
        assert report.peak_total_entries <= 2 * 96 + 48
    assert Session(store, store.get("h"), tiny_lm, encoder).ask("Which gate?").conversation == "h"
