"""Answer quality against full KV: build each variant's caches, ask every question, compare.

For each QA set the full-KV cache is built first: its answers and first-answer-token distributions are
the reference. Each variant (a method at a budget, optionally with other cache settings) is then
ingested into a scratch store, every question is asked, and a record is appended to the results file:
the LoCoMo score against the gold answer, **agreement** (token F1 between the variant's answer and the
full-KV answer) and the KL divergence KL(full || variant) of the first answer token. Records are
appended as they are produced; a re-run skips every (set, variant, question) already in the file.

Design notes (the details and the choices made): docs/internals.md, "kvchat/eval/evaluate.py".
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvchat.answer.session import Session
from kvchat.config import (
    ANSWER_ROOM,
    CACHE_PRECISIONS,
    METHODS,
    OFFLOAD_MODES,
    REFERENCES,
    AskConfig,
    CacheConfig,
    EvalConfig,
    IngestConfig,
    OffloadConfig,
)
from kvchat.errors import UserError
from kvchat.eval import memory_metrics
from kvchat.eval.qa import (
    QASet,
    contains_gold,
    load_locomo,
    planted_sets,
    sample_questions,
    score_answer,
    token_f1,
)
from kvchat.history.loading import Turn, format_turns
from kvchat.ingest.pipeline import IngestHooks, IngestProgress, ingest, validate
from kvchat.kv import codec
from kvchat.kv.attention import LayerView
from kvchat.messages import option, setting
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import LoadedModel
from kvchat.store import Store

REFERENCE = "full"
_CACHE_DEFAULTS = CacheConfig()
_OFFLOAD_DEFAULTS = OffloadConfig()


class MixedResults(UserError):
    """A resumed results file holds a variant measured another way than this run would measure it."""


@dataclass(frozen=True)
class Variant:
    """One cache configuration under evaluation; `key` names it in results and tables."""

    cache: CacheConfig

    @property
    def key(self) -> str:
        offload = self.cache.offload
        changed = [f":{f.name}={getattr(offload, f.name)}" for f in dataclasses.fields(offload)
                   if f.name not in ("mode", "retrieve", "recent")
                   and getattr(offload, f.name) != getattr(_OFFLOAD_DEFAULTS, f.name)]  # fmt: skip
        paged = [f"offload={offload.mode}:R{offload.retrieve}:W{offload.recent}{''.join(changed)}"] if (
            offload.enabled) else []  # fmt: skip
        if self.cache.method == REFERENCE:
            return "/".join([REFERENCE, *paged])
        extra = [
            f"{f.name}={getattr(self.cache, f.name)}"
            for f in dataclasses.fields(self.cache)
            if f.name not in ("method", "budget", "offload")
            and getattr(self.cache, f.name) != getattr(_CACHE_DEFAULTS, f.name)
        ]
        return "/".join([f"{self.cache.method}@{self.cache.budget}", *extra, *paged])


def variants(methods: Sequence[str], budgets: Sequence[int], base: CacheConfig = _CACHE_DEFAULTS) -> list[Variant]:
    """Every method at every budget, with `base`'s offload. Full KV has no budget: without offload it is the
    reference (run anyway), with offload one variant (IceCache over the whole history)."""
    out: list[Variant] = []
    for method in methods:
        if method == REFERENCE:
            out += [Variant(dataclasses.replace(base, method=method))] if base.offload.enabled else []
            continue
        out += [Variant(dataclasses.replace(base, method=method, budget=b)) for b in budgets]
    return out


def plan_variants(
    data: Sequence[Path], synthetic: int, config: EvalConfig, base: IngestConfig, *,
    offloads: Sequence[str] = (), precisions: Sequence[str] = (), retrieve: int = _OFFLOAD_DEFAULTS.retrieve,
) -> list[Variant]:
    """The variants an eval of `data` (LoCoMo files) and `synthetic` planted-fact conversations runs: every
    method and budget of `config` with each offload mode (default: none) and cache precision (default: full)
    over `base`. Everything is checked here, before a model loads: a mistake raises UserError."""
    if not data and synthetic < 1:
        raise UserError(f"give LoCoMo files to evaluate, or {option('synthetic', 'N')}")
    for method in config.methods:
        if method not in METHODS:
            raise UserError(f"unknown method {method!r} in {option('methods')} (choose from {', '.join(METHODS)})")
    if not config.budgets:
        raise UserError(f"{option('budgets')} is empty")
    if config.questions is not None and config.questions < 1:
        raise UserError(f"{option('questions')} must be >= 1 (got {config.questions})")
    if config.max_context is not None and config.max_context < 64:
        raise UserError(f"{option('max_context')} must be >= 64 tokens (got {config.max_context})")
    if config.against not in REFERENCES:
        raise UserError(f"unknown {option('against')} {config.against!r} (choose from {', '.join(REFERENCES)})")
    if config.chunk_tokens < 1:
        raise UserError(f"{option('chunk_tokens')} must be >= 1 (got {config.chunk_tokens})")
    for mode in offloads:
        if mode not in OFFLOAD_MODES:
            raise UserError(f"unknown mode {mode!r} in {setting('offload')} (choose from {', '.join(OFFLOAD_MODES)})")
    for precision in precisions:
        if precision not in CACHE_PRECISIONS:
            raise UserError(f"unknown precision {precision!r} in {setting('cache_precision')} (choose from "
                            f"{', '.join(CACHE_PRECISIONS)})")  # fmt: skip
    planned = [
        v for mode in offloads or (_OFFLOAD_DEFAULTS.mode,) for precision in precisions or (_CACHE_DEFAULTS.precision,)
        for v in variants(config.methods, config.budgets, dataclasses.replace(
            base.cache, offload=dataclasses.replace(base.cache.offload, mode=mode, retrieve=retrieve),
            precision=precision))
    ]  # fmt: skip
    for v in planned:
        validate(dataclasses.replace(base, cache=v.cache))
    for path in data:
        load_locomo(path)  # a bad file fails here, before any model is loaded
    return planned


def qa_sets(paths: Sequence[Path], synthetic: int, lm: LoadedModel, config: EvalConfig) -> list[QASet]:
    """LoCoMo files cut to `config.max_context` tokens (default: what keeps full KV inside the model's
    window; against gold: whole), then `synthetic` planted-fact conversations."""
    max_context = config.max_context
    if max_context is None and lm.context_window and config.against != "gold":  # gold: whole conversations
        max_context = lm.context_window - ANSWER_ROOM
    sets = [
        load_locomo(
            path,
            count_tokens=lambda text: lm.encode(text).shape[-1],
            max_context=max_context,
            categories=config.categories,
        )
        for path in paths
    ]
    sets += planted_sets(synthetic, topics=config.synthetic_topics, turns_per_topic=config.synthetic_turns_per_topic)
    if not any(qa_set.questions for qa_set in sets):
        categories = ", ".join(str(c) for c in config.categories)
        raise UserError(f"no question to score: {', '.join(str(p) for p in paths)} holds no question of categories "
                        f"{categories} with evidence ({option('categories')} chooses others)")
    return sets


class EvalHooks(Protocol):
    """What an evaluation tells a progress display (kvchat.cli.progress's, `EvalProgress`): also each ingest's."""

    @property
    def ingest(self) -> IngestHooks: ...

    def variant(self, qa_set: str, key: str, index: int, total: int) -> None: ...

    def question(self, done: int, total: int) -> None: ...


class EvalProgress:
    """The `EvalHooks` that do nothing: the default."""

    ingest: IngestProgress = IngestProgress()

    def variant(self, qa_set: str, key: str, index: int, total: int) -> None: ...

    def question(self, done: int, total: int) -> None: ...


class ResultsFile:
    """Append-only JSON lines: `ingest` records (one per set and variant) and `answer` records."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.records: list[dict] = []
        if path is not None and path.exists():
            self.records, complete = _read_jsonl(path)
            with path.open("r+b") as f:  # drop a line an interruption cut, so appends start on a new line
                f.truncate(complete)

    def done(self, qa_set: str, key: str) -> set[str]:
        return {
            r["qid"] for r in self.records
            if r["kind"] == "answer" and r["set"] == qa_set and r["variant"] == key and r.get("against") != "gold"
        }  # fmt: skip

    def append(self, record: dict) -> None:
        self.records.append(record)
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()


def evaluate(
    qa_sets: Iterable[QASet],
    variant_list: Sequence[Variant],
    *,
    lm: LoadedModel,
    encoder: SentenceEncoder,
    config: EvalConfig = EvalConfig(),
    base: IngestConfig = IngestConfig(),
    results: ResultsFile | None = None,
    profile_dirs: Sequence[Path] = (),
    progress: EvalHooks | None = None,
    answering: LoadedModel | None = None,
) -> list[dict]:
    """Run every variant on every set (full KV first, as the reference); returns all records, those
    read from `results` included. Caches live in a scratch store that is deleted afterwards. `lm` builds them, as
    `kvchat ingest` does; `answering` (default `lm`: the same weights, held as `kvchat ask --weights` holds them)
    answers from them."""
    results = results or ResultsFile(None)
    progress = progress or EvalProgress()
    ask_config = config.answering()
    # the reference: stored as the model computed it, not in the storage precision compressed caches are kept in
    full_kv = Variant(dataclasses.replace(base.cache, method=REFERENCE, offload=OffloadConfig(), storage="model"))
    everything = [full_kv, *(v for v in variant_list if v.key != REFERENCE)]
    for qa_set in qa_sets:
        questions = sample_questions(qa_set.questions, config.questions)
        skips = skipped(results.records)
        pending = [
            v for v in everything
            if (qa_set.name, v.key) not in skips and {q.qid for q in questions} - results.done(qa_set.name, v.key)
        ]
        if not questions or not pending:
            continue
        with tempfile.TemporaryDirectory(prefix="kvchat-eval-") as scratch:
            store = Store(Path(scratch))
            runner = _SetRunner(qa_set, questions, lm, answering or lm, encoder, base, ask_config, store, results,
                                profile_dirs)  # fmt: skip
            reference = runner.run(everything[0], progress, position=(0, len(pending)))
            for i, variant in enumerate(v for v in pending if v.key != REFERENCE):
                try:
                    runner.run(variant, progress, position=(i + 1, len(pending)), reference=reference)
                except MixedResults:
                    raise
                except UserError as error:  # a setting this model cannot take: say so, run the rest
                    skip = {"kind": "skipped", "set": qa_set.name, "variant": variant.key, "reason": str(error)}
                    results.append(skip)
            store.close()
    return results.records


@dataclass
class _Reference:
    answers: dict[str, str]
    logprobs: dict[str, torch.Tensor]
    # per question: full KV's attention on each evidence position, [layers * kv_heads, evidence] (in memory only)
    evidence_attention: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclass
class _SetRunner:
    """Ingests variants of one QA set and asks its questions."""

    qa_set: QASet
    questions: list
    lm: LoadedModel          # builds the caches
    answering: LoadedModel   # answers from them
    encoder: SentenceEncoder
    base: IngestConfig
    ask_config: AskConfig
    store: Store
    results: ResultsFile
    profile_dirs: Sequence[Path]

    def run(
        self, variant: Variant, progress: EvalHooks, position: tuple[int, int], reference: _Reference | None = None
    ) -> _Reference:
        progress.variant(self.qa_set.name, variant.key, *position)
        name = f"{self.qa_set.name}.{position[0]}"
        report = ingest(
            self.qa_set.turns,
            name=name,
            config=dataclasses.replace(self.base, cache=variant.cache),
            store=self.store,
            lm=self.lm,
            encoder=self.encoder,
            source=self.qa_set.name,
            progress=progress.ingest,
            profile_dirs=self.profile_dirs,
        )
        conversation = self.store.get(name)
        done = self.results.done(self.qa_set.name, variant.key)
        earlier = {r["variant"]: r.get("prefill", "block") for r in self._ingests()}  # older files: block
        if done and earlier.get(variant.key, report.prefill) != report.prefill:
            raise MixedResults(
                f"{self.results.path}: {variant.key} on {self.qa_set.name} was measured with "
                f"{earlier[variant.key]} prefill and this run builds its caches with {report.prefill} prefill; "
                f"resume with {setting('prefill', earlier[variant.key])} or write to a new {option('out')} file"
            )
        if variant.key not in earlier:
            self.results.append(
                {
                    "kind": "ingest",
                    "set": self.qa_set.name,
                    "variant": variant.key,
                    "method": variant.cache.method,
                    "budget": None if variant.cache.method == REFERENCE else variant.cache.budget,
                    "history_tokens": report.history_tokens,
                    "episodes": report.episodes,
                    "layer_budgets": report.layer_budgets,
                    "prefill": report.prefill,
                    "peak_layer_entries": report.peak_layer_entries,
                    "cache_bytes": report.cache_bytes,
                    "seconds": report.seconds,
                }
            )
        session = Session(self.store, conversation, self.answering, self.encoder, self.ask_config)
        kept, protected, positions = zip(*(self._kept_positions(e) for e in conversation.episodes), strict=True)
        spans = _turn_positions(self.lm, self.qa_set.turns, protected[0])
        ours = _Reference({}, {})
        references = memory_metrics.References(self.answering, self.qa_set, self.base.system_prompt,
                                               self.ask_config.question_template)  # fmt: skip
        for n, question in enumerate(self.questions, start=1):
            first = _FirstToken(session)
            probe = memory_metrics.probe_for(self.answering, question)
            spans_of = [spans[e] for e in question.evidence if e in spans]
            evidence = torch.cat(spans_of) if spans_of else None
            recorder = _LastQueryAttention() if reference is None and evidence is not None else None
            answer = session.ask(question.text, log=False, on_first_logits=first, first_recorder=recorder, probe=probe)
            if first.logits is None:
                raise RuntimeError(f"question {question.qid} was not answered ({answer.finish_reason})")
            logprobs = first.logits.float().log_softmax(-1)
            if reference is None:
                ours.answers[question.qid], ours.logprobs[question.qid] = answer.text, logprobs
                if recorder is not None and evidence is not None:
                    weights = recorder.on_positions(positions[answer.episode], evidence)
                    if weights is not None:
                        ours.evidence_attention[question.qid] = weights
            if question.qid not in done:
                ref_text = reference.answers[question.qid] if reference else answer.text
                kl = _kl(reference.logprobs[question.qid], logprobs) if reference else 0.0
                retained = [_retained(k, evidence) if evidence is not None else None for k in kept]
                seen = _with_retrieved(kept[answer.episode], first.retrieved)
                recalled = _retained(seen, evidence) if evidence is not None else None
                attention = (reference or ours).evidence_attention.get(question.qid)
                weighted = _attention_recalled(seen, evidence, attention) if evidence is not None else None
                known = [r for r in retained if r is not None]
                self.results.append(
                    {
                        "kind": "answer",
                        "set": self.qa_set.name,
                        "variant": variant.key,
                        "method": variant.cache.method,
                        "budget": None if variant.cache.method == REFERENCE else variant.cache.budget,
                        "qid": question.qid,
                        "category": question.category,
                        "question": question.text,
                        "gold": question.gold,
                        "prediction": answer.text,
                        "full_prediction": ref_text,
                        "f1": round(score_answer(answer.text, question), 4),
                        "recall": contains_gold(answer.text, question),
                        "agreement": round(token_f1(answer.text, ref_text), 4) if ref_text or answer.text else 1.0,
                        "kl": round(kl, 5),
                        "episode": answer.episode,
                        "evidence_kept": retained[answer.episode],
                        "evidence_kept_best": max(known, default=None),
                        "evidence_recalled": recalled,
                        "evidence_attention_recalled": weighted,
                        "answer_tokens": answer.answer_tokens,
                        "timings_ms": answer.timings_ms,
                        "cache_bytes": conversation.episodes[answer.episode].bytes,
                        **memory_metrics.fields(probe, references, question),
                    }
                )
            progress.question(n, len(self.questions))
        self.store.remove(name)
        return ours

    def _kept_positions(self, episode) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        """[layers * heads, positions] booleans saying which original positions each head kept, the
        length of the protected system prompt, and each head's positions in cache order (empty when
        compacted without keeping them)."""
        cache, meta = codec.decode(
            *self.store.load_episode(episode, self.lm.fingerprint), dtype=self.lm.dtype, device=self.lm.device,
            origins=True,
        )
        protected = meta.protected
        if cache.origins is not None:  # compacted, with each entry's original position kept (an offload's)
            heads = [o.cpu() for layer in cache.origins for o in layer]
        elif meta.positions == "compact":  # re-rotated: original positions are gone
            return torch.zeros(0, 0, dtype=torch.bool), protected, []
        else:
            heads = [p.cpu() for layer in cache.layers for p in layer.positions]  # rows of [heads, n], or ragged
        kept = torch.zeros(len(heads), max(int(p.max()) + 1 for p in heads), dtype=torch.bool)
        for row, positions in zip(kept, heads, strict=True):
            row[positions] = True
        return kept, protected, heads

    def _ingests(self) -> list[dict]:
        return [r for r in self.results.records
                if r["kind"] == "ingest" and r["set"] == self.qa_set.name and r.get("against") != "gold"]  # fmt: skip


@dataclass
class _FirstToken:
    """`Session.ask`'s first-answer-token hook: keeps the logits and, per layer and KV head, the positions
    retrieved from the pages at that moment (the pool empties when the answer ends)."""

    session: Session
    logits: torch.Tensor | None = None
    retrieved: list[list[torch.Tensor] | None] = dataclasses.field(default_factory=list)

    def __call__(self, logits: torch.Tensor) -> None:
        self.logits, self.retrieved = logits, self.session.retrieved_positions()


@dataclass
class _LastQueryAttention:
    """Recorder for the first answer token's forward: per layer, the attention each cached entry gets from
    the forward's last query (the one that gives the first answer token), summed over the query heads of
    its KV head's group: `[kv_heads, past]`."""

    query_rows: int | None = 1
    weights: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def record(self, view: LayerView) -> None:
        self.weights[view.layer_idx] = view.weights[:, :, -1, : view.past].sum(dim=1).float().cpu()

    def on_positions(self, heads: Sequence[torch.Tensor], evidence: torch.Tensor) -> torch.Tensor | None:
        """`[layers * kv_heads, evidence]`: the attention on each evidence position, given each head's cached
        positions in cache order (`heads`, as `_kept_positions`); 0 where a head does not hold it. None when
        positions were compacted or the recorded layers do not match."""
        rows = [w for layer in sorted(self.weights) for w in self.weights[layer]]
        if not heads or len(rows) != len(heads):
            return None
        out = torch.zeros(len(heads), len(evidence))
        for i, (row, positions) in enumerate(zip(rows, heads, strict=True)):
            attention = torch.zeros(int(max(positions.max(), evidence.max())) + 1)
            attention[positions] = row[: len(positions)]
            out[i] = attention[evidence]
        return out


def _attention_recalled(seen: torch.Tensor, evidence: torch.Tensor, attention: torch.Tensor | None) -> float | None:
    """Share of full KV's attention on the evidence (`attention [layers * heads, evidence]`, as
    `_LastQueryAttention.on_positions`) that falls on entries `seen` (`[layers * heads, positions]` booleans:
    resident or retrieved) holds. None without the reference's weights, when positions were compacted, or
    when full KV pays the evidence no attention at all."""
    if attention is None or seen.numel() == 0 or seen.shape[0] != attention.shape[0]:
        return None
    total = float(attention.sum())
    if total <= 0:
        return None
    inside = evidence < seen.shape[1]
    held = torch.zeros_like(attention, dtype=torch.bool)
    held[:, inside] = seen[:, evidence[inside]]
    return round(float(attention[held].sum()) / total, 4)


def _turn_positions(lm: LoadedModel, turns: list[Turn], offset: int) -> dict[str, torch.Tensor]:
    """Cache positions of each turn's tokens: the history is tokenized as ingest does (turn lines joined
    by newlines) and token offsets are matched to each line's characters."""
    lines = format_turns(turns)
    encoded = lm.tokenizer("\n".join(lines), add_special_tokens=False, return_offsets_mapping=True)
    starts = torch.tensor([s for s, _ in encoded["offset_mapping"]])
    ends = torch.tensor([e for _, e in encoded["offset_mapping"]])
    spans, cursor = {}, 0
    for turn, line in zip(turns, lines, strict=True):
        inside = ((ends > cursor) & (starts < cursor + len(line))).nonzero().flatten()
        if turn.turn_id is not None:
            spans[turn.turn_id] = inside + offset
        cursor += len(line) + 1
    return spans


def _with_retrieved(kept: torch.Tensor, retrieved: Sequence[Sequence[torch.Tensor] | None]) -> torch.Tensor:
    """`kept` ([layers * heads, positions] booleans, `_kept_positions`) with the positions each head also
    retrieved (per layer, per KV head, as `Session.retrieved_positions`; None: nothing retrieved there)."""
    if kept.numel() == 0 or not any(layer is not None for layer in retrieved):
        return kept
    heads = kept.shape[0] // len(retrieved)
    width = max([kept.shape[1]] + [int(p.max()) + 1 for layer in retrieved if layer for p in layer if p.numel()])
    seen = torch.zeros(kept.shape[0], width, dtype=torch.bool)
    seen[:, : kept.shape[1]] = kept
    for i, layer in enumerate(retrieved):
        for h, positions in enumerate(layer or ()):
            seen[i * heads + h, positions] = True
    return seen


def _retained(kept: torch.Tensor, positions: torch.Tensor) -> float | None:
    """Fraction of (layer, head, position) entries kept; None when positions were compacted away."""
    if kept.numel() == 0:
        return None
    inside = positions[positions < kept.shape[1]]
    return round(float(kept[:, inside].float().sum() / (kept.shape[0] * len(positions))), 4)


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) in nats, from log-probabilities."""
    return float((reference.exp() * (reference - other)).sum().clamp_min(0))


def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Records of an earlier run and the byte length of its complete lines (a last line cut by an
    interruption is not one)."""
    records, complete = [], 0
    lines = path.read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if not line.strip():
            complete += len(line) + (not last)
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if last:
                break
            raise UserError(f"{path}: line {i + 1} is not JSON; not an eval results file") from None
        if not isinstance(record, dict) or record.get("kind") not in ("ingest", "answer", "skipped"):
            raise UserError(f"{path}: line {i + 1} is not an eval record")
        if last:  # complete JSON but no newline: the write was cut right before it
            break
        records.append(record)
        complete += len(line) + 1
    return records, complete


def skipped(records: Sequence[dict]) -> dict[tuple[str, str], str]:
    """(set, variant) -> why it was skipped: a setting the model cannot take, not retried on resume (compared
    with full KV; kvchat.eval.gold keeps its own)."""
    return {(r["set"], r["variant"]): r["reason"] for r in records if r["kind"] == "skipped" and
            r.get("against") != "gold"}  # fmt: skip
