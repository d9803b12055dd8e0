"""Stage 2 of `kvchat train-indexer`: the latent memory's slow weights, the indexer frozen.

The memory makes up for what eviction drops, so it is trained on the evictions ingest makes: each chunk's
context is evicted by simulated block prefill at several budgets with ingest's own `--method indexmem` scorer
(`IndexerScorer.for_cache`) and `select_top`, and the chunk's last `memory_queries` tokens are the readers. Its
target is the residual `o_full - o_kept` of their attention outputs (the paper's eq. 8), the loss an MSE relative
to the residual's own size, so every layer counts alike. The mass readout also reads `o_kept` and its log-sum-exp
over the kept entries, what ingest's attention passes it, and its log-scales start from the data
(`init_mass_scale`). Layers whose memory removes too little of the held-out residual are shut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvchat.config import IndexMemConfig, TrainConfig
from kvchat.kv.attention import LayerView, grouped_attention_weights
from kvchat.kv.indexer import Indexer, IndexerScorer
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
from kvchat.kv.scoring import select_top
from kvchat.model.llm import LoadedModel
from kvchat.training.teacher import Captured, Rope, layer_attention


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
    for index, (x16, rope) in enumerate(zip(item.hidden, item.rope, strict=True)):
        x = x16.float()
        kept = simulate_eviction(scorer, model, index, x[:context], item.chunk.sink, budget,
                                 config.memory_block, rope=rope)                        # [kv, context] bool
        attention = layer_attention(model, index, x, rope, readers)
        logits = attention.logits()                                                      # [kv, g, R, n]
        values = attention.values[0]                                                     # [kv, n, d]
        full = logits.softmax(-1) @ values[:, None]                                      # [kv, g, R, d]
        keep = torch.cat([kept, kept.new_ones(kept.shape[0], readers)], dim=1)             # [kv, n]
        masked = logits.masked_fill(~keep[:, None, None], float("-inf"))
        compressed = masked.softmax(-1) @ values[:, None]
        unrotated = layer_attention(model, index, x, rope, readers, rotate=False)      # what the memory sees
        out.keys.append(unrotated.keys[0, :, :context].half())
        out.values.append(values[:, :context].half())
        out.evicted.append((~kept).half())
        out.queries.append(unrotated.queries[0].half())
        out.residual.append((full - compressed).flatten(0, 1).half())
        out.attended.append(compressed.flatten(0, 1).half())
        out.log_mass.append(masked.logsumexp(-1, keepdim=True).flatten(0, 1))
    return out


def simulate_eviction(scorer: IndexerScorer, model, layer_idx: int, x: torch.Tensor, sink: int, budget: int,
                      block: int, *, rope: Rope) -> torch.Tensor:
    """Which of `x`'s tokens (layer `layer_idx`'s attention inputs, positions 0..n-1; `rope`: the position
    embeddings the model gave the layer, kvchat.training.teacher) block prefill keeps per KV head at `budget`
    (uniform layer and head budgets), as ingest's loop does it (kvchat.kv.prefill, cascade's `BlockWindow`): the
    first `sink` tokens come first and are never evicted; then, block by block, ingest's own `scorer` reads the
    block's hidden states and its last queries' attention over the kept entries and the block (`LayerView`,
    computed as kvchat's attention computes it), `select_top` evicts, and the scorer is told what stayed.
    Returns a `[kv_heads, n]` mask. `scorer` is fresh per chunk (it holds every layer's indexer keys). Above
    layer 0 `x` is the full pass's (teacher forcing), so the inputs differ from an ingest's, whose earlier layers
    attended to evicted caches."""
    n = x.shape[0]
    attention = layer_attention(model, layer_idx, x, rope)
    queries, keys = attention.queries[0], attention.keys[0]        # [q_heads, n, d], [kv, n, d]
    heads, d = keys.shape[0], keys.shape[-1]
    kept = torch.arange(min(sink, n), device=x.device).expand(heads, -1)             # [kv, c]: what each head holds
    for start in range(min(sink, n), n, block):
        new = torch.arange(start, min(start + block, n), device=x.device)
        entries = torch.cat([kept, new.expand(heads, -1)], dim=1)
        past, rows = kept.shape[1], min(scorer.query_rows, new.shape[0])
        last = new[-rows:]                                           # the block's last queries: their attention
        visible = torch.arange(entries.shape[1], device=x.device)[None, :] <= (past + last - start)[:, None]
        weights = grouped_attention_weights(queries[None, :, last],
                                            keys.gather(1, entries[..., None].expand(-1, -1, d))[None],
                                            attention.scale, visible, attention.softcap)
        view = LayerView(layer_idx, weights, past, queries[None, :, last], x[new][None], attention.scale,
                         attention.softcap)
        index = select_top(scorer.layer_scores(view), budget, sink)
        if index is not None:
            scorer.kept(layer_idx, index)
            entries = entries.gather(1, index)
        kept = entries
    return torch.zeros(heads, n, dtype=torch.bool, device=x.device).scatter_(1, kept, True)


def memory_prediction(memory: MemoryWeights, layer: int, t: MemoryTargets, indexmem: IndexMemConfig) -> torch.Tensor:
    """What layer `layer`'s memory, written with the chunk's evicted entries, gives its readers `[q_heads, R, d]`."""
    phi, gate = memory.phi_of(layer), memory.gate_of(layer)
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
    device = t.keys[layer].device
    distance = (context - 1) - torch.arange(context, dtype=torch.float32, device=device)
    weight = t.evicted[layer].float() * torch.exp(-gamma * distance)
    m, z = write_terms(memory.phi_of(layer), t.keys[layer].float(), t.values[layer].float(), weight, "mass")
    ahead = torch.arange(1, readers + 1, dtype=torch.float32, device=device)[:, None]   # t - r for the readers
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
            mass = (features(memory.phi_of(layer), q, "mass") @ (indexmem.write_strength * z)[:, None, :, None])
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
            memory.gate_of(layer).weight.zero_()
            memory.gate_of(layer).bias.fill_(CLOSED_GATE)


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
