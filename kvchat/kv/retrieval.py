"""Which offloaded pages each KV head loads for the current queries (IceCache §4.2, App. B.2).

Per KV head, the queries of its GQA group (every query head of the group, every query token) score
the head's pages; the best pages are loaded until R entries. Different heads load different pages.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/retrieval.py".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvchat.kv import backends
from kvchat.kv.attention import Retrieved as Retrieved  # defined beside PageSource, which returns it
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.layers import PagedLayer
from kvchat.kv.paged_decode import FlashinferPagedDecode, PagedDecode
from kvchat.kv.pages import HeadPages

# (queries [rows, D], one head's pages, softmax scale, entries to retrieve R) -> one score per page [P];
# higher = load first.
PageScorer = Callable[[torch.Tensor, HeadPages, float, int], torch.Tensor]


def centroid_scores(queries: torch.Tensor, pages: HeadPages, scale: float, budget: int = 0) -> torch.Tensor:
    """Max over query rows of each page's estimated attention share (mean-key logit, page size)."""
    logits = queries.float() @ pages.centroids.float().T * scale + pages.lengths.float().log()
    return logits.softmax(dim=-1).amax(dim=0)


def top_key_scores(queries: torch.Tensor, pages: HeadPages, scale: float, budget: int = 0) -> torch.Tensor:
    """Max over query rows and the page's entries of the exact attention weight over the head's entries."""
    return _best_key_scores(queries, pages, torch.arange(pages.num_pages), scale)


@dataclass(frozen=True)
class TwoStageScorer:
    """Centroid scores choose candidate pages of up to `candidates x R` entries; those score by their keys
    (as `top_key_scores`, the softmax over the candidates' entries), the other pages below them all."""

    candidates: int = 4

    def __call__(self, queries: torch.Tensor, pages: HeadPages, scale: float, budget: int) -> torch.Tensor:
        coarse = centroid_scores(queries, pages, scale)
        return _best_key_scores(queries, pages, select_pages(coarse, pages.lengths, self.candidates * budget), scale)


def _best_key_scores(queries: torch.Tensor, pages: HeadPages, chosen: torch.Tensor, scale: float) -> torch.Tensor:
    """Pages `chosen` score as their best key (max over query rows of the softmax over the chosen pages'
    entries); the others score -1."""
    keys = pages.keys.index_select(0, pages.rows(chosen))
    weights = (queries.float() @ keys.float().T * scale).softmax(dim=-1).amax(dim=0)
    page = torch.repeat_interleave(chosen, pages.lengths[chosen].to(torch.long))
    return torch.full((pages.num_pages,), -1.0).scatter_reduce(0, page, weights, "amax")


@dataclass(frozen=True)
class EntryScorer:
    """Centroid scores choose candidate pages of up to `candidates x R` entries; their keys are scored
    exactly (the softmax over the candidates' entries, max over query rows) and the best R entries are read.
    Closer to full KV than reading whole pages, near the oracle that scores every key
    (benchmarks/results/icecache_pages_entries.md)."""

    candidates: int = 8

    def rows(self, queries: torch.Tensor, pages: HeadPages, scale: float, budget: int,
             pinned: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the best `budget` entries, best first; `pinned` rows first whatever they score."""
        coarse = centroid_scores(queries, pages, scale)
        rows = pages.rows(select_pages(coarse, pages.lengths, self.candidates * budget))
        first = 0
        if pinned is not None and pinned.numel():
            rows, first = torch.cat([pinned, rows[~torch.isin(rows, pinned)]]), pinned.numel()
        weights = (queries.float() @ pages.keys.index_select(0, rows).float().T * scale).softmax(dim=-1).amax(dim=0)
        weights[:first] = float("inf")
        return rows[torch.sort(weights, descending=True, stable=True).indices[:budget]]


Scorer = PageScorer | EntryScorer

PAGE_SCORERS: dict[str, Scorer] = {
    "centroid": centroid_scores, "top-keys": top_key_scores, "two-stage": TwoStageScorer(), "entries": EntryScorer(),
}


def page_scorer(name: str, candidates: int = EntryScorer.candidates) -> Scorer:
    """The scorer `name` (a key of `PAGE_SCORERS`); `two-stage` and `entries` with `candidates` x R candidate
    entries."""
    if name == "two-stage":
        return TwoStageScorer(candidates)
    return EntryScorer(candidates) if name == "entries" else PAGE_SCORERS[name]


def choose_rows(scorer: Scorer, queries: torch.Tensor, pages: HeadPages, scale: float, budget: int,
                pinned: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `pages` to read for `queries [rows, D]`, best first, at most `budget`; the `pinned` rows come
    first (a page scorer pins the pages they fill whole, which is how `PagePool` pins them)."""
    if isinstance(scorer, EntryScorer):
        return scorer.rows(queries, pages, scale, budget, pinned)
    scores = scorer(queries, pages, scale, budget)
    if pinned is not None and pinned.numel():
        filled = torch.bincount(pages.page_of_entry()[pinned], minlength=pages.num_pages)
        scores = scores.masked_fill(filled == pages.lengths, float("inf"))
    return pages.rows(select_pages(scores, pages.lengths, budget))


def select_pages(scores: torch.Tensor, lengths: torch.Tensor, budget: int) -> torch.Tensor:
    """Page ids, best first, of the longest run of best pages that holds at most `budget` entries
    (ties: the lower page id first)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[torch.cumsum(lengths[order], 0) <= budget]


def retrieve(
    query: torch.Tensor,
    layer: Sequence[HeadPages],
    budget: int,
    scorer: Scorer = centroid_scores,
    scale: float | None = None,
    pinned: Sequence[torch.Tensor] | None = None,
) -> list[Retrieved]:
    """For one layer: per KV head, the best entries for `query` `[1, q_heads, q, D]` (post-RoPE, as the
    attention sees it), up to `budget`, whole pages or single entries as `scorer` reads them; `pinned[h]`
    (rows, at most `budget`) are taken first whatever they score. Query heads are grouped as GQA groups
    them: KV head h serves query heads `h*group .. (h+1)*group-1`."""
    _, q_heads, _, dim = query.shape
    if q_heads % len(layer):
        raise ValueError(f"{q_heads} query heads do not group over {len(layer)} KV heads")
    group = q_heads // len(layer)
    scale = scale if scale is not None else dim**-0.5
    if layer:  # the pages live off the accelerator (IceCache): they are scored where they are
        query = query.to(layer[0].keys.device)
    out = []
    for h, pages in enumerate(layer):
        if pages.num_pages == 0 or budget <= 0:
            chosen = torch.zeros(0, dtype=torch.long)
        else:
            queries = query[0, h * group : (h + 1) * group].reshape(-1, dim)
            chosen = choose_rows(scorer, queries, pages, scale, budget, None if pinned is None else pinned[h])
        out.append(Retrieved(*pages.take(chosen), chosen))
    return out


@dataclass
class PagePool:
    """The offloaded entries one layer attends to while a question is answered.

    The question's forward (the first after `clear`) chooses each head's best entries up to `budget`;
    the best of them, up to `pinned_share x budget` entries, stay for the whole answer. Every
    `refresh` decoded tokens the current token's queries choose the rest again (0: never). `clear`
    (rollback after the answer) empties the pool.

    With `paged` (kvchat.kv.paged_decode), a decode token attends through it: the layer's and the retrieved
    entries in one slot buffer, one paged decode per layer (flashinfer's where it runs). Without, kvchat's
    attention concatenates them per head at every step (the ragged path).
    """

    layer: Sequence[HeadPages]
    budget: int
    scorer: Scorer = centroid_scores
    refresh: int = 8
    pinned_share: float = 0.5
    paged: PagedDecode | None = None
    _current: list[Retrieved] | None = field(default=None, init=False, repr=False)
    _pinned: list[torch.Tensor] | None = field(default=None, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)

    def retrieved(self, query: torch.Tensor, scale: float | None = None) -> list[Retrieved]:
        """Each head's entries for this forward's `query` `[1, q_heads, q, D]`."""
        if self._current is None:
            self._current = retrieve(query, self.layer, self.budget, self.scorer, scale)
            keep = int(self.pinned_share * self.budget)
            self._pinned = [got.rows[:keep] for got in self._current]
            self._steps = 0
        else:
            self._steps += 1
            if self.refresh and self._steps % self.refresh == 0:
                self._current = retrieve(query, self.layer, self.budget, self.scorer, scale, self._pinned)
        return self._current

    @property
    def current(self) -> list[Retrieved] | None:
        """Each head's entries the latest forward attended to (None before the question's forward and after
        `clear`); evaluation reads it at the first answer token to count retrieved evidence."""
        return self._current

    def clear(self) -> None:
        self._current, self._pinned, self._steps = None, None, 0
        if self.paged is not None:
            self.paged.slots.clear()


def attach_pages(
    cache: EpisodeCache,
    pages: Sequence[Sequence[HeadPages]],
    *,
    budget: int,
    scorer: Scorer = centroid_scores,
    refresh: int = 8,
    pinned_share: float = 0.5,
    paged_decode: bool | None = None,
) -> None:
    """Make `cache` answer with its offloaded `pages` (per layer, per KV head, e.g. kvchat.kv.pagefile's
    `decode`): every layer with pages becomes a `PagedLayer` over its own `PagePool`.

    `paged_decode`: decode tokens attend through a `PagedDecode` (one flashinfer wrapper and workspace for
    the cache's layers); None: where flashinfer runs for the cache's device and dtype (kvchat.kv.backends),
    elsewhere the ragged path (on the CPU the faster of the two, benchmarks/results/icecache_speed.md; the paged
    one's torch reference is what tests use)."""
    if len(pages) != len(cache.layers):
        raise ValueError(f"pages for {len(pages)} layers, the cache has {len(cache.layers)}")
    kernel = FlashinferPagedDecode()  # built at its first call, if flashinfer runs
    for i, layer_pages in enumerate(pages):
        if len(layer_pages) != len(cache.layers[i].lengths):
            heads = len(cache.layers[i].lengths)
            raise ValueError(f"layer {i}: pages for {len(layer_pages)} KV heads, the cache has {heads}")
        if any(head.num_pages for head in layer_pages):
            pool = PagePool(layer_pages, budget, scorer, refresh, pinned_share)
            # PageSource.paged (kvchat.kv.attention) is a settable Callable; the pool's is a PagedDecode
            cache.layers[i] = layer = PagedLayer.over(cache.layers[i], pool)  # type: ignore[arg-type]
            if paged_decode is None:
                paged_decode = backends.decode_backend(layer.device, layer.dtype) == "flashinfer"
            if paged_decode:
                pool.paged = PagedDecode(kernel)
