"""Grounded answers on the embedded model: does the grounding check flag the wrong answers and pass the right ones,
and does the off-topic signal leave every right answer alone, on planted-fact histories in every format?

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grounding.py [--histories 4] [--formats openai,...] [--out PATH]

Each planted-fact history kvchat.history.synthetic generates (seeds 0..N-1, 4 topics of 24 turns) is written as a user
would export it, once per format (OpenAI messages JSON, a ChatGPT export, a Claude export, a plain transcript, a
WhatsApp export with its notice line, LoCoMo JSON), read back by kvchat's own reader (`load_history`), ingested with
the default settings at `--budget`, and every planted question asked with sources (`Session.ask(sources=True)`).
An answer is right when it contains the fact (`synthetic.recalled`). Besides, 5 questions about another history
(`synthetic.OFF_TOPIC_QUESTIONS`) per history and format are asked to see the off-topic signal still fire.

Targets (issue 45): wrong answers flagged (grounding "unsupported") >= 80%; right answers flagged <= 10%; no right
answer flagged off-topic. Thresholds (config.py's GroundingConfig) are chosen on these generated histories, never
on LoCoMo; `--report-only` writes the table again from the records.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _load import checked  # benchmarks/ is on sys.path

from kvchat.answer.session import Session
from kvchat.config import AskConfig, CacheConfig, IngestConfig
from kvchat.history.loading import load_history
from kvchat.history.synthetic import OFF_TOPIC_QUESTIONS, SPEAKERS, planted_conversation, recalled
from kvchat.ingest.pipeline import ingest
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model
from kvchat.store import Store

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / ".venv" / "kvchat-test-models"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "grounding.md"
OFF_TOPIC_PER_HISTORY = 5
START = 1_700_000_000  # the exports' first message time (seconds since the epoch): 2023-11-14


def _openai(messages: list[dict]) -> str:
    return json.dumps(messages)


def _chatgpt(messages: list[dict]) -> str:
    """A ChatGPT export: one conversation whose `mapping` chains the messages under a root (Maya the user)."""
    mapping: dict = {"root": {"id": "root", "message": None, "parent": None, "children": ["m0"]}}
    for i, m in enumerate(messages):
        mapping[f"m{i}"] = {
            "id": f"m{i}", "parent": "root" if i == 0 else f"m{i - 1}",
            "children": [f"m{i + 1}"] if i + 1 < len(messages) else [],
            "message": {"id": f"m{i}", "author": {"role": "user" if m["role"] == SPEAKERS[0] else "assistant"},
                        "create_time": START + 60 * i, "content": {"content_type": "text", "parts": [m["content"]]},
                        "status": "finished_successfully", "recipient": "all"},
        }
    return json.dumps([{"title": "Planted facts", "create_time": START, "update_time": START + 60 * len(messages),
                        "mapping": mapping, "current_node": f"m{len(messages) - 1}"}])


def _claude(messages: list[dict]) -> str:
    stamp = lambda i: time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(START + 60 * i))  # noqa: E731
    return json.dumps([{"uuid": "c0", "name": "Planted facts", "created_at": stamp(0), "updated_at": stamp(0),
                        "chat_messages": [
                            {"uuid": f"m{i}", "text": m["content"],
                             "content": [{"type": "text", "text": m["content"], "citations": []}],
                             "sender": "human" if m["role"] == SPEAKERS[0] else "assistant",
                             "created_at": stamp(i), "updated_at": stamp(i), "attachments": [], "files": []}
                            for i, m in enumerate(messages)]}])  # fmt: skip


def _transcript(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def _whatsapp(messages: list[dict]) -> str:
    day = lambda i: time.strftime("%d/%m/%Y, %H:%M", time.gmtime(START + 60 * i))  # noqa: E731
    notice = f"{day(0)} - Messages and calls are end-to-end encrypted. No one outside of this chat can read them.\n"
    return notice + "".join(f"{day(i)} - {m['role']}: {m['content']}\n" for i, m in enumerate(messages))


def _locomo(messages: list[dict]) -> str:
    sessions: dict = {"speaker_a": SPEAKERS[0], "speaker_b": SPEAKERS[1]}
    per = 24
    for s in range(0, len(messages), per):
        n = s // per + 1
        sessions[f"session_{n}_date_time"] = f"1:56 pm on {n} May, 2023"
        sessions[f"session_{n}"] = [{"speaker": m["role"], "dia_id": f"D{n}:{i + 1}", "text": m["content"]}
                                    for i, m in enumerate(messages[s : s + per])]  # fmt: skip
    return json.dumps(sessions | {"qa": []})


FORMATS: dict[str, tuple[str, Callable[[list[dict]], str]]] = {
    "openai": ("json", _openai), "chatgpt": ("json", _chatgpt), "claude": ("json", _claude),
    "transcript": ("txt", _transcript), "whatsapp": ("txt", _whatsapp), "locomo": ("json", _locomo),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=int, default=4)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--budget", type=int, default=256)  # compressed: ~1.2K history tokens
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--models", type=Path, default=MODELS_DIR, help="where the embedded model is converted")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--report-only", action="store_true", help="the table again from the records beside --out")
    args = checked(parser, skip=lambda a: a.report_only)
    measured = args.out.parent / "records" / args.out.with_suffix(".jsonl").name
    if args.report_only:
        records = [json.loads(line) for line in measured.read_text().splitlines()]
        _write(_report(records), args.out)
        return
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        sys.exit(f"unknown formats: {', '.join(unknown)} (known: {', '.join(FORMATS)})")

    lm = load_model("default", args.models)
    encoder = SentenceEncoder()
    config = IngestConfig(cache=dataclasses.replace(CacheConfig(), budget=args.budget))
    records: list[dict] = [{"kind": "run", "histories": args.histories, "formats": formats, "budget": args.budget,
                            "max_new_tokens": args.max_new_tokens, "load": args.load.record(),
                            "run": str(args.load)}]  # fmt: skip
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as home:
        store = Store(Path(home) / "home")
        for seed in range(args.histories):
            messages, facts = planted_conversation(seed=seed, topics=4, turns_per_topic=24)
            for name in formats:
                suffix, write = FORMATS[name]
                path = Path(home) / f"planted{seed}-{name}.{suffix}"
                path.write_text(write(messages))
                conversation = f"planted{seed}-{name}"
                ingest(load_history(path), name=conversation, config=config, store=store, lm=lm, encoder=encoder,
                       source=str(path))
                session = Session(store, store.get(conversation), lm, encoder,
                                  AskConfig(max_new_tokens=args.max_new_tokens))
                for fact in facts:
                    answer = session.ask(fact.question, sources=True, log=False)
                    records.append({"kind": "answer", "format": name, "seed": seed, "question": fact.question,
                                    "fact": fact.answer, "answer": answer.text, "right": recalled(answer.text, fact),
                                    "grounding": answer.grounding.to_dict() if answer.grounding else None,
                                    "off_topic": answer.off_topic, "similarity": answer.similarity,
                                    "sources": [s.to_dict() for s in answer.sources or []]})  # fmt: skip
                refusing = Session(store, store.get(conversation), lm, encoder,
                                   AskConfig(max_new_tokens=1, refuse_off_topic=True))
                for k in range(OFF_TOPIC_PER_HISTORY):
                    question = OFF_TOPIC_QUESTIONS[(seed * OFF_TOPIC_PER_HISTORY + k) % len(OFF_TOPIC_QUESTIONS)]
                    answer = refusing.ask(question, log=False)
                    records.append({"kind": "off_topic", "format": name, "seed": seed, "question": question,
                                    "off_topic": answer.off_topic, "similarity": answer.similarity})
                print(f"{conversation}: done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    records[0]["seconds"] = round(time.perf_counter() - started, 1)
    measured.parent.mkdir(parents=True, exist_ok=True)
    measured.write_text("".join(json.dumps(r) + "\n" for r in records))
    _write(_report(records), args.out)


def _share(hits: int, n: int) -> str:
    return f"{hits / n:.0%} ({hits}/{n})" if n else "n/a (0)"


def _report(records: list[dict]) -> str:
    run = next(r for r in records if r["kind"] == "run")
    answers = [r for r in records if r["kind"] == "answer"]
    off = [r for r in records if r["kind"] == "off_topic"]
    flagged = lambda r: (r["grounding"] or {}).get("status") == "unsupported"  # noqa: E731
    quoted = lambda r: bool((r["grounding"] or {}).get("better")) and r["fact"].lower() in \
        r["grounding"]["better"]["quote"].lower()  # noqa: E731
    lines = [
        "# Grounded answers: the grounding check and the off-topic signal (embedded model)", "",
        f"SmolLM2-135M-Instruct; {run['histories']} planted-fact histories (kvchat.history.synthetic seeds "
        f"0..{run['histories'] - 1}, 4 topics x 24 turns), each written in every format ({', '.join(run['formats'])})"
        f" and read back by kvchat's reader; default ingest settings with --budget {run['budget']}, answers of at "
        f"most {run['max_new_tokens']} tokens with sources; {run.get('seconds', '?')} s, run {run.get('run', '?')} "
        f"(the figures are answers' text, which the load does not change). Reproduce with "
        f"`HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grounding.py --histories {run['histories']}`.", "",
        "| format | answers | right | wrong answers flagged | right answers flagged | wrong with the fact quoted "
        "| right flagged off-topic | off-topic questions flagged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in [*run["formats"], "all"]:
        mine = [r for r in answers if name in ("all", r["format"])]
        right = [r for r in mine if r["right"]]
        wrong = [r for r in mine if not r["right"]]
        others = [r for r in off if name in ("all", r["format"])]
        lines.append(
            f"| {'**all**' if name == 'all' else name} | {len(mine)} | {len(right)} "
            f"| {_share(sum(map(flagged, wrong)), len(wrong))} | {_share(sum(map(flagged, right)), len(right))} "
            f"| {_share(sum(map(quoted, wrong)), len(wrong))} "
            f"| {_share(sum(r['off_topic'] for r in right), len(right))} "
            f"| {_share(sum(r['off_topic'] for r in others), len(others))} |")
    lines += ["", "Targets (issue 45): wrong answers flagged >= 80%, right answers flagged <= 10%, no right answer "
              "flagged off-topic. \"Wrong with the fact quoted\": the better quote under a flagged wrong answer holds "
              "the planted fact. Raw records: `benchmarks/results/records/grounding.jsonl`.", ""]
    return "\n".join(lines)


def _write(text: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
