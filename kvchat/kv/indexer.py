"""IndexMem's indexer (Yang et al. 2026, §3.1): a small learned module per layer that predicts which cached
entries the frozen model's attention needs, read inside the block's forward, so eviction needs no probe pass.

Design notes (the details and the choices made): docs/internals.md, "kvchat/kv/indexer.py".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.kv.attention import LayerView
from kvchat.kv.causal_lm import decoder_of
from kvchat.kv.config import SNAPKV_QUERIES, CacheConfig, IndexMemConfig
from kvchat.kv.scoring import BlockScorer, pool_scores


@dataclass(frozen=True)
class IndexMemShape:
    """The dimensions of a model that an indexer and memory are built for, and their own."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    index_heads: int
    index_dim: int
    memory_dim: int

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @classmethod
    def of(cls, model_config, config: IndexMemConfig = IndexMemConfig()) -> IndexMemShape:
        """The shape for a transformers model config."""
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        return cls(
            layers=model_config.num_hidden_layers, q_heads=heads, kv_heads=model_config.num_key_value_heads,
            head_dim=head_dim, hidden=model_config.hidden_size,
            index_heads=max(1, heads // config.index_head_ratio), index_dim=max(1, head_dim // config.index_dim_ratio),
            memory_dim=max(1, model_config.hidden_size // config.memory_dim_ratio),
        )

    def to_dict(self) -> dict:
        return asdict(self)


class LayerIndexer(nn.Module):
    """One layer's indexer (see the module docstring)."""

    def __init__(self, shape: IndexMemShape) -> None:
        super().__init__()
        self.shape = shape
        self.u_q = nn.Linear(shape.group * shape.head_dim, shape.index_heads * shape.index_dim, bias=False)
        self.u_k = nn.Linear(shape.hidden, shape.index_dim, bias=False)
        self.gate = nn.Linear(shape.hidden, shape.index_heads, bias=False)
        self.q_norm = nn.RMSNorm(shape.index_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(shape.index_dim, eps=1e-6)

    def keys(self, hidden: torch.Tensor) -> torch.Tensor:
        """Indexer keys `[n, d_index]` of tokens with attention inputs `hidden [n, hidden]`."""
        return self.k_norm(self.u_k(hidden))

    def query_map(self, q_proj: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """`u_q(W_q x + b)` per KV group (query head i serves KV head i // group) as one map of the hidden
        state x: weights `[kv_heads, H_i*d_i, hidden]`, bias `[kv_heads, H_i*d_i]`. Differentiable in u_q;
        the frozen projection is read, never trained."""
        s = self.shape
        w = _float_weight(q_proj).reshape(s.kv_heads, s.group * s.head_dim, s.hidden)
        fused = torch.einsum("oc,hcx->hox", self.u_q.weight, w)
        if q_proj.bias is None:
            return fused, fused.new_zeros(s.kv_heads, fused.shape[1])
        return fused, q_proj.bias.detach().float().reshape(s.kv_heads, -1) @ self.u_q.weight.T

    def queries(self, hidden: torch.Tensor, query_map: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Indexer queries `[kv_heads, n, H_index, d_index]` of tokens with attention inputs `hidden [n, hidden]`."""
        s = self.shape
        weight, bias = query_map
        projected = torch.einsum("nc,hoc->hno", hidden, weight) + bias[:, None]
        return self.q_norm(projected.unflatten(-1, (s.index_heads, s.index_dim)))

    def importance(self, hidden: torch.Tensor, query_map: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Importance `[kv_heads, n]` of every token of a sequence, the query set being all of its tokens
        (what training distils)."""
        return causal_importance(self.scores(self.queries(hidden, query_map), self.weights(hidden),
                                             self.keys(hidden)), 0)

    def weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head gates alpha `[n, H_index]` of query tokens with attention inputs `hidden [n, hidden]`."""
        return self.gate(hidden) / math.sqrt(self.shape.index_heads * self.shape.index_dim)

    @staticmethod
    def scores(queries: torch.Tensor, alpha: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """A `[kv_heads, n_q, n_k]` (unmasked) from `queries`, `alpha` and keys `[n_k, d]` or `[kv_heads, n_k, d]`."""
        if keys.dim() == 2:
            z = torch.einsum("hsjd,td->hsjt", queries, keys)
        else:
            z = torch.einsum("hsjd,htd->hsjt", queries, keys)
        return torch.einsum("hsjt,sj->hst", F.relu(z), alpha)


class Indexer(nn.Module):
    """The indexers of every layer of one model."""

    def __init__(self, shape: IndexMemShape) -> None:
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(LayerIndexer(shape) for _ in range(shape.layers))

    # nn.ModuleList types its items as Module: what `layers` holds.
    def layer(self, i: int) -> LayerIndexer:
        """Layer `i`'s indexer."""
        return cast(LayerIndexer, self.layers[i])

    def per_layer(self) -> list[LayerIndexer]:
        """Every layer's indexer, in order."""
        return [cast(LayerIndexer, m) for m in self.layers]


def causal_importance(scores: torch.Tensor, first_query: int) -> torch.Tensor:
    """Max over queries of `scores [heads, n_q, n_k]` whose queries are the keys `first_query..` onward:
    query s sees keys `<= first_query + s`. A key no query sees gets -inf."""
    n_q, n_k = scores.shape[-2], scores.shape[-1]
    rows = first_query + torch.arange(n_q, device=scores.device)
    visible = torch.arange(n_k, device=scores.device)[None, :] <= rows[:, None]
    return scores.masked_fill(~visible, float("-inf")).amax(dim=-2)


def distill_loss(teacher: torch.Tensor, student: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) || softmax(student)) over `valid` keys, summed over keys, mean over heads.
    `teacher`, `student`: `[heads, n]` importances; `valid [n]` masks the sinks (and unseen keys)."""
    t = teacher[:, valid].float().log_softmax(-1)
    s = student[:, valid].float().log_softmax(-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def top_overlap(teacher: torch.Tensor, other: torch.Tensor, valid: torch.Tensor, fraction: float) -> torch.Tensor:
    """Per head, the share of the teacher's top `fraction` of valid keys that `other` also ranks there."""
    t, o = teacher[:, valid], other[:, valid]
    k = max(1, int(round(fraction * t.shape[-1])))
    top_t = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, t.topk(k, dim=-1).indices, True)
    top_o = torch.zeros_like(o, dtype=torch.bool).scatter_(-1, o.topk(k, dim=-1).indices, True)
    return (top_t & top_o).sum(-1).float() / k


class IndexerScorer(BlockScorer):
    """`--method indexmem`: the indexer scores every entry of a layer right after that layer's attention in the
    block's forward, from the block's hidden states, so eviction needs no extra pass.

    The indexer's keys come from hidden states that are gone once their block has passed, so the scorer keeps
    them (`d_index` floats per entry and KV head) aligned with the cache: the prefill loop tells it what each
    eviction kept (`kept`). It therefore scores a cache it builds from the protected prefix on; it cannot
    continue a stored cache (`block_prefill(resume=...)`), whose indexer keys were not stored.
    """

    in_forward = True
    needs_hidden = True
    transient_tokens = 0

    def __init__(self, indexer: Indexer, model: nn.Module, pool_kernel: int = 1, recent_window: int = 0,
                 query_window: int = 0, attention_mix: float = 0.0, attention_window: int = 64) -> None:
        if not 0.0 <= attention_mix <= 1.0:
            raise ValueError(f"attention_mix must lie in [0, 1] (got {attention_mix})")
        # on the model's device (trained weights load on the CPU; a GPU ingest scores on the GPU)
        self.indexer = indexer.to(next(model.parameters()).device).eval().requires_grad_(False)
        self.shape = indexer.shape
        self.pool_kernel = pool_kernel
        self.recent_window = recent_window
        self.query_window = query_window
        self.attention_mix = attention_mix
        self.attention_window = attention_window
        with torch.no_grad():  # U_q o W_q per layer: indexer queries straight from hidden states
            self.query_maps = [ind.query_map(layer.self_attn.q_proj) for layer, ind in
                               zip(decoder_of(model).layers, indexer.per_layer(), strict=True)]
        self.keys: list[list[torch.Tensor] | None] = [None] * self.shape.layers  # per layer, per KV head

    @classmethod
    def for_cache(cls, indexer: Indexer, model: nn.Module, cache: CacheConfig) -> IndexerScorer:
        """The scorer `--method indexmem` evicts with under `cache`'s settings (recent window, attention mix
        over SnapKV's last-64-query window, pooling). Ingest and the memory stage's simulated eviction
        (kvchat.training) both build it here, so the memory is trained on the evictions it makes up for."""
        return cls(indexer, model, cache.indexer_pool_kernel, cache.indexer_recent,
                   attention_mix=cache.attention_mix, attention_window=SNAPKV_QUERIES)

    @property
    def query_rows(self) -> int:
        """The block's last queries whose attention weights are read: the observation window when they are
        mixed in, else one row (weights unread: the recorder's own work stays minimal)."""
        return self.attention_window if self.attention_mix > 0 else 1

    def layer_scores(self, view: LayerView) -> torch.Tensor:
        if view.hidden is None:
            raise ValueError("the indexer needs the layer's hidden states (needs_hidden)")
        s, layer = self.shape, self.indexer.layer(view.layer_idx)
        hidden = view.hidden[0].float()                                    # [q, hidden]: every token of the block
        n_new = hidden.shape[0]
        heads = self._append(view.layer_idx, layer.keys(hidden), view.past)
        first = max(0, n_new - self.query_window) if self.query_window > 0 else 0  # the query set's first row
        queries = layer.queries(hidden[first:], self.query_maps[view.layer_idx])
        alpha = layer.weights(hidden[first:])
        longest = max(k.shape[0] for k in heads)
        out = hidden.new_full((s.kv_heads, longest), float("-inf"))
        for h, keys in enumerate(heads):
            imp = causal_importance(LayerIndexer.scores(queries[h : h + 1], alpha, keys), keys.shape[0] - n_new + first)
            dist = imp[0].softmax(-1)
            if self.attention_mix > 0:
                dist = (1 - self.attention_mix) * dist + self.attention_mix * self._attention(view, h, keys.shape[0])
            out[h, : keys.shape[0]] = dist
        out = pool_scores(out, self.pool_kernel)
        window = min(self.recent_window, n_new)
        for h, keys in enumerate(heads):  # the block's last entries stay: the paper's recent local window
            out[h, keys.shape[0] - window : keys.shape[0]] = float("inf")
        return out

    def _attention(self, view: LayerView, head: int, entries: int) -> torch.Tensor:
        """KV head `head`'s attention from the block's last `attention_window` queries over its `entries`
        entries (SnapKV's observation window, aggregated as kvchat's probe scores are: max over those queries
        and the GQA group's query heads), normalised to sum to one. A ragged layer's weights pad the shorter
        heads' cached part (kvchat.kv.attention)."""
        w = view.weights[head, :, -self.attention_window :].float()         # [group, rows, past + n_new]
        n_new = w.shape[-1] - view.past
        own = entries - n_new
        w = torch.cat([w[..., :own], w[..., view.past :]], dim=-1)
        peak = w.amax(dim=(0, 1))
        return peak / peak.sum().clamp_min(1e-12)

    def _append(self, layer_idx: int, new: torch.Tensor, past: int) -> list[torch.Tensor]:
        """Each head's indexer keys with the block's appended. The first block finds only the protected
        prefix cached, whose keys are never needed (it is always kept): zeros stand in for them."""
        held = self.keys[layer_idx]
        if held is None:
            held = [new.new_zeros(past, new.shape[-1]) for _ in range(self.shape.kv_heads)]
        elif max(k.shape[0] for k in held) != past:
            raise RuntimeError(f"layer {layer_idx}: the indexer holds keys for {[k.shape[0] for k in held]} "
                               f"entries, the cache {past}: it can only score a cache it built")
        heads = [torch.cat([k, new]) for k in held]
        self.keys[layer_idx] = heads
        return heads

    def kept(self, layer_idx: int, index: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """Called after layer `layer_idx` kept entries `index` (per head): keep those entries' keys too."""
        held = self.keys[layer_idx]
        if held is None:
            raise RuntimeError(f"layer {layer_idx}: entries kept before the indexer scored it")
        self.keys[layer_idx] = [k[i.to(k.device)] for k, i in zip(held, index, strict=True)]


def _float_weight(linear: nn.Module) -> torch.Tensor:
    """A projection's weight `[out, in]` in float32: an `nn.Linear`'s own, or what an int8/int4 weight module
    (model.int8_weights, model.int4_weights: a model loaded with `--weights`) stands for (its `float_weight`)."""
    dequantized = getattr(linear, "float_weight", None)
    # an nn.Linear's `weight` is a Parameter; nn.Module types the attributes it does not know as Tensor | Module
    return dequantized() if callable(dequantized) else cast(torch.Tensor, linear.weight).detach().float()
