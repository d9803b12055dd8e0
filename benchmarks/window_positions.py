"""Where IceCache's offloaded entries go when the resident cache is compacted (`--positions compact`, the only way a
history longer than the model's window fits it): the measurement behind `kvchat.kv.spill.beside_residents`.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=.:benchmarks python benchmarks/window_positions.py \
        [--within 6] [--beyond 2] [--locomo conv-26.json ...] [--results JSONL] [--models-dir DIR] [--out PATH]

Compacting re-rotates the kept keys to 0..n-1 after every eviction, so a key that leaves the cache is rotated for
wherever it sat at that moment, and the resident entries move on. Read back as they are, the offloaded keys would
sit in a frame that no longer exists. Placements compared (each re-rotates the pages' keys once, when the pages
file is written):
- `beside`: kvchat's; the compact position of the entry's nearest resident predecessor in history order
  (`beside_residents`); entries between two residents share it.
- `evicted`: the position the key had when it was evicted (no re-rotation; what compacting alone leaves),
  capped before the question.
- `recent`: every entry just before the question.
- `front`: every entry where the history starts (just after the system prompt).
- `scaled`: original positions scaled linearly onto the compact range (history order kept among the offloaded
  entries, not against the resident ones).

Studies:
- within the window: planted-fact histories (kvchat.eval.qa.planted_sets) of about `--within-tokens` tokens, so full
  KV at original positions is the reference: first-token KL and top-1 agreement with it, token F1 of the greedy
  answers against its answers; also the offload without compaction (`original`, the layout kvchat used before)
  and the compacted cache without pages (`resident`).
- beyond it: planted histories of about `--beyond-tokens` tokens and whole LoCoMo conversations (`--locomo`,
  `--questions` of categories 1-4 spread over each), 1.5-3x the window, where no reference fits: the gold answer's
  mean log-probability (teacher-forced after the question), LoCoMo's F1 of the greedy answer, and the share of the
  evidence turns' entries resident or read back at the first answer token (over layers and KV heads).
Every placement is also compared with `beside` question by question (mean difference, bootstrap 95% interval).
One cache per history (EpiCache's block prefill with one episode's patched prompt, budget M + window W, R entries
read back per head); the placements share it and its spill, so they differ only in where the pages' keys sit.
Progress goes to stderr; a markdown section goes to stdout and to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _load import checked
from core_loop import patched_prompt_ids  # benchmarks/ is on sys.path

from kvchat.config import SYSTEM_PROMPT, AskConfig, IceCacheConfig, PagingConfig
from kvchat.eval.qa import QASet, load_locomo, planted_sets, sample_questions, score_answer, token_f1
from kvchat.history.loading import format_turns
from kvchat.history.tokens import turn_spans
from kvchat.kv.budgets import uniform_budgets
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.prefill import block_prefill
from kvchat.kv.retrieval import attach_pages, page_scorer
from kvchat.kv.scoring import PatchedPromptScorer
from kvchat.kv.spill import Placement, SpillWriter, beside_residents
from kvchat.model.llm import ChatLayout, LoadedModel, load_model

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_DIR = REPO / ".venv" / "kvchat-test-models"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "window_positions.md"
BLOCK = 512
ANSWER_TOKENS = 12
TOKENS_PER_TURN_TOPIC = 6 * 11  # about 11 tokens a turn, six topics: turns per topic = tokens / this
BOOTSTRAP = 2000


def log(message: str) -> None:
    print(f"[window_positions {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def placements(protected: int) -> dict[str, Placement]:
    """The placements compared (the module docstring); `protected`, the system prompt's length."""
    return {
        "beside": lambda origins, at, ro, rp, end: beside_residents(origins, ro, rp, end),
        "evicted": lambda origins, at, ro, rp, end: at.clamp_max(end - 1),
        "recent": lambda origins, at, ro, rp, end: torch.full_like(origins, end - 1),
        "front": lambda origins, at, ro, rp, end: torch.full_like(origins, protected),
        "scaled": lambda origins, at, ro, rp, end: protected + (origins - protected) * (end - 1 - protected) // max(
            1, int(ro[-1]) - protected),
    }


class History:
    """One conversation as the ingest lays it out, with its questions: token ids, gold answers, evidence."""

    def __init__(self, lm: LoadedModel, qa_set: QASet, questions: int | None = None, study: str = "beyond") -> None:
        self.name = f"{study}/{qa_set.name}"
        self.layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
        self.prefix = lm.encode(self.layout.before_conversation)
        self.context = lm.encode("\n".join(format_turns(qa_set.turns)))
        protected = self.prefix.shape[-1]
        where = {s.turn_id: torch.arange(s.start, s.end) for s in turn_spans(lm.tokenizer, qa_set.turns, protected)}
        self.questions = sample_questions(qa_set.questions, questions)
        template = AskConfig().question_template
        self.prompts = [lm.encode(self.layout.question(template.format(question=q.text))) for q in self.questions]
        self.answers = [lm.encode(q.gold) for q in self.questions]
        self.evidence = [torch.cat([where[e] for e in q.evidence if e in where]) for q in self.questions]
        self.tokens = protected + self.context.shape[-1]


def answer(lm: LoadedModel, cache: EpisodeCache, question: torch.Tensor, gold: torch.Tensor,
           evidence: torch.Tensor) -> dict:  # fmt: skip
    """First-token logits, a greedy answer, the gold answer's mean log-probability and the evidence seen."""
    mark = cache.checkpoint()
    logits = forward(lm.model, cache, question)[0, -1].float()
    seen = _evidence_seen(cache, evidence)
    tokens = [int(logits.argmax())]
    for _ in range(ANSWER_TOKENS - 1):
        if tokens[-1] in lm.stop_ids:
            break
        tokens.append(int(forward(lm.model, cache, torch.tensor([[tokens[-1]]]))[0, -1].argmax()))
    cache.rollback(mark)
    out = forward(lm.model, cache, torch.cat([question, gold], -1), last_logits_only=False)[0].float()
    cache.rollback(mark)
    q = question.shape[-1]
    logprob = out[q - 1 : -1].log_softmax(-1).gather(1, gold[0, :, None]).mean()
    text = lm.decode([t for t in tokens if t not in lm.stop_ids]).strip()
    return {"logits": logits, "text": text, "logprob": float(logprob), "evidence": seen}


def _evidence_seen(cache: EpisodeCache, evidence: torch.Tensor) -> float:
    """Share of (layer, KV head, evidence token) entries resident or read back by the last forward."""
    shares = []
    for i, layer in enumerate(cache.layers):
        resident = cache.origins[i] if cache.origins is not None else list(
            layer.positions if layer.ragged else layer.positions.unbind(0))  # fmt: skip
        pool = getattr(layer, "pool", None)
        current = pool.current if pool is not None else None
        for h, held in enumerate(resident):
            seen = set(held.tolist())
            if current is not None:
                seen |= set(current[h].positions.tolist())
            shares.append(sum(int(p) in seen for p in evidence) / len(evidence))
    return statistics.fmean(shares)


def build(lm: LoadedModel, history: History, args, *, compact: bool, scratch: Path) -> tuple[EpisodeCache, SpillWriter]:
    cfg = lm.model.config
    spill = SpillWriter(scratch, num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                        head_dim=getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
                        rotary_emb=lm.model.model.rotary_emb)  # fmt: skip
    budgets = uniform_budgets(cfg.num_hidden_layers, args.budget + args.window)
    scorer = PatchedPromptScorer(patched_prompt_ids(lm, history.layout))
    cache = block_prefill(lm.model, history.prefix, history.context, block_size=BLOCK, budgets=budgets,
                          scorer=scorer, compact=compact, on_evict=spill, recent=args.window,
                          origins=compact).cache  # fmt: skip
    cache.on_evict = None
    spill.place_beside(cache)
    return cache, spill


def paged(cache: EpisodeCache, spill: SpillWriter, placement: Placement, retrieve: int) -> EpisodeCache:
    copy, offload = cache.copy(), IceCacheConfig()
    attach_pages(copy, list(spill.layers(PagingConfig(), placement)), budget=retrieve,
                 scorer=page_scorer(offload.scorer, offload.candidates), refresh=offload.refresh,
                 pinned_share=offload.pinned_share)  # fmt: skip
    return copy


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p = reference.log_softmax(-1)
    return float((p.exp() * (p - other.log_softmax(-1))).sum())


def run_history(lm: LoadedModel, history: History, args, within: bool) -> list[dict]:
    rows: list[dict] = []
    variants: dict[str, Callable[[], EpisodeCache]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        log(f"history of {history.tokens} tokens: compact build")
        cache, spill = build(lm, history, args, compact=True, scratch=Path(tmp))
        log(f"resident positions < {cache.next_position}, spilled {spill.entries} entries")
        chosen = placements(history.prefix.shape[-1])
        for name, placement in chosen.items():
            variants[name] = lambda placement=placement: paged(cache, spill, placement, args.retrieve)
        if within:
            variants["resident"] = lambda: cache.copy()
            (Path(tmp) / "original").mkdir()
            log("original-positions build")
            plain, plain_spill = build(lm, history, args, compact=False, scratch=Path(tmp) / "original")
            variants["original"] = lambda: paged(plain, plain_spill, chosen["beside"], args.retrieve)
            log("full KV reference")
            full = block_prefill(lm.model, history.prefix, history.context, block_size=BLOCK, budgets=None,
                                 scorer=None).cache  # fmt: skip
            reference = [answer(lm, full, q, a, e) for q, a, e in
                         zip(history.prompts, history.answers, history.evidence, strict=True)]  # fmt: skip
            del full
            rows += [{"set": history.name, "variant": "full", "question": i, "logprob": ref["logprob"],
                      "evidence": ref["evidence"], "f1": score_answer(ref["text"], history.questions[i]), "kl": 0.0,
                      "top1": 1.0, "agreement": 1.0} for i, ref in enumerate(reference)]  # fmt: skip
        for name, make in variants.items():
            log(f"answering: {name}")
            built = make()
            for i, (q, a, e) in enumerate(zip(history.prompts, history.answers, history.evidence, strict=True)):
                got = answer(lm, built, q, a, e)
                row = {"set": history.name, "variant": name, "question": i, "logprob": got["logprob"],
                       "evidence": got["evidence"], "f1": score_answer(got["text"], history.questions[i])}
                if within:
                    ref = reference[i]
                    row |= {"kl": _kl(ref["logits"], got["logits"]),
                            "top1": float(ref["logits"].argmax() == got["logits"].argmax()),
                            "agreement": token_f1(got["text"], ref["text"]) if ref["text"] or got["text"] else 1.0}
                rows.append(row)
    return rows


def table(rows: list[dict], columns: list[str]) -> str:
    names = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["| placement | questions | " + " | ".join(columns) + " |", "|---|---:|" + "---:|" * len(columns)]
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        cells = [_mean_and_error([float(r[c]) for r in mine]) for c in columns]
        lines.append(f"| {name} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(rows: list[dict], column: str, against: str = "beside") -> str:
    """Each placement minus `against` on `column`, question by question: mean and a bootstrap 95% interval."""
    by = {(r["set"], r["question"]): r[column] for r in rows if r["variant"] == against}
    lines = [f"| {column}: placement - {against} | mean | 95% interval |", "|---|---:|---|"]
    generator = torch.Generator().manual_seed(0)
    for name in dict.fromkeys(r["variant"] for r in rows):
        if name == against:
            continue
        diff = torch.tensor([float(r[column]) - by[(r["set"], r["question"])] for r in rows if r["variant"] == name])
        means = diff[torch.randint(len(diff), (BOOTSTRAP, len(diff)), generator=generator)].mean(1)
        low, high = means.quantile(torch.tensor([0.025, 0.975])).tolist()
        lines.append(f"| {name} | {diff.mean():+.3f} | [{low:+.3f}, {high:+.3f}] |")
    return "\n".join(lines)


def _mean_and_error(values: list[float]) -> str:
    """The mean and its standard error."""
    error = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {error:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--within", type=int, default=6, help="planted histories inside the window")
    parser.add_argument("--beyond", type=int, default=2, help="planted histories beyond it")
    parser.add_argument("--locomo", type=Path, nargs="*", default=[], help="whole LoCoMo conversations (beyond)")
    parser.add_argument("--questions", type=int, default=40, help="LoCoMo questions per conversation (spread)")
    parser.add_argument("--within-tokens", type=int, default=4000)
    parser.add_argument("--beyond-tokens", type=int, default=20000)
    parser.add_argument("--results", type=Path, default=None,
                        help="every question's row, as JSON lines, appended per history; a run resumes from it")
    parser.add_argument("--budget", type=int, default=128, help="M: scored resident entries per layer and KV head")
    parser.add_argument("--window", type=int, default=32, help="W: resident recent window")
    parser.add_argument("--retrieve", type=int, default=128, help="R: entries read back per KV head")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = checked(parser)
    lm = load_model("default", args.models_dir)
    out = [f"## Offloaded entries beside a compacted cache ({dt.date.today()}, {platform.machine()}, torch "
           f"{torch.__version__}, {torch.get_num_threads()} thread(s), run {args.load})", "",
           f"Embedded model (window {lm.context_window}); M = {args.budget}, W = {args.window}, R = {args.retrieve} "
           f"(IceCache's default page scorer), block {BLOCK}; six planted facts per history.", ""]  # fmt: skip
    done: list[dict] = []  # rows of a run that stopped: its histories are not run again
    if args.results is not None and args.results.exists():
        done = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]

    def rows_of(history: History, within: bool) -> list[dict]:
        got = [r for r in done if r["set"] == history.name] or run_history(lm, history, args, within=within)
        if args.results is not None and not any(r["set"] == history.name for r in done):
            with args.results.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in got)
        return got

    rows: list[dict] = []
    if args.within:
        for qa_set in planted_sets(args.within, turns_per_topic=args.within_tokens // TOKENS_PER_TURN_TOPIC):
            rows += rows_of(History(lm, qa_set, study="within"), within=True)
        out += [f"### Within the window: {args.within} planted histories of about {args.within_tokens} tokens, "
                "against full KV", "", table(rows, ["kl", "top1", "agreement", "logprob", "f1", "evidence"]), "",
                paired(rows, "kl"), "", paired(rows, "logprob"), ""]  # fmt: skip
    beyond: list[dict] = []
    sets = planted_sets(args.beyond, turns_per_topic=args.beyond_tokens // TOKENS_PER_TURN_TOPIC) if args.beyond else []
    histories = [History(lm, s) for s in sets] + [History(lm, load_locomo(p), args.questions) for p in args.locomo]
    for history in histories:
        assert history.tokens > lm.context_window, (history.name, history.tokens)
        beyond += rows_of(history, within=False)
    if beyond:
        names = ", ".join(f"{h.name} ({h.tokens} tokens, {len(h.questions)} questions)" for h in histories)
        out += [f"### Beyond the window, against gold: {names}", "", table(beyond, ["logprob", "f1", "evidence"]),
                "", paired(beyond, "logprob"), "", paired(beyond, "evidence"), ""]  # fmt: skip
    command = "OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=.:benchmarks python benchmarks/window_positions.py"
    out += [f"Command: `{command} {' '.join(sys.argv[1:])}`", ""]
    text = "\n".join(out)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
