"""An episode's topic label: the words of its medoid text most distinctive against the other episodes'.

TF-IDF as scikit-learn's `TfidfVectorizer(stop_words="english", sublinear_tf=True)` weighs words (the same tokens,
stop words and weights; a test holds the two equal), computed here with numpy: `kvchat show`, `list` and the REPL's
/episodes label episodes without the second scikit-learn and SciPy take to import.
"""

from __future__ import annotations

import importlib.resources
import math
import re
from collections import Counter
from collections.abc import Sequence
from functools import cache

import numpy as np

_TOKEN = re.compile(r"(?u)\b[^\W\d_][\w'-]{2,}\b")  # a letter, then 2 or more word characters, ' or -


@cache
def stop_words() -> frozenset[str]:
    """English stop words (kvchat/data/stop_words.txt: scikit-learn's list)."""
    text = (importlib.resources.files("kvchat.data") / "stop_words.txt").read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


def topic_labels(medoid_texts: Sequence[str], words: int = 3) -> list[str]:
    """A short label per episode: up to `words` words of its medoid text, most distinctive first (TF-IDF over the
    episodes, speaker names and stop words left out; equal weights in alphabetical order). Computed, never stored."""
    stop = stop_words()
    counts = [Counter(t for t in _TOKEN.findall(_without_speakers(text).lower()) if t not in stop)
              for text in medoid_texts]
    vocabulary = sorted(set().union(*counts))
    if not vocabulary:
        return ["" for _ in medoid_texts]
    documents = len(medoid_texts)
    frequency = Counter(word for c in counts for word in c)
    idf = {word: math.log((1 + documents) / (1 + frequency[word])) + 1 for word in vocabulary}
    labels = []
    for c in counts:
        row = np.array([(1 + math.log(c[word])) * idf[word] if word in c else 0.0 for word in vocabulary])
        top = [i for i in np.argsort(-row, kind="stable")[:words] if row[i] > 0]
        labels.append(", ".join(vocabulary[i] for i in top))
    return labels


def _without_speakers(text: str) -> str:
    """A rendered turn starts with `Speaker:` (and maybe a time): a label names the topic, not who spoke."""
    return "\n".join(line.split(":", 1)[1] if ":" in line[:40] else line for line in text.splitlines())
