"""Receipts: which turns of the history an answer drew on, by the attention its tokens paid them.

At ingest every turn's token range is recorded (`history_tokens`, stored in each episode file's metadata as
`turns`): an episode cache holds the history (`--method routed`: the episode's own turns) at its positions,
each entry carrying its original position (`pos` tensors; a compacted cache's, re-rotated to 0..n-1, in `orig`
tensors beside them), so a cached entry belongs to the turn whose range holds it. Turns recalled for a question
(`--method recall`) are prefilled as text after the cache; their tokens belong to their turns too
(`kvchat.answer.recall.recalled_spans`). While an answer is decoded a `SourceRecorder` sees each forward that picks an
answer token (the question's last query, then every decode step) and adds, per layer (the upper ones: lower layers
attend by position more than by content) and KV head, the attention each resident, retrieved (IceCache) or recalled
entry gets to its turn. The turns with the most attention are the answer's sources; a turn's share is of the
attention paid to the history's turns (the system prompt, the question and the answer so far are left out: an
attention sink would dwarf everything else), `kept_tokens` says how much of the turn the episode's cache still
holds, averaged over layers and KV heads, and `recalled` whether its text was recalled for the question.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass

import torch

from kvchat.answer.grounding import quote_span
from kvchat.history.spans import TurnSpan
from kvchat.kv.attention import LayerView
from kvchat.kv.cache import EpisodeCache


@dataclass(frozen=True)
class Source:
    """A turn an answer drew on (`kvchat ask --sources`)."""

    turn: int                 # 0-based index in the history
    turn_id: str | None
    speaker: str
    time: str | None
    quote: str
    attention_share: float    # of the attention the answer paid to the history's turns
    kept_tokens: int          # of the turn's tokens the episode cache holds (mean over layers and KV heads)
    tokens: int               # the turn's tokens (in the cache's history; a turn only recalled: as recalled)
    recalled: bool = False    # its text was recalled for the question (--method recall) and prefilled

    def to_dict(self) -> dict:
        return asdict(self)


class SourceRecorder:
    """A `kvchat.kv.attention.Recorder` summing, over the forwards it is passed to, the attention each turn's
    entries get from the forward's last `query_rows` queries (those that chose answer tokens), over the layers from
    `first_layer` up, every KV head and query head.

    The cache's entries when the recorder is made belong to the turns their original positions fall in: the
    positions they are rotated for, or `origins` (per layer and KV head, each entry's original position in cache
    order) where compaction moved them. Tokens fed afterwards (recalled turns, the question, the answer) belong
    to no stored turn, except those of `recalled`: turns prefilled as text right after the cache, their
    `[start, end)` counted from its first token (`kvchat.answer.recall.recalled_spans`). `spans` are then the stored
    turns followed by the recalled turns the cache does not hold; `recalled` the indices of recalled turns among
    them."""

    query_rows = 1  # the last queries of a forward whose attention counts (`Session` sets the answer's)

    def __init__(self, cache: EpisodeCache, spans: Sequence[TurnSpan], first_layer: int = 0, *,
                 origins: Sequence[Sequence[torch.Tensor]] | None = None,
                 recalled: Sequence[TurnSpan] = ()) -> None:  # fmt: skip
        self.cache, self.first_layer = cache, first_layer
        place = {s.index: i for i, s in enumerate(spans)}
        extra = [r for r in recalled if r.index not in place]
        self.spans = [*spans, *extra]
        self.turns = len(self.spans)
        place |= {r.index: len(spans) + i for i, r in enumerate(extra)}
        self.recalled = {place[r.index] for r in recalled}
        end = max((s.end for s in spans), default=0)
        owner = torch.full((end,), self.turns, dtype=torch.long)  # `turns`: no turn (the system prompt)
        for i, s in enumerate(spans):
            owner[s.start : s.end] = i
        self._owner = owner
        appended = torch.full((max((r.end for r in recalled), default=0),), self.turns, dtype=torch.long)
        for r in recalled:
            appended[r.start : r.end] = place[r.index]
        self._appended, self._base = appended, cache.next_position
        if origins is None:  # the entries sit at their original positions
            origins = [[p[p < cache.next_position] for p in _head_positions(layer)] for layer in cache.layers]
        self._held = [[self.turn_of(o) for o in heads] for heads in origins]  # per layer and KV head, held now
        self.mass = torch.zeros(self.turns + 1, dtype=torch.float64)

    def turn_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The turn index of each original position; `self.turns` for positions in no turn."""
        return _looked_up(self._owner, positions.cpu().long(), self.turns)

    def _fed_turn(self, positions: torch.Tensor) -> torch.Tensor:
        """The turn of each token fed after the recorder was made (positions the cache gave it): a recalled turn's,
        else `self.turns`."""
        return _looked_up(self._appended, positions.cpu().long() - self._base, self.turns)

    def record(self, view: LayerView) -> None:
        if view.layer_idx < self.first_layer:
            return
        # [kv_heads, columns]: cached, retrieved, then this forward's
        weights = view.weights[:, :, -self.query_rows :].sum(dim=(1, 2))
        turns = self.column_turns(view.layer_idx)
        mass = [weights[h, : len(t)].double().cpu() for h, t in enumerate(turns)]
        self.mass += torch.bincount(torch.cat(turns), torch.cat(mass), minlength=self.turns + 1)

    def column_turns(self, layer_idx: int) -> list[torch.Tensor]:
        """Per KV head of layer `layer_idx`, during a forward, the turn of every entry its queries attend to, in the
        attention's column order: cached, retrieved from pages, then this forward's (`self.turns`: no turn)."""
        layer = self.cache.layers[layer_idx]
        current = getattr(getattr(layer, "pool", None), "current", None)  # IceCache: retrieved this forward
        turns = []
        for h, (positions, held) in enumerate(zip(_head_positions(layer), self._held[layer_idx], strict=True)):
            fed = positions[len(held):]  # since the recorder was made: this forward's tokens come last
            earlier = int((fed < self.cache.next_position).sum())
            columns = [held, self._fed_turn(fed[:earlier])]
            if current is not None:  # retrieved entries carry their original positions
                columns.append(self.turn_of(current[h].positions))
            columns.append(self._fed_turn(fed[earlier:]))
            turns.append(torch.cat(columns))
        return turns

    def kept_tokens(self) -> torch.Tensor:
        """Per turn, the tokens the cache held when the recorder was made, averaged over layers and KV heads."""
        held = torch.zeros(self.turns + 1, dtype=torch.float64)
        heads = 0
        for layer in self._held:
            for turns in layer:
                held += torch.bincount(turns, minlength=self.turns + 1).double()
                heads += 1
        return held[: self.turns] / max(heads, 1)


class TurnPresence(SourceRecorder):
    """A recorder counting, per layer and KV head, each turn's entries a forward's queries attend to: passed to the
    forward whose first query chooses the first answer token (kvchat.answer.probe), it says which of the history's
    tokens that token can attend to, whether held by the cache, read back from its pages, placed or prefilled after
    it (`recalled`, as `SourceRecorder` takes them). Every layer counts."""

    def __init__(self, cache: EpisodeCache, spans: Sequence[TurnSpan], *,
                 origins: Sequence[Sequence[torch.Tensor]] | None = None,
                 recalled: Sequence[TurnSpan] = ()) -> None:  # fmt: skip
        super().__init__(cache, spans, 0, origins=origins, recalled=recalled)
        self.counts: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, turns + 1]

    def record(self, view: LayerView) -> None:
        self.counts[view.layer_idx] = torch.stack(
            [torch.bincount(t, minlength=self.turns + 1) for t in self.column_turns(view.layer_idx)])

    def present(self) -> dict[int, torch.Tensor]:
        """History turn index -> its entries attended to, per layer and KV head in order (`[layers * kv_heads]`), for
        every turn with at least one; empty before a forward was recorded."""
        if not self.counts:
            return {}
        counts = torch.cat([self.counts[layer] for layer in sorted(self.counts)])[:, : self.turns]
        return {self.spans[i].index: counts[:, i].clone() for i in counts.sum(0).nonzero().flatten().tolist()}


def rank(spans: Sequence[TurnSpan], mass: torch.Tensor, kept: torch.Tensor, top: int, quote_chars: int,
         recalled: Collection[int] = (), *, answer: str = "", question: str = "") -> list[Source]:  # fmt: skip
    """The `top` turns by attention `mass` (per turn, as `SourceRecorder.mass`), shares of the turns' total;
    `recalled`, the indices of `spans` recalled for the question (`SourceRecorder.recalled`). Each quote is the part
    of its turn matching `answer` (else `question`; kvchat.answer.grounding.quote_span)."""
    turns = mass[: len(spans)]
    total = float(turns.sum())
    if total <= 0:
        return []
    order = sorted(range(len(spans)), key=lambda i: (-float(turns[i]), i))[:top]
    return [
        Source(turn=spans[i].index, turn_id=spans[i].turn_id, speaker=spans[i].speaker, time=spans[i].time,
               quote=quote_span(spans[i].text, answer, question, quote_chars),
               attention_share=round(float(turns[i]) / total, 4),
               kept_tokens=int(round(float(kept[i]))), tokens=spans[i].end - spans[i].start, recalled=i in recalled)
        for i in order
    ]  # fmt: skip


def _looked_up(table: torch.Tensor, index: torch.Tensor, missing: int) -> torch.Tensor:
    """`table[index]` where `index` lies in the table, else `missing`."""
    if not len(table):
        return torch.full_like(index, missing)
    inside = (index >= 0) & (index < len(table))
    return torch.where(inside, table[index.clamp(0, len(table) - 1)], missing)


def _head_positions(layer) -> list[torch.Tensor]:
    """Each KV head's original positions in cache order (a uniform layer's rows, a ragged layer's tensors)."""
    positions = layer.positions
    return list(positions) if isinstance(positions, (tuple, list)) else [row for row in positions]
