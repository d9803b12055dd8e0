"""What an answer's context holds, measured apart from the reader that decodes it.

A 135M reader scores every memory system alike on token F1, so evaluation also asks two questions of the context an
answer is decoded from (kvchat.eval.memory_metrics turns them into evidence recall, gold-answer NLL and oracle-gain
recovery):
- how likely the reader finds a given continuation (the gold answer) right after the answer's prompt, teacher forced
  on the same cache the answer was decoded from (`continuation_nll`);
- which turns of the history the first answer token can attend to, token by token, per layer and KV head (resident,
  read back from pages, placed or prefilled: `kvchat.answer.sources.TurnPresence` counts them).
A `Probe` carries the continuation in and both answers out of `Session.ask` and `RagSession.ask`; asking with one
costs one forward of the continuation's tokens once the answer is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvchat.kv.attention import Recorder
from kvchat.kv.cache import Checkpoint, EpisodeCache
from kvchat.kv.forward import forward


@dataclass
class Probe:
    """A continuation to score after an answer's prompt; the answer fills in `nll` and (where the cache's turns are
    known) `present`."""

    continuation: Sequence[int]  # token ids scored after the prompt (a gold answer)
    nll: float | None = None     # their mean negative log-likelihood in nats, teacher forced
    # history turn index -> its tokens the first answer token can attend to, per layer and KV head `[layers * heads]`;
    # None where the cache does not say which turns it holds (a file written before turn spans, a caller's text)
    present: dict[int, torch.Tensor] | None = None


def continuation_nll(model: torch.nn.Module, cache: EpisodeCache, held: Checkpoint, last: torch.Tensor,
                     continuation: Sequence[int], recorder: Recorder | None = None) -> float:  # fmt: skip
    """Mean negative log-likelihood of `continuation` after a prompt whose last token is `last` (`[1, 1]`), on
    `cache` rolled back to `held` (everything the prompt fed but its last token): one forward of that token and the
    continuation but its last, whose logits score each continuation token. `recorder` sees that forward; its first
    query is the one that chose the first answer token. The cache holds those tokens afterwards (roll it back)."""
    if not continuation:
        raise ValueError("an empty continuation has no likelihood")
    cache.rollback(held)
    target = torch.tensor([list(continuation)], dtype=last.dtype, device=last.device)
    logits = forward(model, cache, torch.cat([last, target[:, :-1]], dim=-1), recorder=recorder,
                     last_logits_only=False)  # fmt: skip
    logprobs = logits[0].float().log_softmax(-1)
    return float(-logprobs.gather(-1, target[0].unsqueeze(-1)).mean())


def prompt_held(cache: EpisodeCache, prompt_tokens: int) -> Checkpoint:
    """The mark of a cache that was empty before a prompt of `prompt_tokens` was fed, at that prompt's last token but
    one (a fresh cache has no mark of its own to extend: `EpisodeCache.checkpoint` of an empty cache holds no heads)."""
    lengths = tuple(tuple([prompt_tokens - 1] * len(layer.lengths)) for layer in cache.layers)
    return Checkpoint(lengths, prompt_tokens - 1)
