"""Lexical ranking of retrieval chunks (kvchat.answer.lexical) and how RagIndex.top combines it with the encoder's."""

from __future__ import annotations

import numpy as np

from kvchat.answer.lexical import LexicalIndex
from kvchat.answer.rag import Chunk, RagIndex

TEXTS = [
    "Caroline: I went to the support group yesterday, it was lovely.",
    "Melanie: We painted a sunrise with the kids last weekend.",
    "Caroline: The adoption agency called me back this morning.",
    "Melanie: The kids loved the camping trip in the mountains.",
]


def test_the_chunk_sharing_the_rarest_words_ranks_first():
    scores = LexicalIndex(TEXTS).scores("When did Melanie paint a sunrise?")
    assert int(np.argmax(scores)) == 1
    assert scores[0] == 0 and scores[2] == 0  # no shared word: nothing (Melanie's name alone weighs in 1 and 3)
    assert scores[1] > scores[3] > 0


def test_a_question_without_shared_words_scores_zero_and_wordless_chunks_do_not_break_it():
    assert not LexicalIndex(TEXTS).scores("zebra xylophone?").any()
    assert not LexicalIndex(["!!", "? ?", ""]).scores("a b !").any()
    assert LexicalIndex([]).scores("anything").shape == (0,)


def test_the_scores_are_scikit_learns_tfidf_cosines():
    from sklearn.feature_extraction.text import TfidfVectorizer

    texts = [*TEXTS, "Caroline: Caroline's caroline, CAROLINE!\nMelanie: a sunrise; sunrise 2023 2023 2023."]
    vectorizer = TfidfVectorizer(sublinear_tf=True)
    vectors = vectorizer.fit_transform(texts)
    index = LexicalIndex(texts)
    for question in ("When did Melanie paint a sunrise in 2023?", "Caroline caroline adoption", "zebra"):
        expected = (vectors @ vectorizer.transform([question]).T).toarray().ravel()
        np.testing.assert_allclose(index.scores(question), expected, rtol=1e-5, atol=1e-6)


def _index(embeddings: list[list[float]]) -> RagIndex:
    chunks = [Chunk(i, i + 1, text, 10) for i, text in enumerate(TEXTS)]
    vectors = np.asarray(embeddings, dtype=np.float32)
    return RagIndex(chunks, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))


def test_top_ranks_by_words_first_and_by_the_encoder_among_ties():
    index = _index([[1, 0], [0, 1], [1, 0.1], [0.2, 1]])
    query = np.asarray([1, 0], dtype=np.float32)
    assert index.top(query, 1) == [0]  # the encoder alone
    assert index.top(query, 1, "When did Melanie paint a sunrise?") == [1]  # its words, although far by embedding
    # "adoption" is in chunk 2 only; the other three tie at 0 and the encoder orders them: 0 first
    assert index.top(query, 2, "adoption agency?") == [0, 2]
    assert index.top(query, 2, "zebra?") == index.top(query, 2)  # no shared word: the encoder decides
