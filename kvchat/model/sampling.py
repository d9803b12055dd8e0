"""The choice of each answer token from the model's scores: greedy, or sampled with a temperature and top-p, after a
repetition penalty over the answer's own tokens.

The penalty and the warpers are transformers' logits processors (CTRL's repetition penalty, temperature, nucleus
top-p); OpenAI's frequency and presence penalties, which transformers lacks, are subtracted here. Penalties count only
the answer's tokens, not the question's or the history's: an answer may use the words it is asked about, and what
they stop is an answer repeating itself ("a mix of a mix of a mix ..."). A sampled answer draws from its own
generator, seeded by `Sampling.seed` (the same seed, question and cache give the same answer) or afresh.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import cast

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from kvchat.config import Sampling


class Sampler:
    """Chooses answer tokens as `sampling` says; one per answer (a sampled answer's draws follow its seed)."""

    def __init__(self, sampling: Sampling = Sampling()) -> None:
        self.sampling = sampling
        processors: list = []
        if sampling.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
        self.greedy = sampling.temperature == 0.0
        if not self.greedy:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_p < 1.0:
                processors.append(TopPLogitsWarper(sampling.top_p))
        self.processors = LogitsProcessorList(processors)
        self.seed = (secrets.randbits(63) if sampling.seed is None else sampling.seed) if not self.greedy else None
        self._generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None

    @property
    def plain(self) -> bool:
        """Greedy with no penalty: the argmax of the scores as they come."""
        s = self.sampling
        return self.greedy and not self.processors and not s.frequency_penalty and not s.presence_penalty

    def choose(self, scores: torch.Tensor, answer: Sequence[int]) -> int:
        """The next token from `scores` `[vocab]`, the answer so far being `answer`'s tokens."""
        if self.plain:
            return int(scores.argmax())
        scores = scores.detach().float().unsqueeze(0)
        ids = torch.tensor([list(answer)], dtype=torch.long, device=scores.device).reshape(1, -1)
        s = self.sampling
        if answer and (s.frequency_penalty or s.presence_penalty):
            counts = torch.bincount(ids[0], minlength=scores.shape[-1])[: scores.shape[-1]].float()
            scores = scores - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()
        scores = self.processors(cast(torch.LongTensor, ids), scores)  # transformers types its ids LongTensor
        if self.greedy:
            return int(scores.argmax())
        probabilities = torch.softmax(scores, dim=-1).cpu()  # drawn on the CPU: one generator for every device
        return int(torch.multinomial(probabilities[0], 1, generator=self._generator))
