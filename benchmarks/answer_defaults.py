"""Choosing the answer defaults (the question template, the answer length, the repetition penalty) by measuring them
through the one answer path, on whole LoCoMo conversations and on planted-fact histories made like users' exports.

    KVCHAT_HOME=... python benchmarks/answer_defaults.py DATA... [--planted 10] \
        [--candidates plain:1.1,locomo:1.1] [--planted-only plain:1.2] [--questions N] [--max-new-tokens 64] \
        --out benchmarks/results/records/answer_defaults.jsonl --report benchmarks/results/answer_defaults.md

Each candidate is a question template (`TEMPLATES`, by key) and a repetition penalty. kvchat answers at its defaults
otherwise, as `kvchat ingest HISTORY` then `kvchat ask` do (`--method auto`: recall beyond the model's window,
epicache within it; budget 1024; int4 weights on a CPU; greedy; the echo guard), every question through
kvchat.eval.gold (the library `kvchat eval --against gold` runs, which answers through `Session.ask` as `kvchat ask`
does): LoCoMo's category 1-4 questions of each conversation given, and the planted facts of `--planted` histories
per export style (kvchat.history.synthetic.planted_export: seeds 0..N-1, 4 topics of 24 turns, in `openai`,
`transcript` and `whatsapp` form, read by kvchat's own readers). Caches are built once in $KVCHAT_HOME's store and
shared by the candidates (and by `benchmarks/whole_conversation.py --systems auto@1024`, which names them alike); the
records file resumes.

Reported per candidate: LoCoMo's token F1 with a bootstrap 95% interval, and the F1 the same answers would score cut
to fewer tokens (`--caps`: each answer's text re-tokenized and cut, an approximation of a run at that cap: greedy
decoding makes the shorter answer the longer one's first tokens); on planted facts the F1 and the share of answers
holding the fact; the mean answer tokens; answers that loop (a sequence of 4 words twice) and answers cut where the
model went on writing the transcript (kvchat.answer.stops), in percent of all answers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import (
    LOCOMO_QA_TEMPLATE,
    REPETITION_PENALTY,
    AskConfig,
    CacheConfig,
    EvalConfig,
    IngestConfig,
    Sampling,
    default_home,
)
from kvchat.eval.evaluate import EvalProgress, ResultsFile
from kvchat.eval.gold import bootstrap_interval, evaluate_gold, kvchat_variant, paired_difference
from kvchat.eval.qa import QASet, Question, load_locomo, repeats_itself, score_answer
from kvchat.history.loading import load_history
from kvchat.history.synthetic import EXPORT_STYLES, planted_export
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model, use_threads
from kvchat.store import Store

TEMPLATES = {
    "plain": "{question}",  # what `kvchat ask` asked before these measurements
    "locomo": LOCOMO_QA_TEMPLATE,  # what kvchat's benchmarks asked before them (LoCoMo's own QA prompt)
    "phrase": "{question} Answer with a short phrase from the conversation.",
    "assistant": "{question}\n\nAs the assistant, answer in a few words using facts from the conversation; write a "
                 "full sentence only if the question asks for an explanation.",
}
CANDIDATES = ",".join(f"{key}:{REPETITION_PENALTY:g}" for key in TEMPLATES)  # at the default penalty


def planted_sets(count: int, scratch: Path) -> list[QASet]:
    """`count` planted-fact histories per export style, read back by kvchat's readers, with their questions."""
    sets = []
    for style in EXPORT_STYLES:
        for seed in range(count):
            text, facts = planted_export(seed, style)
            path = scratch / f"planted-{style}-{seed}.{'json' if style == 'openai' else 'txt'}"
            path.write_text(text)
            questions = [Question(str(i), f.question, f.answer, 0) for i, f in enumerate(facts)]
            sets.append(QASet(f"planted-{style}-{seed}", load_history(path), questions))
    return sets


def parse_candidate(spec: str) -> tuple[str, str, float]:
    """`TEMPLATE:PENALTY` -> (its name, the template, the penalty)."""
    key, _, penalty = spec.strip().partition(":")
    if key not in TEMPLATES:
        raise SystemExit(f"unknown template {key!r} (known: {', '.join(TEMPLATES)})")
    return f"{key}:{float(penalty or 1.0):g}", TEMPLATES[key], float(penalty or 1.0)


class _Progress(EvalProgress):
    def variant(self, qa_set: str, key: str, index: int, total: int) -> None:
        print(f"[{dt.datetime.now():%H:%M:%S}] {qa_set} {key}", file=sys.stderr, flush=True)


def report(records: list[dict], names: list[str], caps: list[int], cut, title: str, notes: list[str]) -> str:
    """The markdown table: one row per candidate."""
    by = defaultdict(list)
    for r in records:
        if r.get("kind") == "answer":
            by[r["variant"]].append(r)
    lines = [f"# {title}", "", *[line for note in notes for line in (note, "")]]
    header = ["candidate", "LoCoMo F1 [95% interval]", *[f"F1 at {c} tokens" for c in caps], "planted F1",
              "planted right", "answer tokens", "loops", "transcript cut"]
    lines += ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for name in names:
        rs = by.get(name, [])
        locomo = [r for r in rs if not r["set"].startswith("planted-")]
        planted = [r for r in rs if r["set"].startswith("planted-")]
        if not rs:
            continue
        f1 = [r["f1"] for r in locomo]
        low, high = bootstrap_interval(f1) if f1 else (float("nan"), float("nan"))
        capped = [np.mean([score_answer(cut(r["prediction"], c), _question(r)) for r in locomo]) if locomo else
                  float("nan") for c in caps]  # fmt: skip
        cells = [name, f"{np.mean(f1):.3f} [{low:.3f}, {high:.3f}]" if f1 else "",
                 *[f"{v:.3f}" if locomo else "" for v in capped],
                 f"{np.mean([r['f1'] for r in planted]):.3f}" if planted else "",
                 f"{np.mean([r['recall'] for r in planted]):.0%}" if planted else "",
                 f"{np.mean([r['answer_tokens'] for r in rs]):.1f}",
                 f"{np.mean([repeats_itself(r['prediction']) for r in rs]):.0%}",
                 f"{np.mean([bool(r.get('transcript_cut')) for r in rs]):.0%}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    scores = {n: {(r["set"], r["qid"]): r["f1"] for r in by.get(n, []) if not r["set"].startswith("planted-")}
              for n in names}  # fmt: skip
    lines += ["", "Paired LoCoMo F1 differences (95% interval over the questions both answered):", ""]
    for a in names:
        for b in names:
            if a < b and scores[a] and scores[b]:
                diff, low, high, n = paired_difference(scores[a], scores[b])
                lines.append(f"- {a} - {b}: {diff:+.3f} [{low:+.3f}, {high:+.3f}] ({n} questions)")
    counts = {n: (len([r for r in by.get(n, []) if not r["set"].startswith("planted-")]),
                  len([r for r in by.get(n, []) if r["set"].startswith("planted-")])) for n in names}  # fmt: skip
    lines += ["", "Questions per candidate (LoCoMo, planted): "
              + ", ".join(f"{n} {a}/{b}" for n, (a, b) in counts.items()), ""]
    return "\n".join(lines)


def _question(record: dict) -> Question:
    return Question(record["qid"], record["question"], record["gold"], record["category"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="*", type=Path, help="LoCoMo conversations (conv-26.json, ...)")
    parser.add_argument("--planted", type=int, default=10, help="planted-fact histories per export style")
    parser.add_argument("--candidates", default=CANDIDATES, help="TEMPLATE:PENALTY,... (templates: "
                        + ", ".join(TEMPLATES) + ")")
    parser.add_argument("--questions", type=int, default=None,
                        help="LoCoMo questions per conversation, spread over the file (a subset of 2N's); default all")
    parser.add_argument("--planted-only", default="", help="more candidates, measured on the planted histories only")
    parser.add_argument("--max-new-tokens", type=int, default=AskConfig.max_new_tokens)
    parser.add_argument("--caps", default="16,32,48", help="shorter answer lengths, derived from the answers")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, resumed")
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument("--note", default="")
    args = checked(parser)
    use_threads()
    candidates = [parse_candidate(c) for c in args.candidates.split(",") if c.strip()]
    planted_only = [parse_candidate(c) for c in args.planted_only.split(",") if c.strip()]
    caps = [int(c) for c in args.caps.split(",") if c.strip()]
    home = default_home()
    store = Store(home)
    lm = load_model("default", home / "models", weights="auto")  # builds and answers, as kvchat does on a CPU
    encoder = SentenceEncoder()
    results = ResultsFile(args.out)
    with tempfile.TemporaryDirectory(prefix="kvchat-answer-defaults-") as scratch:
        planted = planted_sets(args.planted, Path(scratch))
        sets = [load_locomo(path) for path in args.data] + planted
        for (name, template, penalty), on in [*[(c, sets) for c in candidates], *[(c, planted) for c in planted_only]]:
            config = EvalConfig(max_new_tokens=args.max_new_tokens, question_template=template,
                                questions=args.questions, sampling=Sampling(repetition_penalty=penalty))
            evaluate_gold(on, [kvchat_variant(CacheConfig(), name)], lm=lm, encoder=encoder, results=results,
                          config=config, base=IngestConfig(), profile_dirs=[home / "profiles"], progress=_Progress(),
                          store=store, conversation_name=lambda s, v: f"{s.name}.auto-1024")  # fmt: skip

    def cut(text: str, tokens: int) -> str:
        return lm.decode(lm.encode(text)[0, :tokens].tolist()).strip()

    command = shlex.join(["python", "benchmarks/answer_defaults.py", *sys.argv[1:]])
    note = (f"{dt.date.today()}, {platform.machine()} CPU, {os.cpu_count()} cores, run {args.load} (load average "
            f"{os.getloadavg()[0]:.1f} at the end), one torch thread. {args.note}")
    text = report(results.records, [c[0] for c in [*candidates, *planted_only]], caps, cut,
                  "Answer defaults: question template, answer length, repetition penalty", [f"`{command}`", note])
    print(text)
    if args.report is not None:
        args.report.write_text(text)
    store.close()


if __name__ == "__main__":
    main()
