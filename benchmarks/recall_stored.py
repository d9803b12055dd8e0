"""`--method recall` with its chunks' entries computed at ingest instead of prefilled at each question: what it
would give, measured before it is built.

    KVCHAT_HOME=... OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/recall_stored.py DATA... \
        --out benchmarks/results/records/recall_stored.jsonl --report benchmarks/results/recall_stored.md

Recall answers from a routed episode cache with the question's top chunks of raw turns prefilled on top of it
(answer.recall), so every answer pays a prefill of its chunks (R = 512 tokens at the defaults). Their entries could
instead be computed once per chunk when the conversation is ingested, kept, and at each question placed after the
cache with their keys re-rotated to the positions the prefill would give them (kvchat.kv.rope); only the question
is prefilled then. A chunk's entries cannot see the cache they will follow, so the question is what that costs.
Systems, on the same store, the same routed caches, the same chunks and the same entries per question:
- `prefilled`: kvchat's recall as it ships (`Session.ask`);
- `stored, alone`: each chunk's entries computed after the system prompt alone;
- `stored, after the previous chunk`: each chunk's entries computed after the system prompt and the chunk before it
  in the history (whose entries are dropped);
- `... int8` / `... int4`: those entries kept in 8 or 4 bits as `--cache-precision` keeps caches (KIVI: keys per
  channel in groups of 32 / 16 tokens, values per token; a chunk's last entries short of a group in float16), and
  placed dequantized.
Each conversation is ingested at the defaults into `$KVCHAT_HOME` (reused by a later run); answers with LoCoMo's QA
prompt and kvchat's answer settings for evaluation (kvchat.config.EvalConfig), every category 1-4 question; the
records file resumes. `stored MB`: the chunks' entries as they would be kept (float16, or their 8- or 4-bit codes
with their scales and minima).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _load import Load, checked  # benchmarks/ is on sys.path

from kvchat.answer import recall
from kvchat.answer.decoding import decode_answer, question_prompt
from kvchat.answer.rag import RagIndex
from kvchat.answer.session import Session
from kvchat.config import AskConfig, EvalConfig, IngestConfig, default_home
from kvchat.eval.evaluate import ResultsFile
from kvchat.eval.gold import bootstrap_interval, paired_difference
from kvchat.eval.qa import load_locomo, score_answer
from kvchat.history.episodes import route
from kvchat.ingest.pipeline import ingest
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.quantize import QuantizedEntries
from kvchat.kv.rope import rotate_keys
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, LoadedModel, load_model, use_threads
from kvchat.settings import from_settings
from kvchat.store import Store

PREFILLED, ALONE, AFTER_PREVIOUS = "prefilled", "stored, alone", "stored, after the previous chunk"
INT8, INT4 = f"{AFTER_PREVIOUS}, int8", f"{AFTER_PREVIOUS}, int4"
SYSTEMS = (PREFILLED, ALONE, AFTER_PREVIOUS, INT8, INT4)
QUANTIZED = {INT8: (8, 32), INT4: (4, 16)}  # bits, key group: kvchat's quantized caches' (CacheConfig)


@dataclass(frozen=True)
class StoredChunks:
    """Every chunk's entries per layer (`[1, kv_heads, n, D]` keys rotated for positions from `starts[i]`, and
    values); `seconds` their prefill, `stored_bytes` what keeping them takes."""

    entries: list[list[tuple[torch.Tensor, torch.Tensor]]]
    starts: list[int]
    seconds: float
    stored_bytes: int

    @classmethod
    def computed(cls, lm: LoadedModel, index: RagIndex, prefix: torch.Tensor, after_previous: bool) -> StoredChunks:
        """Each chunk's entries computed after `prefix` (the system prompt), with the chunk before it or alone; kept
        in float16."""
        clock = time.perf_counter()
        entries, starts = [], []
        with torch.inference_mode():
            for i, chunk in enumerate(index.chunks):
                cache = EpisodeCache(lm.num_layers)
                lm.forward(cache, prefix)
                if after_previous and i > 0:
                    lm.forward(cache, lm.encode("\n" + index.chunks[i - 1].text))
                ids = lm.encode("\n" + chunk.text)  # as recall prefills it: after the line before it
                starts.append(cache.next_position)
                lm.forward(cache, ids)
                n = ids.shape[-1]
                entries.append([(layer.keys[:, :, -n:].clone(), layer.values[:, :, -n:].clone())
                                for layer in cache.layers])  # fmt: skip
        stored = sum(2 * (k.numel() + v.numel()) for chunk in entries for k, v in chunk)
        return cls(entries, starts, time.perf_counter() - clock, stored)

    def quantized(self, bits: int, group: int) -> StoredChunks:
        """These entries as they come back from `bits`-bit codes (whole groups of `group`; the rest in float16),
        `stored_bytes` what the codes, scales and minima take; `seconds` 0: no prefill of their own."""
        entries, stored = [], 0
        for chunk in self.entries:
            layers = []
            for keys, values in chunk:
                whole = keys.shape[2] // group * group
                codes = QuantizedEntries.quantize(keys[0, :, :whole], values[0, :, :whole], group, bits)
                rest = keys.shape[2] - whole
                stored += codes.nbytes() + 2 * rest * 2 * keys.shape[1] * keys.shape[3]
                layers.append((torch.cat([codes.keys()[None], keys[:, :, whole:].half().float()], dim=2),
                               torch.cat([codes.values()[None], values[:, :, whole:].half().float()], dim=2)))
            entries.append(layers)
        return StoredChunks(entries, self.starts, 0.0, stored)

    def place(self, cache: EpisodeCache, chunk: int, rotary: torch.nn.Module) -> None:
        """The chunk's entries appended to `cache` as a prefill of its text there would append them."""
        layers = self.entries[chunk]
        heads, n = layers[0][0].shape[1], layers[0][0].shape[2]
        delta = torch.full((heads, n), cache.next_position - self.starts[chunk])
        for layer, (keys, values) in enumerate(layers):
            cache.update(rotate_keys(keys, delta, rotary), values, layer)
        cache.advance(n)


class StoredAnswerer:
    """Recall's answer (route, cache, chunks, question) with the chunks' stored entries placed instead of their
    text prefilled."""

    def __init__(self, store: Store, name: str, lm: LoadedModel, encoder: SentenceEncoder, config: AskConfig) -> None:
        self.store, self.lm, self.encoder, self.config = store, lm, encoder, config
        self.conversation = store.get(name)
        settings = self.conversation.settings
        self.layout = ChatLayout.from_tokenizer(lm.tokenizer, settings["system_prompt"])
        self.split = recall.split(from_settings(settings).cache)
        self.centroids = np.stack([np.asarray(e.centroid, dtype=np.float32) for e in self.conversation.episodes])
        self.caches: dict[int, EpisodeCache] = {}
        self.index: RagIndex | None = None
        self._cache(0)  # reads the chunk index
        self.rotary = lm.model.model.rotary_emb
        self.prefix = lm.encode(self.layout.before_conversation)
        self.stored: dict[str, StoredChunks] = {}

    def chunks(self, system: str) -> StoredChunks:
        """The stored entries `system` places, computed when first asked for."""
        if system not in self.stored:
            if system in QUANTIZED:
                self.stored[system] = self.chunks(AFTER_PREVIOUS).quantized(*QUANTIZED[system])
            else:
                self.stored[system] = StoredChunks.computed(self.lm, self.index, self.prefix,
                                                            system == AFTER_PREVIOUS)
        return self.stored[system]

    def _cache(self, episode: int) -> EpisodeCache:
        if episode not in self.caches:
            tensors, metadata = self.store.load_episode(self.conversation.episodes[episode], self.lm.fingerprint)
            self.caches[episode], _ = codec.decode(tensors, metadata, dtype=self.lm.dtype, device=self.lm.device)
            self.index = self.index or recall.from_metadata(metadata)
        return self.caches[episode]

    def ask(self, question: str, system: str) -> str:
        question = question.strip()
        query = self.encoder.embed([question])[0]
        cache = self._cache(route(query, self.centroids)[0])
        chunks = recall.picked(self.index, question, query, self.split)
        prompt = self.lm.encode(question_prompt(self.layout, self.config, question))
        mark = cache.checkpoint()
        try:
            with torch.inference_mode():
                for chunk in chunks:
                    self.chunks(system).place(cache, chunk, self.rotary)
                return decode_answer(self.lm, cache, prompt, self.config, question=question).text  # as ask decodes
        finally:
            cache.rollback(mark)


def run(paths: list[Path], out: Path, home: Path, load: Load) -> list[dict]:
    """Every question of every conversation answered by each system; records appended to `out` (resumed), after
    a `run` record of the load this run started on."""
    results = ResultsFile(out)  # resumed: a line an interruption cut is dropped
    note, records = results.append, results.records
    done = {(r["set"], r["qid"], r["system"]) for r in records if r["kind"] == "answer"}
    store, encoder = Store(home), SentenceEncoder()
    lm = load_model("default", home / "models", weights="auto")
    evaluation = EvalConfig()
    config = evaluation.answering()  # as eval and `kvchat ask` answer (kvchat.answer.decoding)
    note({"kind": "run", "date": str(dt.date.today()), "load": load.record()})
    for path in paths:
        qa = load_locomo(path, max_context=None)
        todo = [(q, s) for q in qa.questions for s in SYSTEMS if (qa.name, q.qid, s) not in done]
        if not todo:
            continue
        name = f"recall-stored.{path.stem}"
        if name not in {c.name for c in store.conversations()}:
            ingest(qa.turns, name=name, config=IngestConfig(), store=store, lm=lm, encoder=encoder,
                   source=str(path))  # fmt: skip
        session = Session(store, store.get(name), lm, encoder, config)
        stored = StoredAnswerer(store, name, lm, encoder, config)
        for system in dict.fromkeys(s for _, s in todo if s != PREFILLED):
            chunks = stored.chunks(system)
            note({"kind": "build", "set": qa.name, "system": system, "chunks": len(chunks.entries),
                  "seconds": round(chunks.seconds, 1), "stored_bytes": chunks.stored_bytes})  # fmt: skip
        session.ask("How are you?", log=False)  # warm-up: the first answer builds the decode step
        print(f"{qa.name}: {len(todo)} answers", file=sys.stderr, flush=True)
        for question, system in todo:
            clock = time.perf_counter()
            text = (
                session.ask(question.text, log=False).text
                if system == PREFILLED
                else stored.ask(question.text, system)
            )
            note({"kind": "answer", "set": qa.name, "qid": question.qid, "category": question.category,
                  "system": system, "prediction": text, "f1": round(score_answer(text, question), 4),
                  "seconds": round(time.perf_counter() - clock, 3)})  # fmt: skip
    return records


def report(records: list[dict], command: str, load: Load) -> str:
    answers: dict[str, dict] = defaultdict(dict)
    seconds: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["kind"] == "answer":
            answers[r["system"]][(r["set"], r["qid"])] = r["f1"]
            seconds[r["system"]].append(r["seconds"])
    builds = defaultdict(list)
    for r in records:
        if r["kind"] == "build":
            builds[r["system"]].append(r)
    lines = [
        "# Recall with its chunks' entries computed at ingest",
        "",
        f"`{command}`",
        "",
        f"{dt.date.today()}, {platform.machine()}, one torch thread, the embedded model with its default weights "
        f"(int4 on a CPU), caches ingested at the defaults; the last run {load} (each run's load: the `run` "
        "records).",
        "",
        "| system | questions | F1 [95% interval] | - prefilled [95% interval] | answer s, mean | x prefilled "
        "| built s | stored MB |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    base = float(np.mean(seconds[PREFILLED])) if seconds[PREFILLED] else float("nan")
    for system in SYSTEMS:
        f1 = answers[system]
        if not f1:
            continue
        low, high = bootstrap_interval(list(f1.values()))
        diff = (
            ""
            if system == PREFILLED
            else "{:+.3f} [{:+.3f}, {:+.3f}]".format(*paired_difference(f1, answers[PREFILLED])[:3])
        )
        mean_s = float(np.mean(seconds[system]))
        built = sum(b["seconds"] for b in builds[system])  # quantized: the unquantized entries' prefill, not again
        stored = sum(b.get("stored_bytes", b.get("float16_bytes", 0)) for b in builds[system]) / 2**20
        lines.append(
            f"| {system} | {len(f1)} | {np.mean(list(f1.values())):.3f} [{low:.3f}, {high:.3f}] | {diff} | "
            f"{mean_s:.2f} | {base / mean_s:.2f} | {f'{built:.0f}' if built else ''} | "
            f"{f'{stored:.0f}' if builds[system] else ''} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, resumed")
    parser.add_argument("--report", type=Path, default=None)
    args = checked(parser)
    use_threads()
    records = run(args.data, args.out, default_home(), args.load)
    text = report(records, "python benchmarks/recall_stored.py " + " ".join(sys.argv[1:]), args.load)
    print(text)
    if args.report is not None:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
