"""Which offloaded pages each KV head loads for the current queries (IceCache §4.2, App. B.2).

Per KV head, the queries of its GQA group (every query head of the group, every query token) score
the head's pages; the best pages are loaded until R entries. Different heads load different pages.
Two page scorers, the two the issue's table compares:

- `centroid`: a page's estimated share of the attention, from its mean key: per query row,
  softmax over pages of `scale * q.centroid + log(entries)`. One `[rows, P]` matmul on the centroids
  held in memory; no key is read until the chosen pages are.
- `top-keys`: the exact attention of every offloaded key (softmax over the head's entries per row),
  a page scoring as its best key, so pages are taken in the order of their top keys (IceCache's
  "top-k keys, then their pages" with an exact search). Reads every offloaded key of the head.

Both are softmax weights per query row, so rows with different query norms are comparable and the
max over rows and the group's heads is EpiCache eq. 3's aggregation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvchat.kv.pages import HeadPages

# (queries [rows, D], one head's pages, softmax scale) -> one score per page [P]; higher = load first.
PageScorer = Callable[[torch.Tensor, HeadPages, float], torch.Tensor]


def centroid_scores(queries: torch.Tensor, pages: HeadPages, scale: float) -> torch.Tensor:
    """Max over query rows of each page's estimated attention share (mean-key logit, page size)."""
    logits = queries.float() @ pages.centroids.float().T * scale + pages.lengths.float().log()
    return logits.softmax(dim=-1).amax(dim=0)


def top_key_scores(queries: torch.Tensor, pages: HeadPages, scale: float) -> torch.Tensor:
    """Max over query rows and the page's entries of the exact attention weight over the head's entries."""
    weights = (queries.float() @ pages.keys.float().T * scale).softmax(dim=-1).amax(dim=0)
    return torch.zeros(pages.num_pages).scatter_reduce(0, pages.page_of_entry(), weights, "amax")


PAGE_SCORERS: dict[str, PageScorer] = {"centroid": centroid_scores, "top-keys": top_key_scores}


def select_pages(scores: torch.Tensor, lengths: torch.Tensor, budget: int) -> torch.Tensor:
    """Page ids, best first, of the longest run of best pages that holds at most `budget` entries
    (ties: the lower page id first)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[torch.cumsum(lengths[order], 0) <= budget]


@dataclass(frozen=True)
class Retrieved:
    """The entries one KV head loaded: keys/values `[r, D]`, original positions `[r]`, and the pages."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    pages: torch.Tensor


def retrieve(
    query: torch.Tensor,
    layer: Sequence[HeadPages],
    budget: int,
    scorer: PageScorer = centroid_scores,
    scale: float | None = None,
) -> list[Retrieved]:
    """For one layer: per KV head, the best pages for `query` `[1, q_heads, q, D]` (post-RoPE, as the
    attention sees it) up to `budget` entries. Query heads are grouped as GQA groups them: KV head h
    serves query heads `h*group .. (h+1)*group-1`."""
    _, q_heads, _, dim = query.shape
    if q_heads % len(layer):
        raise ValueError(f"{q_heads} query heads do not group over {len(layer)} KV heads")
    group = q_heads // len(layer)
    scale = scale if scale is not None else dim**-0.5
    out = []
    for h, pages in enumerate(layer):
        if pages.num_pages == 0 or budget <= 0:
            chosen = torch.zeros(0, dtype=torch.long)
        else:
            rows = query[0, h * group : (h + 1) * group].reshape(-1, dim)
            chosen = select_pages(scorer(rows, pages, scale), pages.lengths, budget)
        out.append(Retrieved(*pages.gather(chosen), chosen))
    return out
