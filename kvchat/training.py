"""`kvchat train-indexer`: IndexMem's indexer and latent-memory slow weights, distilled from the frozen model.

**Data, made locally** (never LoCoMo, the evaluation set): chit-chat conversations from the MIT-licensed
`chitchat-dataset` package (when installed), kvchat's synthetic planted-fact conversations and the shipped
public-domain calibration text, each laid out as an ingest lays out a history (the system prompt, then
`speaker: text` lines), cut into chunks of `chunk_tokens`. The last chunks of every source are held out.
Or the user's own files (`--data`: chat histories or plain text).

**Targets.** One full-attention forward of the frozen model per chunk records every layer's attention input
X; everything else is recomputed from X with the model's own projections:
- indexer (stage 1): the teacher's per-key importance, the max over the chunk's queries and the KV head's
  group of query heads of the attention logits `q . k / sqrt(d_head)` (causal); the loss is
  `KL(softmax(teacher) || softmax(indexer))` over every key but the system prompt's (the sinks, which
  ingest never evicts), per layer and KV head (kvchat.kv.indexer);
- memory (stage 2, the indexer frozen): the chunk's context is evicted by simulated block prefill at several
  budgets, scored by ingest's own `--method indexmem` scorer (`IndexerScorer.for_cache`: the indexer blended
  with the block's last queries' attention, the recent window) and evicted by ingest's `select_top`, so the
  memory learns the residual of the evictions it makes up for; the chunk's last `memory_queries` tokens are
  the readers. Target:
  the residual `o_full - o_kept` of their attention outputs (eq. 8); the memory is written with the
  evicted entries and trained by MSE relative to the residual's own size (kvchat.kv.latent). The mass readout
  (`IndexMemConfig.readout`, the default) also reads `o_kept` and its log-sum-exp over the kept entries and
  the readers (what ingest's attention passes it), and its log-scales start from the data (`init_mass_scale`).
Layers are trained side by side and independently (teacher forcing: each layer's inputs come from the full
pass).

**Reproducible and resumable.** The seed fixes the data order, the initial weights and the held-out split;
a checkpoint (`<out>.ckpt`, safetensors: weights, optimizer state, step) is written every
`checkpoint_every` steps and a rerun with the same settings continues from it. Held-out figures (top-25%
overlap with the teacher, against a SnapKV-like last-64-query score and random; the share of the eviction
residual the memory removes) go into the weights file's metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvchat.config import SYSTEM_PROMPT, TRAIN_STAGES, IndexMemConfig, TrainConfig
from kvchat.errors import UserError
from kvchat.history import Turn, format_turns, load_history
from kvchat.kv.attention import LayerView, grouped_attention_weights
from kvchat.kv.indexer import Indexer, IndexerScorer, IndexMemShape, distill_loss, top_overlap
from kvchat.kv.latent import (
    CLOSED_GATE,
    MIN_MASS,
    MemoryWeights,
    features,
    gate_closed,
    read,
    read_mass,
    write_terms,
)
from kvchat.kv.methods import SNAPKV_WINDOW
from kvchat.kv.scoring import select_top
from kvchat.kv.trained import SUFFIX, TrainedIndexMem
from kvchat.llm import ChatLayout, LoadedModel, weights_fingerprint
from kvchat.profile import calibration_text
from kvchat.synthetic import planted_conversation

DEFAULT_SOURCES = ("chitchat", "synthetic", "calibration")
SHARES = {"chitchat": 0.6, "synthetic": 0.25, "calibration": 0.15}  # of the chunks, when all are there
_NAMES = ("Alex", "Sam", "Jordan", "Riley", "Casey", "Morgan", "Jamie", "Taylor")


class TrainProgress:
    """Hooks for a progress display; the default does nothing."""

    def prepare(self, done: int, total: int) -> None:
        """Chunks run through the frozen model."""

    def step(self, stage: str, done: int, total: int, loss: float) -> None: ...


@dataclass(frozen=True)
class Chunk:
    ids: torch.Tensor  # [n] token ids
    sink: int          # leading tokens (the system prompt) masked from the losses
    source: str


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
    return home / "profiles" / f"{weights_fingerprint(lm.model)}{SUFFIX}"


# --- data ------------------------------------------------------------------------------------------------
def make_chunks(lm: LoadedModel, config: TrainConfig, files: Sequence[Path] = (),
                notes: list[str] | None = None) -> tuple[list[Chunk], list[Chunk], list[str]]:
    """(train, held-out, sources used). Deterministic for `config.seed`."""
    notes = notes if notes is not None else []
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    prefix = lm.encode(layout.before_conversation)[0]
    room = config.chunk_tokens - prefix.shape[0]
    if room < 16:
        raise UserError(f"chunks of {config.chunk_tokens} tokens leave {room} after the system prompt; use more")
    rng = random.Random(config.seed)
    streams: dict[str, list[str]] = {}
    if files:
        for path in files:
            streams[str(path)] = _file_lines(path)
    else:
        chitchat = _chitchat_lines(rng)
        if chitchat is None:
            notes.append("chitchat-dataset is not installed (pip install 'kvchat[train]'): trained without it")
        else:
            streams["chitchat"] = chitchat
        streams["synthetic"] = [line for seed in range(1000, 1040) for line in
                                format_turns(_planted_turns(seed))]
        streams["calibration"] = [line for line in calibration_text().splitlines() if line.strip()]
    pools = {name: _cut(lm, lines, room) for name, lines in streams.items()}
    total = config.train_chunks + config.held_out_chunks
    quota = _quotas({n: len(p) for n, p in pools.items()}, total, files_given=bool(files))
    train, held = [], []
    for name, pool in pools.items():
        take = pool[: quota[name]]
        held_n = round(config.held_out_chunks * quota[name] / total) if total else 0
        held_n = min(max(held_n, 1 if config.held_out_chunks and len(take) > 1 else 0), len(take) - 1)
        held += [Chunk(torch.cat([prefix, ids]), prefix.shape[0], name) for ids in take[len(take) - held_n:]]
        train += [Chunk(torch.cat([prefix, ids]), prefix.shape[0], name) for ids in take[: len(take) - held_n]]
    train, held = train[: config.train_chunks], held[: config.held_out_chunks]
    if not train:
        raise UserError("no training text: give --data files with at least a chunk of text")
    return train, held, list(pools)


def _quotas(available: dict[str, int], total: int, *, files_given: bool) -> dict[str, int]:
    """Chunks per source: SHARES of `total` (equal shares for user files), what one lacks going to the rest."""
    shares = {n: (1.0 if files_given else SHARES.get(n, 1.0)) for n in available}
    quota = {n: 0 for n in available}
    left = total
    while left > 0:
        open_ = [n for n in available if quota[n] < available[n]]
        if not open_:
            break
        weight = sum(shares[n] for n in open_)
        for n in open_:
            add = min(available[n] - quota[n], max(1, int(left * shares[n] / weight)))
            quota[n] += add
        left = total - sum(quota.values())
    return quota


def _cut(lm: LoadedModel, lines: list[str], room: int) -> list[torch.Tensor]:
    """Consecutive chunks of `room` tokens of the lines joined as a history is (newlines)."""
    ids = lm.encode("\n".join(lines))[0]
    return [ids[i : i + room] for i in range(0, ids.shape[0] - room + 1, room)]


def _chitchat_lines(rng: random.Random) -> list[str] | None:
    """Conversations of the Chit Chat Challenge dataset (BYU PCC lab, MIT), in a seeded order, each with two
    made-up speaker names, one line per message group."""
    try:
        data = json.loads((importlib.resources.files("chitchat_dataset") / "dataset.json").read_text())
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    keys = sorted(data)
    rng.shuffle(keys)
    lines = []
    for key in keys[:1500]:
        names = rng.sample(_NAMES, 2)
        senders: dict[str, str] = {}
        for group in data[key]["messages"]:
            if not group:
                continue
            name = senders.setdefault(group[0]["sender"], names[len(senders) % 2])
            text = " ".join(u["text"].strip() for u in group if u["text"].strip())
            if text:
                lines.append(f"{name}: {text}")
    return lines


def _planted_turns(seed: int) -> list[Turn]:
    history, _facts = planted_conversation(seed=seed, topics=3, turns_per_topic=12)
    return [Turn(m["role"], m["content"]) for m in history]


def _file_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.suffix == ".txt":
        return [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return format_turns(load_history(path))


def data_hash(chunks: Sequence[Chunk]) -> str:
    digest = hashlib.sha256()
    for c in chunks:
        digest.update(c.ids.to(torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


# --- what the frozen model says ----------------------------------------------------------------------------
@dataclass
class Captured:
    """One chunk as the frozen model saw it: every layer's attention input, and the teacher's importance."""

    chunk: Chunk
    hidden: list[torch.Tensor]   # per layer [n, hidden], float16
    teacher: torch.Tensor        # [layers, kv_heads, n]
    snapkv: torch.Tensor | None  # [layers, kv_heads, n]: mean attention of the last 64 queries (held-out only)


@torch.inference_mode()
def capture(lm: LoadedModel, chunk: Chunk, *, with_snapkv: bool = False) -> Captured:
    """Run `chunk` through the frozen model (full causal attention) and derive the teacher's targets."""
    model = lm.model
    captured: dict[int, torch.Tensor] = {}

    def stash(module, args, kwargs):
        captured[module.layer_idx] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])[0]

    handles = [layer.self_attn.register_forward_pre_hook(stash, with_kwargs=True) for layer in model.model.layers]
    try:
        model(input_ids=chunk.ids[None], use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    hidden = [captured[i].float() for i in range(len(model.model.layers))]
    teacher, snap = [], []
    for layer, x in zip(model.model.layers, hidden, strict=True):
        logits = _logits(model, layer.self_attn, x)          # [kv, group, n, n], causal -inf
        teacher.append(logits.amax(dim=(1, 2)))
        if with_snapkv:
            window = logits[:, :, -SNAPKV_WINDOW:].softmax(-1)
            snap.append(window.mean(dim=2).amax(dim=1))
    return Captured(chunk, [x.half() for x in hidden], torch.stack(teacher),
                    torch.stack(snap) if with_snapkv else None)


def _rotated(model, attn, x: torch.Tensor, rows: slice = slice(None)) -> tuple[torch.Tensor, ...]:
    """Queries `[q_heads, r, d]` of `rows`, keys and values `[kv_heads, n, d]` of every token, after RoPE at
    positions 0..n-1 (values have none)."""
    n, d = x.shape[0], attn.head_dim
    q = attn.q_proj(x[rows]).view(-1, model.config.num_attention_heads, d).transpose(0, 1)
    k = attn.k_proj(x).view(n, -1, d).transpose(0, 1)
    v = attn.v_proj(x).view(n, -1, d).transpose(0, 1)
    positions = torch.arange(n)[None]
    cos, sin = model.model.rotary_emb(x[None], positions)
    q_pos = positions[:, rows]
    cos_q, sin_q = model.model.rotary_emb(x[None], q_pos)
    q_rot, _ = apply_rotary_pos_emb(q[None], q[None], cos_q, sin_q)
    _, k_rot = apply_rotary_pos_emb(k[None], k[None], cos, sin)
    return q_rot[0], k_rot[0], v


def _logits(model, attn, x: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Causal attention logits `[kv_heads, group, n - first, n]` of the queries from `first` on."""
    n = x.shape[0]
    q, k, _ = _rotated(model, attn, x, slice(first, n))
    kv = k.shape[0]
    logits = (q.unflatten(0, (kv, -1)) @ k[:, None].transpose(-1, -2)) * attn.scaling
    visible = torch.arange(n)[None, :] <= torch.arange(first, n)[:, None]
    return logits.masked_fill(~visible, float("-inf"))


# --- training ----------------------------------------------------------------------------------------------
def train(
    lm: LoadedModel,
    out: Path,
    config: TrainConfig = TrainConfig(),
    *,
    files: Sequence[Path] = (),
    indexmem: IndexMemConfig = IndexMemConfig(),
    progress: TrainProgress | None = None,
) -> TrainReport:
    """Train the stages `config.stage` asks for and write the weights file `out` (see the module docstring)."""
    if config.stage not in TRAIN_STAGES:
        raise UserError(f"unknown --stage {config.stage!r} (choose from {', '.join(TRAIN_STAGES)})")
    if config.steps < 1:
        raise UserError(f"--steps must be >= 1 (got {config.steps})")
    progress = progress or TrainProgress()
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    notes: list[str] = []
    shape = IndexMemShape.of(lm.model.config, indexmem)
    weights = weights_fingerprint(lm.model)
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
    indexer = previous.indexer if previous is not None else Indexer(shape)
    memory = MemoryWeights(shape, indexmem.readout)
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


def _check_memory_budgets(config: TrainConfig, sink: int) -> None:
    """Every simulated budget must leave room beside the system prompt, which eviction never drops."""
    small = [b for b in config.memory_budgets if b <= sink]
    if small:
        raise UserError(f"memory budgets {', '.join(map(str, small))} must exceed the system prompt's {sink} tokens, "
                        "which every layer keeps; raise them (--memory-budgets)")


def _previous(out: Path, weights: str) -> TrainedIndexMem:
    """The indexer `--stage memory` builds on: the one at `out`, trained on these weights."""
    if not out.is_file():
        raise UserError(f"--stage memory trains on an indexer: {out} does not exist (run --stage indexer first)")
    try:
        trained = TrainedIndexMem.load(out)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if trained.weights != weights:
        raise UserError(f"{out} was trained on other weights ({trained.weights[:8]}); run --stage both")
    return trained


def _train_stage(stage, module, lm, indexer, data, config, indexmem, checkpoint, key, progress) -> int:
    """Run one stage's steps (from a checkpoint when one matches); returns the step it resumed from."""
    params = [p for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    start = _restore(checkpoint, key, stage, module, optimizer, indexer, config.steps)
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
            _save_checkpoint(checkpoint, key, stage, step + 1, module, optimizer, indexer)
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


def indexer_loss(indexer: Indexer, lm: LoadedModel, item: Captured) -> torch.Tensor:
    """Mean over layers of the distillation KL on one chunk."""
    valid = torch.arange(item.teacher.shape[-1]) >= item.chunk.sink
    losses = []
    for layer, ind, x, teacher in zip(lm.model.model.layers, indexer.layers, item.hidden, item.teacher, strict=True):
        student = ind.importance(x.float(), ind.query_map(layer.self_attn.q_proj))
        losses.append(distill_loss(teacher, student, valid))
    return torch.stack(losses).mean()


@torch.no_grad()
def evaluate_indexer(indexer: Indexer, lm: LoadedModel, held: Sequence[Captured], fraction: float) -> dict:
    """Held-out agreement with the teacher: top-`fraction` overlap (indexer, SnapKV-like, random) and KL."""
    if not held:
        return {}
    ours, snap, rand, kls = [], [], [], []
    generator = torch.Generator().manual_seed(0)
    for item in held:
        valid = torch.arange(item.teacher.shape[-1]) >= item.chunk.sink
        for i, (layer, ind) in enumerate(zip(lm.model.model.layers, indexer.layers, strict=True)):
            x = item.hidden[i].float()
            student = ind.importance(x, ind.query_map(layer.self_attn.q_proj))
            teacher = item.teacher[i]
            ours.append(top_overlap(teacher, student, valid, fraction).mean())
            snap.append(top_overlap(teacher, item.snapkv[i], valid, fraction).mean())
            rand.append(top_overlap(teacher, torch.rand(teacher.shape, generator=generator), valid, fraction).mean())
            kls.append(distill_loss(teacher, student, valid))
    mean = lambda xs: round(float(torch.stack(xs).mean()), 4)  # noqa: E731
    return {"top_overlap": mean(ours), "snapkv_like_top_overlap": mean(snap), "random_top_overlap": mean(rand),
            "kl": mean(kls), "fraction": fraction, "held_out_chunks": len(held)}


# --- memory ------------------------------------------------------------------------------------------------
@dataclass
class MemoryTargets:
    """One chunk's memory-stage tensors per layer (float16): pre-RoPE keys and values of the context with
    which entries were evicted, the readers' pre-RoPE queries and the residual they should get back."""

    keys: list[torch.Tensor]      # [kv, P, d]
    values: list[torch.Tensor]    # [kv, P, d]
    evicted: list[torch.Tensor]   # [kv, P] 1.0 = evicted
    queries: list[torch.Tensor]   # [q_heads, R, d]
    residual: list[torch.Tensor]  # [q_heads, R, d]
    attended: list[torch.Tensor]  # [q_heads, R, d] o_kept, the compressed cache's attention output
    log_mass: list[torch.Tensor]  # [q_heads, R, 1] float32: its log-sum-exp over the kept entries (mass readout)


@torch.no_grad()
def memory_targets(lm: LoadedModel, indexer: Indexer, item: Captured, budget: int, config: TrainConfig,
                   indexmem: IndexMemConfig) -> MemoryTargets:
    """Evict the chunk's context (all but its last `memory_queries` tokens) by simulated block prefill with
    ingest's indexmem scorer at `budget`, and derive what the memory must make up for the readers (the last
    tokens)."""
    model = lm.model
    n = item.teacher.shape[-1]
    readers = min(config.memory_queries, n // 4)
    context = n - readers
    scorer = IndexerScorer.for_cache(indexer, model, config.simulated_cache())
    out = MemoryTargets([], [], [], [], [], [], [])
    for index, (layer, x16) in enumerate(zip(model.model.layers, item.hidden, strict=True)):
        attn, x = layer.self_attn, x16.float()
        kept = simulate_eviction(scorer, model, index, x[:context], item.chunk.sink, budget,
                                 config.memory_block)                                   # [kv, context] bool
        q_rot, k_rot, v = _rotated(model, attn, x, slice(context, n))
        kv, d = k_rot.shape[0], k_rot.shape[-1]
        logits = (q_rot.unflatten(0, (kv, -1)) @ k_rot[:, None].transpose(-1, -2)) * attn.scaling
        visible = torch.arange(n)[None, :] <= torch.arange(context, n)[:, None]          # [R, n]
        full = logits.masked_fill(~visible, float("-inf")).softmax(-1) @ v[:, None]      # [kv, g, R, d]
        keep = torch.cat([kept, torch.ones(kv, readers, dtype=torch.bool)], dim=1)      # [kv, n]
        masked = logits.masked_fill(~(visible[None, None] & keep[:, None, None]), float("-inf"))
        compressed = masked.softmax(-1) @ v[:, None]
        q_pre = attn.q_proj(x[context:]).view(readers, -1, d).transpose(0, 1)
        k_pre = attn.k_proj(x[:context]).view(context, -1, d).transpose(0, 1)
        out.keys.append(k_pre.half())
        out.values.append(v[:, :context].half())
        out.evicted.append((~kept).half())
        out.queries.append(q_pre.half())
        out.residual.append((full - compressed).flatten(0, 1).half())
        out.attended.append(compressed.flatten(0, 1).half())
        out.log_mass.append(masked.logsumexp(-1, keepdim=True).flatten(0, 1))
    return out


def simulate_eviction(scorer: IndexerScorer, model, layer_idx: int, x: torch.Tensor, sink: int, budget: int,
                      block: int) -> torch.Tensor:
    """Which of `x`'s tokens (layer `layer_idx`'s attention inputs, positions 0..n-1) block prefill keeps per KV
    head at `budget` (uniform layer and head budgets), as ingest's loop does it (kvchat.kv.prefill, cascade's
    `BlockWindow`): the first `sink` tokens come first and are never evicted; then, block by block, ingest's
    own `scorer` reads the block's hidden states and its last queries' attention over the kept entries and
    the block (`LayerView`, computed as kvchat's attention computes it), `select_top` evicts, and the scorer
    is told what stayed. Returns a `[kv_heads, n]` mask. `scorer` is fresh per chunk (it holds every layer's
    indexer keys). Above layer 0 `x` is the full pass's (teacher forcing), so the inputs differ from an
    ingest's, whose earlier layers attended to evicted caches."""
    n = x.shape[0]
    attn = model.model.layers[layer_idx].self_attn
    queries, keys, _ = _rotated(model, attn, x)                    # [q_heads, n, d], [kv, n, d]
    heads, d = keys.shape[0], keys.shape[-1]
    kept = torch.arange(min(sink, n)).expand(heads, -1)             # [kv, c]: what each head holds
    for start in range(min(sink, n), n, block):
        new = torch.arange(start, min(start + block, n))
        entries = torch.cat([kept, new.expand(heads, -1)], dim=1)
        past, rows = kept.shape[1], min(scorer.query_rows, new.shape[0])
        last = new[-rows:]                                           # the block's last queries: their attention
        visible = torch.arange(entries.shape[1])[None, :] <= (past + last - start)[:, None]
        weights = grouped_attention_weights(queries[None, :, last],
                                            keys.gather(1, entries[..., None].expand(-1, -1, d))[None],
                                            attn.scaling, visible)
        view = LayerView(layer_idx, weights, past, queries[None, :, last], x[new][None])
        index = select_top(scorer.layer_scores(view), budget, sink)
        if index is not None:
            scorer.kept(layer_idx, index)
            entries = entries.gather(1, index)
        kept = entries
    return torch.zeros(heads, n, dtype=torch.bool).scatter_(1, kept, True)


def memory_prediction(memory: MemoryWeights, layer: int, t: MemoryTargets, indexmem: IndexMemConfig) -> torch.Tensor:
    """What layer `layer`'s memory, written with the chunk's evicted entries, gives its readers `[q_heads, R, d]`."""
    phi, gate = memory.phi[layer], memory.gate[layer]
    eta = indexmem.write_strength
    if memory.readout == "mass":
        m, z, shift = _mass_state(memory, layer, t)
        return read_mass(phi, gate, memory.log_scale[layer], eta * m, eta * z, t.queries[layer].float(),
                         t.attended[layer].float(), t.log_mass[layer], shift)
    m, b = write_terms(phi, t.keys[layer].float(), t.values[layer].float(), t.evicted[layer].float())
    return read(phi, gate, eta * m, eta * b, t.queries[layer].float(), indexmem.eps)


def _mass_state(memory: MemoryWeights, layer: int, t: MemoryTargets):
    """The mass readout's state after writing the chunk's evicted entries (positions 0..P-1, reference P-1, as
    an ingest's `LatentMemory.write` decays them) and the readers' shift `-gamma (t - r)` `[R, 1]`."""
    context, readers = t.keys[layer].shape[1], t.queries[layer].shape[1]
    gamma = memory.gamma(layer)
    distance = (context - 1) - torch.arange(context, dtype=torch.float32)
    weight = t.evicted[layer].float() * torch.exp(-gamma * distance)
    m, z = write_terms(memory.phi[layer], t.keys[layer].float(), t.values[layer].float(), weight, "mass")
    ahead = torch.arange(1, readers + 1, dtype=torch.float32)[:, None]                 # t - r for the readers
    return m, z, -gamma * ahead


@torch.no_grad()
def init_mass_scale(memory: MemoryWeights, targets: Sequence[MemoryTargets], indexmem: IndexMemConfig) -> None:
    """Start each layer's log-scale c where the memory takes about the gate's share (sigmoid(GATE_BIAS)) of a
    reader's attention: c = mean of L_K - log phi(q).z over the training readers, z written with what was
    evicted. Deterministic (the data and the seeded initial phi); the optimizer moves c by ~lr a step, too
    slowly to find the scale of sums over thousands of entries by itself."""
    for layer in range(memory.shape.layers):
        gaps = []
        for t in targets:
            _, z, shift = _mass_state(memory, layer, t)
            q = t.queries[layer].float().unflatten(0, (z.shape[0], -1))
            mass = (features(memory.phi[layer], q, "mass") @ (indexmem.write_strength * z)[:, None, :, None])
            present = mass.flatten(0, 1) > MIN_MASS
            log_mass = mass.flatten(0, 1).clamp_min(MIN_MASS).log() + shift
            gaps.append((t.log_mass[layer] - log_mass)[present])
        gap = torch.cat(gaps)
        memory.log_scale[layer] = gap.mean() if gap.numel() else 0.0


def memory_loss(memory: MemoryWeights, t: MemoryTargets, indexmem: IndexMemConfig) -> torch.Tensor:
    """Mean over layers of the MSE to the residual, relative to the residual's own mean square."""
    losses = []
    for layer in range(len(t.keys)):
        residual = t.residual[layer].float()
        error = (memory_prediction(memory, layer, t, indexmem) - residual).pow(2).mean()
        losses.append(error / residual.pow(2).mean().clamp_min(1e-12))
    return torch.stack(losses).mean()


@torch.no_grad()
def residual_removed(memory: MemoryWeights, indexer: Indexer, lm: LoadedModel, data: Sequence[Captured],
                     config: TrainConfig, indexmem: IndexMemConfig) -> dict[int, list[float]]:
    """Per budget, per layer: the share of the eviction residual the memory removes on `data`,
    `1 - |r - g m|^2 / |r|^2` (negative where the readout adds more error than it takes away)."""
    out = {}
    for budget in config.memory_budgets:
        err = [0.0] * indexer.shape.layers
        base = [0.0] * indexer.shape.layers
        for item in data:
            t = memory_targets(lm, indexer, item, budget, config, indexmem)
            for layer in range(len(t.keys)):
                residual = t.residual[layer].float()
                err[layer] += float((memory_prediction(memory, layer, t, indexmem) - residual).pow(2).sum())
                base[layer] += float(residual.pow(2).sum())
        out[budget] = [round(1 - e / b, 4) if b else 0.0 for e, b in zip(err, base, strict=True)]
        out[budget].append(round(1 - sum(err) / sum(base), 4) if sum(base) else 0.0)  # last: all layers
    return out


def close_gates(memory: MemoryWeights, layers: Sequence[int]) -> None:
    """Shut the memory of `layers`: gate weight 0 and bias CLOSED_GATE, so g = 0 and the readout adds nothing
    (kvchat.kv.latent skips those layers' writes and reads)."""
    with torch.no_grad():
        for layer in layers:
            memory.gate[layer].weight.zero_()
            memory.gate[layer].bias.fill_(CLOSED_GATE)


@torch.no_grad()
def evaluate_memory(memory: MemoryWeights, indexer: Indexer, lm: LoadedModel, held: Sequence[Captured],
                    config: TrainConfig, indexmem: IndexMemConfig) -> dict:
    """Held-out share of the eviction residual the memory removes, `1 - |r - g m|^2 / |r|^2`, per budget
    (all layers) and per layer (mean over the budgets)."""
    removed = residual_removed(memory, indexer, lm, held, config, indexmem)
    layers = indexer.shape.layers
    per_layer = [round(sum(r[layer] for r in removed.values()) / len(removed), 4) for layer in range(layers)]
    return {"residual_removed": {str(b): r[-1] for b, r in removed.items()}, "per_layer": per_layer,
            "open_layers": [layer for layer in range(layers) if not gate_closed(memory, layer)],
            "held_out_chunks": len(held), "readers": config.memory_queries}


# --- checkpoints -------------------------------------------------------------------------------------------
def _save_checkpoint(path: Path, key: str, stage: str, step: int, module: torch.nn.Module, optimizer,
                     indexer: Indexer) -> None:
    tensors = {f"param.{k}": v.detach().clone().contiguous() for k, v in module.state_dict().items()}
    if module is not indexer:  # the memory stage: the finished indexer rides along
        tensors |= {f"indexer.{k}": v.detach().clone().contiguous() for k, v in indexer.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"opt.{index}.{name}"] = torch.as_tensor(value).clone().contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"key": key, "stage": stage, "step": str(step)})
    tmp.replace(path)


def _restore(path: Path, key: str, stage: str, module: torch.nn.Module, optimizer, indexer: Indexer,
             steps: int) -> int:
    """The step a matching checkpoint of this stage reached (its weights and optimizer state loaded), else 0.
    A checkpoint of the memory stage means the indexer stage finished: the indexer's weights come from it."""
    if not path.is_file():
        return 0
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("key") != key:
        return 0
    tensors = load_file(str(path))
    if meta.get("stage") == "memory" and stage == "indexer":
        indexer.load_state_dict({k[8:]: v for k, v in tensors.items() if k.startswith("indexer.")})
        return steps
    if meta.get("stage") != stage:
        return 0
    module.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("param.")})
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("opt."):
            _, index, field_name = name.split(".", 2)
            state.setdefault(int(index), {})[field_name] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return int(meta["step"])
