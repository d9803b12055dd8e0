"""Untrusted text on a terminal (kvchat.cli.terminal) and streamed answers (the incremental detokenizer, stop)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvchat.answer.decoding import Detokenizer
from kvchat.cli.terminal import StreamCleaner, cell, clean


@pytest.mark.parametrize(
    "text, shown",
    [
        ("a\x1b[31mred\x1b[0m", "ared"),  # CSI (colour)
        ("x\x1b]0;title\x07y", "xy"),  # OSC window title, BEL-terminated
        ("x\x1b]8;;http://e.vil\x1b\\link\x1b]8;;\x1b\\", "xlink"),  # OSC 8 hyperlink, ST-terminated
        ("x\x9b2Jy", "xy"),  # 8-bit CSI
        ("lone\x1b", "lone"),
        ("a\x07b\x08c\rd", "a\\x07b\\x08c\\x0dd"),  # bell, backspace, carriage return: visible
        ("bidi\u202eevil", "bidi\\u202eevil"),  # right-to-left override: visible
        ("[b]x[/b] [/]", "[b]x[/b] [/]"),  # markup is the terminal's business only through rich: untouched
        ("é漢字😀\nnext\tcol", "é漢字😀\nnext\tcol"),
    ],
)
def test_clean(text, shown):
    assert clean(text) == shown


def test_cell_is_one_line_without_tabs():
    assert cell("a\nb\tc\r") == "a b c "


@given(st.text(alphabet=st.sampled_from(list("ab[]/ \n\x1b\x07\x9b\x9d\\;0123m]")), max_size=40),
       st.integers(min_value=1, max_value=7))
def test_nothing_a_terminal_acts_on_survives_however_the_text_is_cut(text, step):
    stream = StreamCleaner()
    out = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step)) + stream.flush()
    assert not any(ch in out for ch in "\x1b\x07\x9b\x9d")


def test_a_stream_cut_inside_escape_sequences_removes_them_whole():
    text = "ok \x1b[31mred\x1b[0m and \x1b]0;pwn\x07 done \x9b2Jx"
    for step in (1, 2, 3, 5):
        stream = StreamCleaner()
        out = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step)) + stream.flush()
        assert out == clean(text) == "ok red and  done x"


# --------------------------------------------------------------------------- incremental detokenizer


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE tokenizer (as GPT-2, Llama 3, SmolLM2 use): multi-byte characters span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = ["Maya walks the dog in the park and Tom bakes bread."] * 20 + ["naïve café 漢字 😀 über"] * 3
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core)


TEXTS = ["Maya walks the dog.", "naïve café 漢字 😀 über — ok", "  spaces  and\nlines\n", "😀😀😀漢"]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_streams_exactly_the_decoded_text(byte_tokenizer, text):
    ids = byte_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any(byte_tokenizer.decode([i]).endswith("\ufffd") for i in ids) or text.isascii() or "\n" in text
    stream = Detokenizer(lambda t: byte_tokenizer.decode(t, skip_special_tokens=True))
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == byte_tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_detokenizer_decodes_a_window_not_the_whole_answer(tiny_lm):
    """Quadratic decoding is what it replaces: the tokens decoded per step stay bounded."""
    decoded: list[int] = []

    def decode(ids):
        decoded.append(len(ids))
        return tiny_lm.decode(ids)

    stream = Detokenizer(decode)
    words = tiny_lm.encode(" ".join(["Maya walks the dog in the park ."] * 40))[0].tolist()
    text = "".join(stream.push(t) for t in words)
    assert text == tiny_lm.decode(words) and len(words) > 200
    assert max(decoded) <= 3


def test_stop_ends_an_answer_early_and_leaves_the_cache_as_it_was(tmp_path, tiny_lm, encoder):
    import json

    from kvchat.answer.session import Session
    from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig
    from kvchat.history.synthetic import planted_conversation
    from kvchat.ingest.pipeline import ingest
    from kvchat.store import Store

    history = tmp_path / "h.json"
    history.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    store = Store(tmp_path / "home")
    # stored as the model computed it: under int8 storage (the default since the scale merge) the tiny random
    # model's whole answer here is one token, and a stop after the first token would stop nothing
    config = IngestConfig(
        cache=CacheConfig(budget=64, block_size=32, prefill="block", storage="model"),
        episodes=EpisodeConfig(episodes=2),
    )
    ingest(history, name="h", config=config, store=store, lm=tiny_lm, encoder=encoder)
    session = Session(store, store.get("h"), tiny_lm, encoder, AskConfig(max_new_tokens=8))
    full = session.ask("Which gate?", episode=0, log=False)
    asked = iter(range(100))
    stopped = session.ask("Which gate?", episode=0, log=False, stop=lambda: next(asked) >= 1)
    again = session.ask("Which gate?", episode=0, log=False)
    assert full.answer_tokens >= 2 and stopped.finish_reason == "stopped" and stopped.answer_tokens == 1
    assert again.text == full.text and again.reused_cache  # the resident cache was rolled back whole


def test_kmeans_on_repeated_segments_prints_no_warning():
    """A history of repeated turns has fewer distinct segments than episodes; scikit-learn's
    ConvergenceWarning about it reached stderr on every ingest, --json or not."""
    import warnings

    import numpy as np

    from kvchat.history.episodes import cluster

    repeated = np.tile(np.eye(4, dtype=np.float32)[:2], (4, 1))  # 8 segments, 2 distinct
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        labels, centroids = cluster(repeated, k=4, seed=0)
    assert caught == [] and len(labels) == 8 and centroids.shape == (4, 4)
