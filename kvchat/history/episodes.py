"""Episodes: a history cut into segments of w turns, embedded, clustered with K-Means (EpiCache §3.1).

Each episode keeps its centroid (for routing questions) and its medoid segments, the ones closest to
the centroid, which become the patched prompt that decides what its cache keeps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Episode:
    index: int
    centroid: np.ndarray        # unit norm
    segments: tuple[int, ...]   # member segment indices, closest to the centroid first
    medoid_text: str            # the closest segments, joined, within the token cap


def segment(lines: Sequence[str], window: int) -> list[str]:
    """Consecutive groups of `window` rendered turns."""
    if window < 1:
        raise ValueError("window must be >= 1")
    return ["\n".join(lines[i : i + window]) for i in range(0, len(lines), window)]


def cluster(embeddings: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """K-Means (k-means++) labels and unit-norm centroids; k is capped at the number of segments."""
    from sklearn.cluster import KMeans  # scikit-learn and SciPy load here: answering a question needs neither
    from sklearn.exceptions import ConvergenceWarning

    k = max(1, min(k, len(embeddings)))
    if k == 1:
        return np.zeros(len(embeddings), dtype=int), _unit(embeddings.mean(axis=0, keepdims=True))
    with warnings.catch_warnings():
        # Fewer distinct segments than k (repeated turns): K-Means says so, and leaves some clusters empty or
        # duplicated; that is a property of the history, not something to print on every ingest.
        warnings.simplefilter("ignore", ConvergenceWarning)
        km = KMeans(n_clusters=k, init="k-means++", n_init=10, random_state=seed).fit(embeddings)
    return km.labels_, _unit(km.cluster_centers_)


def build_episodes(
    segments: Sequence[str],
    embeddings: np.ndarray,
    *,
    k: int,
    seed: int,
    token_cap: int,
    count_tokens: Callable[[str], int],
) -> list[Episode]:
    """Cluster segments into episodes; medoid text = nearest segments until `token_cap` tokens."""
    labels, centroids = cluster(embeddings, k, seed)
    episodes = []
    for index, centroid in enumerate(centroids):
        members = np.flatnonzero(labels == index)
        order = members[np.argsort(-(embeddings[members] @ centroid), kind="stable")]
        chosen: list[str] = []
        used = 0
        for seg in order:
            cost = count_tokens(segments[seg])
            if chosen and used + cost > token_cap:
                break
            chosen.append(segments[seg])
            used += cost
        episodes.append(Episode(index, centroid, tuple(int(s) for s in order), "\n".join(chosen)))
    return episodes


def route(query: np.ndarray, centroids: np.ndarray) -> tuple[int, float]:
    """Index of the most similar centroid (cosine; EpiCache eq. 7) and that similarity."""
    sims = centroids @ query
    best = int(np.argmax(sims))
    return best, float(sims[best])


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)).astype(np.float32)
