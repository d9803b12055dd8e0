"""Running tokens through the model on top of an EpisodeCache, at the cache's logical positions.

`forward` is the one entry: it feeds any model taking transformers' forward call (kvchat's own Llama,
`kvchat.model.native_llama`, or transformers' model of another family). `feeding` is what it does around the
model's layers: the context check, the positions, the keywords kvchat's attention takes, and the cache's advance
after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvchat.kv import families
from kvchat.kv.attention import Recorder
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.causal_lm import SelfAttention, config_of, decoder_of


@torch.inference_mode()
def forward(
    model: torch.nn.Module,
    cache: EpisodeCache,
    ids: torch.Tensor,
    *,
    recorder: Recorder | None = None,
    last_logits_only: bool = True,
) -> torch.Tensor:
    """Feed `ids` [1, n] through `model` (transformers' forward call); returns logits (of the last token only, by
    default) and advances the cache.

    Position ids are passed explicitly: after eviction the physical cache is shorter than the logical
    position, and transformers would otherwise infer positions from the physical length. A `recorder`
    sees every layer's attention (kvchat.kv.attention.LayerView); one with `needs_hidden` also gets the
    layers' attention inputs. A cache with a latent memory has it read by every layer's attention.
    """
    with feeding(model, cache, ids, recorder) as (positions, extra):
        out = model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1 if last_logits_only else 0,
            **extra,
        )
    return out.logits


@contextmanager
def feeding(
    model: torch.nn.Module, cache: EpisodeCache, ids: torch.Tensor, recorder: Recorder | None = None
) -> Iterator[tuple[torch.Tensor, dict]]:
    """One forward of `ids [1, n]` on `cache`: checks the model's context, yields the tokens' position ids `[1, n]`
    and the keywords every layer's attention gets (kvchat.kv.attention.kvchat_attention: the recorder, the latent
    memory's readout, the attention modules' inputs for a recorder with `needs_hidden`), and advances the cache
    when the forward returns."""
    n = ids.shape[-1]
    families.check_context(config_of(model), cache.next_position + n, config_of(model).name_or_path or "the model",
                           what="the conversation with this question and answer")
    positions = cache.position_ids(n).to(ids.device)
    extra: dict = {}
    if recorder is not None:
        extra["kvchat_recorder"] = recorder
    if cache.memory is not None:  # a latent memory of evicted entries adds its readout (kvchat.kv.latent)
        extra["kvchat_memory"] = cache.memory.readout(decoder_of(model).rotary_emb, positions)
    with _hidden_states(model, getattr(recorder, "needs_hidden", False)) as hidden:
        if hidden is not None:
            extra["kvchat_hidden"] = hidden
        yield positions, extra
    cache.advance(n)


@contextmanager
def _hidden_states(model: torch.nn.Module, wanted: bool) -> Iterator[dict[int, torch.Tensor] | None]:
    """While inside, every attention module's input hidden states land in the yielded dict by layer index
    (torch forward pre-hooks: a public extension point; the model's code is untouched)."""
    if not wanted:
        yield None
        return
    captured: dict[int, torch.Tensor] = {}

    def stash(module: SelfAttention, args: tuple, kwargs: dict) -> None:
        captured[module.layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    handles = [layer.self_attn.register_forward_pre_hook(stash, with_kwargs=True) for layer in decoder_of(model).layers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
