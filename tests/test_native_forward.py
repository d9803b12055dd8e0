"""`kv.forward.forward` through the native Llama computes what it computes through transformers' model and
kvchat's attention for every cache layout and option: recorders (with the layers' hidden states or not), int8 and
int4 caches, ragged (adaptive head budgets), paged with attached pages (the per-head path and the paged decode),
latent memories (the additive and the mass readout). The same logits, the same recorded attention, the same cache
after."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from conftest import random_ids, with_kvchat_attention
from transformers import AutoModelForCausalLM

from kvchat.config import PagingConfig
from kvchat.kv.attention import LayerView
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.indexer import IndexMemShape
from kvchat.kv.latent import LatentMemory, MemoryWeights
from kvchat.kv.layers import PagedLayer, QuantizedLayer, RaggedLayer, UniformLayer
from kvchat.kv.pagefile import open_pages
from kvchat.kv.prefill import block_prefill, keep_sink_and_window
from kvchat.kv.retrieval import attach_pages
from kvchat.kv.scoring import KeyDiffScorer, PatchedPromptScorer
from kvchat.kv.spill import SpillWriter
from kvchat.model import native_llama

CPU = torch.device("cpu")
STEPS = 5


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """The tiny Llama built natively, and as transformers loads it (with kvchat's attention)."""
    native = native_llama.load(tiny_model_dir, torch.float32, CPU)
    assert native is not None
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return native, with_kvchat_attention(reference).eval()


@dataclass
class Views:
    """A recorder keeping every layer view it is shown."""

    query_rows: int | None = None
    needs_hidden: bool = False
    views: list[LayerView] = field(default_factory=list)

    def record(self, view: LayerView) -> None:
        self.views.append(view)


def _prefilled(reference, vocab: int, *, heads: HeadBudgets = HeadBudgets(), on_evict=None) -> EpisodeCache:
    """A history of 80 tokens after a 4-token prefix, evicted block by block down to 24 entries per head (by a
    patched prompt's attention where the heads keep their own numbers of entries)."""
    scorer = KeyDiffScorer() if heads.mode == "uniform" else PatchedPromptScorer(random_ids(6, seed=7, vocab=vocab))
    return block_prefill(reference, random_ids(4, vocab=vocab), random_ids(80, seed=2, vocab=vocab), block_size=16,
                         budgets=[24, 24], scorer=scorer, heads=heads, on_evict=on_evict).cache


def _paged(reference, vocab: int, tmp_path, paged_decode: bool) -> tuple[EpisodeCache, EpisodeCache]:
    """Two copies of one cache whose entries between the prefix and the last 8 are offloaded to pages, each with
    its own page pool (8 entries retrieved per head, refreshed every 2 tokens)."""
    cfg = reference.config
    spill = SpillWriter(tmp_path, num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, dtype=torch.float32)
    cache = block_prefill(reference, random_ids(5, vocab=vocab), random_ids(90, seed=2, vocab=vocab), block_size=16,
                          budgets=None, scorer=None, on_evict=spill).cache
    keep_sink_and_window(cache, window=8)
    spill.write_pages(tmp_path / "pages.safetensors", PagingConfig(page_size=4, cluster_size=4))
    copies = cache.copy(), cache.copy()
    for copy in copies:
        attach_pages(copy, open_pages(tmp_path / "pages.safetensors"), budget=8, refresh=2, paged_decode=paged_decode)
        assert all(isinstance(layer, PagedLayer) and (layer.pool.paged is not None) == paged_decode
                   for layer in copy.layers)
    return copies


def _with_memory(reference, vocab: int, readout: str) -> EpisodeCache:
    """A cache whose evicted entries were written into a latent memory with random features and open gates."""
    torch.manual_seed(3)
    weights = MemoryWeights(IndexMemShape.of(reference.config), readout)
    with torch.no_grad():
        for phi, gate in zip(weights.phi, weights.gate, strict=True):
            torch.nn.init.normal_(phi.weight, std=0.3)
            gate.bias.fill_(2.0)
    memory = LatentMemory(weights)
    cache = _prefilled(reference, vocab, on_evict=memory.writer(reference.model.rotary_emb))
    assert memory.written > 0
    cache.memory = memory
    return cache


LAYOUTS = ["uniform", "int8", "int4", "ragged", "paged", "paged-decode", "memory-additive", "memory-mass"]


def _caches(layout: str, reference, vocab: int, tmp_path) -> tuple[EpisodeCache, EpisodeCache]:
    """Two equal caches of `layout`, one for each model."""
    if layout.startswith("paged"):
        return _paged(reference, vocab, tmp_path, paged_decode=layout == "paged-decode")
    if layout.startswith("memory"):
        cache = _with_memory(reference, vocab, layout.removeprefix("memory-"))
    elif layout == "ragged":
        cache = _prefilled(reference, vocab, heads=HeadBudgets("adaptive"))
        assert all(isinstance(layer, RaggedLayer) for layer in cache.layers)
        assert len(set(cache.layers[0].lengths)) > 1  # the heads keep different numbers of entries
    else:
        cache = _prefilled(reference, vocab)
    copies = cache.copy(), cache.copy()
    if layout in ("int8", "int4"):
        for copy in copies:
            copy.quantize(group=8, residual=4, bits=int(layout[-1]))
            assert all(isinstance(layer, QuantizedLayer) for layer in copy.layers) and copy.precision == layout
    elif layout == "uniform":
        assert all(type(layer) is UniformLayer for layer in cache.layers)
    return copies


def _answered(feed, cache: EpisodeCache, question: torch.Tensor, recorder) -> list[torch.Tensor]:
    """The question's logits, then those of each greedy token fed one at a time, all seen by `recorder`."""
    logits = [feed(cache, question, recorder)]
    for _ in range(STEPS):
        logits.append(feed(cache, logits[-1][:, -1:].argmax(-1), recorder))
    return logits


def _per_head(entries) -> list[torch.Tensor]:
    if isinstance(entries, torch.Tensor):
        return [entries[:, h] for h in range(entries.shape[1])] if entries.dim() == 4 else list(entries)
    return [e.reshape(-1, *e.shape[-1:]) if e.dim() == 4 else e for e in entries]


def _same_cache(ours: EpisodeCache, theirs: EpisodeCache) -> None:
    assert ours.next_position == theirs.next_position and ours.sizes == theirs.sizes
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        assert type(a) is type(b)
        for got, expected in ((a.keys, b.keys), (a.values, b.values)):
            for g, e in zip(_per_head(got), _per_head(expected), strict=True):
                torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-6)
        for g, e in zip(_per_head(a.positions), _per_head(b.positions), strict=True):
            assert torch.equal(g, e)
        if isinstance(a, PagedLayer):  # the same entries retrieved for the last token
            for g, e in zip(a.pool.current, b.pool.current, strict=True):
                assert torch.equal(g.positions, e.positions)


def _same_views(ours: list[LayerView], theirs: list[LayerView]) -> None:
    assert len(ours) == len(theirs) == (STEPS + 1) * 2
    for a, b in zip(ours, theirs, strict=True):
        assert (a.layer_idx, a.past, a.scale, a.softcap) == (b.layer_idx, b.past, b.scale, b.softcap)
        torch.testing.assert_close(a.weights, b.weights, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a.queries, b.queries, atol=1e-6, rtol=1e-5)
        assert (a.hidden is None) == (b.hidden is None)
        if a.hidden is not None:
            torch.testing.assert_close(a.hidden, b.hidden, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("recording", [None, "weights", "hidden"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_native_forward_is_transformers_forward_for_every_cache(models, layout, recording, tmp_path):
    native, reference = models
    vocab = native.config.vocab_size
    ours, theirs = _caches(layout, reference, vocab, tmp_path)
    question = random_ids(9, seed=7, vocab=vocab)
    recorders = [None, None] if recording is None else [Views(needs_hidden=recording == "hidden") for _ in range(2)]
    got = _answered(lambda c, i, r: forward(native, c, i, recorder=r), ours, question, recorders[0])
    expected = _answered(lambda c, i, r: forward(reference, c, i, recorder=r), theirs, question, recorders[1])
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape == (1, 1, vocab)
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        assert int(g.argmax()) == int(e.argmax())
    _same_cache(ours, theirs)
    if recording is not None:
        _same_views(recorders[0].views, recorders[1].views)
        assert all((v.hidden is not None) == (recording == "hidden") for v in recorders[0].views)
    if layout.startswith("memory"):  # the memory's readout changed the answer: it was read
        cache = _caches(layout, reference, vocab, tmp_path)[0]
        cache.memory = None
        assert not torch.allclose(forward(native, cache, question), got[0], atol=1e-4)
