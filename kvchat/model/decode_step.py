"""One answer token through kvchat's Llama with none of a forward's per-layer bookkeeping: the decode step
`llm.generate` runs.

The step is the native forward's own computation (`NativeLlama.run`: the same layers, projections, RoPE and norms)
for one token; only how each layer stores and attends differs: the token's key and value written straight into the
layer's buffers (`EpisodeCache.append_token`: none of `update`'s bookkeeping, the peaks noted once after the last
layer), then kvchat's `attend` over them (no recorder, mask or memory to dispatch on). On a GPU it is replayed as
one CUDA graph (kvchat.model.cuda_graph_step, which builds on it).

It runs only where that is what the forward computes: a `NativeLlama` (every Llama kvchat loads), one token, a
cache of uniform full-precision layers without a latent memory or tracked origins, no recorder. Anything else goes
through the forward (`kv/forward.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvchat.kv import families
from kvchat.kv.attention import attend
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.layers import UniformLayer
from kvchat.model.native_llama import Attend, Attention, NativeLlama


class DecodeStep:
    """Feeds one token to `model` on top of an `EpisodeCache`, as `kv.forward.forward` does, without its per-layer
    bookkeeping."""

    def __init__(self, model: NativeLlama) -> None:
        self.model, self.config = model, model.config

    @classmethod
    def for_model(cls, model: nn.Module) -> DecodeStep | None:
        """The decode step of `model`, or None when it is not kvchat's Llama (another family: its forward runs)."""
        return cls(model) if isinstance(model, NativeLlama) and not model.training else None

    @staticmethod
    def applies(cache: EpisodeCache, ids: torch.Tensor) -> bool:
        """Whether this step computes what the model's forward would for `ids` on `cache`."""
        return (ids.shape[-1] == 1 and cache.memory is None and cache.origins is None
                and all(type(layer) is UniformLayer and layer.is_initialized for layer in cache.layers))

    def check_context(self, cache: EpisodeCache) -> None:
        """Refuse a token a sliding-window layer would not see the conversation whole with (as the forward does)."""
        families.check_context(self.config, cache.next_position + 1, self.config.name_or_path or "the model",
                               what="the conversation with this question and answer")

    @torch.inference_mode()
    def __call__(self, cache: EpisodeCache, ids: torch.Tensor) -> torch.Tensor:
        """Logits `[1, 1, vocab]` of the token after `ids [1, 1]`; the token is appended to `cache`."""
        self.check_context(cache)
        position = torch.full((1, 1), cache.next_position, dtype=torch.long, device=ids.device)

        def appended(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float) -> torch.Tensor:
            keys, values = cache.append_token(key, value, index)
            assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)  # uniform layers: `fits`
            return attend(query, keys, values, None, scale).transpose(1, 2)

        logits = self.run(ids.view(1), position, appended)
        cache.note_decoded()
        return logits

    def run(self, ids: torch.Tensor, position: torch.Tensor, attend_layer: Attend) -> torch.Tensor:
        """Logits `[1, 1, vocab]` of token `ids [1]` at `position [1, 1]`, each layer's attention through
        `attend_layer(layer, query, key, value, scale)`, which stores the token's key and value
        `[1, kv_heads, 1, D]` and returns its attention `[1, 1, heads, D]`."""

        def attention(module: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return module.attend_with(x, cos, sin, attend_layer)

        return self.model.run(ids, position, attention)
