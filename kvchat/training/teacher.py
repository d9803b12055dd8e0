"""What the frozen model says: each layer's attention over a training chunk, as the model itself computes it.

The indexer is distilled from the model's attention logits and the memory from its attention outputs, so the
teacher must be the attention the model runs, whatever its family: attention biases (Qwen2), q/k norms (Qwen3,
Gemma3), the query scale (Gemma2/3), the logit softcap (Gemma2), per-layer RoPE (Gemma3's local layers). Nothing
is rebuilt here from the projections: a layer's own attention module runs on its recorded input with the
position embeddings the model gave it; kvchat's attention hands over the queries, the scale and the softcap
the module passed it (a `Recorder`), and the keys and values come from the cache slot the module writes them
to. One full-attention forward per chunk records every layer's input; layers are then taught side by side and
independently (teacher forcing: each layer's inputs come from the full pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.kv.attention import LayerView, attention_logits
from kvchat.kv.causal_lm import decoder_of
from kvchat.kv.methods import SNAPKV_QUERIES
from kvchat.model.llm import LoadedModel
from kvchat.training.chunks import Chunk

Rope = tuple[torch.Tensor, torch.Tensor]  # the (cos, sin) `[1, n, head_dim]` a model passes a layer's attention


@dataclass
class Captured:
    """One chunk as the frozen model saw it: every layer's attention input and position embeddings, and the
    teacher's importance."""

    chunk: Chunk
    hidden: list[torch.Tensor]   # per layer [n, hidden], float16
    rope: list[Rope]             # per layer, positions 0..n-1 (layers of one kind share theirs)
    teacher: torch.Tensor        # [layers, kv_heads, n]
    snapkv: torch.Tensor | None  # [layers, kv_heads, n]: mean attention of the last 64 queries (held-out only)


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention over a sequence at positions 0..n-1, as the model computes it: the queries of the
    last `rows` tokens, every token's keys and values (`[1, heads, ., head_dim]`, the queries and keys after
    the layer's norms and RoPE) and what the module passed attention (`scale`, `softcap`)."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scale: float
    softcap: float | None

    def logits(self) -> torch.Tensor:
        """Causal attention logits `[kv_heads, group, rows, n]` (-inf on later keys), as kvchat's attention
        computes them (kvchat.kv.attention.attention_logits: scale, then softcap)."""
        rows, n = self.queries.shape[2], self.keys.shape[2]
        positions = torch.arange(n, device=self.keys.device)
        visible = positions[None, :] <= positions[n - rows:, None]
        logits = attention_logits(self.queries, self.keys, self.scale, self.softcap)
        return logits.masked_fill(~visible, float("-inf"))


@torch.inference_mode()
def capture(lm: LoadedModel, chunk: Chunk, *, with_snapkv: bool = False) -> Captured:
    """Run `chunk` through the frozen model (full causal attention) and derive the teacher's targets: per layer
    and KV head, each key's largest logit over the chunk's queries and the KV head's group of query heads."""
    model = lm.model
    captured: dict[int, tuple[torch.Tensor, Rope]] = {}

    def stash(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        captured[module.layer_idx] = (hidden[0], kwargs["position_embeddings"])

    handles = [layer.self_attn.register_forward_pre_hook(stash, with_kwargs=True) for layer in decoder_of(model).layers]
    try:
        model(input_ids=chunk.ids[None], use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    hidden = [captured[i][0].float() for i in range(len(decoder_of(model).layers))]
    rope = [captured[i][1] for i in range(len(decoder_of(model).layers))]
    teacher, snap = [], []
    for index, x in enumerate(hidden):
        logits = layer_attention(model, index, x, rope[index]).logits()   # [kv, group, n, n]
        teacher.append(logits.amax(dim=(1, 2)))
        if with_snapkv:
            window = logits[:, :, -SNAPKV_QUERIES:].softmax(-1)
            snap.append(window.mean(dim=2).amax(dim=1))
    return Captured(chunk, [x.half() for x in hidden], rope, torch.stack(teacher),
                    torch.stack(snap) if with_snapkv else None)


@torch.no_grad()
def layer_attention(model, layer_idx: int, hidden: torch.Tensor, rope: Rope, rows: int | None = None, *,
                    rotate: bool = True) -> LayerAttention:
    """Layer `layer_idx`'s attention module run on `hidden [n, hidden]`, its input at positions 0..n-1 (`rope`:
    the position embeddings the model gave it for at least those positions), keeping the queries of the last
    `rows` tokens (all: None). `rotate=False` runs it without RoPE: the queries and keys the latent memory
    reads and writes (kvchat.kv.latent), which carry no position. The module runs in its own dtype (bfloat16 on
    a GPU); what it hands over comes back in float32, as the stages compute. Needs kvchat's attention on the
    model."""
    module = decoder_of(model).layers[layer_idx].self_attn
    dtype = next(module.parameters()).dtype
    n = hidden.shape[0]
    cos, sin = (part[:, :n] for part in rope)
    if not rotate:
        cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    recorder, entries = _LastView(rows), _Entries()
    module(hidden_states=hidden[None].to(dtype), position_embeddings=(cos, sin), attention_mask=None,
           past_key_values=entries, kvchat_recorder=recorder)
    view, keys, values = recorder.view, entries.keys, entries.values
    if view is None or view.scale is None or keys is None or values is None:
        raise RuntimeError("the model's attention is not kvchat's (kvchat.model.llm.load_model attaches it)")
    return LayerAttention(view.queries.float(), keys.float(), values.float(), view.scale, view.softcap)


@dataclass
class _LastView:
    """A `Recorder` (kvchat.kv.attention) that keeps the view it is given."""

    query_rows: int | None
    view: LayerView | None = None

    def record(self, view: LayerView) -> None:
        self.view = view


class _Entries:
    """Stands where an attention module hands its keys and values to the cache (`past_key_values.update`),
    keeping them as they are: after the layer's norms and RoPE, as a cache holds them."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = keys, values
        return keys, values
