"""Receipts on the embedded model: are the sources an answer names the turns that hold its fact, and does the
off-topic flag tell questions about the history from questions about another one?

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/receipts.py [--histories 10] [--budget N] [--out PATH]

For each planted-fact history kvchat.history.synthetic generates (seeds 0..N-1, 4 topics of 24 turns, ingested with the
default settings), every planted question is asked with sources (`Session.ask(sources=True)`): when the answer
is right (it contains the fact), is the planted turn among the top 3 sources? The 20 questions of
`synthetic.OFF_TOPIC_QUESTIONS` (about another history) and the planted questions are routed (`Session.route`):
their similarities give the share of each flagged at the threshold in config.py (`OFF_TOPIC_SIMILARITY`), and
the range of thresholds that would meet both targets (off-topic flagged >= 90%, in-topic <= 10%).

Targets: planted turn in the top 3 for >= 90% of right answers; off-topic flagged >= 90%; in-topic <= 10%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

from kvchat.answer.session import Session
from kvchat.config import OFF_TOPIC_SIMILARITY, AskConfig, CacheConfig, IngestConfig
from kvchat.history.synthetic import OFF_TOPIC_QUESTIONS, planted_conversation, recalled
from kvchat.ingest.pipeline import ingest
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model
from kvchat.store import Store

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / ".venv" / "kvchat-test-models"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "receipts.md"
TOP = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=int, default=10)
    parser.add_argument("--budget", type=int, default=256)  # compressed: ~1.2K history tokens
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--source-layers-from", type=float, default=AskConfig.source_layers_from,
                        help="AskConfig.source_layers_from: 0 counts every layer's attention")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report-only", action="store_true",
                        help="the report again from the records beside --out (records/NAME.jsonl): a new threshold")
    args = checked(parser, skip=lambda a: a.report_only)
    measured = args.out.parent / "records" / args.out.with_suffix(".jsonl").name
    if args.report_only:
        records = [json.loads(line) for line in measured.read_text().splitlines()]
        run = next(r for r in records if r.get("kind") == "run")
        args.histories, args.budget, args.max_new_tokens = run["histories"], run["budget"], run["max_new_tokens"]
        args.source_layers_from = run["source_layers_from"]
        rows = [r for r in records if r.get("kind") == "answer"]
        off_topic = [r["similarity"] for r in records if r.get("kind") == "off_topic"]
        _write(_report(rows, [r["similarity"] for r in rows], off_topic, args), args.out)
        return

    lm = load_model("default", MODELS_DIR)
    encoder = SentenceEncoder()
    config = IngestConfig(cache=dataclasses.replace(CacheConfig(), budget=args.budget))
    rows, in_topic, off_topic = [], [], []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as home:
        store = Store(Path(home))
        for seed in range(args.histories):
            messages, facts = planted_conversation(seed=seed, topics=4, turns_per_topic=24)
            ingest([_turn(m) for m in messages], name=f"planted{seed}", config=config, store=store, lm=lm,
                   encoder=encoder, source="synthetic")
            session = Session(store, store.get(f"planted{seed}"), lm, encoder,
                              AskConfig(max_new_tokens=args.max_new_tokens, source_count=TOP,
                                        source_layers_from=args.source_layers_from))
            for fact in facts:
                answer = session.ask(fact.question, sources=True, log=False)
                turns = [s.turn for s in answer.sources or []]
                rank = turns.index(fact.turn) + 1 if fact.turn in turns else None
                rows.append({"kind": "answer", "similarity": answer.similarity, "seed": seed, "topic": fact.topic,
                             "right": recalled(answer.text, fact), "planted_turn": fact.turn, "sources": turns,
                             "rank": rank, "answer": answer.text})
                in_topic.append(answer.similarity)
            off_topic += [session.route(q)[1] for q in OFF_TOPIC_QUESTIONS]
            print(f"history {seed + 1}/{args.histories}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    run = {"kind": "run", "histories": args.histories, "budget": args.budget, "max_new_tokens": args.max_new_tokens,
           "source_layers_from": args.source_layers_from, "load": args.load.record()}
    off = [{"kind": "off_topic", "similarity": round(s, 4)} for s in off_topic]
    measured.parent.mkdir(parents=True, exist_ok=True)
    measured.write_text("".join(json.dumps(r) + "\n" for r in [run, *rows, *off]))
    _write(_report(rows, in_topic, off_topic, args), args.out)


def _write(report: str, out: Path) -> None:
    print(report)
    out.write_text(report)


def _turn(message: dict):
    from kvchat.history.loading import Turn

    return Turn(message["role"], message["content"])


def _share(values: list[bool]) -> str:
    return f"{sum(values) / len(values):.0%} ({sum(values)}/{len(values)})" if values else "n/a"


def _report(rows: list[dict], in_topic: list[float], off_topic: list[float], args) -> str:
    right = [r for r in rows if r["right"]]
    threshold = OFF_TOPIC_SIMILARITY
    # thresholds t meeting both targets: >= 90% of off-topic below t, <= 10% of in-topic below t
    candidates = sorted(set(in_topic + off_topic))
    meets = [t for t in candidates if sum(s < t for s in off_topic) >= 0.9 * len(off_topic)
             and sum(s < t for s in in_topic) <= 0.1 * len(in_topic)]
    lines = [
        "# Receipts: sources and the off-topic flag (embedded model)",
        "",
        f"SmolLM2-135M-Instruct, {args.histories} planted-fact histories (kvchat.history.synthetic seeds "
        f"0..{args.histories - 1}, 4 topics x 24 turns), default ingest settings with --budget {args.budget}, "
        f"answers of at most {args.max_new_tokens} tokens, sources from the layers from "
        f"{args.source_layers_from:.0%} of the depth up; `benchmarks/receipts.py`.",
        "",
        "| measure | result | target |",
        "|---|---|---|",
        f"| answers right (contain the planted fact) | {_share([r['right'] for r in rows])} | |",
        f"| right answers whose planted turn is among the top {TOP} sources | "
        f"{_share([r['rank'] is not None for r in right])} | >= 90% |",
        f"| ... the top source | {_share([r['rank'] == 1 for r in right])} | |",
        f"| wrong answers whose planted turn is among the top {TOP} | "
        f"{_share([r['rank'] is not None for r in rows if not r['right']])} | |",
        f"| off-topic questions flagged (similarity < {threshold}) | {_share([s < threshold for s in off_topic])} "
        f"| >= 90% |",
        f"| in-topic (planted) questions flagged | {_share([s < threshold for s in in_topic])} | <= 10% |",
        "",
        "Routing similarity (cosine of the question to its nearest episode centroid):",
        "",
        "| questions | n | min | median | max |",
        "|---|---|---|---|---|",
        _stats("planted (in-topic)", in_topic),
        _stats(f"off-topic ({len(OFF_TOPIC_QUESTIONS)} per history)", off_topic),
        "",
        f"Thresholds meeting both flag targets here: {_range(meets)}. config.py's `OFF_TOPIC_SIMILARITY` is "
        f"{threshold}.",
        "",
    ]
    if args.source_layers_from:
        lines += ["Counting every layer's attention instead (`--source-layers-from 0`, 10 histories): "
                  "`receipts_all_layers.md`; the lower layers attend by position (the history's first turns, the "
                  "last ones) more than by content.", ""]
    return "\n".join(lines)


def _stats(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    return f"| {name} | {len(ordered)} | {ordered[0]:.3f} | {ordered[len(ordered) // 2]:.3f} | {ordered[-1]:.3f} |"


def _range(values: list[float]) -> str:
    return f"{min(values):.3f} to {max(values):.3f}" if values else "none"


if __name__ == "__main__":
    main()
