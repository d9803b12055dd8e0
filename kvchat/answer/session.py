"""The answer pipeline as one library call: route the question -> load that episode's cache -> decode.

A `Session` keeps the model, the encoder and the resident episode cache between questions: a question
routed to the episode already resident reuses it without reloading. Every answer is decoded on top of
the cache and rolled back afterwards, so no question leaks into the next.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from kvchat import features
from kvchat.answer import grounding, recall, recall_entries
from kvchat.answer.decoding import decode_answer, question_prompt
from kvchat.answer.grounding import Grounding
from kvchat.answer.probe import Probe, continuation_nll
from kvchat.answer.rag import Chunk, RagIndex
from kvchat.answer.recall_entries import StoredEntries
from kvchat.answer.sources import Source, SourceRecorder, TurnPresence, rank
from kvchat.config import AskConfig
from kvchat.errors import CacheIntegrityError, UserError
from kvchat.features import UnreadableFile, retrieved_positions
from kvchat.history.episodes import route
from kvchat.history.spans import METADATA_KEY, TurnSpan, from_metadata
from kvchat.kv import codec, families
from kvchat.kv.attention import Recorder
from kvchat.kv.cache import Checkpoint, EpisodeCache
from kvchat.kv.tensorfile import ShrunkFile
from kvchat.messages import option
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, LoadedModel
from kvchat.settings import from_settings, rebuild_command
from kvchat.store import ConversationRecord, Store
from kvchat.untrusted_text import valid_text


@dataclass(frozen=True)
class Answer:
    text: str
    conversation: str
    episode: int
    similarity: float
    prompt_tokens: int
    answer_tokens: int
    reused_cache: bool
    timings_ms: dict[str, float] = field(default_factory=dict)  # embed, route, load, decode
    # "stop": the model ended it; "length": cut at max_new_tokens; "stopped": `stop` asked (Ctrl-C)
    finish_reason: str = "stop"
    attention_backend: str = "torch"  # the decode attention kernel that answered: torch | flashinfer
    weights: str = "float"  # how the answering model's Linear weights were held: float | int8 | int4 (--weights)
    off_topic: bool = False  # nothing found for the question: no episode nor turn matches it (grounding.off_topic)
    sources: list[Source] | None = None  # asked for (`sources=True`) and available: the turns drawn on most
    sources_note: str | None = None  # asked for and unavailable: why
    recalled: list[list[int]] | None = None  # --method recall: the [first, end) turns recalled for the question
    transcript_cut: bool = False  # the answer ends where the model went on writing the history (kvchat.answer.stops)
    # the answer checked against the turns it drew on (kvchat.answer.grounding); None when refused before decoding
    grounding: Grounding | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Session:
    """Answers questions about one stored conversation."""

    def __init__(
        self,
        store: Store,
        conversation: ConversationRecord,
        lm: LoadedModel,
        encoder: SentenceEncoder,
        config: AskConfig = AskConfig(),
    ) -> None:
        self.store, self.conversation, self.lm, self.encoder, self.config = (
            store, conversation, lm, encoder, config,
        )
        self.layout = ChatLayout.from_tokenizer(lm.tokenizer, conversation.settings["system_prompt"])
        self._centroids = self._routing_centroids(conversation)
        self._split = _recall_split(conversation)
        self._resident: tuple[int, EpisodeCache] | None = None
        self._turns: dict[str, str] = {}  # the resident episode file's turn spans entry, parsed when asked
        self._compacted = False  # the resident episode's keys were re-rotated to compact positions
        self._origins: list[list[torch.Tensor]] | None = None  # its entries' original positions, where compacted
        self._recall: RagIndex | None = None  # the conversation's recall index (--method recall), read once
        self._stored: StoredEntries | None = None  # its recall entries file (--recall-entries stored), opened once
        self._speaker_names: frozenset[str] | None = None  # the resident episode's speakers, read when first asked
        self._episode_turns: tuple[int, list[grounding.Turn]] | None = None  # the resident episode's turns, as read

    def ask(
        self,
        question: str,
        *,
        episode: int | None = None,
        on_text: Callable[[str], None] | None = None,
        on_first_logits: Callable[[torch.Tensor], None] | None = None,
        first_recorder: Recorder | None = None,
        log: bool = True,
        stop: Callable[[], bool] | None = None,
        earlier: Sequence[tuple[str, str]] = (),
        sources: bool = False,
        retrieved_text: str = "",
        probe: Probe | None = None,
        stops: Sequence[str] = (),
    ) -> Answer:
        """Answer `question`; `episode` forces a cache instead of routing; `on_text` gets text as it is
        decoded; `on_first_logits` the logits of the first answer token (evaluation compares them);
        `first_recorder` the attention of that token's forward (the question's; evaluation reads where
        full KV attends); `stop`, asked before each token, ends the answer early when it returns true;
        `earlier` (question, answer) pairs are decoded before the question as the exchange it follows up, and routing
        reads the last of them with the question (a follow-up names little of what it is about);
        `sources` records the answer's attention to name the turns it drew on (kvchat.answer.sources; costs one forward
        of the answer's tokens once it is decoded, nothing when off); `retrieved_text`, turns of the history
        retrieved for the question by the caller (kvchat.answer.rag: eval's rag baseline), prefilled after the cache
        and before it, so the answer sees them in the conversation (given this way they are not counted as sources;
        the turns `--method recall` recalls are); `stops`, strings that end the answer; `probe`, a continuation whose
        likelihood after the prompt, and the turns the first answer token could attend to, the answer fills in
        (kvchat.answer.probe: evaluation's reader-light metrics). The prompt and decoding are
        kvchat.answer.decoding's, as every caller's. An off-topic question (never a follow-up) is not answered when
        the config refuses them (`finish_reason` "refused")."""
        question = valid_text(question).strip()  # a lone surrogate (bytes not UTF-8 in an argument) fails nowhere
        earlier = [(valid_text(asked), valid_text(answered)) for asked, answered in earlier]
        if not question:
            raise UserError("the question is empty")
        self._check_length(question)
        timings: dict[str, float] = {}
        self._follow_replacement()
        clock = time.perf_counter()
        query = routing_query(self.encoder, question, earlier)
        timings["embed"] = _ms_since(clock)

        clock = time.perf_counter()
        index, similarity = self._route(query, episode)
        timings["route"] = _ms_since(clock)

        clock = time.perf_counter()
        reused = self._resident is not None and self.conversation.episodes[self._resident[0]].path == (
            self.conversation.episodes[index].path)
        with self._shrunk_pages_refused(index):
            cache = self._cache(index)
        stored = self._stored_entries()
        timings["load"] = _ms_since(clock)

        clock = time.perf_counter()
        prompt_ids = self.lm.encode(question_prompt(self.layout, self.config, question, earlier))
        chunks: list[list[int]] | None = None
        placing: list[int] = []  # --recall-entries stored: the chunks whose stored entries are placed, not prefilled
        recalled_turns: list[TurnSpan] = []  # with sources: each recalled turn's tokens after the cache
        prefilled = retrieved_text  # text prefilled after the cache: retrieved by the caller, or recalled here
        # --method recall: the question's chunks of raw turns (a recall index is read where there is a split)
        if self._recall is not None and self._split is not None and not prefilled:
            picks = recall.picked(self._recall, question, query, self._split)
            picked = [self._recall.chunks[i] for i in picks]
            chunks = recall.turn_ranges(picked)
            if stored is not None:
                placing = picks
            else:
                prefilled = recall.recalled_text(picked)
            recalled_turns = self._recalled_spans(picked, stored, placing) if sources or probe is not None else []
        drawn = [grounding.Turn(i, mark.speaker, text, mark.time)
                 for i, mark, text in recall.recalled_turns(picked)] if chunks is not None else []  # fmt: skip
        episode_turns = self._turns_of(index)
        off_topic = grounding.off_topic(similarity, grounding.coverage(question, [*drawn, *episode_turns]),
                                        bool(earlier), self.config.grounding, self.config.off_topic_similarity)
        if off_topic and self.config.refuse_off_topic:
            return Answer("", self.conversation.name, index, round(similarity, 4), 0, 0, reused, timings,
                          "refused", self.lm.attention_backend, self.lm.weights, off_topic=True)
        if prefilled:  # the cached history's last line ends without a newline
            prompt_ids = torch.cat([self.lm.encode("\n" + prefilled), prompt_ids], dim=-1)
        placed = sum(stored.lengths[i] for i in placing) if stored is not None else 0  # the positions they take
        families.check_context(  # before any token streams: a sliding-window model's window holds the answer too
            self.lm.config, cache.next_position + placed + prompt_ids.shape[-1] + self.config.max_new_tokens,
            self.lm.spec, what=f"the conversation with this question and {option('max_new_tokens')}",
        )
        recorder, note = self._source_recorder(cache, recalled_turns) if sources else (None, None)
        presence = self._presence(cache, recalled_turns) if probe is not None else None
        kept = recorder.kept_tokens() if recorder is not None else None
        mark = cache.checkpoint()
        entries = 0  # placed per KV head
        with self._shrunk_pages_refused(index):
            try:
                entries = self._place(cache, stored, placing)
                held = cache.checkpoint()  # the placed chunks' entries, and nothing of the prompt yet
                decoded = decode_answer(  # a grounded answer is shown once it is checked
                    self.lm, cache, prompt_ids, self.config, question=question, speakers=self._speakers(episode_turns),
                    stops=stops, on_text=None if self.config.grounded else on_text, stop=stop,
                    on_first_logits=on_first_logits, first_recorder=first_recorder,
                )
                tokens, finish, text = decoded.tokens, decoded.finish_reason, decoded.text
                if recorder is not None:  # the answer's last token chose nothing when the answer was cut there
                    self._record_answer(cache, recorder, held.extended(prompt_ids.shape[-1] - 1),
                                        prompt_ids, tokens if decoded.closed else tokens[:-1])  # fmt: skip
                if probe is not None:
                    # an int `query_rows` does not match Recorder's settable `int | None` (as in `_record_answer`)
                    probe.nll = continuation_nll(self.lm.model, cache, held.extended(prompt_ids.shape[-1] - 1),
                                                 prompt_ids[:, -1:], probe.continuation,
                                                 presence)  # type: ignore[arg-type]
                    probe.present = presence.present() if presence is not None else None
            finally:
                cache.rollback(mark)
        timings["decode"] = _ms_since(clock)
        ranked = None if recorder is None or kept is None else rank(
            recorder.spans, recorder.mass, kept, self.config.source_count, self.config.quote_chars,
            recorder.recalled, answer=text, question=question)
        checked = self._grounding(question, text, ranked, recorder, drawn, episode_turns)
        if self.config.grounded and checked.status == grounding.UNSUPPORTED:
            text, finish = "", "unsupported"  # withheld: what it said is in `checked`
        elif self.config.grounded and on_text is not None and text:
            on_text(text)

        answer = Answer(
            text=text,
            conversation=self.conversation.name,
            episode=index,
            similarity=round(similarity, 4),
            prompt_tokens=entries + int(prompt_ids.shape[-1]),
            answer_tokens=len(tokens),
            reused_cache=reused,
            timings_ms=timings,
            finish_reason=finish,
            attention_backend=self.lm.attention_backend,
            weights=self.lm.weights,
            off_topic=off_topic,
            sources=ranked,
            sources_note=note,
            recalled=chunks,
            transcript_cut=decoded.transcript_cut,
            grounding=checked,
        )
        if log:
            self.store.log_ask(
                {
                    "conversation": answer.conversation,
                    "episode": answer.episode,
                    "question": question,
                    "answer": answer.text,
                    "similarity": answer.similarity,
                    "timings": timings,
                }
            )
        return answer

    def _turns_of(self, index: int) -> list[grounding.Turn]:
        """The turns episode `index` (the resident one) holds, as its file records them (none for a file written
        before kvchat recorded turn spans), read once per resident episode."""
        if self._episode_turns is None or self._episode_turns[0] != index:
            spans = from_metadata(self._turns) or []
            self._episode_turns = (index, [grounding.Turn(s.index, s.speaker, s.text, s.time) for s in spans])
        return self._episode_turns[1]

    def _grounding(self, question: str, text: str, ranked: Sequence[Source] | None, recorder: SourceRecorder | None,
                   recalled: Sequence[grounding.Turn], episode_turns: Sequence[grounding.Turn]) -> Grounding:
        """`text` checked against the turns it drew on: its sources (where recorded), the turns recalled for it, and
        its episode's turns matching the question best."""
        first: list[grounding.Turn] = []
        if ranked and recorder is not None:
            spans = {s.index: s for s in recorder.spans}
            first = [grounding.Turn(s.turn, s.speaker, spans[s.turn].text, s.time) for s in ranked]
        first += [t for t in recalled if t.index not in {f.index for f in first}]
        drawn = grounding.drawn_on(question, episode_turns, first, self.config.grounding.drawn_on)
        return grounding.check(text, question, drawn, self.config.grounding)

    def _routing_centroids(self, conversation: ConversationRecord) -> np.ndarray:
        """The episodes' centroids, refused unless each is one of the encoder's embeddings: their digest only
        proves they are what was written (a re-signed manifest can hold any numbers)."""
        lengths = sorted({len(e.centroid) for e in conversation.episodes})
        if lengths != [self.encoder.dimension]:
            c = conversation
            raise CacheIntegrityError(
                f"conversation '{c.name}' has episode centroids of {'/'.join(map(str, lengths))} numbers where the "
                f"encoder's embeddings have {self.encoder.dimension}, so no question can be routed; rebuild with "
                f"`{rebuild_command(c.name, c.model, c.settings, replace=True)}`"
            )
        return np.asarray([e.centroid for e in conversation.episodes], dtype=np.float32)

    def route(self, question: str, earlier: Sequence[tuple[str, str]] = ()) -> tuple[int, float]:
        """The episode `question` (following up `earlier`) routes to and its similarity, without answering."""
        return self._route(routing_query(self.encoder, question.strip(), earlier), None)

    def _route(self, query: np.ndarray, episode: int | None) -> tuple[int, float]:
        if episode is None:
            return route(query, self._centroids)
        if not 0 <= episode < len(self._centroids):
            raise UserError(
                f"{option('episode', episode)} does not exist (conversation "
                f"'{self.conversation.name}' has episodes 0..{len(self._centroids) - 1})"
            )
        return episode, float(self._centroids[episode] @ query)

    def _stored_entries(self) -> StoredEntries | None:
        """The conversation's recall entries file (`--recall-entries stored`), opened and checked once; None where
        its chunks are prefilled."""
        c = self.conversation
        if c.recall_entries is None or self._recall is None:
            return None
        if self._stored is None:
            tensors, metadata = self.store.load_recall_entries(c, self.lm.fingerprint)
            try:
                stored = StoredEntries.opened(tensors, metadata)
                prefix = self.lm.encode(self.layout.before_conversation)
                if stored.digest != recall_entries.digest(self._recall.chunks, prefix):
                    raise ValueError("holds the entries of other chunks than its recall index")
            except ValueError as e:
                raise self._unreadable_entries(str(e)) from None
            self._stored = stored
        return self._stored

    def _speakers(self, episode_turns: Sequence[grounding.Turn]) -> frozenset[str]:
        """The speakers of the turns the answer can see (the resident episode's, `_turns_of`, and every recalled
        chunk's): a line of the answer that starts with one's label is the model writing the history on
        (kvchat.answer.stops)."""
        if self._speaker_names is None:
            chunks = self._recall.chunks if self._recall is not None else []
            self._speaker_names = frozenset({t.speaker for t in episode_turns} |
                                            {m.speaker for c in chunks for m in c.marks})  # fmt: skip
        return self._speaker_names

    def _place(self, cache: EpisodeCache, stored: StoredEntries | None, placing: Sequence[int]) -> int:
        """The `stored` entries of chunks `placing` appended to `cache` in turn, each chunk's first tokens computed
        again on top of what precedes it where the file leaves them out (RecallConfig.repair); returns the entries per
        KV head appended. A file truncated since it was checked ends the answer with a message (the caller rolls the
        cache back)."""
        if stored is None:  # nothing to place: the chunks were prefilled as text
            return 0
        placed = 0
        try:
            for chunk in placing:
                text = self._recall.chunks[chunk] if stored.repair and self._recall is not None else None
                ids = recall_entries.chunk_ids(self.lm, [text])[0] if text is not None else None
                placed += stored.place(cache, chunk, self.lm, ids)
        except ShrunkFile:
            self._stored = None  # the next question checks the file again
            raise self._unreadable_entries("was truncated while this session was reading it") from None
        except ValueError as e:
            raise self._unreadable_entries(str(e)) from None
        return placed

    def _recalled_spans(self, picked: Sequence[Chunk], stored: StoredEntries | None, placing: Sequence[int]
                        ) -> list[TurnSpan]:  # fmt: skip
        """Each recalled turn's tokens after the cache: in the text prefilled for `picked`, or (`placing`) in their
        `stored` entries, each chunk's counted after those placed before it."""
        if not placing or stored is None:
            return recall.recalled_spans(self.lm.tokenizer, picked)
        spans, offset = [], 0
        for chunk, i in zip(picked, placing, strict=True):
            spans += [dataclasses.replace(s, start=s.start + offset, end=s.end + offset)
                      for s in recall.recalled_spans(self.lm.tokenizer, [chunk], recall_entries.LEAD)]  # fmt: skip
            offset += stored.lengths[i]
        return spans

    def _unreadable_entries(self, problem: str) -> CacheIntegrityError:
        c = self.conversation
        return CacheIntegrityError(f"recall entries file of conversation '{c.name}' {problem}; "
                                   f"rebuild with `{rebuild_command(c.name, c.model, c.settings, replace=True)}`")

    def _source_recorder(self, cache: EpisodeCache, recalled: Sequence[TurnSpan]
                         ) -> tuple[SourceRecorder | None, str | None]:  # fmt: skip
        """A recorder of the answer's attention per turn (`recalled`: turns prefilled after the cache), or why
        there can be none."""
        spans = from_metadata(self._turns)
        c = self.conversation
        rebuild = f"rebuild it with `{rebuild_command(c.name, c.model, c.settings, replace=True)}`"
        if spans is None:
            return None, (f"no sources: conversation '{c.name}' was ingested before kvchat recorded turn spans; "
                          f"{rebuild}")
        if self._compacted and self._origins is None:
            return None, (f"no sources: conversation '{c.name}' was re-rotated to compact positions before kvchat "
                          f"kept each cached entry's original position; {rebuild}")
        first = int(self.config.source_layers_from * len(cache.layers))
        return SourceRecorder(cache, spans, first_layer=first, origins=self._origins, recalled=recalled), None

    def _presence(self, cache: EpisodeCache, recalled: Sequence[TurnSpan]) -> TurnPresence | None:
        """A recorder of the turns the first answer token can attend to (`recalled`: turns placed or prefilled after
        the cache); None where the cache's turns are unknown (as `_source_recorder` says why)."""
        spans = from_metadata(self._turns)
        if spans is None or (self._compacted and self._origins is None):
            return None
        return TurnPresence(cache, spans, origins=self._origins, recalled=recalled)

    def _record_answer(self, cache: EpisodeCache, recorder: SourceRecorder, prompt_held: Checkpoint,
                       prompt_ids: torch.Tensor, fed: list[int]) -> None:  # fmt: skip
        """Into `recorder`, the attention of the queries that chose the answer's tokens: the prompt's last token
        chose the first, each token of `fed` the one after it (or the end). Recorded once the answer is decoded
        (so it is the answer decoded without sources), in one forward of those tokens on the cache rolled back
        to `prompt_held`: the prompt's entries but its last token's, as the answer's forwards saw them."""
        cache.rollback(prompt_held)
        ids = torch.tensor([fed], dtype=prompt_ids.dtype, device=prompt_ids.device)
        recorder.query_rows = 1 + len(fed)
        # Recorder.query_rows (kvchat.kv.attention) is `int | None` and settable, so an int attribute does not match
        self.lm.forward(cache, torch.cat([prompt_ids[:, -1:], ids], dim=-1), recorder=recorder)  # type: ignore[arg-type]

    def retrieved_positions(self) -> list[list[torch.Tensor] | None]:
        """Per layer of the resident cache, the original positions each KV head is attending to from its
        offloaded pages right now (None for a layer without pages); empty before any question. Read it
        while answering (e.g. from `ask`'s `on_first_logits`): the pool empties when the answer ends."""
        return [] if self._resident is None else retrieved_positions(self._resident[1])

    def _check_length(self, question: str) -> None:
        """Refuse a question longer than a quarter of the model's window before it costs anything: its
        attention over the cache grows with its square."""
        limit = max(64, self.lm.context_window // 4) if self.lm.context_window else 2048
        if len(question) > 32 * limit:  # no tokenizer makes fewer than one token per 32 characters of text
            raise UserError(f"the question is {len(question)} characters; at most about {limit} tokens fit")
        n = int(self.lm.encode(question).shape[-1])
        if n > limit:
            raise UserError(f"the question is {n} tokens; at most {limit} (a quarter of the model's window) fit")

    def _follow_replacement(self) -> None:
        """A conversation re-ingested (`--replace`) while this session is open is answered from its new
        caches; one removed meanwhile is a clear error rather than a missing-file one."""
        name = self.conversation.name
        try:
            current = self.store.get(name)
        except UserError:
            raise UserError(f"conversation '{name}' was removed while this session was open") from None
        if current.fingerprint not in (self.conversation.fingerprint, self.lm.fingerprint):
            raise UserError(f"conversation '{name}' was re-ingested with another model; ask again in a new session")
        if [e.path for e in current.episodes] != [e.path for e in self.conversation.episodes]:
            self.conversation = current
            self.layout = ChatLayout.from_tokenizer(self.lm.tokenizer, current.settings["system_prompt"])
            self._centroids = self._routing_centroids(current)
            self._split, self._recall, self._stored = _recall_split(current), None, None
            self._resident = None

    def _cache(self, index: int) -> EpisodeCache:
        """The episode's cache, reused when it is the resident one (or in the same file: episodes whose caches are the
        same share one)."""
        record = self.conversation.episodes[index]
        if self._resident is not None and self.conversation.episodes[self._resident[0]].path == record.path:
            self._resident = (index, self._resident[1])
            return self._resident[1]
        self._resident = None  # drop the old one before loading the next: one resident cache at a time
        tensors, metadata = self.store.load_episode(record, self.lm.fingerprint)
        try:
            cache, meta = codec.decode(tensors, metadata, dtype=self.lm.dtype, device=self.lm.device)
            origins = codec.stored_origins(tensors, meta, cache)  # for receipts of a compacted cache
        except ValueError as e:  # checksummed, so written this way: not a layout kvchat reads
            raise self._unreadable(index, "cache", f"does not hold a KV cache kvchat can read ({e})") from None
        try:  # what the cache features stored beside it (IceCache's pages, read on demand)
            features.attach(cache, from_settings(self.conversation.settings).cache,
                            lambda: self.store.load_pages(record, self.lm.fingerprint), self.config.retrieve)
        except UnreadableFile as e:
            raise self._unreadable(index, e.what, e.problem) from None
        if self._split is not None and self._recall is None:  # every episode file holds the same index: read once
            try:
                self._recall = recall.from_metadata(metadata)
            except ValueError as e:
                raise self._unreadable(index, "cache", str(e)) from None
        self._resident = (index, cache)
        self._turns = {k: v for k, v in metadata.items() if k == METADATA_KEY}
        self._speaker_names = None
        self._episode_turns = None  # read from this file when first asked
        # full KV evicts nothing, so nothing was re-rotated, whatever its positions setting says
        self._compacted, self._origins = meta.positions == "compact" and meta.method != "full", origins
        return cache

    @contextmanager
    def _shrunk_pages_refused(self, index: int) -> Iterator[None]:
        """A pages file truncated after it was checked (reads run out of bytes, kvchat.kv.tensorfile) ends the
        answer with a message; the cache is dropped, so the next question reads its files again and checks them."""
        try:
            yield
        except ShrunkFile:
            self._resident = None
            raise self._unreadable(index, "pages file", "was truncated while this session was reading it") from None

    def _unreadable(self, index: int, what: str, problem: str) -> CacheIntegrityError:
        c = self.conversation
        return CacheIntegrityError(
            f"{what} of conversation '{c.name}' episode {index} {problem}; "
            f"rebuild with `{rebuild_command(c.name, c.model, c.settings, replace=True)}`"
        )


def _recall_split(conversation: ConversationRecord) -> recall.RecallSplit | None:
    """How a `--method recall` conversation spends its budget (None for other methods)."""
    return recall.split_for(from_settings(conversation.settings).cache)


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)


def routing_query(encoder: SentenceEncoder, question: str, earlier: Sequence[tuple[str, str]] = ()) -> np.ndarray:
    """The unit vector a question is routed (and its turns recalled) by: `question`'s embedding, or for a follow-up
    the mean of the question's and the last exchange's, so "and what colour was it?" goes where the exchange it
    continues went, while a question clearly about something else still goes elsewhere (its similarity to an
    episode is the mean of the two similarities, scaled)."""
    if not earlier:
        return encoder.embed([question])[0]
    last_question, last_answer = earlier[-1]
    query, exchange = encoder.embed([question, f"{last_question}\n{last_answer}"])
    both = query + exchange
    return both / max(float(np.linalg.norm(both)), 1e-12)
