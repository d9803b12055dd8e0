"""IceCache page formation and page scoring on the embedded model: which pages to build, how to score them.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/icecache_pages.py [--sets 2] [--out PATH]

Setup (the issue's quick experiment, IceCache proper on a history inside the window): planted-fact
conversations (kvchat.eval.qa.planted_sets: 6 topics x 48 turns, ~3.5K tokens, one question per fact) are
prefilled with full KV once. Resident: the system prompt (sink), the last `--window` history tokens
and the question/answer tokens; layers below `--first-paged` keep everything. Every other history entry
of layers >= first-paged is offloaded (stored at half precision, as the pages file stores it) and
grouped into pages per KV head. For each question and policy, the question is run with retrieval
inside attention (kvchat.kv.retrieval + kvchat.kv.paged_attention): per layer and KV head, the
question's queries choose pages up to R entries, which stay for the answer's greedy decode.

Measured against full KV: first-answer-token KL, first-token agreement, answer agreement (token F1
with the full-KV answer, as `kvchat eval`), gold recall; and, on the question's forward over layers >=
first-paged: attention mass on resident + retrieved entries, recall of the 32 offloaded keys with the
highest true attention, evidence recall (the planted fact's tokens among resident + retrieved). Cost:
seconds to build each head's pages, milliseconds to score one layer's pages.

Progress goes to stderr; a markdown section goes to stdout and to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _load import checked  # benchmarks/ is on sys.path
from sklearn.cluster import KMeans
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from kvchat.config import SYSTEM_PROMPT, PagingConfig
from kvchat.eval.evaluate import _turn_positions
from kvchat.eval.qa import QASet, contains_gold, planted_sets, token_f1
from kvchat.history.loading import format_turns
from kvchat.kv.attention import attention_with_retrieved, causal_mask, grouped_attention_weights, kvchat_attention
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.pages import (
    HeadPages,
    mips_keys,
    pages_from_clusters,
    positional_pages,
    semantic_pages,
)
from kvchat.kv.retrieval import PAGE_SCORERS, EntryScorer, PagePool, Retrieved, Scorer, TwoStageScorer, centroid_scores
from kvchat.model.llm import ChatLayout, LoadedModel, load_model

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_DIR = REPO / ".venv" / "kvchat-test-models"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "icecache_pages.md"
ATTENTION = "kvchat-icecache-bench"
TOP_KEYS = 32


def log(message: str) -> None:
    print(f"[icecache_pages {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- page groupings --------------------------------------------------------------------------------
def _kmeans_pp(keys, values, positions):
    n = keys.shape[0]
    labels = KMeans(-(-n // 16), init="k-means++", n_init=1, max_iter=8, random_state=0).fit_predict(
        mips_keys(keys).numpy()
    )
    return pages_from_clusters(keys, values, positions, torch.from_numpy(labels).long(), 16)


GROUPINGS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], HeadPages]] = {
    "semantic": lambda k, v, p: semantic_pages(k, v, p, PagingConfig()),
    "semantic k-means++": _kmeans_pp,
    "semantic, clusters of 64": lambda k, v, p: semantic_pages(k, v, p, PagingConfig(cluster_size=64)),
    "positional": lambda k, v, p: positional_pages(k, v, p, 16),
    "tokens (oracle)": lambda k, v, p: positional_pages(k, v, p, 1),
}
def raw_centroid_scores(queries: torch.Tensor, pages: HeadPages, scale: float, budget: int) -> torch.Tensor:
    """Centroid scoring without the per-row softmax: the largest mean-key logit over query rows."""
    return (queries.float() @ pages.centroids.float().T).amax(dim=0)


SCORERS = {**PAGE_SCORERS, "centroid, raw logit": raw_centroid_scores, "entries, 4R candidates": EntryScorer(4),
           "two-stage, 8R candidates": TwoStageScorer(8)}
# (grouping, scorer) pairs measured; "tokens (oracle)" + top-keys is exact top-R retrieval.
POLICIES = [
    ("semantic", "top-keys"), ("semantic", "centroid"), ("semantic", "two-stage"), ("semantic", "centroid, raw logit"),
    ("semantic k-means++", "top-keys"), ("semantic k-means++", "centroid"),
    ("semantic, clusters of 64", "top-keys"), ("semantic, clusters of 64", "centroid"),
    ("positional", "top-keys"), ("positional", "centroid"),
    ("semantic", "entries"),
    ("tokens (oracle)", "top-keys"),
]


# --- retrieval inside attention ----------------------------------------------------------------------
@dataclass
class Plan:
    """What one question's run retrieves: per paged layer, each KV head's pages; entries kept resident."""

    pages: dict[int, list[HeadPages]]
    scorer: Scorer
    budget: int
    resident: torch.Tensor          # history positions that stay resident (sink + window)
    history_end: int                # positions from here on (question, answer) are resident
    evidence: torch.Tensor          # positions of the planted fact's turn
    refresh: int = 0                # decoded tokens between page refreshes (0: the question's pages throughout)
    pools: dict[int, PagePool] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    score_ms: list[float] = field(default_factory=list)

    def attend(self, module, query, key, value, scaling):
        layer = module.layer_idx
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        keep = torch.cat([self.resident, torch.arange(self.history_end, key.shape[2])])
        first = layer not in self.pools
        if first:
            self.pools[layer] = PagePool(self.pages[layer], self.budget, self.scorer, self.refresh)
        clock = time.perf_counter()
        retrieved = self.pools[layer].retrieved(query, scale)
        if first:  # the question's forward: measure its choice
            self.score_ms.append((time.perf_counter() - clock) * 1000)
            self._measure(query, key, scale, retrieved)
        return attention_with_retrieved(query, key[:, :, keep], value[:, :, keep], retrieved, scale)

    def _measure(self, query, key, scale, retrieved: list[Retrieved]) -> None:
        q_len, n = query.shape[2], key.shape[2]
        weights = grouped_attention_weights(query, key, scale, causal_mask(q_len, n, query.device))
        offloaded = torch.ones(n, dtype=torch.bool)
        offloaded[self.resident] = False
        offloaded[self.history_end :] = False
        for h, got in enumerate(retrieved):
            kept = ~offloaded.clone()
            kept[got.positions] = True
            self.metrics["attention mass"].append(float(weights[h][..., kept].sum(-1).mean()))
            best = weights[h].amax(dim=(0, 1)).masked_fill(~offloaded, -1).topk(TOP_KEYS).indices
            self.metrics["top-32 key recall"].append(float(kept[best].float().mean()))
            self.metrics["evidence recall"].append(float(kept[self.evidence].float().mean()))
            self.metrics["entries retrieved"].append(float(got.positions.numel()))


def planned_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """kvchat's attention, except in paged layers of a run with a plan: resident + retrieved entries."""
    plan: Plan | None = kwargs.pop("icecache_plan", None)
    if plan is None or module.layer_idx not in plan.pages:
        return kvchat_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    return plan.attend(module, query, key, value, scaling), None


def run_forward(lm: LoadedModel, cache: EpisodeCache, ids: torch.Tensor, plan: Plan | None) -> torch.Tensor:
    extra = {"icecache_plan": plan} if plan is not None else {}
    with torch.inference_mode():
        out = lm.model(
            input_ids=ids, position_ids=cache.position_ids(ids.shape[-1]), past_key_values=cache,
            use_cache=True, logits_to_keep=1, **extra,
        )
    cache.advance(ids.shape[-1])
    return out.logits[0, -1]


def answer(lm: LoadedModel, cache: EpisodeCache, prompt: torch.Tensor, plan: Plan | None, tokens: int):
    """(first-token log-probs, greedy answer text), leaving the cache as it was."""
    mark = cache.checkpoint()
    try:
        logits = run_forward(lm, cache, prompt, plan)
        first = logits.float().log_softmax(-1)
        out: list[int] = []
        for _ in range(tokens):
            token = int(logits.argmax())
            if token in lm.stop_ids:
                break
            out.append(token)
            logits = run_forward(lm, cache, torch.tensor([[token]]), plan)
    finally:
        cache.rollback(mark)
    return first, lm.decode(out).strip()


# --- the experiment ------------------------------------------------------------------------------------
@dataclass
class Prefilled:
    qa: QASet
    cache: EpisodeCache
    protected: int
    history_end: int
    spans: dict[str, torch.Tensor]


def prefill(lm: LoadedModel, qa: QASet) -> Prefilled:
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    prefix = lm.encode(layout.before_conversation)
    context = lm.encode("\n".join(format_turns(qa.turns)))
    cache = EpisodeCache(lm.num_layers)
    forward(lm.model, cache, prefix)
    for block in context.split(512, dim=-1):
        forward(lm.model, cache, block)
    protected = prefix.shape[-1]
    return Prefilled(qa, cache, protected, cache.next_position, _turn_positions(lm, qa.turns, protected))


def build_pages(
    run: Prefilled, window: int, first_paged: int, groupings: set[str]
) -> tuple[dict[str, dict], dict[str, float]]:
    """Per grouping: {layer: [HeadPages per KV head]} of the offloaded entries; and build seconds per head."""
    middle = slice(run.protected, run.history_end - window)
    groups = {name: group for name, group in GROUPINGS.items() if name in groupings}
    built: dict[str, dict] = {name: {} for name in groups}
    seconds: dict[str, float] = defaultdict(float)
    heads = 0
    for layer in range(first_paged, len(run.cache.layers)):
        cached = run.cache.layers[layer]
        for name in groups:
            built[name][layer] = []
        for h in range(cached.keys.shape[1]):
            keys = cached.keys[0, h, middle].half()
            values = cached.values[0, h, middle].half()
            positions = cached.positions[h, middle]
            heads += 1
            for name, group in groups.items():
                clock = time.perf_counter()
                built[name][layer].append(group(keys, values, positions))
                seconds[name] += time.perf_counter() - clock
    return built, {name: s / heads for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, default=2, help="planted-fact conversations (6 questions each)")
    parser.add_argument("--window", type=int, default=32, help="recent history tokens kept resident")
    parser.add_argument("--first-paged", type=int, default=2, help="layers below keep full KV")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 192], help="R: entries per KV head")
    parser.add_argument("--tokens", type=int, default=24, help="greedy answer tokens at most")
    parser.add_argument("--refresh", type=int, default=0, help="decoded tokens between page refreshes (0: never)")
    parser.add_argument(
        "--policies", nargs="+", default=None,
        help="GROUPING:SCORER pairs to measure (default: all of POLICIES), e.g. semantic:two-stage",
    )
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = checked(parser)
    torch.set_grad_enabled(False)

    loaded = load_model("default", args.models_dir)
    AttentionInterface.register(ATTENTION, planned_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *a, **k: None)
    # transformers' model of the same weights, whose attention function this benchmark replaces by its own
    model = AutoModelForCausalLM.from_pretrained(loaded.config.name_or_path, dtype=torch.float32).eval()
    model.set_attn_implementation(ATTENTION)
    lm = LoadedModel(loaded.spec, loaded.tokenizer, loaded.fingerprint, model)

    policies = POLICIES if args.policies is None else [tuple(p.split(":", 1)) for p in args.policies]
    rows: dict[tuple[str, str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    build_seconds: dict[str, list[float]] = defaultdict(list)
    history_tokens = []
    for qa in planted_sets(args.sets):
        log(f"{qa.name}: prefill")
        run = prefill(lm, qa)
        history_tokens.append(run.history_end - run.protected)
        log(f"{qa.name}: {history_tokens[-1]} history tokens; building pages")
        pages, seconds = build_pages(run, args.window, args.first_paged, {g for g, _ in policies} | {"positional"})
        for name, s in seconds.items():
            build_seconds[name].append(s)
        window = torch.arange(run.history_end - args.window, run.history_end)
        resident = torch.cat([torch.arange(run.protected), window])
        for question in qa.questions:
            prompt = lm.encode(ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT).question(question.text))
            ref_first, ref_answer = answer(lm, run.cache, prompt, None, args.tokens)
            evidence = torch.cat([run.spans[e] for e in question.evidence])
            for grouping, scorer, budget in [("none", "-", 0)] + [(g, s, r) for g, s in policies for r in args.budgets]:
                plan = Plan(
                    pages=pages.get(grouping, pages["positional"]), scorer=SCORERS.get(scorer, centroid_scores),
                    budget=budget, resident=resident, history_end=run.history_end, evidence=evidence,
                    refresh=args.refresh,
                )
                first, text = answer(lm, run.cache, prompt, plan, args.tokens)
                row = rows[(grouping, scorer, budget)]
                row["KL"].append(float((ref_first.exp() * (ref_first - first)).sum().clamp_min(0)))
                row["first-token agreement"].append(float(first.argmax() == ref_first.argmax()))
                row["answer agreement"].append(token_f1(text, ref_answer) if text or ref_answer else 1.0)
                row["gold recall"].append(float(contains_gold(text, question)))
                for name, values in plan.metrics.items():
                    row[name].append(statistics.fmean(values))
                row["score ms/layer"].append(statistics.fmean(plan.score_ms) if plan.score_ms else 0.0)
            full = rows[("full KV", "-", 0)]
            full["gold recall"].append(float(contains_gold(ref_answer, question)))
            log(f"{qa.name} q{question.qid}: full KV says {ref_answer!r}")
    report = render(rows, build_seconds, history_tokens, args)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)


COLUMNS = ("KL", "first-token agreement", "answer agreement", "gold recall", "attention mass",
           "top-32 key recall", "evidence recall", "entries retrieved", "score ms/layer")


def render(rows, build_seconds, history_tokens, args) -> str:
    questions = len(next(iter(rows.values()))["KL"])
    columns = [c for c in COLUMNS if args.tokens or c not in ("answer agreement", "gold recall")]
    lines = [
        f"## IceCache pages ({dt.date.today()}, {platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), run {args.load})",
        "",
        f"Embedded model, {len(history_tokens)} planted-fact conversations "
        f"({statistics.fmean(history_tokens):.0f} history tokens on average), {questions} questions. "
        f"Resident: system prompt + last {args.window} history tokens + question/answer; layers "
        f"< {args.first_paged} keep full KV; every other history entry is offloaded (half precision) and "
        f"retrieved per KV head, R entries, pages chosen by the question and kept for the answer "
        f"(greedy, <= {args.tokens} tokens; "
        + (f"half of R re-chosen every {args.refresh} tokens" if args.refresh else "no refresh")
        + "). Metrics are means over questions; attention metrics over "
        "paged layers, KV heads and the question's tokens.",
        "",
        "| pages | scorer | R | " + " | ".join(columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for (grouping, scorer, budget), row in rows.items():
        cells = [f"{statistics.fmean(row[c]):.3f}" if row.get(c) else "" for c in columns]
        lines.append(f"| {grouping} | {scorer} | {budget or ''} | " + " | ".join(cells) + " |")
    lines += ["", "Page building, mean seconds per KV head:", ""]
    lines += [f"- {name}: {statistics.fmean(s):.4f} s" for name, s in build_seconds.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
