"""Whole LoCoMo conversations (2-3x the embedded model's window): kvchat's caches against what a user would run
instead, every system scored against the gold answers at equal KV entries.

    KVCHAT_HOME=... python benchmarks/whole_conversation.py DATA... [--questions N] \
        [--systems rag@2x256,rag@4x256,recent@1024,snapkv@1024,epicache@1024] \
        --out benchmarks/results/records/whole_conversation.jsonl --report benchmarks/results/whole_conversation.md

Each conversation is loaded whole (every session, every category 1-4 question with evidence) and answered by each
system through kvchat.eval.gold, the library `kvchat eval --against gold` runs, every answer decoded as `kvchat ask`
decodes it (kvchat.answer.decoding at AskConfig's defaults: the question as asked, 64 tokens, repetition penalty):
F1 with a percentile bootstrap 95% interval (fixed seed), gold-answer NLL, oracle-gain recovery and evidence recall
(kvchat.eval.memory_metrics), per category, seconds per answer in this one process, KV entries per layer and KV head
the first answer token attends to (resident + read back + prefilled at question time), bytes on disk and resident.
kvchat's caches are built in $KVCHAT_HOME's store as `<conversation>.<system>` and reused by later runs while their
settings match (ingest seconds are the first build's); the results file resumes, so a run can be stopped and continued,
and `--questions N` measures an evenly spread subset first.

Systems (`--systems`): `rag@KxC` (top K chunks of at most C tokens of consecutive turns; `rag-dated@KxC`: each
chunk opening with its date), `recent@M` (sink + the last tokens, `streaming` at uniform layer budgets),
`rag-lexical@KxC` and `rag-hybrid@KxC` (ranked by their words, or by reciprocal-rank fusion of both rankings),
`METHOD@M` (`kvchat ingest --method METHOD --budget M` at its other defaults; `:eE` with E episodes, `:rR` with
IceCache offload reading R entries; `recall@M:sS:cC`: recall share S% of M, chunks of C tokens; `:lexical`,
`:dense`, `:hybrid`, `:interleaved`: `recall_retrieval` so; `:stored` or `:prefilled`: `--recall-entries` so;
`:kK`, each stored chunk's first K tokens recomputed at the question (`recall_repair`); `:fF`, F% of each stored
chunk's entries kept (`recall_kept`)), `CACHE+rag@KxC` (the question's top K chunks prefilled on top of CACHE's
routed cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import platform
import re
import sys
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import (
    WEIGHT_MODES,
    CacheConfig,
    EpisodeConfig,
    EvalConfig,
    IngestConfig,
    OffloadConfig,
    RecallConfig,
    default_home,
)
from kvchat.eval.evaluate import EvalProgress, ResultsFile
from kvchat.eval.gold import (
    GoldVariant,
    evaluate_gold,
    gold_markdown,
    hybrid_variant,
    kvchat_variant,
    rag_variant,
    recent_variant,
)
from kvchat.eval.qa import load_locomo, sample_questions
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model, use_threads
from kvchat.store import Store

SYSTEMS = "rag@2x256,rag@4x256,recent@1024,snapkv@1024,epicache@1024"
_SPEC = re.compile(r"(?P<name>[a-z0-9_-]+)@(?P<a>\d+)(?:x(?P<b>\d+))?(?::e(?P<e>\d+))?(?::r(?P<r>\d+))?"
                   r"(?::s(?P<s>\d+))?(?::c(?P<c>\d+))?(?::(?P<ret>dense|lexical|hybrid|interleaved))?(?P<dated>:dated)?"
                   r"(?::(?P<entries>stored|prefilled))?(?::k(?P<k>\d+))?(?::f(?P<f>\d+))?")


def parse_system(spec: str) -> GoldVariant:
    if "+" in spec:  # a cache with retrieved turns prefilled on top of it
        cache, rag = (parse_system(part) for part in spec.split("+", 1))
        return hybrid_variant(cache, rag)
    match = _SPEC.fullmatch(spec.strip())
    if not match:
        raise SystemExit(f"cannot read system {spec!r} (rag@KxC, recent@M, METHOD@M[:eE][:rR][:sS][:cC], "
                         "CACHE+rag@KxC)")
    name, a, b = match["name"], int(match["a"]), match["b"]
    if name in ("rag", "rag-dated", "rag-lexical", "rag-hybrid"):
        return rag_variant(a * int(b or 256), int(b or 256), dated=name == "rag-dated",
                           retrieval=name.removeprefix("rag-") if name in ("rag-lexical", "rag-hybrid") else "dense")
    if name == "recent":
        return recent_variant(a)
    layer_budgets = "uniform" if name == "streaming" else CacheConfig.layer_budgets
    offload = OffloadConfig(mode="icecache", retrieve=int(match["r"])) if match["r"] else OffloadConfig()
    recall = RecallConfig(share=int(match["s"] or 50) / 100, chunk_tokens=int(match["c"] or 256),
                          retrieval=match["ret"] or RecallConfig.retrieval, dated=bool(match["dated"]),
                          entries=match["entries"] or RecallConfig.entries,
                          repair=int(match["k"]) if match["k"] else RecallConfig.repair,
                          kept=int(match["f"]) / 100 if match["f"] else RecallConfig.kept)
    cache = CacheConfig(method=name, budget=a, layer_budgets=layer_budgets, offload=offload, recall=recall)
    variant = kvchat_variant(cache, spec.strip())
    if match["e"]:
        variant = dataclasses.replace(variant, episodes=EpisodeConfig(episodes=int(match["e"])))
    return variant


class _Progress(EvalProgress):
    def variant(self, qa_set: str, key: str, index: int, total: int) -> None:
        print(f"[{dt.datetime.now():%H:%M:%S}] {qa_set} {key} ({index + 1}/{total})", file=sys.stderr, flush=True)

    def question(self, done: int, total: int) -> None:
        if done % 10 == 0 or done == total:
            print(f"  {done}/{total}", file=sys.stderr, flush=True)


def _name(qa_set, variant: GoldVariant) -> str:
    """`<conversation>.<system>` in the store; a hybrid's cache is its cache system's (shared)."""
    key = variant.key.split("+")[0].replace("@", "-").replace(":", "-").replace("recent-", "streaming-")
    return f"{qa_set.name}.{key}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", type=Path)
    parser.add_argument("--systems", default=SYSTEMS)
    parser.add_argument("--questions", type=int, default=None, help="per conversation, spread over the file")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, resumed")
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument("--note", default="", help="a line for the report (machine load, ...)")
    parser.add_argument("--no-echo-guard", action="store_true",
                        help="decode answers without kvchat.model.echo's guard (as kvchat did before 2026-11-26)")
    parser.add_argument("--weights", choices=WEIGHT_MODES, default="float",
                        help="the Linear weights answers are decoded with (as `kvchat ask --weights`)")
    parser.add_argument("--ingest-weights", choices=WEIGHT_MODES, default=None,
                        help="the Linear weights the caches are built with (as `kvchat ingest --weights`; default: "
                             "--weights, as kvchat builds and answers with the same weights)")
    args = checked(parser)
    use_threads()
    variants = [parse_system(s) for s in args.systems.split(",") if s.strip()]
    home = default_home()
    store = Store(home)
    building = args.weights if args.ingest_weights is None else args.ingest_weights
    lm = load_model("default", home / "models", weights=building)  # builds the caches
    answering = lm if args.weights == building else load_model("default", home / "models", weights=args.weights)
    sets = [load_locomo(path) for path in args.data]
    for s in sets:
        print(f"{s.name}: {len(s.turns)} turns, {len(s.questions)} questions", file=sys.stderr)
    results = ResultsFile(args.out)
    records = evaluate_gold(
        sets, variants, lm=lm, encoder=SentenceEncoder(), results=results,
        config=EvalConfig(questions=args.questions, echo_guard=not args.no_echo_guard), base=IngestConfig(),
        profile_dirs=[home / "profiles"], progress=_Progress(), store=store,
        conversation_name=_name, answering=answering,
    )
    names = {s.name for s in sets}
    asked = {(s.name, q.qid) for s in sets for q in sample_questions(s.questions, args.questions)}
    records = [r for r in records if (r.get("set"), r.get("qid")) in asked or (
        r.get("set") in names and r.get("kind") != "answer")]  # this run's questions
    command = "python benchmarks/whole_conversation.py " + " ".join(sys.argv[1:])
    note = (f"{dt.date.today()}, {platform.machine()} CPU, {os.cpu_count()} cores, run {args.load} (load average "
            f"{os.getloadavg()[0]:.1f} at the end), one torch thread. {args.note}")
    text = gold_markdown(records, title="Whole LoCoMo conversations against gold answers", notes=[f"`{command}`", note])
    print(text)
    if args.report is not None:
        args.report.write_text(text)
    store.close()


if __name__ == "__main__":
    main()
