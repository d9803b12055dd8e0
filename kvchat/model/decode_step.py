"""One answer token through a Llama-family model in few torch calls: the decode step `llm.generate` runs.

A decode step on the CPU reads every weight once for one token; what it costs beyond that read is per-call
overhead, and transformers' modules spend about 90 torch calls per layer on one token (norms in seven
operations, three projections, rotary embedding per tensor, views and transposes). `DecodeStep` computes the
same layer in about 25: `torch.rms_norm`, one projection for the query, key and value rows together and one
for the gate and up rows together (their weights are put side by side once, in one tensor each, and the
model's own Linear modules keep views of it, so memory does not grow and the model's forward is unchanged),
the rotary embedding on query and key heads at once (a roll, the sign carried by the sine), the entries written
straight into each layer's buffers (`EpisodeCache.append_token`: none of `update`'s per-layer bookkeeping), then
kvchat's `attend`.

It runs only where it computes what the model's forward computes: a Llama-architecture model (RMSNorm, SiLU
MLP, no biases, RoPE from the model's own rotary module), one token, a cache of uniform full-precision layers
without a latent memory or tracked origins, no recorder. Anything else goes through the model's forward
(`kv/forward.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.kv import backends, families
from kvchat.kv.attention import attend
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.layers import UniformLayer
from kvchat.model.cuda_graph_step import CudaGraphStep, graphable
from kvchat.model.int4_weights import Int4Linear, stackable
from kvchat.model.int4_weights import product as int4_product
from kvchat.model.int8_weights import Int8Linear

_log = logging.getLogger(__name__)

FAMILIES = ("llama",)
# (layer, query, key, value, scale) -> the layer's attention output, the token's key and value stored
AttendLayer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class _Projection:
    """Several Linear layers with the same input as one matrix product: their weights (and int8 scales) stacked
    into one tensor, the modules' own weights rebound to views of it. int4 weights stack the same way where the
    kernel's packed layout allows it (`int4_weights.stackable`), but their scales and offsets, which the kernel
    reads only as one contiguous tensor, are stacked as a copy (a fifth of the packed weights' bytes); int4 parts
    that do not stack are multiplied one by one."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.kind = type(modules[0])
        self.parts = None
        if self.kind is Int4Linear and not stackable([m.out_features for m in modules]):
            self.parts = [(m.weight, m.scale_zero) for m in modules]
            return
        names = ("weight", "scale") if self.kind is Int8Linear else ("weight",)
        self.tensors = []
        for name in names:
            stacked = torch.cat([getattr(m, name).detach() for m in modules])
            start = 0
            for module in modules:
                rows = getattr(module, name).shape[0]
                view = stacked[start : start + rows]
                if isinstance(getattr(module, name), nn.Parameter):
                    getattr(module, name).data = view
                else:
                    setattr(module, name, view)
                start += rows
            self.tensors.append(stacked)
        if self.kind is Int4Linear:  # [groups, out, 2]: stacked along the output rows
            self.tensors.append(torch.cat([m.scale_zero for m in modules], dim=1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([int4_product(x, *part) for part in self.parts], dim=-1)
        if self.kind is Int8Linear:
            return _int8(x, *self.tensors)
        if self.kind is Int4Linear:
            return int4_product(x, *self.tensors)
        return F.linear(x, self.tensors[0])


def _linear(module: nn.Module):
    """`module`'s product without the module call: F.linear for a Linear, the int8 or int4 kernel for an
    Int8Linear or Int4Linear (left in bfloat16, as `_int8`)."""
    if isinstance(module, Int8Linear):
        return lambda x: _int8(x, module.weight, module.scale)
    if isinstance(module, Int4Linear):
        return lambda x: int4_product(x, module.weight, module.scale_zero)
    return lambda x: F.linear(x, module.weight, module.bias)


def _int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`Int8Linear`'s product of one token `x [1, in]` on bfloat16 activations, left in bfloat16 `[1, out]`: the
    step's next operation on it computes in float32 (type promotion upcasts exactly, as Int8Linear's `.to` does)."""
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), weight, scale)


class DecodeStep:
    """Feeds one token to `model` on top of an `EpisodeCache`, as `kv.forward.forward` does, in fewer calls."""

    def __init__(self, model: nn.Module, *, cuda_graphs: bool = True) -> None:
        config = model.config
        self.model, self.config = model, config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.rotary = model.model.rotary_emb
        # A dynamic RoPE (NTK "dynamic") recomputes its frequencies from the position on the host: not in a graph.
        self.cuda_graphs = cuda_graphs and "dynamic" not in str(getattr(self.rotary, "rope_type", "default"))
        self._graph: CudaGraphStep | None = None
        half = self.head_dim // 2  # rotate_half(x) == roll(x, half) with the first half negated: sin carries the sign
        weight = model.model.embed_tokens.weight
        self._sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(weight.device, weight.dtype)
        self._embedding, self._head = weight, _linear(model.lm_head)
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm, _Projection([attn.q_proj, attn.k_proj, attn.v_proj]), attn.scaling,
                _linear(attn.o_proj), layer.post_attention_layernorm, _Projection([mlp.gate_proj, mlp.up_proj]),
                _linear(mlp.down_proj),
            ))

    @classmethod
    def for_model(cls, model: nn.Module) -> DecodeStep | None:
        """The decode step of `model`, or None when the model is not one it computes exactly."""
        config = model.config
        if (getattr(config, "model_type", None) not in FAMILIES or getattr(config, "hidden_act", None) != "silu"
                or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
                or (getattr(config, "pretraining_tp", 1) or 1) != 1 or model.training):
            return None
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
            return None
        for layer in inner.layers:
            linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
                       layer.mlp.up_proj]
            if len({type(m) for m in linears}) != 1 or type(linears[0]) not in (nn.Linear, Int8Linear, Int4Linear):
                return None
        return cls(model)

    @staticmethod
    def applies(cache: EpisodeCache, ids: torch.Tensor) -> bool:
        """Whether this step computes what the model's forward would for `ids` on `cache`."""
        return (ids.shape[-1] == 1 and cache.memory is None and cache.origins is None
                and all(type(layer) is UniformLayer and layer.is_initialized for layer in cache.layers))

    @torch.inference_mode()
    def __call__(self, cache: EpisodeCache, ids: torch.Tensor) -> torch.Tensor:
        """Logits `[1, 1, vocab]` of the token after `ids [1, 1]`; the token is appended to `cache`. On a GPU the
        step is replayed as one CUDA graph where the cache's buffers have room for the token
        (kvchat.model.cuda_graph_step; `cuda_graphs=False` turns that off)."""
        families.check_context(self.config, cache.next_position + 1, self.config.name_or_path or "the model",
                               what="the conversation with this question and answer")
        if self.cuda_graphs and ids.is_cuda and self._torch_attention(ids.device) and graphable(cache):
            logits = self._replayed(cache, ids)
            if logits is not None:
                return logits
        position = torch.full((1, 1), cache.next_position, dtype=torch.long, device=ids.device)

        def attend_cached(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          scale: float) -> torch.Tensor:
            keys, values = cache.append_token(key, value, index)
            return attend(query, keys, values, None, scale)

        logits = self.forward(ids.view(1), position, attend_cached)
        cache.note_decoded()
        return logits

    def _replayed(self, cache: EpisodeCache, ids: torch.Tensor) -> torch.Tensor | None:
        """The step as a CUDA graph's replay; None, with graphs off for this step from then on, where recording or
        replaying one fails (a kernel a graph cannot hold): the eager step then feeds the token, which the failed
        graph has not made live in the cache."""
        if self._graph is None:
            self._graph = CudaGraphStep(self)
        try:
            return self._graph(cache, ids)
        except RuntimeError as exc:
            _log.warning("kvchat: answering without CUDA graphs: %s", exc)
            self.cuda_graphs, self._graph = False, None
            return None

    def _torch_attention(self, device: torch.device) -> bool:
        """Whether decode attention is torch's here: with the flashinfer extra, it runs flashinfer's, un-graphed, as
        `attention_backend` reports."""
        return backends.decode_backend(device, self._embedding.dtype) == "torch"

    def forward(self, ids: torch.Tensor, position: torch.Tensor, attend_layer: AttendLayer) -> torch.Tensor:
        """The step's computation: logits `[1, 1, vocab]` of token `ids [1]` at `position [1, 1]`, each layer's
        attention through `attend_layer(layer, query, key, value, scale)`, which also stores the token's key and
        value `[1, kv_heads, 1, D]` and returns `[1, heads, 1, D]`."""
        hidden = F.embedding(ids, self._embedding)                              # [1, H]: one token, no batch axis
        cos, sin = self.rotary(hidden, position)                                 # [1, 1, D]
        cos, sin = cos[0, 0], sin[0, 0] * self._sign
        half, q_rows, kv_rows = self.head_dim // 2, self.heads * self.head_dim, self.kv_heads * self.head_dim
        rotated_heads = self.heads + self.kv_heads
        for index, (norm_in, qkv, scale, o_proj, norm_post, gate_up, down) in enumerate(self.layers):
            projected = qkv(_rms_norm(hidden, norm_in))[0]                       # [q_rows + 2 kv_rows]
            qk = projected[: q_rows + kv_rows].view(rotated_heads, self.head_dim)
            qk = qk * cos + qk.roll(half, -1) * sin                              # in the cos's dtype, the model's
            query = qk[: self.heads].view(1, self.heads, 1, self.head_dim)
            key = qk[self.heads :].view(1, self.kv_heads, 1, self.head_dim)
            value = projected[q_rows + kv_rows :].view(1, self.kv_heads, 1, self.head_dim)  # the cache casts it
            hidden = hidden + o_proj(attend_layer(index, query, key, value, scale).reshape(1, q_rows))
            gate, up = gate_up(_rms_norm(hidden, norm_post)).to(hidden.dtype).chunk(2, dim=-1)
            hidden = hidden + down(F.silu(gate) * up)
        return self._head(_rms_norm(hidden, self.model.model.norm)).to(hidden.dtype).view(1, 1, -1)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """A Llama RMSNorm as the module computes it (in float32, the weight applied in the input's dtype)."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm.weight * torch.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon).to(x.dtype)
