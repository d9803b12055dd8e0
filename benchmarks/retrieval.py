"""How often retrieved chunks hold a question's evidence: the ranking behind `RecallConfig.retrieval`.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/retrieval.py DATA... \
        [--chunk-tokens 256 128] [--out benchmarks/results/retrieval.md]

Every category 1-4 question of each LoCoMo conversation (whole, every session) names its evidence turns. The
conversation is cut into chunks as `answer.rag` cuts it, and each ranking picks its top k chunks for the question;
the score is the share of the question's evidence turns inside them (mean over questions), at the k that fill
the same tokens (k x chunk tokens). Rankings:
- `dense`: the sentence encoder kvchat ships (MiniLM), cosine of the chunk's and the question's embeddings (what
  plain RAG does);
- `lexical`: TF-IDF of the words (kvchat.answer.lexical), the encoder breaking ties (what `--method recall` shipped
  until 2026-12-02);
- `turns`: the encoder, a chunk scored by its best turn's embedding;
- `lexical-turns`: TF-IDF over the turns (idf over turns), a chunk scored by its best turn, the encoder breaking
  ties (a fact stated in one turn is not diluted by the chunk's other turns);
- `lexical+turns`: the chunk's TF-IDF cosine plus its best turn's, the encoder breaking ties;
- `fused`: reciprocal-rank fusion of dense and lexical (k = 60);
- `lexical|turns`: reciprocal-rank fusion of lexical and turns (k = 60);
- `interleaved`: lexical's best chunk, then the best by `turns` not taken yet, and so on (kvchat.answer.rag's
  `interleaved_order` over `TurnEmbeddings` of the turns as the history renders them: what `--method recall` ships
  since 2026-12-02);
- `segments`: the encoder, a chunk scored by the best episode segment (w turns, as an ingest embeds them for
  K-Means) it overlaps: no embedding beyond what an ingest computes;
- `interleaved-segments`: as `interleaved`, with segments in place of turns.

A second table asks the same of `--method recall`'s episode routing: the history cut into episodes as an ingest
cuts it (segments of w turns, K-Means, kvchat.history.episodes), the share of the evidence turns in the routed episode's
turns, in the recalled chunks (the top k at the default split and ranking), and in either. Routings:
- `centroid`: the nearest centroid (what `ask` does);
- `chunks`: the episode that holds most of the recalled chunks' turns;
- `best`: the episode that would cover most of the evidence with the chunks (known only from the gold evidence).
Only the encoder and the model's tokenizer run: no answer is decoded, so this takes a minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import numpy as np
from _load import checked  # benchmarks/ is on sys.path

from kvchat.answer.lexical import LexicalIndex
from kvchat.answer.rag import RagIndex, TurnEmbeddings, fused_order, interleaved_order
from kvchat.answer.recall import split
from kvchat.config import DEFAULT_EPISODES, EpisodeConfig, IngestConfig, default_home
from kvchat.eval.qa import load_locomo
from kvchat.history.episodes import build_episodes, route, segment
from kvchat.history.loading import format_turns
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import load_model, use_threads

RANKINGS = ("dense", "lexical", "turns", "lexical-turns", "lexical+turns", "fused", "lexical|turns", "interleaved",
            "segments", "interleaved-segments")


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
    turn_words = LexicalIndex(format_turns(qa.turns))
    rendered = TurnEmbeddings.build(format_turns(qa.turns), encoder)
    window = EpisodeConfig().segment_turns
    segment_embeddings = encoder.embed(segment(format_turns(qa.turns), window))
    hits: dict = {}
    for question, query in zip(qa.questions, encoder.embed([q.text for q in qa.questions]), strict=True):
        evidence = {int(owner[turn_of[e]]) for e in question.evidence if e in turn_of}
        dense = index.embeddings @ query
        best_turn = np.full(len(index.chunks), -np.inf)
        np.maximum.at(best_turn, owner, turn_embeddings @ query)
        lexical = index.lexical.scores(question.text)
        best_segment = np.full(len(index.chunks), -np.inf)
        for c, chunk in enumerate(index.chunks):
            best_segment[c] = float(np.max(segment_embeddings[chunk.first // window : (chunk.end - 1) // window + 1]
                                           @ query))
        best_words = np.zeros(len(index.chunks), dtype=np.float32)
        np.maximum.at(best_words, owner, turn_words.scores(question.text))
        by_words = np.lexsort((-dense, -lexical))
        orders = {
            "dense": np.argsort(-dense, kind="stable"),
            "lexical": by_words,
            "turns": np.argsort(-best_turn, kind="stable"),
            "lexical-turns": np.lexsort((-dense, -best_words)),
            "lexical+turns": np.lexsort((-dense, -(lexical + best_words))),
            "fused": np.argsort(-_fused(dense, lexical), kind="stable"),
            "lexical|turns": fused_order(by_words, np.argsort(-best_turn, kind="stable")),
            "interleaved": interleaved_order(by_words, np.argsort(
                -rendered.best_per_chunk(index.chunks, query), kind="stable"), k=len(index.chunks)),
            "segments": np.argsort(-best_segment, kind="stable"),
            "interleaved-segments": interleaved_order(by_words,
                                                      np.argsort(-best_segment, kind="stable"), k=len(index.chunks)),
        }
        for name, order in orders.items():
            for k in ks:
                top = set(order[:k].tolist())
                hits.setdefault((name, k), []).append(len(evidence & top) / max(1, len(evidence)))
    return hits


ROUTINGS = ("centroid", "chunks", "best")


def routing_hits(path: Path, lm, encoder: SentenceEncoder) -> dict:
    """{(routing, "episode" | "chunks" | "either"): [share of each question's evidence turns there]} for one
    conversation, at recall's default split and episode settings."""
    qa = load_locomo(path, max_context=None)
    turn_of = {t.turn_id: i for i, t in enumerate(qa.turns)}
    recall_split, window = split(IngestConfig().cache), EpisodeConfig().segment_turns
    segments = segment(format_turns(qa.turns), window)
    episodes = build_episodes(segments, encoder.embed(segments), k=min(DEFAULT_EPISODES, len(segments)),
                              seed=EpisodeConfig().seed, token_cap=1, count_tokens=len)  # fmt: skip
    episode_of = np.zeros(len(qa.turns), dtype=int)
    for episode in episodes:
        for s in episode.segments:
            episode_of[s * window : (s + 1) * window] = episode.index
    centroids = np.stack([e.centroid for e in episodes])
    index = RagIndex.build(qa.turns, lm, encoder, recall_split.chunk_tokens,
                           turn_embeddings=TurnEmbeddings.build(format_turns(qa.turns), encoder))
    hits: dict = {}
    for question, query in zip(qa.questions, encoder.embed([q.text for q in qa.questions]), strict=True):
        evidence = [turn_of[e] for e in question.evidence if e in turn_of]
        if not evidence:
            continue
        recalled = {t for c in index.top(query, recall_split.chunks, question.text, recall_split.retrieval)
                    for t in range(index.chunks[c].first, index.chunks[c].end)}  # fmt: skip
        votes = np.bincount(episode_of[sorted(recalled)], minlength=len(episodes)) + 1e-3 * (centroids @ query)
        covered = [_shares(e, evidence, recalled, episode_of) for e in range(len(episodes))]
        best = max(range(len(episodes)), key=lambda e: covered[e]["either"])
        for name, episode in (("centroid", route(query, centroids)[0]), ("chunks", int(np.argmax(votes))),
                              ("best", best)):  # fmt: skip
            for where, share in covered[episode].items():
                hits.setdefault((name, where), []).append(share)
    return hits


def _shares(episode: int, evidence: list[int], recalled: set[int], episode_of: np.ndarray) -> dict[str, float]:
    """The share of the `evidence` turns in `episode`, in the `recalled` turns, and in either."""
    where = [(episode_of[t] == episode, t in recalled) for t in evidence]
    return {"episode": sum(e for e, _ in where) / len(evidence), "chunks": sum(c for _, c in where) / len(evidence),
            "either": sum(e or c for e, c in where) / len(evidence)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", nargs="+", type=Path)
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 768, 1024], help="k x chunk tokens")
    parser.add_argument("--out", type=Path, default=None)
    args = checked(parser)
    use_threads()
    home = default_home()
    lm, encoder = load_model("default", home / "models"), SentenceEncoder()
    lines = ["# Retrieval: the share of a question's evidence turns in its top chunks", "",
             f"`python benchmarks/retrieval.py {' '.join(sys.argv[1:])}` ({dt.date.today()}, run {args.load}); "
             "whole conversations "
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
    lines += ["", f"{questions} questions.", ""]
    recall_split = split(IngestConfig().cache)
    routed: dict = {}
    for path in args.data:
        for key, values in routing_hits(path, lm, encoder).items():
            routed.setdefault(key, []).extend(values)
    lines += [f"`--method recall`'s routing at the defaults ({DEFAULT_EPISODES} episodes, {recall_split.chunks} "
              f"chunks of {recall_split.chunk_tokens} tokens, ranked by {recall_split.retrieval}): the share of "
              "the evidence turns in the routed episode, in the recalled chunks, and in either.", "",
              "| routing | episode | chunks | either |", "|---|---:|---:|---:|"]
    for name in ROUTINGS:
        lines.append(f"| {name} | " + " | ".join(f"{np.mean(routed[(name, w)]):.3f}"
                                                for w in ("episode", "chunks", "either")) + " |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
