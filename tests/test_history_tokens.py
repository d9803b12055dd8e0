"""A history tokenized a chunk of lines at a time (issue 29, case 11: a million tiny turns grew memory by gigabytes):
the ids are those of tokenizing the whole text, and the turn spans come from the same pass, equal to the spans the
whole text's offsets give."""

from __future__ import annotations

import bisect
import json

import numpy as np
import pytest
from conftest import MODELS_DIR, SHARED_DATA

from kvchat.history import tokens as history_tokens
from kvchat.history.loading import Turn, format_turns, load_history
from kvchat.history.spans import TurnSpan, span_of
from kvchat.history.synthetic import planted_conversation
from kvchat.history.tokens import tokenize_turns, turn_spans


def _whole_text_spans(tokenizer, turns, offset, lead=""):
    """The spans as kvchat computed them before it tokenized in chunks: one call over the whole text."""
    lines = format_turns(turns)
    encoded = tokenizer(lead + "\n".join(lines), add_special_tokens=False, return_offsets_mapping=True)
    starts, cursor = [], len(lead)
    for line in lines:
        starts.append(cursor)
        cursor += len(line) + 1
    owner = [max(0, bisect.bisect_right(starts, max(end - 1, begin)) - 1) for begin, end in encoded["offset_mapping"]]
    return [span_of(turn, offset + bisect.bisect_left(owner, i), offset + bisect.bisect_right(owner, i), i)
            for i, turn in enumerate(turns)]  # fmt: skip


def _awkward_turns() -> list[Turn]:
    """Turns whose lines end or begin where a byte-level BPE might join them to the newline between."""
    texts = ["hi!", "", "  spaced out  ", "two\nlines\n\n", "ends with a space ", "naïve café 🙂", "!!!", "1234",
             "'quoted'", "\ttab", "...", "x" * 300, "a\r\nb", "end."]  # fmt: skip
    turns = [Turn(("user", "assistant")[i % 2], text, time=f"2024-01-0{1 + i // 5}") for i, text in enumerate(texts)]
    turns += [Turn("user", "in a second conversation", conversation_title="Trip"), Turn(" Maya ", "hello")]
    return turns * 6


def _histories() -> list[list[Turn]]:
    planted = [Turn(m["role"], m["content"]) for m in planted_conversation(seed=2, topics=4, turns_per_topic=12)[0]]
    found = [planted, _awkward_turns()]
    if (SHARED_DATA / "conv-26.json").is_file():
        found.append(load_history(SHARED_DATA / "conv-26.json")[:300])
    return found


def _tokenizers(tiny_lm):
    from transformers import AutoTokenizer

    found = [("tiny", tiny_lm.tokenizer)]
    embedded = sorted(MODELS_DIR.glob("SmolLM2-135M-Instruct*"))
    if embedded:  # converted by an earlier test run (the slow tests convert it)
        found.append(("embedded", AutoTokenizer.from_pretrained(embedded[0], local_files_only=True)))
    return found


@pytest.mark.parametrize("chunk_chars", [1, 40, 1 << 16])
def test_chunked_ids_and_spans_equal_the_whole_texts(tiny_lm, monkeypatch, chunk_chars):
    monkeypatch.setattr(history_tokens, "CHUNK_CHARS", chunk_chars)
    for name, tokenizer in _tokenizers(tiny_lm):
        for turns in _histories():
            for lead in ("", "\n"):
                whole = tokenizer(lead + "\n".join(format_turns(turns)), add_special_tokens=False)["input_ids"]
                tokenized = tokenize_turns(tokenizer, turns, lead=lead)
                assert tokenized.ids.dtype == tiny_lm.encode("x").dtype and tokenized.ids.shape == (1, len(whole))
                assert tokenized.ids[0].tolist() == whole, (name, lead)
                assert tokenized.spans(turns, 7) == _whole_text_spans(tokenizer, turns, 7, lead), (name, lead)


def test_a_tokenizer_that_marks_every_texts_start_is_never_cut(monkeypatch):
    """A text's first token differs from the same text's inside a longer one (as SentencePiece's space marker
    does): no line boundary is a safe cut, so the history is one chunk and its ids still the whole text's."""
    monkeypatch.setattr(history_tokens, "CHUNK_CHARS", 1)
    turns = [Turn("user", f"hi {i}") for i in range(50)]
    tokenized = tokenize_turns(_MarkingTokenizer(), turns)
    assert tokenized.ids[0].tolist() == _MarkingTokenizer()("\n".join(format_turns(turns)))["input_ids"]
    assert tokenized.spans(turns, 0)[-1].end == tokenized.ids.shape[-1]


def test_progress_is_heard_chunk_by_chunk_and_spans_are_compact(tiny_lm, monkeypatch):
    monkeypatch.setattr(history_tokens, "CHUNK_CHARS", 200)
    turns = [Turn(("user", "assistant")[i % 2], f"ok {i % 7}") for i in range(2000)]
    heard: list[tuple[int, int]] = []
    tokenized = tokenize_turns(tiny_lm.tokenizer, turns, on_progress=lambda *report: heard.append(report))
    assert len(heard) > 10 and heard[-1] == (2000, 2000) and [d for d, _ in heard] == sorted(d for d, _ in heard)
    assert tokenized.bounds.dtype == np.int64 and tokenized.bounds.shape == (2001,)
    assert turn_spans(tiny_lm.tokenizer, turns, 3) == _whole_text_spans(tiny_lm.tokenizer, turns, 3)


def test_a_tokenizer_without_offsets_gives_ids_and_no_spans():
    turns = [Turn("user", "hi"), Turn("assistant", "hello")]
    tokenized = tokenize_turns(_MarkingTokenizer(offsets=False), turns)
    assert tokenized.ids.shape[-1] == len("user: hi\nassistant: hello") + 1 and tokenized.spans(turns, 0) == []


def test_turn_spans_survive_their_metadata_round_trip():
    from kvchat.history.spans import from_metadata, to_metadata

    spans = [TurnSpan(1, 4, 0, "user", "hi", "2024", "D1:1"), TurnSpan(4, 9, 1, "assistant", json.dumps("x"))]
    assert from_metadata({"turns": to_metadata(spans)}) == spans


class _MarkingTokenizer:
    """Characters as ids, every text opened by a marker (id 0); offsets when asked, unless `offsets` is False."""

    def __init__(self, offsets: bool = True) -> None:
        self.offsets = offsets

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        if return_offsets_mapping and not self.offsets:
            raise NotImplementedError("no offsets")
        out = {"input_ids": [0] + [ord(c) for c in text]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(0, 0)] + [(i, i + 1) for i in range(len(text))]
        return out
