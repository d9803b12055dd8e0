"""Stage 1 of `kvchat train-indexer`: the indexer distilled from the teacher's per-key importance.

The loss is `KL(softmax(teacher) || softmax(indexer))` per layer and KV head over every key but the system
prompt's (the sinks, which ingest never evicts): the indexer only has to rank keys as the teacher does, since
eviction keeps a top-k (kvchat.kv.indexer). Held out, it is judged by how much of the teacher's top keys it
also ranks on top, beside a SnapKV-like last-queries score and chance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.kv.causal_lm import decoder_of
from kvchat.kv.indexer import Indexer, distill_loss, top_overlap
from kvchat.model.llm import LoadedModel
from kvchat.training.teacher import Captured


def indexer_loss(indexer: Indexer, lm: LoadedModel, item: Captured) -> torch.Tensor:
    """Mean over layers of the distillation KL on one chunk."""
    valid = _evictable(item)
    losses = []
    for layer, ind, x, teacher in zip(decoder_of(lm.model).layers, indexer.per_layer(), item.hidden, item.teacher,
                                      strict=True):  # fmt: skip
        student = ind.importance(x.float(), ind.query_map(layer.self_attn.q_proj))
        losses.append(distill_loss(teacher, student, valid))
    return torch.stack(losses).mean()


@torch.no_grad()
def evaluate_indexer(indexer: Indexer, lm: LoadedModel, held: Sequence[Captured], fraction: float) -> dict:
    """Held-out agreement with the teacher: top-`fraction` overlap (indexer, SnapKV-like, random) and KL."""
    if not held:
        return {}
    ours, snap, rand, kls = [], [], [], []
    generator = torch.Generator().manual_seed(0)
    for item in held:
        valid = _evictable(item)
        if item.snapkv is None:
            raise ValueError("a held-out chunk without its SnapKV-like scores (teacher.capture(with_snapkv=True))")
        for i, (layer, ind) in enumerate(zip(decoder_of(lm.model).layers, indexer.per_layer(), strict=True)):
            x = item.hidden[i].float()
            student = ind.importance(x, ind.query_map(layer.self_attn.q_proj))
            teacher = item.teacher[i]
            ours.append(top_overlap(teacher, student, valid, fraction).mean())
            snap.append(top_overlap(teacher, item.snapkv[i], valid, fraction).mean())
            chance = torch.rand(teacher.shape, generator=generator).to(teacher.device)
            rand.append(top_overlap(teacher, chance, valid, fraction).mean())
            kls.append(distill_loss(teacher, student, valid))
    mean = lambda xs: round(float(torch.stack(xs).mean()), 4)  # noqa: E731
    return {"top_overlap": mean(ours), "snapkv_like_top_overlap": mean(snap), "random_top_overlap": mean(rand),
            "kl": mean(kls), "fraction": fraction, "held_out_chunks": len(held)}


def _evictable(item: Captured) -> torch.Tensor:
    """`[n]`: every key of the chunk but the system prompt's (the sinks, which ingest never evicts)."""
    return torch.arange(item.teacher.shape[-1], device=item.teacher.device) >= item.chunk.sink
