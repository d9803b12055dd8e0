"""What kvchat reads of a causal language model's modules, by the names transformers gives them.

kvchat runs on any module that takes transformers' forward call and names its decoder `model`, with `layers`,
`rotary_emb`, `embed_tokens` and `norm` under it, and its settings `config`: kvchat's own Llama
(kvchat.model.native_llama) and transformers' models of other families alike. torch types a module's submodules
and attributes as `Tensor | Module`; these accessors give them their types once, here, instead of at every use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:  # torch is not imported by what only reads settings (the features' registry, the CLI's start)
    from torch import nn
    from torch.utils.hooks import RemovableHandle


class ModelConfig(Protocol):
    """A model's config (transformers' or kvchat.model.native_llama's), by the attributes both have."""

    name_or_path: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int


class SelfAttention(Protocol):
    """A decoder layer's attention module (`self_attn`): what kvchat calls, hooks and reads of it."""

    layer_idx: int
    q_proj: nn.Linear

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def register_forward_pre_hook(self, hook: Callable[..., Any], *, with_kwargs: bool = False) -> RemovableHandle:
        ...


class DecoderLayer(Protocol):
    """One decoder layer: its attention module (the rest kvchat leaves to the layer's own forward)."""

    self_attn: SelfAttention


class Decoder(Protocol):
    """A causal LM's decoder stack (`model.model`), as transformers and kvchat's Llama name it."""

    embed_tokens: nn.Module
    layers: Sequence[DecoderLayer]
    norm: nn.Module
    rotary_emb: nn.Module


def decoder_of(model: nn.Module) -> Decoder:
    """The decoder stack of `model` (its `model` attribute)."""
    return cast(Decoder, model.model)


def config_of(model: nn.Module) -> ModelConfig:
    """`model`'s config (kvchat.kv.families reads the attributes only some families have)."""
    return cast(ModelConfig, model.config)
