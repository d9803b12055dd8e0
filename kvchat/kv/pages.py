"""IceCache pages: one KV head's offloaded entries, grouped by key similarity into small pages.

Why group by similarity: answering loads whole pages, so the entries one query needs should share
pages; contiguous (positional) pages scatter them (IceCache §4.1). Keys are grouped where Euclidean
nearest neighbour equals maximum inner product (IceCache eqs. 2-3): `T_K(k) = [k/c, sqrt(1-|k|^2/c^2)]`
with `c = max |k|`, `T_Q(q) = [q/|q|, 0]`, so `|T_Q(q) - T_K(k)|^2 = 2 - 2 q.k / (|q| c)`. K-means on
`T_K(keys)` (a few seeded Lloyd iterations, see `kmeans`), then each cluster is cut into pages of at
most `page_size` entries along one random projection, the order the official code gives entries
inside a tree node. Each page keeps the mean of its keys as its centroid: `q . centroid` is the mean
logit of the page's entries, which is what page scoring needs (kvchat.kv.retrieval).

Keys are cached after RoPE, so they are grouped as the attention sees them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from kvchat.kv.config import PagingConfig


@dataclass(frozen=True)
class HeadPages:
    """One KV head's offloaded entries stored page after page.

    `keys`/`values` `[n, D]` and `positions` `[n]` (original token positions) hold page 0's entries,
    then page 1's, ...; `lengths` `[P]` says how many entries each page has (all >= 1) and `centroids`
    `[P, D]` the mean key of each page. `at` `[n]`, when set, are the positions the keys are rotated for, where
    those are not the original ones (a compacted cache's offload, kvchat.kv.spill). The tensors may be `FileRows`
    of a pages file (kvchat.kv.pagefile); only what `take` selects is then read from disk.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    centroids: torch.Tensor
    at: torch.Tensor | None = None

    @property
    def rotated_for(self) -> torch.Tensor:
        """The positions the keys are rotated for `[n]`."""
        return self.positions if self.at is None else self.at

    @property
    def num_pages(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_entries(self) -> int:
        return int(self.keys.shape[0])

    @property
    def starts(self) -> torch.Tensor:
        """First row of every page `[P]`."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    def page_of_entry(self) -> torch.Tensor:
        """The page of every row `[n]`."""
        return torch.repeat_interleave(torch.arange(self.num_pages), self.lengths.to(torch.long))

    def rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Row indices of the entries of `pages` (1-D page ids), page by page in the given order."""
        lengths = self.lengths[pages].to(torch.long)
        if lengths.numel() == 0:
            return torch.zeros(0, dtype=torch.long)
        first_row = torch.repeat_interleave(self.starts[pages].to(torch.long), lengths)
        first_out = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        return first_row + torch.arange(int(lengths.sum())) - first_out

    def take(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys `[r, D]`, values `[r, D]` and positions `[r]` (long) of the entries at `rows`."""
        return (
            self.keys.index_select(0, rows),
            self.values.index_select(0, rows),
            self.positions.index_select(0, rows).to(torch.long),
        )

    @classmethod
    def empty(cls, head_dim: int, dtype: torch.dtype = torch.float32) -> HeadPages:
        return cls(
            torch.zeros(0, head_dim, dtype=dtype),
            torch.zeros(0, head_dim, dtype=dtype),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, head_dim, dtype=dtype),
        )


def mips_keys(keys: torch.Tensor) -> torch.Tensor:
    """`T_K`: keys `[n, D]` as points `[n, D+1]` on the unit sphere whose Euclidean nearest neighbour to
    `mips_queries(q)` is the key of largest `q . k` (IceCache eq. 2, with c the largest key norm)."""
    keys = keys.float()
    norms = keys.norm(dim=-1, keepdim=True)
    c = norms.max().clamp_min(torch.finfo(torch.float32).tiny)
    last = (1 - (norms / c).square()).clamp_min(0).sqrt()
    return torch.cat([keys / c, last], dim=-1)


def mips_queries(queries: torch.Tensor) -> torch.Tensor:
    """`T_Q`: queries `[..., D]` as unit points `[..., D+1]` with a zero last coordinate (eq. 3)."""
    queries = queries.float()
    unit = queries / queries.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.cat([unit, unit.new_zeros(*unit.shape[:-1], 1)], dim=-1)


def kmeans(points: torch.Tensor, clusters: int, iterations: int, seed: int) -> torch.Tensor:
    """Cluster label of every point `[n]`: scikit-learn's Lloyd k-means from `clusters` random points,
    at most `iterations` steps. Random initialisation, not k-means++: at n/16 clusters the ++ seeding
    costs more than the iterations and pages recall no better (benchmarks/icecache_pages.py)."""
    from sklearn.cluster import KMeans  # scikit-learn and SciPy load here: answering a question needs neither
    from sklearn.exceptions import ConvergenceWarning

    n = points.shape[0]
    clusters = max(1, min(clusters, n))
    if clusters == 1:
        return torch.zeros(n, dtype=torch.long)
    with warnings.catch_warnings():  # fewer distinct points than clusters: some clusters stay empty
        warnings.simplefilter("ignore", ConvergenceWarning)
        labels = KMeans(clusters, init="random", n_init=1, max_iter=iterations, random_state=seed).fit_predict(
            points.numpy()
        )
    return torch.from_numpy(labels).to(torch.long)


def semantic_pages(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, config: PagingConfig = PagingConfig()
) -> HeadPages:
    """IceCache pages of one head's entries (`keys`/`values` `[n, D]`, `positions` `[n]`): k-means on
    `T_K(keys)` into about n / cluster_size clusters, each cut along one random projection into
    nearly equal pages of at most `page_size` entries. Deterministic for `config.seed`."""
    n = keys.shape[0]
    if n == 0:
        return HeadPages.empty(keys.shape[-1], keys.dtype)
    points = mips_keys(keys)
    labels = kmeans(points, -(-n // config.cluster_size), config.iterations, config.seed)
    return pages_from_clusters(keys, values, positions, labels, config.page_size, config.seed)


def pages_from_clusters(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    labels: torch.Tensor,
    page_size: int,
    seed: int = 0,
) -> HeadPages:
    """Pages of clustered entries (`labels` `[n]`): each cluster is ordered along one random projection
    of `T_K(keys)` (the same direction for every cluster) and cut into the fewest nearly equal pages
    of at most `page_size` entries."""
    direction = torch.randn(keys.shape[-1] + 1, generator=torch.Generator().manual_seed(seed))
    projection = mips_keys(keys) @ direction
    # Entries sorted by (cluster, projection): every cluster is one contiguous run.
    by_projection = torch.argsort(projection, stable=True)
    order = by_projection[torch.argsort(labels[by_projection], stable=True)]
    sizes = torch.bincount(labels)
    lengths = torch.cat([_split_evenly(int(m), page_size) for m in sizes.tolist() if m > 0])
    return pages_from_order(keys, values, positions, order, lengths)


def positional_pages(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, page_size: int = 16
) -> HeadPages:
    """Contiguous pages in position order (Quest/ArkVale/PagedAttention): the baseline semantic pages are
    measured against. With `page_size=1` every entry is its own page (token-level retrieval)."""
    n = keys.shape[0]
    if n == 0:
        return HeadPages.empty(keys.shape[-1], keys.dtype)
    order = torch.argsort(positions, stable=True)
    full, rest = divmod(n, page_size)
    lengths = torch.tensor([page_size] * full + ([rest] if rest else []), dtype=torch.long)
    return pages_from_order(keys, values, positions, order, lengths)


def pages_from_order(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, order: torch.Tensor, lengths: torch.Tensor
) -> HeadPages:
    """Pages from a permutation of the entries `order` `[n]` and consecutive page sizes `lengths` `[P]`."""
    keys, values = keys.index_select(0, order), values.index_select(0, order)
    page = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    sums = torch.zeros(lengths.shape[0], keys.shape[-1]).index_add_(0, page, keys.float())
    centroids = (sums / lengths.unsqueeze(-1)).to(keys.dtype)
    return HeadPages(keys, values, positions.index_select(0, order).to(torch.long), lengths, centroids)


def _split_evenly(count: int, page_size: int) -> torch.Tensor:
    """Sizes of the fewest pages of at most `page_size` that hold `count` entries, as equal as possible."""
    pages = -(-count // page_size)
    base, extra = divmod(count, pages)
    return torch.tensor([base + 1] * extra + [base] * (pages - extra), dtype=torch.long)
