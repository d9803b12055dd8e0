"""The sentence encoder: sentence-transformers' embeddings, computed with `tokenizers` and BERT in torch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvchat.errors import UserError
from kvchat.model.encoder import ENCODER_BATCH, SentenceEncoder, default_encoder_path

TEXTS = [
    "How many tomato plants did Tom plant this spring?",
    "  surrounded by spaces and a newline \n",
    "",
    "x",
    "word " * 400,  # past the encoder's 256 tokens: cut as sentence-transformers cuts it
    "Émile: ça va? 😀 日本語",
    *[f"segment {i} " * (i % 40) for i in range(2 * ENCODER_BATCH + 5)],  # several batches of mixed lengths
]


def test_embeddings_are_sentence_transformers_own(encoder):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(str(default_encoder_path()), device="cpu",
                                                          local_files_only=True)  # fmt: skip
    expected = reference.encode(TEXTS, batch_size=ENCODER_BATCH, convert_to_numpy=True, normalize_embeddings=True,
                                show_progress_bar=False)  # fmt: skip
    got = encoder.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == (len(TEXTS), encoder.dimension)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_embeddings_are_transformers_bert_models_own(encoder):
    """What kvchat computed through transformers' tokenizer and `BertModel` before it computed BERT itself."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = str(default_encoder_path())
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    texts = [text.strip() for text in TEXTS]
    with torch.inference_mode():
        batch = tokenizer(texts, padding=True, truncation="longest_first", max_length=encoder.max_length,
                          return_tensors="pt")  # fmt: skip
        states = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        expected = torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=1).numpy()
    np.testing.assert_allclose(encoder.embed(TEXTS), expected, atol=1e-5)


def test_embeddings_do_not_depend_on_the_batch_they_are_in(encoder):
    alone = np.concatenate([encoder.embed([text]) for text in TEXTS[:8]])
    np.testing.assert_allclose(encoder.embed(TEXTS)[:8], alone, atol=1e-5)
    assert encoder.embed([]).shape == (0, encoder.dimension)


def test_an_encoder_that_is_not_bert_is_refused_in_one_line(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta", "hidden_size": 8}))
    with pytest.raises(UserError, match="not a BERT model kvchat can run"):
        SentenceEncoder(tmp_path)


def test_an_encoder_that_does_not_mean_pool_is_refused_before_it_loads(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    with pytest.raises(UserError, match="only a mean-pooling encoder"):
        SentenceEncoder(tmp_path)
