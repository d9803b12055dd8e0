"""How often retrieved chunks hold a question's evidence: the ranking behind `RecallConfig.retrieval`.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/retrieval.py DATA... \
        [--chunk-tokens 256 128] [--out benchmarks/results/retrieval.md]

Every category 1-4 question of each LoCoMo conversation (whole, every session) names its evidence turns. The
conversation is cut into chunks as `kvchat.rag` cuts it, and each ranking picks its top k chunks for the question;
the score is the share of the question's evidence turns inside them (mean over questions), at the k that fill
the same tokens (k x chunk tokens). Rankings:
- `dense`: the sentence encoder kvchat ships (MiniLM), cosine of the chunk's and the question's embeddings (what
  plain RAG does);
- `lexical`: TF-IDF of the words (kvchat.lexical), the encoder breaking ties (what `--method recall` ships);
- `turns`: the encoder, a chunk scored by its best turn's embedding;
- `fused`: reciprocal-rank fusion of dense and lexical (k = 60).
Only the encoder and the model's tokenizer run: no answer is decoded, so this takes a minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import numpy as np

from kvchat.config import default_home
from kvchat.encoder import SentenceEncoder
from kvchat.llm import load_model, use_threads
from kvchat.qa import load_locomo
from kvchat.rag import RagIndex

RANKINGS = ("dense", "lexical", "turns", "fused")


def _fused(*scores: np.ndarray, k: int = 60) -> np.ndarray:
    total = np.zeros(len(scores[0]))
    for s in scores:
        ranks = np.empty(len(s))
        ranks[np.argsort(-s, kind="stable")] = np.arange(len(s))
        total += 1 / (k + ranks)
    return total


def evidence_hits(path: Path, lm, encoder: SentenceEncoder, chunk_tokens: int, ks: list[int]) -> dict:
    """{(ranking, k): [share of each question's evidence turns in its top k chunks]} for one conversation."""
    qa = load_locomo(path, max_context=None)
    turn_of = {t.turn_id: i for i, t in enumerate(qa.turns)}
    index = RagIndex.build(qa.turns, lm, encoder, chunk_tokens)
    owner = np.zeros(len(qa.turns), dtype=int)
    for c, chunk in enumerate(index.chunks):
        owner[chunk.first:chunk.end] = c
    turn_embeddings = encoder.embed([f"{t.role}: {t.text}" for t in qa.turns])
    hits: dict = {}
    for question, query in zip(qa.questions, encoder.embed([q.text for q in qa.questions]), strict=True):
        evidence = {int(owner[turn_of[e]]) for e in question.evidence if e in turn_of}
        dense = index.embeddings @ query
        best_turn = np.full(len(index.chunks), -np.inf)
        np.maximum.at(best_turn, owner, turn_embeddings @ query)
        lexical = index.lexical.scores(question.text)
        orders = {
            "dense": np.argsort(-dense, kind="stable"),
            "lexical": np.lexsort((-dense, -lexical)),
            "turns": np.argsort(-best_turn, kind="stable"),
            "fused": np.argsort(-_fused(dense, lexical), kind="stable"),
        }
        for name, order in orders.items():
            for k in ks:
                top = set(order[:k].tolist())
                hits.setdefault((name, k), []).append(len(evidence & top) / max(1, len(evidence)))
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", type=Path)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 768, 1024], help="k x chunk tokens")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    use_threads()
    home = default_home()
    lm, encoder = load_model("default", home / "models"), SentenceEncoder()
    lines = ["# Retrieval: the share of a question's evidence turns in its top chunks", "",
             f"`python benchmarks/retrieval.py {' '.join(sys.argv[1:])}` ({dt.date.today()}); whole conversations "
             f"({', '.join(p.stem for p in args.data)}), every category 1-4 question with evidence, mean over "
             "questions of the share of its evidence turns inside the chosen chunks.", "",
             "| chunk tokens | tokens retrieved | k | " + " | ".join(RANKINGS) + " |",
             "|---:|---:|---:|" + "---:|" * len(RANKINGS)]
    for chunk_tokens in args.chunk_tokens:
        ks = [t // chunk_tokens for t in args.tokens]
        hits: dict = {}
        for path in args.data:
            for key, values in evidence_hits(path, lm, encoder, chunk_tokens, ks).items():
                hits.setdefault(key, []).extend(values)
        for tokens, k in zip(args.tokens, ks, strict=True):
            cells = " | ".join(f"{np.mean(hits[(name, k)]):.3f}" for name in RANKINGS)
            lines.append(f"| {chunk_tokens} | {tokens} | {k} | {cells} |")
        questions = len(hits[(RANKINGS[0], ks[0])])
    lines += ["", f"{questions} questions."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
