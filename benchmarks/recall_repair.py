"""Stored recall entries, repaired and compressed, against recall as it prefills its chunks, measured apart from the
reader: how much of prefilled recall's answer each keeps, what it costs at a question, and what it stores.

    KVCHAT_HOME=... OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/recall_repair.py \
        [DATA...] [--synthetic N] [--questions N] [--variants stored:k0,stored:k8,stored:k32,stored:k8:f25] \
        --out benchmarks/results/records/recall_repair.jsonl --report benchmarks/results/recall_repair.md

Histories: LoCoMo conversations, whole (every category 1-4 question with evidence; `--questions N` an evenly spread
N of each), and `--synthetic N` generated planted-fact histories beyond the model's window (kvchat.eval.qa
.planted_sets, seeds 0..N-1, 6 topics of 250 turns: about 19K tokens, a question per planted fact). Each history is
ingested at kvchat's defaults (`--method recall`, budget 1024) with its chunks prefilled, the reference, and per
variant with them stored (`--recall-entries stored`; the variants' episode caches are the same, built once and
written into each): `stored:kK` recomputes the first K tokens of each placed
chunk at the question with everything placed before it in view (RecallConfig.repair, EPIC), `:fF` keeps F% of each
chunk's entries (RecallConfig.kept; the budget then places about 100/F as many chunks). Every question is asked of
each through `Session.ask` (the path `kvchat ask` answers by), the reference first, with a probe
(kvchat.answer.probe): per answer the gold answer's NLL teacher forced, the KL divergence KL(prefilled || variant) of
the first answer token's distribution, evidence recall, and seconds (LoCoMo's QA prompt, greedy, at most 32 tokens:
kvchat.config.EvalConfig). The records file resumes; caches stay in $KVCHAT_HOME's store and are reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import platform
import re
import sys
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from _load import Load, checked  # benchmarks/ is on sys.path

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, EvalConfig, IngestConfig, RecallConfig, default_home
from kvchat.eval import memory_metrics
from kvchat.eval.evaluate import ResultsFile
from kvchat.eval.qa import QASet, load_locomo, planted_sets, sample_questions
from kvchat.eval.stats import bootstrap_interval, paired_difference
from kvchat.ingest.pipeline import (
    IngestReport,
    build_episodes,
    commit_ingest,
    plan_ingest,
    write_episode,
    write_recall_entries,
)
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model, use_threads
from kvchat.store import Store

PREFILLED = "prefilled"
VARIANTS = "stored:k0,stored:k8,stored:k32"
SYNTHETIC = {"topics": 6, "turns_per_topic": 250}  # ~19K tokens: 2.3x the embedded model's window
_SPEC = re.compile(r"stored:k(?P<k>\d+)(?::f(?P<f>\d+))?")


def recall_config(variant: str) -> RecallConfig:
    """The RecallConfig of `prefilled` or a `stored:kK[:fF]` variant (kvchat's defaults otherwise)."""
    if variant == PREFILLED:
        return dataclasses.replace(RecallConfig(), entries="prefilled")
    match = _SPEC.fullmatch(variant)
    if match is None:
        raise SystemExit(f"cannot read variant {variant!r} (stored:kK or stored:kK:fF)")
    return dataclasses.replace(RecallConfig(), entries="stored", repair=int(match["k"]),
                               kept=int(match["f"] or 100) / 100)  # fmt: skip


def histories(paths: list[Path], synthetic: int) -> list[QASet]:
    sets = [load_locomo(path) for path in paths]
    return sets + [dataclasses.replace(s, name=f"planted-long-{i}")
                   for i, s in enumerate(planted_sets(synthetic, **SYNTHETIC))]  # fmt: skip


def ingest_variants(qa: QASet, configs: dict[str, IngestConfig], store: Store, lm, encoder) -> dict[str, IngestReport]:
    """Each config's conversation of `qa` (by name) from one pass of the episode loop: recall's variants here differ
    in their recall entries file only (their budgets split alike, checked), so every episode cache is built once and
    written into each pending conversation, then each writes its own recall entries file. A report's seconds are the
    episodes' and its own file's."""
    if not configs:
        return {}
    plans = {name: plan_ingest(qa.turns, name=name, config=config, store=store, lm=lm, encoder=encoder,
                               source=qa.name) for name, config in configs.items()}  # fmt: skip
    first = next(iter(plans.values()))
    if any(p.budgets != first.budgets or len(p.episodes) != len(first.episodes) for p in plans.values()):
        raise SystemExit(f"{qa.name}: the variants' episode caches differ; ingest them one by one")
    reports = {}
    with ExitStack() as stack:
        pendings = {name: stack.enter_context(store.begin(name)) for name in plans}
        records: dict[str, list] = {name: [] for name in plans}
        stats = []
        clock = time.perf_counter()
        for built in build_episodes(first, lm, scratch=pendings[first.name].scratch_dir):
            for name, plan in plans.items():
                records[name].append(write_episode(pendings[name], plan, built, lm))
            stats.append(built.stats())
        episodes = time.perf_counter() - clock
        for name, plan in plans.items():
            clock = time.perf_counter()
            recall_file = write_recall_entries(pendings[name], plan, lm)
            reports[name] = commit_ingest(pendings[name], plan, stats, records[name], lm,
                                          episodes + time.perf_counter() - clock, recall_file)  # fmt: skip
    return reports


def run(sets: list[QASet], variants: list[str], questions: int | None, out: Path, home: Path, load: Load) -> list:
    results = ResultsFile(out)  # resumed: a line an interruption cut is dropped
    note, records = results.append, results.records
    done = {(r["set"], r["qid"], r["variant"]) for r in records if r["kind"] == "answer"}
    store, encoder = Store(home), SentenceEncoder()
    lm = load_model("default", home / "models", weights="auto")
    evaluation = EvalConfig()
    config = evaluation.answering()  # as eval and `kvchat ask` answer (kvchat.answer.decoding)
    note({"kind": "run", "date": str(dt.date.today()), "load": load.record()})
    for qa in sets:
        asked = sample_questions(qa.questions, questions)
        everything = [PREFILLED, *variants]
        if all((qa.name, q.qid, v) in done for q in asked for v in everything):
            continue
        names = {v: f"repair.{qa.name}.{v.replace(':', '-')}" for v in everything}
        stored = {c.name for c in store.conversations()}
        missing = {names[v]: IngestConfig(cache=dataclasses.replace(CacheConfig(method="recall"),
                                                                    recall=recall_config(v)))
                   for v in everything if names[v] not in stored}  # fmt: skip
        for name, report in ingest_variants(qa, missing, store, lm, encoder).items():
            note({"kind": "ingest", "set": qa.name, "variant": next(v for v in everything if names[v] == name),
                  "seconds": report.seconds, "history_tokens": report.history_tokens,
                  "recall_entries_bytes": report.recall_entries_bytes})  # fmt: skip
        sessions = {}
        for variant in everything:
            sessions[variant] = Session(store, store.get(names[variant]), lm, encoder, config)
            sessions[variant].ask("How are you?", log=False)  # warm-up: the decode step, the files opened
        references = memory_metrics.References(lm, qa, IngestConfig().system_prompt, config.question_template)
        print(f"{qa.name}: {len(asked)} questions x {len(everything)}", file=sys.stderr, flush=True)
        for n, question in enumerate(asked, start=1):
            first: dict[str, torch.Tensor] = {}
            for variant in everything:
                probe = memory_metrics.probe_for(lm, question)
                logits: list[torch.Tensor] = []
                clock = time.perf_counter()
                answer = sessions[variant].ask(question.text, log=False, on_first_logits=logits.append,
                                               probe=probe)  # fmt: skip
                seconds = time.perf_counter() - clock
                first[variant] = logits[0].float().log_softmax(-1)
                if (qa.name, question.qid, variant) in done:
                    continue
                reference = first[PREFILLED]
                kl = float((reference.exp() * (reference - first[variant])).sum().clamp_min(0))
                note({"kind": "answer", "set": qa.name, "qid": question.qid, "category": question.category,
                      "variant": variant, "prediction": answer.text, "kl": round(kl, 5),
                      "seconds": round(seconds, 3), "prompt_tokens": answer.prompt_tokens,
                      **memory_metrics.fields(probe, references, question)})  # fmt: skip
            if n % 10 == 0:
                print(f"  {n}/{len(asked)}", file=sys.stderr, flush=True)
    return records


def _table(records: list[dict], variants: list[str], sets: set[str]) -> list[str]:
    answers: dict[str, dict] = defaultdict(dict)
    for r in records:
        if r["kind"] == "answer" and r["set"] in sets:
            answers[r["variant"]][(r["set"], r["qid"])] = r
    ingests = defaultdict(list)
    for r in records:
        if r["kind"] == "ingest" and r["set"] in sets:
            ingests[r["variant"]].append(r)
    base = answers[PREFILLED]
    base_s = float(np.mean([r["seconds"] for r in base.values()])) if base else float("nan")
    lines = ["| variant | questions | gold NLL [95%] | - prefilled [95%] | KL to prefilled [95%] | evidence any | "
             "evidence >= half | answer s | x prefilled | recall entries KB / history token |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for variant in [PREFILLED, *variants]:
        got = answers[variant]
        if not got:
            continue
        nll = [r["nll"] for r in got.values()]
        low, high = bootstrap_interval(nll)
        diff = "" if variant == PREFILLED else "{:+.3f} [{:+.3f}, {:+.3f}]".format(*paired_difference(
            {q: r["nll"] for q, r in got.items()}, {q: r["nll"] for q, r in base.items()})[:3])  # fmt: skip
        kl = [r["kl"] for r in got.values()]
        kl_low, kl_high = bootstrap_interval(kl)
        any_ = np.mean([r["evidence_any"] for r in got.values() if r["evidence_any"] is not None])
        half = np.mean([r["evidence_half"] for r in got.values() if r["evidence_half"] is not None])
        seconds = float(np.mean([r["seconds"] for r in got.values()]))
        built = [i for i in ingests[variant] if i.get("history_tokens")]
        per_token = (sum(i["recall_entries_bytes"] for i in built) / sum(i["history_tokens"] for i in built) / 1024
                     if built else float("nan"))  # fmt: skip
        lines.append(f"| {variant} | {len(got)} | {np.mean(nll):.3f} [{low:.3f}, {high:.3f}] | {diff} | "
                     f"{np.mean(kl):.3f} [{kl_low:.3f}, {kl_high:.3f}] | {any_:.2f} | {half:.2f} | {seconds:.2f} | "
                     f"{base_s / seconds:.2f} | {per_token:.2f} |")  # fmt: skip
    return lines


def report(records: list[dict], variants: list[str], command: str, load: Load | None) -> str:
    names = sorted({r["set"] for r in records if r["kind"] == "answer"})
    groups = {"LoCoMo": {n for n in names if not n.startswith("planted")},
              "generated (planted facts)": {n for n in names if n.startswith("planted")}}
    lines = ["# Stored recall entries repaired and compressed, against prefilled recall", "", f"`{command}`", "",
             f"{dt.date.today()}, {platform.machine()}, one torch thread, the embedded model with its default weights "
             f"(int4 on a CPU), every cache at kvchat's defaults but the recall entries; the last run {load}.", ""]
    for title, sets in groups.items():
        if sets:
            lines += [f"## {title}: {', '.join(sorted(sets))}", "", *_table(records, variants, sets), ""]
    lines += ["Columns: gold NLL, the gold answer's mean per-token negative log-likelihood teacher forced after the "
              "variant's context and question, and its paired difference from prefilled recall's (95% bootstrap "
              "intervals over the questions); KL, KL(prefilled || variant) of the first answer token in nats; "
              "evidence, the share of the evidence turns the first answer token can attend to, any token of a turn / "
              "at least half of them (kvchat.eval.memory_metrics); answer s, seconds per answer in this one "
              "process, side by side; recall entries, the file's bytes per history token.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="*", type=Path)
    parser.add_argument("--synthetic", type=int, default=0, help="generated planted-fact histories beyond the window")
    parser.add_argument("--questions", type=int, default=None, help="per LoCoMo conversation, spread over the file")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, resumed")
    parser.add_argument("--report", type=Path, default=None)
    args = checked(parser)
    use_threads()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for variant in variants:
        recall_config(variant)
    records = run(histories(args.data, args.synthetic), variants, args.questions, args.out, default_home(),
                  args.load)  # fmt: skip
    text = report(records, variants, "python benchmarks/recall_repair.py " + " ".join(sys.argv[1:]), args.load)
    print(text)
    if args.report is not None:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
