"""Answering one question from a cache with a latent memory three ways, for the memory tests."""

from __future__ import annotations

import torch

from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward


def logits_with_shut_and_without_memory(
    model: torch.nn.Module, cache: EpisodeCache, question: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits of `question` on `cache` with its memory, with every gate shut, and with no memory; the
    cache is rolled back after each and left without its memory."""
    mark = cache.checkpoint()
    with_memory = forward(model, cache, question)
    cache.rollback(mark)
    for gate in cache.memory.weights.gate:
        gate.bias.data.fill_(-1e4)
    shut = forward(model, cache, question)
    cache.rollback(mark)
    cache.memory = None
    plain = forward(model, cache, question)
    cache.rollback(mark)
    return with_memory, shut, plain
