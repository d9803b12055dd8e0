"""Retrieval of raw turns: what a user of a long-conversation assistant would run instead of a KV cache.

The history is cut into chunks of consecutive turns (at most `RagConfig.chunk_tokens` tokens each), every
chunk embedded once by the sentence encoder kvchat routes with (kvchat.model.encoder). A question embeds the same
way; its top-k chunks go back into the system prompt in history order, in the chat layout kvchat answers
in (kvchat.model.llm.ChatLayout), and are prefilled with the question into a fresh cache: nothing is computed
before the question, everything the answer attends to is computed again for each one. kvchat's evaluation
against gold answers (kvchat.eval.gold) measures it beside kvchat's caches at equal KV entries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch

from kvchat.answer.decoding import decode_answer, question_prompt
from kvchat.answer.lexical import LexicalIndex
from kvchat.answer.probe import Probe, continuation_nll, prompt_held
from kvchat.config import RRF_K, SYSTEM_PROMPT, AskConfig, RagConfig
from kvchat.errors import UserError
from kvchat.history.loading import Turn, format_turns
from kvchat.history.spans import TurnMark, turn_marks
from kvchat.kv.cache import EpisodeCache
from kvchat.messages import option
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, LoadedModel


@dataclass(frozen=True)
class Chunk:
    """Consecutive rendered turns `[first, end)` of the history, as one retrievable text; `marks`, where each turn
    sits in it (receipts for recalled turns, answer.sources; empty in an index stored before kvchat kept them)."""

    first: int
    end: int
    text: str
    tokens: int
    marks: tuple[TurnMark, ...] = ()


def chunk_turns(turns: int, render: Callable[[int, int], str], count_tokens: Callable[[str], int],
                chunk_tokens: int, cut: Callable[[str, int], str]) -> list[Chunk]:  # fmt: skip
    """Consecutive turns `[first, end)` of `turns` grouped while their text, `render(first, end)`, stays within
    `chunk_tokens` tokens; a single turn longer than that is a chunk of its own, cut to its first `chunk_tokens`
    tokens by `cut(text, n)`, so k chunks never hold more than k x chunk_tokens tokens."""
    if chunk_tokens < 1:
        raise UserError(f"{option('chunk_tokens')} must be >= 1 (got {chunk_tokens})")
    chunks: list[Chunk] = []
    first, used = 0, 0
    for i in range(turns):
        if i > first:
            joined = count_tokens(render(first, i + 1))
            if joined <= chunk_tokens:
                used = joined
                continue
            chunks.append(Chunk(first, i, render(first, i), used))
            first = i
        used = count_tokens(render(i, i + 1))
        if used > chunk_tokens:
            text = cut(render(i, i + 1), chunk_tokens)
            chunks.append(Chunk(i, i + 1, text, count_tokens(text)))
            first, used = i + 1, 0
    if first < turns:
        chunks.append(Chunk(first, turns, render(first, turns), used))
    return chunks


@dataclass(frozen=True)
class TurnEmbeddings:
    """Each turn of the history embedded by the sentence encoder (or each group of `width` turns): a fact said in one
    turn ("Hannah's new puppy is called Cobble.") is diluted in a 256-token chunk's embedding and words but not in its
    turn's, so recall's `interleaved` ranking finds the chunk by its best turn."""

    starts: np.ndarray      # [T] int64: each embedded group's first turn, increasing; each ends where the next starts
    embeddings: np.ndarray  # [T, dim] float32, unit norm

    @classmethod
    def build(cls, lines: Sequence[str], encoder: SentenceEncoder, width: int = 1,
              on_progress: Callable[[int, int], None] | None = None) -> TurnEmbeddings:  # fmt: skip
        """The rendered `lines` (one per turn) embedded `width` at a time."""
        texts = list(lines) if width == 1 else ["\n".join(lines[i : i + width]) for i in range(0, len(lines), width)]
        return cls(np.arange(0, len(lines), width, dtype=np.int64),
                   np.asarray(encoder.embed(texts, on_progress), dtype=np.float32))  # fmt: skip

    def offset(self, turns: int) -> TurnEmbeddings:
        return TurnEmbeddings(self.starts + turns, self.embeddings)

    def overlaps(self, chunks: Sequence[Chunk]) -> tuple[np.ndarray, np.ndarray]:
        """(group, chunk) index pairs: each embedded group with every chunk whose turns it overlaps."""
        firsts = np.asarray([c.first for c in chunks], dtype=np.int64)
        ends = np.asarray([c.end for c in chunks], dtype=np.int64)
        group_ends = np.append(self.starts[1:], max(int(ends[-1]), int(self.starts[-1]) + 1))
        lows = np.searchsorted(ends, self.starts, side="right")  # the first chunk ending after the group's start
        highs = np.searchsorted(firsts, group_ends, side="left")  # past the last chunk starting before its end
        counts = np.maximum(highs - lows, 0)
        owner = np.repeat(np.arange(len(self.starts)), counts)
        chunk = np.repeat(lows, counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return owner, chunk

    def best_per_chunk(self, chunks: Sequence[Chunk], query: np.ndarray,
                       overlaps: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:  # fmt: skip
        """Each chunk's best cosine to `query` among the embedded turns (groups) that overlap it; `overlaps`, the
        chunks' `overlaps` where the caller keeps them."""
        owner, chunk = self.overlaps(chunks) if overlaps is None else overlaps
        best = np.full(len(chunks), -np.inf, dtype=np.float32)
        np.maximum.at(best, chunk, (self.embeddings @ query)[owner])
        return best


@dataclass(frozen=True)
class RagIndex:
    """A history's chunks and their unit-norm embeddings `[chunks, dim]`; `turns`, its turns' embeddings where the
    index has them (recall's, since the interleaved ranking: None in indexes stored before it and in plain RAG's)."""

    chunks: list[Chunk]
    embeddings: np.ndarray
    turns: TurnEmbeddings | None = None

    @classmethod
    def build(cls, turns: Sequence[Turn], lm: LoadedModel, encoder: SentenceEncoder, chunk_tokens: int,
              dated: bool = False, turn_embeddings: TurnEmbeddings | None = None) -> RagIndex:  # fmt: skip
        """`dated`: each chunk opens with the date of its first turn (the history's rendering dates only the
        first turn of each session)."""
        lines = format_turns(turns)

        def render(first: int, end: int) -> str:
            return "\n".join(format_turns(turns[first:end]) if dated else lines[first:end])

        def count(text: str) -> int:
            return int(lm.encode(text).shape[-1])

        def cut(text: str, n: int) -> str:
            return lm.decode(lm.encode(text)[0, :n].tolist())

        def marked(chunk: Chunk) -> Chunk:
            shown = format_turns(turns[chunk.first : chunk.end]) if dated else lines[chunk.first : chunk.end]
            marks = turn_marks(turns[chunk.first : chunk.end], shown)
            if chunk.text != "\n".join(shown):  # one turn cut to the chunk's tokens: its text as far as it goes
                marks = (replace(marks[0], text=min(marks[0].text, len(chunk.text))),)
            return replace(chunk, marks=marks)

        chunks = [marked(c) for c in chunk_turns(len(turns), render, count, chunk_tokens, cut)]
        if not chunks:
            raise UserError("the history has no turns to retrieve from")
        return cls(chunks, encoder.embed([c.text for c in chunks]), turn_embeddings)

    def top(self, query: np.ndarray, k: int, question: str | None = None, retrieval: str = "lexical") -> list[int]:
        """The `k` chunks most similar to `query` (cosine of embeddings), in history order. With `question` (its
        text), ranked by `retrieval`: `lexical`, by their words first (kvchat.answer.lexical) and by `query` among
        chunks that tie; `hybrid`, by reciprocal-rank fusion of that ranking and the encoder's (`fused_order`);
        `interleaved`, the lexical ranking's best chunk, then the chunk of the turn nearest `query`, in turn
        (`interleaved_order`; lexical alone where the index has no turn embeddings)."""
        dense = self.embeddings @ query
        if question is None or retrieval == "dense":
            order = np.argsort(-dense, kind="stable")
        else:
            order = np.lexsort((-dense, -self.lexical.scores(question)))
            if retrieval == "hybrid":
                order = fused_order(np.argsort(-dense, kind="stable"), order)
            elif retrieval == "interleaved" and self.turns is not None:
                best = self.turns.best_per_chunk(self.chunks, query, self._turn_overlaps)
                nearest = np.argsort(-best, kind="stable")
                order = interleaved_order(order, nearest, k=k)
        return sorted(int(i) for i in order[: max(0, k)])

    @cached_property
    def _turn_overlaps(self) -> tuple[np.ndarray, np.ndarray]:
        """Which chunks each embedded turn overlaps, found once: every question ranks by them."""
        assert self.turns is not None
        return self.turns.overlaps(self.chunks)

    @cached_property
    def lexical(self) -> LexicalIndex:
        """The chunks' words, indexed the first time a question is ranked by them."""
        return LexicalIndex([c.text for c in self.chunks])

    @property
    def nbytes(self) -> int:
        """What holding the index takes: the chunks' text (UTF-8) and the float32 embeddings."""
        held = self.turns.embeddings.nbytes if self.turns is not None else 0
        return sum(len(c.text.encode()) for c in self.chunks) + self.embeddings.nbytes + held


def interleaved_order(*orders: np.ndarray, k: int) -> np.ndarray:
    """The first `k` items of the `orders` taken in turn, each order's best not taken yet (each ranking gets its
    share of the chunks instead of one ranking's scores drowning the other's)."""
    taken: list[int] = []
    at = [0] * len(orders)
    k = min(k, len(orders[0]))
    while len(taken) < k:
        for i, order in enumerate(orders):
            while at[i] < len(order) and int(order[at[i]]) in taken:
                at[i] += 1
            if at[i] < len(order) and len(taken) < k:
                taken.append(int(order[at[i]]))
    return np.asarray(taken, dtype=np.int64)


def fused_order(*orders: np.ndarray, k: int = RRF_K) -> np.ndarray:
    """Reciprocal-rank fusion (Cormack et al., 2009) of rankings (each an order of the same items, best first): an
    item scores sum 1 / (k + its rank) over them; ties keep the first ranking's order."""
    score = np.zeros(len(orders[0]))
    for order in orders:
        score[order] += 1 / (k + np.arange(len(order)))
    first = np.empty(len(orders[0]), dtype=np.int64)
    first[orders[0]] = np.arange(len(orders[0]))
    return np.lexsort((first, -score))


@dataclass(frozen=True)
class RagAnswer:
    text: str
    chunks: tuple[int, ...]     # the chunks prefilled, in history order
    prompt_tokens: int          # everything prefilled at question time: system prompt, chunks, question
    answer_tokens: int
    entries: int                # keys the first answer token attends to, per layer and KV head
    timings_ms: dict[str, float] = field(default_factory=dict)  # embed, prefill_decode
    transcript_cut: bool = False  # ends where the model went on writing the history (kvchat.answer.stops)


class RagSession:
    """Answers questions about one history by retrieving its chunks (see the module docstring)."""

    def __init__(self, index: RagIndex, lm: LoadedModel, encoder: SentenceEncoder, config: RagConfig = RagConfig(),
                 ask_config: AskConfig = AskConfig(), system_prompt: str | None = None) -> None:  # fmt: skip
        self.index, self.lm, self.encoder, self.config, self.ask_config = index, lm, encoder, config, ask_config
        self.layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT if system_prompt is None else system_prompt)

    def prompt(self, question: str, chunks: Sequence[int]) -> torch.Tensor:
        """Token ids [1, n] prefilled for `question` over `chunks`: tokenized in the same pieces as an
        ingest's cache and an ask's question (system prompt, conversation, question turn)."""
        text = "\n".join(self.index.chunks[i].text for i in chunks)
        question_text = question_prompt(self.layout, self.ask_config, question)
        parts = [self.lm.encode(self.layout.before_conversation), self.lm.encode(text), self.lm.encode(question_text)]
        return torch.cat(parts, dim=-1)

    def retrieve(self, question: str) -> list[int]:
        words = question if self.config.retrieval != "dense" else None
        return self.index.top(self.encoder.embed([question])[0], self.config.top_k, words, self.config.retrieval)

    def ask(self, question: str, *, on_first_logits: Callable[[torch.Tensor], None] | None = None,
            probe: Probe | None = None) -> RagAnswer:
        """`probe`: a continuation whose likelihood after the prompt the answer fills in (kvchat.answer.probe; which
        turns the prompt holds is the caller's to say: the answer's `chunks`)."""
        question = question.strip()
        if not question:
            raise UserError("the question is empty")
        clock = time.perf_counter()
        chunks = self.retrieve(question)
        timings = {"embed": _ms_since(clock)}
        clock = time.perf_counter()
        ids = self.prompt(question, chunks)
        cache = EpisodeCache(self.lm.num_layers)
        speakers = {m.speaker for i in chunks for m in self.index.chunks[i].marks}
        decoded = decode_answer(self.lm, cache, ids, self.ask_config, question=question, speakers=speakers,
                                on_first_logits=on_first_logits)  # fmt: skip
        timings["prefill_decode"] = _ms_since(clock)
        n = int(ids.shape[-1])
        if probe is not None:
            probe.nll = continuation_nll(self.lm.model, cache, prompt_held(cache, n), ids[:, -1:], probe.continuation)
        return RagAnswer(decoded.text, tuple(chunks), n, len(decoded.tokens), n, timings, decoded.transcript_cut)


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)
