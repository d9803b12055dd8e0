"""Answer quality against gold answers: how `kvchat eval` measures histories longer than the model's window.

Full KV cannot be the reference there (it does not fit), so every system is scored against the QA set's gold
answers with LoCoMo's token F1 (kvchat.eval.qa), beside the systems a user would pick instead at equal KV entries:
`rag` (the top-k raw-turn chunks by the same encoder, prefilled with the question, kvchat.answer.rag) and `recent`
(a sink and the last tokens: `streaming` with uniform layer budgets, a cache whose entries are the system
prompt, the first `STREAMING_SINK` history tokens and the last ones). Each answer record carries what it
cost: seconds, KV entries per layer and KV head the first answer token attends to (resident, read back from
pages, and prefilled at question time), bytes on disk and resident. Summaries give means with percentile
bootstrap 95% intervals (fixed seed, so a report is reproducible), per LoCoMo category too, and `verdict`
says in one line per entry budget which system won and by how much, with the paired interval.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from kvchat.answer.probe import Probe
from kvchat.answer.rag import RagIndex, RagSession
from kvchat.answer.session import Session
from kvchat.config import ANSWER_ROOM, CacheConfig, EpisodeConfig, EvalConfig, IngestConfig, RagConfig
from kvchat.errors import UserError
from kvchat.eval import memory_metrics
from kvchat.eval.qa import CATEGORIES, QASet, contains_gold, sample_questions, score_answer
from kvchat.eval.stats import RESAMPLES, SEED, bootstrap_interval, paired_difference
from kvchat.history.loading import format_turns
from kvchat.ingest.pipeline import IngestHooks, IngestProgress, ingest, plan_ingest
from kvchat.messages import option
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import LoadedModel
from kvchat.settings import to_settings, upgraded
from kvchat.store import Store

GOLD = "gold"            # the `against` of every record this module writes
BASELINES = ("rag", "recent")
RAG_RETRIEVALS = ("dense", "lexical", "hybrid")  # the RAG baselines' rankings of chunks (kvchat.answer.rag)
COLUMNS = (  # the table of `summarize_gold` rows: key, header, format
    ("variant", "system", "{}"), ("entries", "entries", "{:.0f}"), ("questions", "questions", "{}"),
    ("f1", "F1", "{:.3f}"), ("f1_low", "95% from", "{:.3f}"), ("f1_high", "95% to", "{:.3f}"),
    ("evidence_any", "evidence any", "{:.2f}"), ("evidence_half", "evidence half", "{:.2f}"),
    ("nll", "gold NLL", "{:.3f}"), ("recovery", "recovery", "{:.2f}"),
    ("answer_seconds", "answer s", "{:.2f}"), ("ingest_seconds", "ingest s", "{:.0f}"),
    ("disk_mb", "disk MB", "{:.1f}"), ("resident_mb", "resident MB", "{:.1f}"),
)


@dataclass(frozen=True)
class GoldVariant:
    """One system under evaluation against gold: a kvchat cache (`cache`), retrieval of raw turns (`rag`), or
    both (the question's retrieved turns prefilled on top of the routed cache). `key` names it in results and
    tables; `entries` is the KV budget it is compared at (the cache's and the retrieved turns' together)."""

    key: str
    entries: int
    cache: CacheConfig | None = None
    rag: RagConfig | None = None
    baseline: bool = False   # a system a user would pick instead of kvchat's (rag, recent)
    episodes: EpisodeConfig | None = None  # the cache's episodes, where not the base ingest's


def hybrid_variant(cache: GoldVariant, rag: GoldVariant) -> GoldVariant:
    """`cache`'s caches with `rag`'s retrieved turns prefilled on top of the routed one at each question."""
    return dataclasses.replace(cache, key=f"{cache.key}+{rag.key}", entries=cache.entries + rag.entries,
                               rag=rag.rag, baseline=False)  # fmt: skip


def kvchat_variant(cache: CacheConfig, key: str) -> GoldVariant:
    """A kvchat cache, compared at its budget M (with offload: M, IceCache's resident window W and the R entries
    read back)."""
    offload = cache.offload
    return GoldVariant(key, cache.budget + (offload.recent + offload.retrieve if offload.enabled else 0), cache=cache)


def recent_variant(budget: int, base: CacheConfig = CacheConfig()) -> GoldVariant:
    """Sink + the last tokens at `budget` entries per layer and KV head: StreamingLLM's cache, every layer
    alike (`streaming` keeps the system prompt, its sink and the most recent entries at every block)."""
    cache = dataclasses.replace(base, method="streaming", budget=budget, layer_budgets="uniform",
                                head_budgets="uniform")  # fmt: skip
    return GoldVariant(f"recent@{budget}", budget, cache=cache, baseline=True)


def rag_variant(budget: int, chunk_tokens: int, dated: bool = False, retrieval: str = "dense") -> GoldVariant:
    """The top budget // chunk_tokens chunks: `budget` entries of retrieved turns (at least one chunk); `dated`,
    each chunk opening with its date; `retrieval`, how they are ranked (RETRIEVALS)."""
    k = max(1, budget // chunk_tokens)
    name = "rag" + ("-dated" if dated else "") + ("" if retrieval == "dense" else f"-{retrieval}")
    return GoldVariant(f"{name}@{k}x{chunk_tokens}", k * chunk_tokens,
                       rag=RagConfig(chunk_tokens, k, dated, retrieval), baseline=True)  # fmt: skip


def baselines(budgets: Iterable[int], chunk_tokens: int, base: CacheConfig = CacheConfig()) -> list[GoldVariant]:
    """RAG as a careful user runs it, ranking chunks each of RETRIEVALS' ways (dense, lexical, hybrid: "RAG" in a
    verdict is the best of them), and `recent`, at each of `budgets`."""
    return [v for b in budgets for v in (*(rag_variant(b, chunk_tokens, retrieval=r) for r in RAG_RETRIEVALS),
                                         recent_variant(b, base))]  # fmt: skip


def gold_variants(caches: Sequence[tuple[str, CacheConfig]], budgets: Sequence[int], chunk_tokens: int,
                  base: CacheConfig = CacheConfig()) -> list[GoldVariant]:  # fmt: skip
    """kvchat's caches (`(key, config)`, as `kvchat eval` plans them), then `rag` and `recent` at each of
    `budgets`: what `kvchat eval` runs against gold."""
    return [kvchat_variant(cache, key) for key, cache in caches] + baselines(budgets, chunk_tokens, base)


def by_reference(qa_sets: Sequence[QASet], lm: LoadedModel, against: str,
                 system_prompt: str) -> tuple[list[QASet], list[QASet]]:  # fmt: skip
    """(sets compared with full KV, sets scored against gold) for `EvalConfig.against`: auto sends a history
    that does not fit the model's window to gold; full refuses one, in one line."""
    if against == "gold":
        return [], list(qa_sets)
    fits = {s.name: fits_window(lm, s, system_prompt) for s in qa_sets}
    too_long = [s.name for s in qa_sets if not fits[s.name]]
    if against == "full" and too_long:
        raise UserError(f"{', '.join(too_long)}: the history does not fit {lm.spec}'s window, so full KV cannot be "
                        f"the reference; use {option('against', 'gold')} (or auto), or a smaller "
                        f"{option('max_context')}")  # fmt: skip
    return [s for s in qa_sets if fits[s.name]], [s for s in qa_sets if not fits[s.name]]


def fits_window(lm: LoadedModel, qa_set: QASet, system_prompt: str) -> bool:
    """Whether the whole history, its system prompt and room for an answer fit the model's window (full KV
    can be the reference only then)."""
    if not lm.context_window:
        return True
    text = system_prompt + "\n".join(format_turns(qa_set.turns))
    return int(lm.encode(text).shape[-1]) + ANSWER_ROOM <= lm.context_window


class Results(Protocol):
    """Where records go (kvchat.eval.evaluate.ResultsFile): append-only, and what is there already."""

    records: list[dict]

    def append(self, record: dict) -> None: ...


class Progress(Protocol):
    @property
    def ingest(self) -> IngestHooks: ...

    def variant(self, qa_set: str, key: str, index: int, total: int) -> None: ...

    def question(self, done: int, total: int) -> None: ...


class _Quiet:
    ingest = IngestProgress()

    def variant(self, qa_set: str, key: str, index: int, total: int) -> None: ...

    def question(self, done: int, total: int) -> None: ...


def evaluate_gold(
    qa_sets: Iterable[QASet],
    variant_list: Sequence[GoldVariant],
    *,
    lm: LoadedModel,
    encoder: SentenceEncoder,
    results: Results,
    config: EvalConfig = EvalConfig(),
    base: IngestConfig = IngestConfig(),
    profile_dirs: Sequence[Path] = (),
    progress: Progress | None = None,
    store: Store | None = None,
    conversation_name: Callable[[QASet, GoldVariant], str] | None = None,
    answering: LoadedModel | None = None,
) -> list[dict]:
    """Ask every set's questions of every variant and score them against gold; returns all records, those
    `results` held before included. kvchat's caches are built in `store` and kept there for the next run
    (reused while their settings match; `conversation_name` names them, default `default_name`), else in a
    scratch store deleted afterwards. `lm` builds the caches, as `kvchat ingest` does; `answering` (default `lm`:
    the same weights, held as `kvchat ask --weights` holds them) decodes every answer and prefills rag's chunks."""
    progress = progress or _Quiet()
    ask_config = config.answering()
    with tempfile.TemporaryDirectory(prefix="kvchat-gold-") as scratch:
        own = store is None
        store = Store(Path(scratch)) if store is None else store
        for qa_set in qa_sets:
            questions = sample_questions(qa_set.questions, config.questions)
            references = memory_metrics.References(answering or lm, qa_set, base.system_prompt,
                                                   config.question_template)  # fmt: skip
            ours = gold_records(results.records)
            skips = {(r["set"], r["variant"]) for r in ours if r["kind"] == "skipped"}
            for i, variant in enumerate(variant_list):
                done = {r["qid"] for r in ours if r["kind"] == "answer" and (r["set"], r["variant"]) == (
                    qa_set.name, variant.key)}  # fmt: skip
                todo = [q for q in questions if q.qid not in done]
                if not todo or (qa_set.name, variant.key) in skips:
                    continue
                progress.variant(qa_set.name, variant.key, i, len(variant_list))
                try:
                    name = (conversation_name or default_name)(qa_set, variant)
                    answerer = _prepare(variant, qa_set, name, lm, answering or lm, encoder, base, ask_config, store,
                                        results, profile_dirs, progress)  # fmt: skip
                except UserError as error:  # a setting this model or history cannot take: say so, run the rest
                    results.append({"kind": "skipped", "against": GOLD, "set": qa_set.name, "variant": variant.key,
                                    "reason": str(error)})  # fmt: skip
                    continue
                for n, question in enumerate(todo, start=1):
                    probe = memory_metrics.probe_for(answering or lm, question)
                    clock = time.perf_counter()
                    got = answerer.ask(question.text, probe)
                    seconds = time.perf_counter() - clock  # the probe's forward included: small beside the answer
                    results.append({
                        "kind": "answer", "against": GOLD, "set": qa_set.name, "variant": variant.key,
                        "method": variant.cache.method if variant.cache else "rag", "entries_budget": variant.entries,
                        "baseline": variant.baseline, "qid": question.qid, "category": question.category,
                        "question": question.text, "gold": question.gold, "prediction": got.text,
                        "f1": round(score_answer(got.text, question), 4), "recall": contains_gold(got.text, question),
                        "seconds": round(seconds, 3), **got.costs,
                        **memory_metrics.fields(probe, references, question, got.present),
                    })  # fmt: skip
                    progress.question(n, len(todo))
        if own:
            store.close()
    return results.records


@dataclass(frozen=True)
class _Got:
    text: str
    costs: dict  # entries, resident_bytes, disk_bytes, prompt_tokens, answer_tokens, episode, transcript_cut
    present: dict | None = None  # what the prompt holds where the answerer knows it better than the probe


class _KvchatAnswerer:
    def __init__(self, session: Session, lm: LoadedModel, disk_bytes: int, retrieve: int,
                 recall: RagSession | None = None) -> None:  # fmt: skip
        self.session, self.disk_bytes, self.retrieve, self.recall = session, disk_bytes, retrieve, recall
        self.heads = lm.num_layers * lm.config.num_key_value_heads
        self.entry_bytes = _entry_bytes(lm)

    def ask(self, question: str, probe: Probe) -> _Got:
        retrieved, present = "", None
        if self.recall is not None:
            chunks = [self.recall.index.chunks[i] for i in self.recall.retrieve(question)]
            retrieved = "\n".join(c.text for c in chunks)
        answer = self.session.ask(question, log=False, retrieved_text=retrieved, probe=probe)
        if self.recall is not None:  # the retrieved turns, given as text, are not the session's to name
            present = memory_metrics.merged(probe.present, memory_metrics.chunk_presence(self.session.lm, chunks))
        record = self.session.conversation.episodes[answer.episode]
        held = record.n_tokens / self.heads + answer.prompt_tokens  # resident + the question prefilled
        # resident bytes: the episode file's tensors (as held), the question's entries and the R read back
        return _Got(answer.text, {
            "entries": round(held + self.retrieve, 1), "resident_bytes": record.bytes + int(
                (answer.prompt_tokens + self.retrieve) * self.heads * self.entry_bytes), "disk_bytes": self.disk_bytes,
            "prompt_tokens": answer.prompt_tokens, "answer_tokens": answer.answer_tokens, "episode": answer.episode,
            "transcript_cut": answer.transcript_cut,
        }, present)  # fmt: skip


class _RagAnswerer:
    def __init__(self, session: RagSession) -> None:
        self.session = session
        lm = session.lm
        self.entry_bytes = _entry_bytes(lm) * lm.num_layers * lm.config.num_key_value_heads  # all layers, heads

    def ask(self, question: str, probe: Probe) -> _Got:
        answer = self.session.ask(question, probe=probe)  # everything it attends to is the prompt's keys and values
        chunks = [self.session.index.chunks[i] for i in answer.chunks]
        return _Got(answer.text, {
            "entries": answer.entries, "resident_bytes": int(answer.entries * self.entry_bytes),
            "disk_bytes": self.session.index.nbytes, "prompt_tokens": answer.prompt_tokens,
            "answer_tokens": answer.answer_tokens, "chunks": list(answer.chunks),
            "transcript_cut": answer.transcript_cut,
        }, memory_metrics.chunk_presence(self.session.lm, chunks))  # fmt: skip


def _entry_bytes(lm: LoadedModel) -> float:
    """Bytes of one entry (key and value) of one layer and KV head in the model's dtype."""
    config = lm.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * head_dim * lm.dtype.itemsize


def default_name(qa_set: QASet, variant: GoldVariant) -> str:
    """The stored conversation of a kvchat variant's caches for `qa_set`."""
    return "gold." + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{qa_set.name}.{variant.key}")[:90]


def _prepare(variant, qa_set, name, lm, answering, encoder, base, ask_config, store, results, profile_dirs, progress):
    """The variant's answerer for `qa_set`: its index built, or its caches ingested by `lm` (or found in `store`);
    `answering` answers."""
    recall = None
    if variant.rag is not None:
        clock = time.perf_counter()
        index = RagIndex.build(qa_set.turns, lm, encoder, variant.rag.chunk_tokens, variant.rag.dated)
        recall = RagSession(index, answering, encoder, variant.rag, ask_config, base.system_prompt)
        if variant.cache is None:
            _note_ingest(results, qa_set.name, variant, seconds=time.perf_counter() - clock, disk_bytes=index.nbytes)
            return _RagAnswerer(recall)
    if variant.cache.method == "full" and not fits_window(lm, qa_set, base.system_prompt):
        raise UserError("full KV: the history does not fit the model's window")
    config = dataclasses.replace(base, cache=variant.cache, episodes=variant.episodes or base.episodes)
    conversation = _stored(store, name, qa_set, config, lm, encoder, profile_dirs)
    if conversation is None:
        ingest(qa_set.turns, name=name, config=config, store=store, lm=lm, encoder=encoder, source=qa_set.name,
               progress=progress.ingest, profile_dirs=profile_dirs, replace=True)  # fmt: skip
        conversation = store.get(name)
    stats = conversation.stats
    disk = sum(f[1] for f in conversation.files()) + (recall.index.nbytes if recall else 0)
    _note_ingest(results, qa_set.name, variant, seconds=stats.get("seconds"), disk_bytes=disk,
                 history_tokens=stats.get("history_tokens"), peak_layer_entries=stats.get("peak_layer_entries"),
                 episodes=stats.get("episodes"), prefill=stats.get("prefill"))  # fmt: skip
    session = Session(store, conversation, answering, encoder, ask_config)
    retrieve = variant.cache.offload.retrieve if variant.cache.offload.enabled else 0
    return _KvchatAnswerer(session, answering, disk, retrieve, recall)


def _stored(store, name, qa_set, config, lm, encoder, profile_dirs):
    """The conversation `name` in `store` when it was built from this history with these settings."""
    if name not in {c.name for c in store.conversations()}:
        return None
    plan = plan_ingest(qa_set.turns, name=name, config=config, store=store, lm=lm, encoder=encoder, replace=True,
                       source=qa_set.name, profile_dirs=profile_dirs, force=True)  # fmt: skip
    stored = store.get(name)
    wanted = to_settings(plan.config, source=None)
    return stored if {**upgraded(stored.settings), "source": None} == wanted else None


def _note_ingest(results: Results, qa_set: str, variant: GoldVariant, **fields) -> None:
    """One `ingest` record per set and variant: what preparing it cost (kept from the first run)."""
    if any(r["kind"] == "ingest" and r["set"] == qa_set and r["variant"] == variant.key for r in results.records):
        return
    results.append({"kind": "ingest", "against": GOLD, "set": qa_set, "variant": variant.key,
                    "entries_budget": variant.entries, **fields})  # fmt: skip


def gold_records(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r.get("against") == GOLD]


def summarize_gold(records: Sequence[dict]) -> list[dict]:
    """One row per variant over all sets: F1 with its interval, per category too; answer seconds; KV entries
    attended while answering; bytes on disk and resident; ingest seconds."""
    answers: dict[str, list[dict]] = defaultdict(list)
    ingests: dict[str, list[dict]] = defaultdict(list)
    for r in gold_records(records):
        if r["kind"] == "answer":
            answers[r["variant"]].append(r)
        elif r["kind"] == "ingest":
            ingests[r["variant"]].append(r)
    rows = []
    for key, rs in answers.items():
        f1 = [r["f1"] for r in rs]
        disks = [i["disk_bytes"] for i in ingests.get(key, []) if i.get("disk_bytes") is not None]
        seconds = [i["seconds"] for i in ingests.get(key, []) if i.get("seconds") is not None]
        low, high = bootstrap_interval(f1)
        rows.append({
            "variant": key, "method": rs[0]["method"], "baseline": rs[0]["baseline"],
            "entries_budget": rs[0]["entries_budget"], "questions": len(rs),
            "f1": float(np.mean(f1)), "f1_interval": (low, high), "f1_low": low, "f1_high": high,
            "f1_by_category": {
                CATEGORIES.get(c, str(c)): (float(np.mean(v)), *bootstrap_interval(v))
                for c in sorted({r["category"] for r in rs}) for v in [[r["f1"] for r in rs if r["category"] == c]]
            },
            "recall": float(np.mean([float(r["recall"]) for r in rs])),
            "answer_seconds": float(np.mean([r["seconds"] for r in rs])),
            "entries": float(np.mean([r["entries"] for r in rs])),
            "resident_bytes": float(np.mean([r["resident_bytes"] for r in rs])),
            "resident_mb": float(np.mean([r["resident_bytes"] for r in rs])) / 2**20,
            "disk_bytes": float(np.mean(disks)) if disks else None,
            "disk_mb": float(np.mean(disks)) / 2**20 if disks else None,
            "ingest_seconds": float(np.mean(seconds)) if seconds else None,
            **memory_metrics.memory_summary(rs),
        })  # fmt: skip
    return sorted(rows, key=lambda r: (r["entries_budget"], r["baseline"], r["nll"] if r["nll"] is not None else 0,
                                       -r["f1"], r["variant"]))


def verdict(records: Sequence[dict]) -> list[str]:
    """Per entry budget with both kvchat and a baseline measured, one line: by gold-answer NLL where the answers carry
    it, kvchat's best against RAG's best (memory_metrics.nll_verdict); in results written before NLL, the best kvchat
    system against the best baseline (by mean F1) among the systems answering the most questions at that budget (a
    mean over a subset is not comparable), their paired difference over the questions both answered and its 95%
    interval. A win is called only when the interval excludes zero."""
    rows = summarize_gold(records)
    if memory_metrics.has_nll(gold_records(records)):
        return memory_metrics.nll_verdict(gold_records(records), rows)
    scores: dict[str, dict] = defaultdict(dict)
    for r in gold_records(records):
        if r["kind"] == "answer":
            scores[r["variant"]][(r["set"], r["qid"])] = r["f1"]
    lines = []
    for budget in sorted({r["entries_budget"] for r in rows}):
        at = [r for r in rows if r["entries_budget"] == budget]
        most = max(r["questions"] for r in at)
        ours = [r for r in at if not r["baseline"] and r["questions"] == most]
        theirs = [r for r in at if r["baseline"] and r["questions"] == most]
        if not ours or not theirs:
            continue
        a = max(ours, key=lambda r: r["f1"])
        b = max(theirs, key=lambda r: r["f1"])
        diff, low, high, n = paired_difference(scores[a["variant"]], scores[b["variant"]])
        gap = f"{diff:+.3f} F1 (95% interval [{low:+.3f}, {high:+.3f}], {n} questions)"
        if low > 0 or high < 0:
            winner, loser = (a, b) if diff > 0 else (b, a)
            lines.append(f"{budget} entries: {winner['variant']} beat {loser['variant']} by "
                         f"{abs(diff):.3f} F1; {a['variant']} - {b['variant']} = {gap}")  # fmt: skip
        else:
            lines.append(f"{budget} entries: no winner between {a['variant']} and {b['variant']}: {gap} is "
                         "inside the noise")  # fmt: skip
    return lines


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value / 2**20:.1f}"


GOLD_COLUMNS = (  # what each column of `gold_markdown`'s table means, stated under it
    ("entries attended", "KV entries per layer and KV head the first answer token attends to: resident, read back "
     "from pages and prefilled at question time (system prompt and question included); systems are compared at "
     "equal entries"),
    ("questions", "n: the questions the row's F1 is the mean over"),
    ("F1 [95% interval]", "LoCoMo's token F1 against the gold answers, with a percentile bootstrap interval over the "
     f"questions ({RESAMPLES} resamples, seed {SEED})"),
    *memory_metrics.LEGEND,
    ("multi-hop ... single-hop", "the same F1 per LoCoMo category"),
    ("answer s", "seconds per answer in this one process, everything done at question time included"),
    ("ingest s", "seconds of the system's ingest (rag: chunking and embedding)"),
    ("disk MB / resident MB", "what the system stores, and holds in memory while answering"),
)


def gold_markdown(records: Sequence[dict], *, title: str, notes: Sequence[str] = (),
                  settings: dict[str, str] | None = None) -> str:  # fmt: skip
    """The report of an eval against gold: the `settings` it ran with, one row per system (F1 with its interval,
    evidence recall, gold-answer NLL and recovery with theirs, F1 per category, answer and ingest seconds, KV entries
    attended, megabytes on disk and resident), what each column means, then the verdict lines."""
    rows = summarize_gold(records)
    categories = [CATEGORIES[c] for c in (1, 2, 3, 4)]
    lines = [f"# {title}", "", *[line for note in notes for line in (note, "")]]
    if settings:
        lines += ["Settings:", "", *[f"- {name}: {value}" for name, value in settings.items()], ""]
    memory = [" | ".join(memory_metrics.HEADERS) + " | ", "|".join(a for _, a in memory_metrics.ALIGN) + "|"]
    lines += [
             "| system | entries attended | questions | F1 [95% interval] | " + memory[0] + " | ".join(categories)
             + " | answer s | ingest s | disk MB | resident MB |",
             "|---|---:|---:|---|" + memory[1] + "---:|" * len(categories) + "---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        low, high = r["f1_interval"]
        cells = [f"{r['f1_by_category'][c][0]:.3f}" if c in r["f1_by_category"] else "" for c in categories]
        ingest = "" if r["ingest_seconds"] is None else f"{r['ingest_seconds']:.0f}"
        lines.append(f"| {r['variant']} | {r['entries']:.0f} | {r['questions']} | {r['f1']:.3f} [{low:.3f}, {high:.3f}]"
                     f" | {' | '.join(memory_metrics.cells(r))} | {' | '.join(cells)} | {r['answer_seconds']:.2f} | "
                     f"{ingest} | {_mb(r['disk_bytes'])} | "
                     f"{_mb(r['resident_bytes'])} |")  # fmt: skip
    legend = ["Columns:", "", *[f"- {name}: {meaning}" for name, meaning in GOLD_COLUMNS]]
    return "\n".join([*lines, "", *[f"- {line}" for line in verdict(records)], "", *legend, ""])
