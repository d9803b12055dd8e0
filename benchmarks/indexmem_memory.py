"""IndexMem's latent memory: the shipped one against ones retrained under ingest's own eviction (additive or
mass readout).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/indexmem_memory.py residual WEIGHTS... [--names a,b]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/indexmem_memory.py length WEIGHTS... [--names a,b]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/indexmem_memory.py report --runs NAME=RESULTS.jsonl...

`residual`: the share of the eviction residual each weights file's memory removes on the held-out chunks of
`kvchat train-indexer` (the default recipe: chit-chat, synthetic, calibration; never LoCoMo), measured by
training's own `evaluate_memory` twice: evicting as ingest does (`TrainConfig`'s defaults, which are
`CacheConfig`'s: the indexer blended 1:3 with the block's last 64 queries' attention, a 16-entry window) and
as the memory stage did before it reused ingest's scorer (the indexer alone, a 64-entry window). Writes
benchmarks/results/records/indexmem_memory_residual.json.
`length`: the same share on one planted-fact conversation (kvchat.history.synthetic seed 7100, the first of
indexmem_ablation.py's; never LoCoMo) cut to 512 tokens, as training's chunks are, and to 1536, as an
ingest's history of it is: budget 128, its last 64 tokens reading. Writes
benchmarks/results/records/indexmem_memory_length.json.
`report`: the LoCoMo table (first-token KL and agreement against full KV, memory on and off) of runs made
by `benchmarks/indexmem.py quality --methods indexmem --out RESULTS.jsonl`, one per weights file (each with
`KVCHAT_HOME` holding that file in its profiles/), into benchmarks/results/indexmem_memory.md.
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

from kvchat.config import SYSTEM_PROMPT, TrainConfig, default_home
from kvchat.eval.evaluate import ResultsFile
from kvchat.eval.summary import summarize
from kvchat.history.loading import Turn, format_turns
from kvchat.history.synthetic import planted_conversation
from kvchat.kv.trained import TrainedIndexMem
from kvchat.model.llm import ChatLayout, load_model
from kvchat.training.chunks import Chunk, make_chunks
from kvchat.training.memory_stage import evaluate_memory, residual_removed
from kvchat.training.teacher import capture

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RECORDS = RESULTS / "records"
LENGTHS = (512, 1536)  # indexmem_memory.py length: training's chunk length, and a planted history's
# The memory stage's eviction before it reused ingest's scorer: the indexer alone, a 64-entry window.
INDEXER_ALONE = {"memory_attention_mix": 0.0, "memory_recent": 64}


def log(message: str) -> None:
    print(f"[indexmem_memory {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def residual(args) -> None:
    lm = load_model("default", default_home() / "models")
    config = TrainConfig()
    _, held_chunks, sources = make_chunks(lm, config)
    held = [capture(lm, chunk) for chunk in held_chunks]
    log(f"{len(held)} held-out chunks from {', '.join(sources)}")
    evictions = {"ingest": config, "indexer alone (window 64)": dataclasses.replace(config, **INDEXER_ALONE)}
    out = {"held_out_chunks": len(held), "readers": config.memory_queries, "budgets": list(config.memory_budgets),
           "evictions": {k: {f: getattr(v, f) for f in ("memory_attention_mix", "memory_recent", "memory_block")}
                         for k, v in evictions.items()}, "weights": {}}
    names = args.names.split(",") if args.names else [p.name for p in args.weights]
    for name, path in zip(names, args.weights, strict=True):
        trained = TrainedIndexMem.load(path)
        rows = {}
        for eviction, train_config in evictions.items():
            clock = time.perf_counter()
            metrics = evaluate_memory(trained.memory, trained.indexer, lm, held, train_config, trained.config)
            rows[eviction] = metrics["residual_removed"] | {"per_layer": metrics["per_layer"]}
            log(f"{name}, evicting as {eviction}: {metrics['residual_removed']} ({time.perf_counter() - clock:.0f} s)")
        out["weights"][name] = {"file": shown(path), "data_hash": trained.data_hash, "residual_removed": rows}
    out["threads"] = torch.get_num_threads()
    out["date"], out["load"] = time.strftime("%Y-%m-%d"), args.load.record()
    (RECORDS / "indexmem_memory_residual.json").write_text(json.dumps(out, indent=1) + "\n")


def length(args) -> None:
    lm = load_model("default", default_home() / "models")
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    prefix = lm.encode(layout.before_conversation)[0]
    messages, _ = planted_conversation(seed=7100, topics=6, turns_per_topic=20)
    ids = torch.cat([prefix, lm.encode("\n".join(format_turns([Turn(m["role"], m["content"]) for m in messages])))[0]])
    config = dataclasses.replace(TrainConfig(), memory_budgets=(128,))
    names = args.names.split(",") if args.names else [p.name for p in args.weights]
    out = {"conversation": "planted seed 7100", "tokens": int(ids.shape[0]), "budget": 128,
           "readers": config.memory_queries, "weights": {}}
    for n in LENGTHS:
        item = capture(lm, Chunk(ids[:n], prefix.shape[0], "planted"))
        for name, path in zip(names, args.weights, strict=True):
            trained = TrainedIndexMem.load(path)
            removed = residual_removed(trained.memory, trained.indexer, lm, [item], config, trained.config)[128]
            row = out["weights"].setdefault(name, {"file": shown(path), "readout": trained.config.readout})
            row[str(n)] = {"all": removed[-1], "worst_layer": min(removed[:-1]), "per_layer": removed[:-1]}
            log(f"{name} at {n} tokens: {removed[-1]} (worst layer {min(removed[:-1])})")
    out["date"], out["load"] = time.strftime("%Y-%m-%d"), args.load.record()
    (RECORDS / "indexmem_memory_length.json").write_text(json.dumps(out, indent=1) + "\n")


def report(args) -> None:
    budgets = (128, 256, 512)
    lines = ["| memory | " + " | ".join(f"KL @{b}" for b in budgets) + " | "
             + " | ".join(f"agree @{b}" for b in budgets) + " |", "|---|" + "---|" * 2 * len(budgets)]
    for run in args.runs:
        name, path = run.split("=", 1)
        rows = summarize(ResultsFile(Path(path)).records)
        for label, off in ((f"{name}, on", False), (f"{name}, off", True)):
            picked = [next((r for r in rows if r["variant"].startswith(f"indexmem@{b}/")
                            and ("memory=False" in r["variant"]) == off), {}) for b in budgets]
            cells = [f"{r['kl']:.4f}" if r else "–" for r in picked] + [f"{r['agreement']:.3f}" if r else "–"
                                                                         for r in picked]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = ("# IndexMem's memory: shipped, retrained under ingest's eviction, mass readout (embedded SmolLM2-135M)\n\n"
            "LoCoMo conv-26 and conv-30 cut to whole sessions within 4096 tokens, 10 questions each (categories "
            "1-4), block 512, block prefill, default layer budgets, uniform heads; first-token KL and agreement "
            "against full KV, means over the 20 questions.\n\n" + "\n".join(lines) + "\n")
    training = RECORDS / "indexmem_training_memory_ingest_eviction.json"
    if training.is_file():
        t = json.loads(training.read_text())
        text += ("\nadditive (retrained): "
                 f"`kvchat train-indexer --stage memory --steps {t['steps']['memory']} --threads 1` "
                 f"on a copy of the shipped file (its indexer; seed 0, the default recipe, data hash "
                 f"{t['data_hash']}), evicting as ingest does; {t['timings_ms']['total'] / 1000:.0f} s "
                 f"(`{training.name}`). Not shipped.\n")
    mass = RECORDS / "indexmem_training_memory_mass.json"
    if mass.is_file():
        t = json.loads(mass.read_text())
        removed = ", ".join(f"{v:.3f} @{k}" for k, v in t["metrics"]["memory"]["residual_removed"].items())
        text += ("\nmass (shipped): the same command with `--memory-readout mass` (the memory's entries join "
                 f"attention's softmax as extra mass, each entry's mass decaying with its distance from the query; "
                 f"kvchat.kv.latent), same data and recipe (data hash {t['data_hash']}); "
                 f"{t['timings_ms']['total'] / 1000:.0f} s (`{mass.name}`); held-out residual removed {removed}. "
                 "Answering adds half its correction (`IndexMemConfig.mass_scale` 0.5, chosen on the planted facts "
                 "below before this LoCoMo run). Shipped: now the default.\n")
    residual_file = RECORDS / "indexmem_memory_residual.json"
    if residual_file.is_file():
        data = json.loads(residual_file.read_text())
        budgets = data["budgets"]
        text += (f"\nShare of the eviction residual the memory removes on the {data['held_out_chunks']} held-out "
                 f"training chunks (training's `residual_removed`, last {data['readers']} tokens reading, all "
                 "layers; negative: the readout adds error; shipped: the additive memory shipped before), by how "
                 "the simulated block prefill evicts:\n\n"
                 "| memory | eviction | " + " | ".join(f"@{b}" for b in budgets)
                 + " | worst layer (mean over budgets) |\n"
                 "|---|---|" + "---|" * (len(budgets) + 1) + "\n")
        for name, weights in data["weights"].items():
            for eviction, row in weights["residual_removed"].items():
                text += (f"| {name} | {eviction} | " + " | ".join(f"{row[str(b)]:.3f}" for b in budgets)
                         + f" | {min(row['per_layer']):.3f} |\n")
    planted = RECORDS / "indexmem_mass_planted.jsonl"
    if planted.is_file():
        text += planted_table(planted)
    length_file = RECORDS / "indexmem_memory_length.json"
    if length_file.is_file():
        data = json.loads(length_file.read_text())
        head = " | ".join(f"{n} tokens" for n in LENGTHS)
        text += (f"\nShare of the eviction residual removed on one {data['conversation']} conversation cut to "
                 f"training's chunk length and to a history's (`indexmem_memory.py length`: budget {data['budget']}, "
                 f"the last {data['readers']} tokens reading, all layers; worst layer in brackets):\n\n"
                 f"| memory | {head} |\n|---|" + "---|" * len(LENGTHS) + "\n")
        for name, row in data["weights"].items():
            text += (f"| {name} | " + " | ".join(f"{row[str(n)]['all']:.3f} ({row[str(n)]['worst_layer']:.3f})"
                                               for n in LENGTHS) + " |\n")
        text += NO_DECAY_NOTE
    (RESULTS / "indexmem_memory.md").write_text(text)
    print(text)


# The mass memory without its distance decay (commit dd8727e; its files do not load in the code that decays):
NO_DECAY_NOTE = ("| mass, no distance decay (commit dd8727e) | 0.227 (0.050) | 0.018 (-1.121) |\n\n"
                 "Without the decay the mass memory, as good as with it on training's 512-token chunks, adds error "
                 "in 16 of 30 layers on the 1536-token history: content features cannot see that attention to "
                 "entries far back falls with distance.\n")


# The weights files of the planted-fact runs (benchmarks/indexmem_ablation.py --weights), by their directory.
PLANTED_LABELS = {"profiles": "additive (shipped before)", "memhome-retrained": "additive (retrained)",
                  "memhome-mass": "mass, no distance decay", "memhome-massd": "mass (shipped)",
                  "memhome-massd1536": "mass, 1536-token training chunks"}


def planted_table(path: Path) -> str:
    """Memory off vs on (each weights file) on planted facts and held-out chit-chat, from indexmem_ablation.py."""
    rows: dict[str, dict[int, dict]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        name = "off" if r["variant"] == "chosen" else PLANTED_LABELS.get(Path(r["weights"]).parent.parent.name
                                                                         if "memhome" in r["weights"] else
                                                                         "profiles", r["weights"])
        scale = r["variant"].removeprefix("chosen").removeprefix("+memory")
        name += f" x{scale}" if scale else ""
        rows.setdefault(name, {})[r["budget"]] = r
    budgets = sorted({b for row in rows.values() for b in row})
    metrics = (("kl_first", "KL 1st", "{:.4f}"), ("nll_gap", "gold NLL gap", "{:.3f}"),
               ("kl_cont", "KL next 48", "{:.4f}"))
    head = " | ".join(f"{label} @{b}" for _, label, _ in metrics for b in budgets)
    lines = [f"| memory | {head} |", "|---|" + "---|" * len(metrics) * len(budgets)]
    for name, row in rows.items():
        cells = [fmt.format(row[b][key]) if b in row else "–" for key, _, fmt in metrics for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return ("\nPlanted facts and held-out chit-chat (`benchmarks/indexmem_ablation.py --variants chosen,chosen+memory "
            "--weights FILE`, records in `records/indexmem_mass_planted.jsonl`; never LoCoMo): three planted-fact "
            "conversations (history.synthetic seeds 7100-7102, about 1466 tokens, 6 questions each) and the held-out "
            "chit-chat chunks (2322 tokens, then 48 more teacher-forced); ingest's scorer (the 1:3 blend, window 16, "
            "no pooling), block 512, sensitivity layer budgets; against full KV. `xS`: the memory's addition "
            "times S.\n\n" + "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("residual", "length", "report"))
    parser.add_argument("weights", nargs="*", type=Path, help="residual, length: IndexMem weights files")
    parser.add_argument("--names", default="", help="residual, length: a name per weights file, comma-separated")
    parser.add_argument("--runs", nargs="*", default=[], help="report: NAME=RESULTS.jsonl of indexmem.py quality")
    args = checked(parser, skip=lambda a: a.what == "report")
    {"residual": residual, "length": length, "report": report}[args.what](args)


if __name__ == "__main__":
    main()
