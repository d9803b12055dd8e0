"""IceCache offload on the embedded model: resident memory, disk and decode speed at a long history, and
answer quality against full KV, plain EpiCache at the same resident size and SnapKV.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/icecache.py speed [--tokens 8000] [--out PATH]
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/icecache.py quality [--study table|resident|planted]
        [--planted 2] [--locomo F ...] [--results JSONL]

`speed`: one history of `--tokens` tokens (planted-fact conversations concatenated, as core_loop.py),
one cache of each kind built in this process: full KV; EpiCache at budget M (`--budget`, one episode's
patched prompt, as core_loop.py) with its evictions paged (IceCache on top, R = `--retrieve`); EpiCache at
budget M + W + R without offload (the same entries attended); full KV paged past the system prompt and the
last W tokens (IceCache proper). With offload the last W = `--window` history tokens stay resident beside M.
Resident MiB counts the kept cache, page centroids and page tables, and the
pool of R retrieved entries per layer and KV head; disk MiB is the pages file. Decode speed: greedy
tokens forced past EOS after the question (kinds interleaved, median of rounds). The share of a decode
step spent retrieving is 1 - speed with pages re-chosen every 8 tokens / speed with the question's pages
kept (no retrieval after the question).

`quality`: `kvchat eval` (kvchat.eval.evaluate) on planted-fact conversations and LoCoMo files cut to
`--max-context` tokens: first-token KL and answer agreement with full KV, gold F1, evidence kept by the
resident cache, evidence recalled (resident or retrieved) and the share of full KV's attention on the
evidence that those entries carry. `--study table`: epicache@M + offload (window W), epicache@(M+W) +
offload without window, epicache@(M+W+R), snapkv@(M+W+R), epicache@(M+W), snapkv@(M+W), full + offload.
`--study planted` (run on planted facts only: the choices are made there, never on LoCoMo): the window at
equal resident entries and on top of M, layers 0-1 kept whole, the two-stage scorer's candidates.
`--study resident`: SnapKV and EpiCache without offload at M + W, the entries the offload variants hold in
memory (the issue's "same resident size").

Progress goes to stderr; a markdown section goes to stdout and to `--out`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _load import Load, checked
from core_loop import forced_decode, long_history_ids, patched_prompt_ids  # benchmarks/ is on sys.path

from kvchat.config import SYSTEM_PROMPT, CacheConfig, EpisodeConfig, EvalConfig, IngestConfig, OffloadConfig
from kvchat.kv.budgets import uniform_budgets
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.pagefile import open_pages
from kvchat.kv.prefill import block_prefill, keep_sink_and_window
from kvchat.kv.retrieval import PagePool, attach_pages, page_scorer
from kvchat.kv.scoring import PatchedPromptScorer
from kvchat.kv.spill import SpillWriter
from kvchat.model.llm import ChatLayout, load_model

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_DIR = REPO / ".venv" / "kvchat-test-models"
RESULTS = REPO / "benchmarks" / "results"
QUESTION = "Which gate does Tom's flight to Lisbon leave from?"
BLOCK = 512


def log(message: str) -> None:
    print(f"[icecache {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def mib(nbytes: float) -> float:
    return nbytes / 2**20


def machine(load: Load) -> str:
    return (f"{dt.date.today()}, {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
            f"thread(s), run {load}")  # fmt: skip


# --------------------------------------------------------------------------- speed and memory


@dataclass
class Kind:
    name: str
    cache: EpisodeCache
    resident_bytes: int
    disk_bytes: int = 0


def _paged(cache: EpisodeCache, spill: SpillWriter, path: Path, retrieve: int, refresh: int) -> int:
    """Write `spill`'s pages to `path`, attach them to `cache`; returns resident bytes of the page tables,
    centroids and a full pool (R entries per layer and KV head, keys and values, at the pages' dtype)."""
    spill.write_pages(path)
    pages = open_pages(path)
    scorer = page_scorer(OffloadConfig.scorer, OffloadConfig.candidates)
    attach_pages(cache, pages, budget=retrieve, scorer=scorer, refresh=refresh)
    tables = sum(h.centroids.nbytes + h.lengths.nbytes for layer in pages for h in layer)
    pool = sum(min(retrieve, h.num_entries) * h.keys.shape[-1] * 2 * h.keys.element_size()
               for layer in pages for h in layer)  # fmt: skip
    return tables + pool


def set_refresh(cache: EpisodeCache, refresh: int) -> None:
    for layer in cache.layers:
        pool = getattr(layer, "pool", None)
        if isinstance(pool, PagePool):
            pool.refresh = refresh


def speed(args: argparse.Namespace) -> str:
    torch.set_grad_enabled(False)
    lm = load_model("default", args.models_dir)
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    prefix = lm.encode(layout.before_conversation)
    history = long_history_ids(lm, args.tokens)
    scorer = PatchedPromptScorer(patched_prompt_ids(lm, layout))
    cfg = lm.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = dict(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=head_dim)
    scratch = Path(tempfile.mkdtemp(prefix="kvchat-icecache-"))
    kinds: list[Kind] = []

    log(f"full KV prefill of {history.shape[-1]} tokens")
    full = block_prefill(lm.model, prefix, history, block_size=BLOCK, budgets=None, scorer=None).cache
    kinds.append(Kind("full KV", full, full.nbytes()))

    (scratch / "proper").mkdir()
    proper_spill = SpillWriter(scratch / "proper", **shape)
    proper = full.copy()
    proper.on_evict = proper_spill
    keep_sink_and_window(proper, window=args.window)
    extra = _paged(proper, proper_spill, scratch / "proper.pages", args.retrieve, 8)
    kinds.append(Kind(f"full + IceCache (sink+{args.window}, R={args.retrieve})", proper, proper.nbytes() + extra,
                      (scratch / "proper.pages").stat().st_size))  # fmt: skip

    for budget, offload in ((args.budget, True), (args.budget + args.window + args.retrieve, False)):
        log(f"epicache prefill, budget {budget}{' + offload' if offload else ''}")
        spill = None
        if offload:
            (scratch / "epi").mkdir()
            spill = SpillWriter(scratch / "epi", **shape)
        window = args.window if offload else 0  # beside M: the budgets hold M + W, the last W always kept
        cache = block_prefill(
            lm.model, prefix, history, block_size=BLOCK, budgets=uniform_budgets(lm.num_layers, budget + window),
            scorer=scorer, on_evict=spill, recent=window,
        ).cache
        if offload:
            extra = _paged(cache, spill, scratch / "epi.pages", args.retrieve, 8)
            kinds.append(Kind(f"EpiCache M={budget} + window {args.window} + IceCache R={args.retrieve}", cache,
                              cache.nbytes() + extra, (scratch / "epi.pages").stat().st_size))  # fmt: skip
        else:
            kinds.append(Kind(f"EpiCache M={budget}", cache, cache.nbytes()))

    prompt = lm.encode(layout.question(QUESTION))
    runs: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for kind in kinds:
            refreshes = (8, 0) if isinstance(getattr(kind.cache.layers[-1], "pool", None), PagePool) else (8,)
            for refresh in refreshes:
                set_refresh(kind.cache, refresh)
                if round_ == 0:
                    forced_decode(lm, kind.cache, prompt, 4)  # warm-up
                seconds = forced_decode(lm, kind.cache, prompt, args.decode)
                runs.setdefault((kind.name, refresh), []).append(args.decode / seconds)
                log(f"round {round_}: {kind.name} (refresh {refresh}): {args.decode / seconds:.1f} tokens/s")

    full_speed = statistics.median(runs[("full KV", 8)])
    lines = [
        f"## IceCache: memory and decode speed at a {history.shape[-1]}-token history ({machine(args.load)})",
        "",
        f"Embedded model (float32). Decode: {args.decode} greedy tokens forced past EOS after one question, "
        f"median of {args.rounds} rounds, kinds interleaved. Pages: half precision, read by the default scorer "
        f"({OffloadConfig.scorer}, {OffloadConfig.candidates}R candidates), re-chosen every 8 tokens beyond the "
        "question's pinned half.",
        "",
        "| cache | resident MiB | vs full KV | pages on disk MiB | disk B / history token | tokens/s | vs full KV "
        "| retrieval share of a step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in kinds:
        tps = statistics.median(runs[(kind.name, 8)])
        kept = runs.get((kind.name, 0))
        share = f"{max(0.0, 1 - tps / statistics.median(kept)):.0%}" if kept else ""
        disk = f"{mib(kind.disk_bytes):.1f}" if kind.disk_bytes else ""
        per_token = f"{kind.disk_bytes / history.shape[-1]:.0f}" if kind.disk_bytes else ""
        lines.append(
            f"| {kind.name} | {mib(kind.resident_bytes):.1f} | {kind.resident_bytes / full.nbytes():.3f} | {disk} "
            f"| {per_token} | {tps:.1f} | {tps / full_speed:.2f}x | {share} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- quality


def quality_variants(study: str, m: int, r: int, w: int) -> list:
    """`table`: EpiCache at M with IceCache on top (M + W resident and R read); EpiCache and SnapKV at
    M + W + R (the same entries attended) and at M + W (the same resident size, the issue's comparison);
    full KV paged past sink and window.
    `resident`: SnapKV and EpiCache without offload at the resident size M + W (the entries IceCache holds
    in memory; it reads R more per question). `planted`: the choices decided on planted facts (the window at
    equal resident entries and on top of M, layers 0-1 whole, the two-stage scorer's candidates)."""
    from kvchat.eval import evaluate

    def variant(method: str, budget: int = 1024, **offload) -> evaluate.Variant:
        paged = OffloadConfig(mode="icecache", retrieve=r, **{"recent": w, **offload})
        return evaluate.Variant(CacheConfig(method=method, budget=budget, block_size=256, prefill="block",
                                            offload=paged))  # fmt: skip

    def plain(method: str, budget: int) -> evaluate.Variant:
        return evaluate.Variant(CacheConfig(method=method, budget=budget, block_size=256, prefill="block"))

    resident = [plain("snapkv", m + w), plain("epicache", m + w)]  # what the offload variants hold in memory
    if study == "table":
        return [variant("epicache", m), variant("epicache", m + w, recent=0), plain("epicache", m + w + r),
                plain("snapkv", m + w + r), *resident, variant("full")]  # fmt: skip
    if study == "resident":  # the issue's own comparison: eviction holding what IceCache holds in memory
        return resident
    if study == "offload":  # the table's offload rows alone (a change of retrieval, the plain rows unchanged)
        return [variant("epicache", m), variant("full")]
    return [
        variant("epicache", m + w, recent=0),
        variant("epicache", m),
        variant("full"),
        variant("full", first_paged_layer=2),
        variant("epicache", m, candidates=8),
        variant("epicache", m, recent=0),
    ][: 4 if study == "planted" else None]


def quality(args: argparse.Namespace) -> str:
    from kvchat.eval import evaluate
    from kvchat.model.encoder import SentenceEncoder

    torch.set_grad_enabled(False)
    lm = load_model("default", args.models_dir)
    config = EvalConfig(max_context=args.max_context, questions=args.questions, max_new_tokens=24)
    base = IngestConfig(cache=CacheConfig(block_size=256, prefill="block"), episodes=EpisodeConfig())
    m, r, w = args.budget, args.retrieve, args.window
    variant_list = quality_variants(args.study, m, r, w)
    sets = evaluate.qa_sets(args.locomo, args.planted, lm, config)
    results = evaluate.ResultsFile(args.results)
    records = evaluate.evaluate(sets, variant_list, lm=lm, encoder=SentenceEncoder(), config=config, base=base,
                                results=results)  # fmt: skip
    rows = evaluate.summarize(records)
    columns = ("variant", "questions", "kl", "agreement", "f1", "relative_f1", "evidence_kept", "evidence_recalled",
               "evidence_attention_recalled", "peak_layer_entries", "answer_tokens_per_s")  # fmt: skip
    lines = [
        f"## IceCache: answer quality, {args.study} ({machine(args.load)})",
        "",
        f"`kvchat eval` on {', '.join(s.name for s in sets)} (histories cut to {args.max_context} tokens, "
        f"at most {args.questions} questions each, 24-token answers). M = {m}, W = {w} (offload: the last W "
        f"history tokens resident beside M), R = {r}. `evidence_kept`: the question's evidence entries (layer, "
        "KV head, token) in the resident cache; `evidence_recalled`: resident or retrieved by the question's "
        "forward (the first answer token's); `evidence_attention_recalled`: the share of full KV's attention "
        "on those entries (last question token, summed over layers, KV heads and query heads) that falls on "
        "entries resident or retrieved (empty in files written before it).",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    names = [s.name for s in sets]
    lines += ["", "KL / agreement / evidence recalled / evidence attention recalled per conversation:", "",
              "| variant | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for row in rows:
        cells = []
        for name in names:
            mine = [r for r in records if r.get("set") == name and r.get("variant") == row["variant"]]
            per_set = evaluate.summarize(mine)
            cells.append(f"{per_set[0]['kl']:.3f} / {per_set[0]['agreement']:.2f} / "
                         f"{_cell(per_set[0]['evidence_recalled'])} / "
                         f"{_cell(per_set[0]['evidence_attention_recalled'])}" if per_set else "")  # fmt: skip
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "" if value is None else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("speed", "quality"))
    parser.add_argument("--budget", type=int, default=64, help="M: resident entries per layer and KV head")
    parser.add_argument("--retrieve", type=int, default=192, help="R: entries read from the pages")
    parser.add_argument("--tokens", type=int, default=8000, help="speed: history length")
    parser.add_argument("--decode", type=int, default=32, help="speed: forced tokens per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="speed: rounds (median)")
    parser.add_argument("--window", type=int, default=OffloadConfig.recent, help="W: resident recent window")
    studies = ("table", "resident", "offload", "planted", "planted-all")
    parser.add_argument("--study", choices=studies, default="table",
                        help="quality: which variants (resident: SnapKV and EpiCache at M + W without offload; "
                        "offload: the table's offload rows only; planted-all adds candidates=8 and M without "
                        "the window)")
    parser.add_argument("--planted", type=int, default=2, help="quality: planted-fact conversations")
    parser.add_argument("--locomo", type=Path, nargs="*", default=[], help="quality: LoCoMo files")
    parser.add_argument("--max-context", type=int, default=4000, help="quality: history tokens kept")
    parser.add_argument("--questions", type=int, default=12, help="quality: questions per conversation")
    parser.add_argument("--results", type=Path, default=None, help="quality: JSON lines to resume from")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--out", type=Path, default=None)
    args = checked(parser)
    report = speed(args) if args.part == "speed" else quality(args)
    print(report)
    name = args.part if args.part == "speed" or args.study == "table" else f"{args.part}_{args.study}"
    out = args.out or RESULTS / f"icecache_{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)


if __name__ == "__main__":
    main()
