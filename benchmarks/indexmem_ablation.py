"""Where IndexMem loses first-token KL, measured on data that is not the evaluation: planted-fact conversations
(kvchat.history.synthetic, seeds the trainer never used) and the held-out chit-chat chunks of the training data.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/indexmem_ablation.py [--budgets 128,256] [--variants a,b]
        [--planted 3] [--out benchmarks/results/records/indexmem_ablation.jsonl] [--weights FILE.indexmem.safetensors]

Every variant builds each context's cache by block prefill (block 512, the ingest's default layer budgets) and
is compared with full KV: planted facts by the first answer token's KL and the gold answer's mean negative
log-likelihood (teacher-forced, LoCoMo's question template), held-out text by the mean KL of the next 48
tokens' distributions (teacher-forced). Variants are IndexerScorer settings (`query_window`, `attention_mix`,
`recent_window`, `pool_kernel`), SnapKV in the same loop as the baseline, and the latent memory (on, with a
readout scale, or only in some layers). LoCoMo is never read here: it is the evaluation set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from _load import checked, shown  # benchmarks/ is on sys.path

from kvchat.config import SYSTEM_PROMPT, CacheConfig, EvalConfig, TrainConfig, default_home
from kvchat.history.loading import Turn, format_turns
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.cache_budgets import resolve_layer_budgets
from kvchat.ingest.layer_profiles import find_indexmem
from kvchat.kv.forward import forward
from kvchat.kv.indexer import IndexerScorer
from kvchat.kv.latent import LatentMemory
from kvchat.kv.methods import REGISTRY, ScorerInputs
from kvchat.kv.prefill import block_prefill
from kvchat.kv.trained import TrainedIndexMem
from kvchat.model.llm import ChatLayout, load_model
from kvchat.training.chunks import make_chunks

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CONTINUATION = 48
BASE_SCORER = {"pool_kernel": 7, "recent_window": 64}  # the settings of the first merge; variants change them
BLOCK = 512

# name -> (method, IndexerScorer keyword arguments, memory: None | "all" | scale float | tuple of layers)
VARIANTS: dict[str, tuple[str, dict, object]] = {
    "snapkv": ("snapkv", {}, None),
    "indexer": ("indexmem", {}, None),
    "indexer/pool1": ("indexmem", {"pool_kernel": 1}, None),
    "indexer/pool15": ("indexmem", {"pool_kernel": 15}, None),
    "indexer/window32": ("indexmem", {"recent_window": 32}, None),
    "indexer/window128": ("indexmem", {"recent_window": 128}, None),
    "indexer/last64": ("indexmem", {"query_window": 64}, None),
    "indexer/last16": ("indexmem", {"query_window": 16}, None),
    "mix0.25": ("indexmem", {"attention_mix": 0.25}, None),
    "mix0.5": ("indexmem", {"attention_mix": 0.5}, None),
    "mix0.75": ("indexmem", {"attention_mix": 0.75}, None),
    "attention-only": ("indexmem", {"attention_mix": 1.0}, None),
    "mix0.5/window32": ("indexmem", {"attention_mix": 0.5, "recent_window": 32}, None),
    "indexer+memory": ("indexmem", {}, 1.0),
    "mix0.5+memory": ("indexmem", {"attention_mix": 0.5}, 1.0),
    "mix0.5+memory0.5": ("indexmem", {"attention_mix": 0.5}, 0.5),
    "mix0.5+memory0.25": ("indexmem", {"attention_mix": 0.5}, 0.25),
    "mix0.5/last64": ("indexmem", {"attention_mix": 0.5, "query_window": 64}, None),
    "mix0.5/pool1": ("indexmem", {"attention_mix": 0.5, "pool_kernel": 1}, None),
    "indexer+memory0.5": ("indexmem", {}, 0.5),
    "attention-only/window0": ("indexmem", {"attention_mix": 1.0, "recent_window": 0}, None),
    "attention-only/window16": ("indexmem", {"attention_mix": 1.0, "recent_window": 16}, None),
    "indexer/window16": ("indexmem", {"recent_window": 16}, None),
    "mix0.5/window16": ("indexmem", {"attention_mix": 0.5, "recent_window": 16}, None),
    "mix0.5/window0": ("indexmem", {"attention_mix": 0.5, "recent_window": 0}, None),
    "mix0.75/window16": ("indexmem", {"attention_mix": 0.75, "recent_window": 16}, None),
    "mix0.5/pool1/window16": ("indexmem", {"attention_mix": 0.5, "pool_kernel": 1, "recent_window": 16}, None),
    "mix0.75/pool1/window16": ("indexmem", {"attention_mix": 0.75, "pool_kernel": 1, "recent_window": 16}, None),
    "attention-only/pool1/window16": ("indexmem", {"attention_mix": 1.0, "pool_kernel": 1, "recent_window": 16},
                                      None),
    "mix0.5/pool3": ("indexmem", {"attention_mix": 0.5, "pool_kernel": 3}, None),
    "mix0.5/pool1+memory0.5": ("indexmem", {"attention_mix": 0.5, "pool_kernel": 1}, 0.5),
    # ingest's defaults (the chosen scorer), memory off and on as the weights file says (its readout and scale)
    "chosen": ("indexmem", {"attention_mix": 0.75, "pool_kernel": 1, "recent_window": 16}, None),
    "chosen+memory": ("indexmem", {"attention_mix": 0.75, "pool_kernel": 1, "recent_window": 16}, 1.0),
    "chosen+memory0.5": ("indexmem", {"attention_mix": 0.75, "pool_kernel": 1, "recent_window": 16}, 0.5),
    "chosen+memory0.25": ("indexmem", {"attention_mix": 0.75, "pool_kernel": 1, "recent_window": 16}, 0.25),
}


def log(message: str) -> None:
    print(f"[ablation {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Context:
    name: str
    ids: torch.Tensor                              # [1, n] conversation tokens
    questions: list[tuple[torch.Tensor, torch.Tensor]]  # (prompt ids [1, p], answer ids [1, a])
    continuation: torch.Tensor | None              # [1, c] the text right after, teacher-forced


def contexts(lm, planted: int) -> list[Context]:
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    template = EvalConfig().question_template
    out = []
    for seed in range(7100, 7100 + planted):  # the trainer's planted conversations are seeds 1000..1039
        messages, facts = planted_conversation(seed=seed, topics=6, turns_per_topic=20)
        ids = lm.encode("\n".join(format_turns([Turn(m["role"], m["content"]) for m in messages])))
        qs = [(lm.encode(layout.question(template.format(question=f.question))), lm.encode(f.answer))
              for f in facts]
        out.append(Context(f"planted-{seed}", ids, qs, None))
    _, held, _ = make_chunks(lm, TrainConfig())
    chat = [c for c in held if c.source == "chitchat"]
    ids = torch.cat([c.ids[c.sink:] for c in chat])[None]
    out.append(Context("held-out-chitchat", ids[:, :-CONTINUATION], [], ids[:, -CONTINUATION:]))
    return out


class ScaledMemory:
    """A latent memory whose readout is multiplied by `scale[layer]` (0 = that layer's memory is off)."""

    def __init__(self, memory: LatentMemory, scale: list[float]) -> None:
        self.memory, self.scale = memory, scale

    def readout(self, rotary_emb, position_ids):
        return ScaledRead(self.memory.readout(rotary_emb, position_ids), self.scale)


@dataclasses.dataclass(frozen=True)
class ScaledRead:
    """One forward's `ScaledMemory` readout (kvchat.kv.attention.MemoryReadout)."""

    inner: object
    scale: list[float]

    def needs_log_mass(self, layer: int) -> bool:
        return self.inner.needs_log_mass(layer)

    def __call__(self, layer, query, attended=None, log_mass=None):
        return self.scale[layer] * self.inner(layer, query, attended, log_mass)


def measure(lm, trained, prefix, ctx: Context, cache, reference: dict | None) -> dict:
    """First-token log-probs and answer NLL per question, continuation log-probs; KL against `reference`."""
    out: dict = {"first": [], "nll": [], "cont": None}
    for prompt, answer in ctx.questions:
        mark = cache.checkpoint()
        logits = forward(lm.model, cache, torch.cat([prompt, answer], -1), last_logits_only=False)[0].float()
        cache.rollback(mark)
        logp = logits.log_softmax(-1)
        p = prompt.shape[-1]
        out["first"].append(logp[p - 1])
        nll = -logp[p - 1 : p - 1 + answer.shape[-1]].gather(-1, answer[0, :, None]).mean()
        out["nll"].append(float(nll))
    if ctx.continuation is not None:
        mark = cache.checkpoint()
        out["cont"] = forward(lm.model, cache, ctx.continuation, last_logits_only=False)[0].float().log_softmax(-1)
        cache.rollback(mark)
    if reference is None:
        return out

    def kl(ref, ours):
        return float((ref.exp() * (ref - ours)).sum(-1).mean())

    row = {}
    if ctx.questions:
        row["kl_first"] = sum(kl(r, o) for r, o in zip(reference["first"], out["first"], strict=True)) / len(
            out["first"])
        row["agree_first"] = sum(int(r.argmax() == o.argmax()) for r, o in zip(reference["first"], out["first"],
                                                                                strict=True)) / len(out["first"])
        row["nll_gap"] = sum(o - r for r, o in zip(reference["nll"], out["nll"], strict=True)) / len(out["nll"])
    if ctx.continuation is not None:
        row["kl_cont"] = kl(reference["cont"][:-1], out["cont"][:-1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="128,256")
    parser.add_argument("--variants", default="snapkv,indexer,indexer+memory")
    parser.add_argument("--planted", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "records" / "indexmem_ablation.jsonl")
    parser.add_argument("--weights", type=Path, default=None, help="IndexMem weights file (default: ingest's)")
    args = checked(parser)
    lm = load_model("default", default_home() / "models")
    trained = TrainedIndexMem.load(args.weights) if args.weights else find_indexmem(lm, [default_home() / "profiles"])
    log(f"weights {trained.path} (memory readout {trained.config.readout})")
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    prefix = lm.encode(layout.before_conversation)
    ctxs = contexts(lm, args.planted)
    log("contexts: " + ", ".join(f"{c.name} {c.ids.shape[-1]} tokens" for c in ctxs))
    refs = {}
    for ctx in ctxs:
        full = block_prefill(lm.model, prefix, ctx.ids, block_size=BLOCK, budgets=None, scorer=None).cache
        refs[ctx.name] = measure(lm, trained, prefix, ctx, full, None)
    log("references done")
    for name in args.variants.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            method, kwargs, memory = VARIANTS[name]
            config = dataclasses.replace(CacheConfig(), method=method, budget=budget, block_size=BLOCK)
            budgets = resolve_layer_budgets(config, lm, [default_home() / "profiles"], prefix.shape[-1], [])[1]
            rows = []
            clock = time.perf_counter()
            for ctx in ctxs:
                if method == "indexmem":
                    settings = BASE_SCORER | kwargs
                    scorer = IndexerScorer(trained.indexer, lm.model, **settings)
                else:
                    scorer = REGISTRY[method].scorer(ScorerInputs(lm.encode, layout, config, model=lm.model))
                latent = None if memory is None else LatentMemory(trained.memory, trained.config)
                result = block_prefill(lm.model, prefix, ctx.ids, block_size=BLOCK, budgets=budgets, scorer=scorer,
                                       on_evict=None if latent is None else latent.writer(lm.model.model.rotary_emb))
                cache = result.cache
                cache.on_evict = None
                if latent is not None:
                    scale = [float(memory)] * lm.num_layers if not isinstance(memory, tuple) else [
                        1.0 if layer in memory else 0.0 for layer in range(lm.num_layers)]
                    cache.memory = ScaledMemory(latent, scale)
                rows.append({"context": ctx.name} | measure(lm, trained, prefix, ctx, cache, refs[ctx.name]))
            planted = [r for r in rows if "kl_first" in r]
            summary = {
                "variant": name, "budget": budget, "weights": shown(trained.path), "readout": trained.config.readout,
                "kl_first": round(sum(r["kl_first"] for r in planted) / len(planted), 4),
                "agree_first": round(sum(r["agree_first"] for r in planted) / len(planted), 3),
                "nll_gap": round(sum(r["nll_gap"] for r in planted) / len(planted), 4),
                "kl_cont": round(sum(r["kl_cont"] for r in rows if "kl_cont" in r), 4),
                "seconds": round(time.perf_counter() - clock, 1), "load": args.load.record(), "rows": rows,
            }
            with args.out.open("a") as f:
                f.write(json.dumps(summary) + "\n")
            log(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
