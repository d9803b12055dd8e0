"""A model's dimensions as the KV core and the memory estimate see them, read from the model once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.kv.causal_lm import config_of


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model."""

    weight_bytes: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype_bytes: int  # bytes per number of the model's dtype: keys, values and activations are stored in it

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        cfg = config_of(model)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        tensors = [*model.parameters(), *model.buffers()]
        return cls(
            weight_bytes=sum(t.numel() * t.element_size() for t in tensors),
            layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            hidden=cfg.hidden_size,
            dtype_bytes=next(model.parameters()).element_size(),
        )
