"""Lexical ranking of retrieval chunks: TF-IDF (scikit-learn) over their words.

Questions about a conversation turn on names, places and rare words ("When did Melanie paint a sunrise?"), which
a small sentence encoder blurs into the topic's other turns; weighting the words a question shares with a chunk by
their rarity in the history finds the turns that hold them. benchmarks/results/retrieval.md compares it with the
encoder by how often the chosen chunks hold a question's evidence turns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer


class LexicalIndex:
    """Chunks' TF-IDF vectors (sublinear term frequency, English stop words left out), unit length."""

    def __init__(self, texts: Sequence[str]) -> None:
        self._vectorizer = TfidfVectorizer(sublinear_tf=True, stop_words="english")
        try:
            self._vectors = self._vectorizer.fit_transform(texts)
        except ValueError:  # no word of any chunk survives (all stop words or symbols): nothing ranks lexically
            self._vectorizer, self._vectors = None, None
        self._count = len(texts)

    def scores(self, question: str) -> np.ndarray:
        """Cosine of `question`'s TF-IDF vector with each chunk's: 0 where they share no weighted word."""
        if self._vectorizer is None:
            return np.zeros(self._count, dtype=np.float32)
        return (self._vectors @ self._vectorizer.transform([question]).T).toarray().ravel().astype(np.float32)
