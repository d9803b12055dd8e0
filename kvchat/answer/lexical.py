"""Lexical ranking of retrieval chunks: TF-IDF over their words.

Questions about a conversation turn on names, places and rare words ("When did Melanie paint a sunrise?"), which
a small sentence encoder blurs into the topic's other turns; weighting the words a question shares with a chunk by
their rarity in the history finds the turns that hold them (benchmarks/results/retrieval.md compares it with the
encoder by how often the chosen chunks hold a question's evidence turns).

The weighting is scikit-learn's `TfidfVectorizer(sublinear_tf=True)` (its word pattern, smoothed idf, unit-length
vectors; tests/test_lexical.py checks the scores against it), kept as an inverted index here: the answer path
ranks chunks once per question and would otherwise import scikit-learn, which costs more than the ranking.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

_WORD = re.compile(r"(?u)\b\w\w+\b")  # TfidfVectorizer's token_pattern, on lowercased text


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _weights(counts: Counter, idf: dict[str, float]) -> dict[str, float]:
    """Sublinear term frequency times idf, scaled to unit length."""
    weights = {w: (1 + math.log(n)) * idf[w] for w, n in counts.items()}
    norm = math.sqrt(sum(v * v for v in weights.values())) or 1.0
    return {w: v / norm for w, v in weights.items()}


class LexicalIndex:
    """Each word's chunks and TF-IDF weights in them (an inverted index over the chunks' words)."""

    def __init__(self, texts: Sequence[str]) -> None:
        counts = [Counter(_words(text)) for text in texts]
        documents = Counter(word for chunk in counts for word in chunk)
        self._count = len(texts)
        self._idf = {w: math.log((1 + self._count) / (1 + n)) + 1 for w, n in documents.items()}
        postings: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
        for i, chunk in enumerate(counts):
            for word, weight in _weights(chunk, self._idf).items():
                postings[word][0].append(i)
                postings[word][1].append(weight)
        self._postings = {w: (np.asarray(ids), np.asarray(ws, dtype=np.float32)) for w, (ids, ws) in postings.items()}

    def scores(self, question: str) -> np.ndarray:
        """Cosine of `question`'s TF-IDF vector with each chunk's: 0 where they share no word."""
        scores = np.zeros(self._count, dtype=np.float32)
        known = Counter(w for w in _words(question) if w in self._idf)
        for word, weight in _weights(known, self._idf).items():
            chunks, weights = self._postings[word]
            scores[chunks] += weights * weight
        return scores
