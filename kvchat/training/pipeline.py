"""`kvchat train-indexer`: the indexer, then the latent memory's slow weights, distilled from the frozen model
into one weights file (kvchat.kv.trained).

The stages run in order because the memory makes up for the indexer's evictions (kvchat.training.memory_stage)
and must learn from the indexer it will serve; `--stage memory` retrains the memory of an existing file. Every
chunk goes through the frozen model once, up front (kvchat.training.teacher), and both stages reuse what it
recorded. The seed fixes the data order, the initial weights and the held-out split, so a run is reproducible
and resumable (kvchat.training.checkpoints); held-out figures go into the weights file's metadata.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from kvchat.config import TRAIN_STAGES, IndexMemConfig, TrainConfig
from kvchat.errors import UserError
from kvchat.kv import families
from kvchat.kv.causal_lm import config_of
from kvchat.kv.indexer import Indexer, IndexMemShape
from kvchat.kv.latent import MemoryWeights
from kvchat.kv.trained import SUFFIX, TrainedIndexMem
from kvchat.messages import option
from kvchat.model.llm import LoadedModel
from kvchat.training.checkpoints import restore_checkpoint, save_checkpoint
from kvchat.training.chunks import data_hash, make_chunks
from kvchat.training.indexer_stage import evaluate_indexer, indexer_loss
from kvchat.training.memory_stage import (
    close_gates,
    evaluate_memory,
    init_mass_scale,
    memory_loss,
    memory_targets,
    residual_removed,
)
from kvchat.training.teacher import capture


class TrainHooks(Protocol):
    """What training tells a progress display (kvchat.cli.progress's, `TrainProgress`)."""

    def prepare(self, done: int, total: int) -> None:
        """Chunks run through the frozen model."""

    def step(self, stage: str, done: int, total: int, loss: float) -> None: ...


class TrainProgress:
    """The `TrainHooks` that do nothing: the default."""

    def prepare(self, done: int, total: int) -> None: ...

    def step(self, stage: str, done: int, total: int, loss: float) -> None: ...


@dataclass
class TrainReport:
    out: str
    stages: list[str]
    steps: dict[str, int]
    resumed_from: dict[str, int]
    seconds: float
    metrics: dict
    parameters: dict[str, int]
    file_bytes: int
    data_hash: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_out(home: Path, lm: LoadedModel) -> Path:
    """Where a user-trained file goes: `$KVCHAT_HOME/profiles/`, found there before the shipped ones."""
    return home / "profiles" / f"{lm.weight_ids[0]}{SUFFIX}"


def train(
    lm: LoadedModel,
    out: Path,
    config: TrainConfig = TrainConfig(),
    *,
    files: Sequence[Path] = (),
    indexmem: IndexMemConfig = IndexMemConfig(),
    progress: TrainHooks | None = None,
) -> TrainReport:
    """Train the stages `config.stage` asks for and write the weights file `out` (see the module docstring)."""
    if config.stage not in TRAIN_STAGES:
        raise UserError(f"unknown {option('stage')} {config.stage!r} (choose from {', '.join(TRAIN_STAGES)})")
    if config.steps < 1:
        raise UserError(f"{option('steps')} must be >= 1 (got {config.steps})")
    _check_window(lm, config)
    progress = progress or TrainProgress()
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    notes: list[str] = []
    shape = IndexMemShape.of(config_of(lm.model), indexmem)
    weights = lm.weight_ids[0]
    stages = ["indexer", "memory"] if config.stage == "both" else [config.stage]
    previous = None
    if stages == ["memory"]:
        previous = _previous(out, weights)
    train_chunks, held_chunks, sources = make_chunks(lm, config, files, notes)
    if "memory" in stages:
        _check_memory_budgets(config, train_chunks[0].sink)
    digest = data_hash(train_chunks + held_chunks)
    everything = train_chunks + held_chunks
    data = []
    for i, chunk in enumerate(everything):
        data.append(capture(lm, chunk, with_snapkv=i >= len(train_chunks)))
        progress.prepare(i + 1, len(everything))
    train_data, held_data = data[: len(train_chunks)], data[len(train_chunks):]
    recipe = {
        "train": dataclasses.asdict(config), "sources": sources, "files": [str(f) for f in files],
        "train_chunks": len(train_chunks), "held_out_chunks": len(held_chunks), "threads": torch.get_num_threads(),
    }
    torch.manual_seed(config.seed)
    indexer = (previous.indexer if previous is not None else Indexer(shape)).to(lm.device)
    memory = MemoryWeights(shape, indexmem.readout).to(lm.device)
    metrics = dict(previous.metrics) if previous is not None else {}
    steps, resumed = {}, {}
    checkpoint = out.with_name(out.name + ".ckpt")
    key = json.dumps({"config": dataclasses.asdict(config), "data": digest, "weights": weights,
                      "shape": shape.to_dict(), "readout": indexmem.readout}, sort_keys=True)
    for stage in stages:
        clock = time.perf_counter()
        module = indexer if stage == "indexer" else memory
        resumed[stage] = _train_stage(stage, module, lm, indexer, train_data, config, indexmem, checkpoint, key,
                                      progress)
        steps[stage] = config.steps
        if stage == "indexer":
            metrics["indexer"] = evaluate_indexer(indexer, lm, held_data, config.top_fraction)
        else:
            gains = residual_removed(memory, indexer, lm, held_data, config, indexmem)
            per_layer = [sum(g[layer] for g in gains.values()) / len(gains) for layer in range(shape.layers)]
            close_gates(memory, [layer for layer, gain in enumerate(per_layer) if gain < config.memory_min_gain])
            metrics["memory"] = evaluate_memory(memory, indexer, lm, held_data, config, indexmem)
            metrics["memory"]["per_layer_before_closing"] = [round(g, 4) for g in per_layer]
        metrics.setdefault("seconds", {})[stage] = round(time.perf_counter() - clock, 1)
    metrics.setdefault("seconds", {})["prepare"] = round(
        time.perf_counter() - started - sum(metrics["seconds"].get(s, 0) for s in stages), 1)
    if previous is not None:
        recipe = {**previous.recipe, "memory": recipe}
    trained = TrainedIndexMem(
        shape=shape, indexer=indexer, memory=memory if "memory" in stages else None, weights=weights,
        model=lm.spec if lm.spec != "default" else "SmolLM2-135M-Instruct (embedded default)", config=indexmem,
        recipe=recipe, data_hash=digest if previous is None else previous.data_hash, metrics=metrics,
    )
    trained.save(out)
    checkpoint.unlink(missing_ok=True)
    params = {"indexer": sum(p.numel() for p in indexer.parameters())}
    if trained.memory is not None:
        params["memory"] = sum(p.numel() for p in memory.parameters())
    return TrainReport(str(out), stages, steps, resumed, round(time.perf_counter() - started, 1), metrics, params,
                       out.stat().st_size, digest, notes)


def _check_window(lm: LoadedModel, config: TrainConfig) -> None:
    """kvchat's attention lets every token see the whole chunk (kvchat.kv.families), so the teacher of a
    sliding-window layer is the model's only while a chunk fits in its window."""
    window = families.sliding_window(config_of(lm.model))
    if window is not None and config.chunk_tokens > window:
        raise UserError(f"{lm.spec} has sliding-window attention layers of {window} tokens: train on chunks of at "
                        f"most {window} ({option('chunk_tokens')}), not {config.chunk_tokens}")


def _check_memory_budgets(config: TrainConfig, sink: int) -> None:
    """Every simulated budget must leave room beside the system prompt, which eviction never drops."""
    small = [b for b in config.memory_budgets if b <= sink]
    if small:
        raise UserError(f"memory budgets {', '.join(map(str, small))} must exceed the system prompt's {sink} tokens, "
                        f"which every layer keeps; raise them ({option('memory_budgets')})")


def _previous(out: Path, weights: str) -> TrainedIndexMem:
    """The indexer `--stage memory` builds on: the one at `out`, trained on these weights."""
    if not out.is_file():
        raise UserError(f"{option('stage', 'memory')} trains on an indexer: {out} does not exist (run "
                        f"{option('stage', 'indexer')} first)")
    try:
        trained = TrainedIndexMem.load(out)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if trained.weights != weights:
        raise UserError(f"{out} was trained on other weights ({trained.weights[:8]}); run {option('stage', 'both')}")
    return trained


def _train_stage(stage, module, lm, indexer, data, config, indexmem, checkpoint, key, progress) -> int:
    """Run one stage's steps (from a checkpoint when one matches); returns the step it resumed from."""
    params = [p for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    start = restore_checkpoint(checkpoint, key, stage, module, optimizer, indexer, config.steps)
    if stage == "memory" and start < config.steps:
        indexer.requires_grad_(False)
        targets = [memory_targets(lm, indexer, c, config.memory_budgets[i % len(config.memory_budgets)], config,
                                  indexmem) for i, c in enumerate(data)]
        if start == 0 and module.readout == "mass":
            init_mass_scale(module, targets, indexmem)
    for step in range(start, config.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config)
        index = _order(step, len(data), config.seed)
        if stage == "indexer":
            loss = indexer_loss(indexer, lm, data[index])
        else:
            loss = memory_loss(module, targets[index], indexmem)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        progress.step(stage, step + 1, config.steps, float(loss.detach()))
        if (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            save_checkpoint(checkpoint, key, stage, step + 1, module, optimizer, indexer)
    return start


def _lr(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to a hundredth."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * progress)))


def _order(step: int, n: int, seed: int) -> int:
    """The chunk of `step`: a fresh seeded permutation every pass over the data."""
    epoch, i = divmod(step, n)
    return int(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))[i])
