"""Receipts: which turns of the history an answer drew on, by the attention its tokens paid them.

At ingest every turn's token range is recorded (`history_tokens`, stored in each episode file's metadata as
`turns`): an episode cache holds the history (`--method routed`: the episode's own turns) at its positions,
each entry carrying its position (`pos` tensors), so a cached entry belongs to the turn whose range holds it. While an
answer is decoded a `SourceRecorder` sees each forward that picks an answer token (the question's last
query, then every decode step) and adds, per layer (the upper ones: lower layers attend by position more
than by content) and KV head, the attention each resident or retrieved
(IceCache) entry gets to its turn. The turns with the most attention are the answer's sources; a turn's
share is of the attention paid to the history's turns (the system prompt, the question and the answer so
far are left out: an attention sink would dwarf everything else), and `kept_tokens` says how much of the
turn the episode's cache still holds, averaged over layers and KV heads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from kvchat.history import Turn
from kvchat.history import excerpt as quote  # a source's quote
from kvchat.kv.attention import LayerView
from kvchat.kv.cache import EpisodeCache
from kvchat.packed_text import pack, unpack

METADATA_KEY = "turns"  # the episode file metadata entry holding the turn spans (JSON)
_STORED_CHARS = 400     # of each turn's text, kept for quotes
_MAX_SPANS_BYTES = 1 << 28  # what an episode file's spans may inflate to: bounded before it allocates


@dataclass(frozen=True, slots=True)  # a history may have a million turns
class TurnSpan:
    """One turn of the history: its original positions `[start, end)` in the cache and what a receipt shows."""

    start: int
    end: int
    index: int                # the turn's 0-based index in the history
    speaker: str
    text: str                 # the turn's text, cut to _STORED_CHARS
    time: str | None = None
    turn_id: str | None = None  # the format's own id (LoCoMo's "D1:3"), when it has one


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
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def span_of(turn: Turn, start: int, end: int, index: int) -> TurnSpan:
    """`turn`'s span: its tokens at positions `[start, end)`, its place `index` in the history, what a receipt shows."""
    return TurnSpan(start, end, index, turn.role, turn.text.strip()[:_STORED_CHARS], turn.time, turn.turn_id)


def to_metadata(spans: Sequence[TurnSpan]) -> str:
    return pack(json.dumps([asdict(s) for s in spans], separators=(",", ":")).encode())


def from_metadata(metadata: dict[str, str]) -> list[TurnSpan] | None:
    """The spans an episode file stores; None for a file written before kvchat recorded them (or a damaged entry)."""
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        return [TurnSpan(**entry) for entry in json.loads(unpack(raw, _MAX_SPANS_BYTES))]
    except (TypeError, ValueError):
        return None


class SourceRecorder:
    """A `kvchat.kv.attention.Recorder` summing, over the forwards it is passed to, the attention each turn's
    entries get from the forward's last query (the one that picks the next answer token), over the layers from
    `first_layer` up, every KV head and query head."""

    query_rows = 1

    def __init__(self, cache: EpisodeCache, spans: Sequence[TurnSpan], first_layer: int = 0) -> None:
        self.cache, self.spans, self.first_layer = cache, list(spans), first_layer
        self.turns = len(spans)
        end = max((s.end for s in spans), default=0)
        owner = torch.full((end,), self.turns, dtype=torch.long)  # `turns`: no turn (the system prompt)
        for i, s in enumerate(spans):
            owner[s.start : s.end] = i
        self._owner = owner
        self.mass = torch.zeros(self.turns + 1, dtype=torch.float64)

    def turn_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The turn index of each original position; `self.turns` for positions in no turn."""
        positions = positions.cpu().long()
        inside = positions < len(self._owner)
        return torch.where(inside, self._owner[positions.clamp(max=max(len(self._owner) - 1, 0))], self.turns)

    def record(self, view: LayerView) -> None:
        if view.layer_idx < self.first_layer:
            return
        layer = self.cache.layers[view.layer_idx]
        current = getattr(getattr(layer, "pool", None), "current", None)  # IceCache: retrieved this forward
        weights = view.weights[:, :, -1].sum(dim=1)  # [kv_heads, columns]: cached, retrieved, then this forward's
        turns, mass = [], []
        for h, resident in enumerate(_head_positions(layer)):
            cached = resident[resident < self.cache.next_position]  # new tokens come last in the layer
            columns = [cached] if current is None else [cached, current[h].positions.to(cached.device)]
            positions = torch.cat(columns)
            turns.append(self.turn_of(positions))
            mass.append(weights[h, : len(positions)].double().cpu())
        self.mass += torch.bincount(torch.cat(turns), torch.cat(mass), minlength=self.turns + 1)

    def kept_tokens(self) -> torch.Tensor:
        """Per turn, the tokens the cache holds, averaged over layers and KV heads (call before answering)."""
        held = torch.zeros(self.turns + 1, dtype=torch.float64)
        heads = 0
        for layer in self.cache.layers:
            for resident in _head_positions(layer):
                held += torch.bincount(self.turn_of(resident), minlength=self.turns + 1).double()
                heads += 1
        return held[: self.turns] / max(heads, 1)


def rank(spans: Sequence[TurnSpan], mass: torch.Tensor, kept: torch.Tensor, top: int, quote_chars: int) -> list[Source]:
    """The `top` turns by attention `mass` (per turn, as `SourceRecorder.mass`), shares of the turns' total."""
    turns = mass[: len(spans)]
    total = float(turns.sum())
    if total <= 0:
        return []
    order = sorted(range(len(spans)), key=lambda i: (-float(turns[i]), i))[:top]
    return [
        Source(turn=spans[i].index, turn_id=spans[i].turn_id, speaker=spans[i].speaker, time=spans[i].time,
               quote=quote(spans[i].text, quote_chars), attention_share=round(float(turns[i]) / total, 4),
               kept_tokens=int(round(float(kept[i]))), tokens=spans[i].end - spans[i].start)
        for i in order
    ]  # fmt: skip


def _head_positions(layer) -> list[torch.Tensor]:
    """Each KV head's original positions in cache order (a uniform layer's rows, a ragged layer's tensors)."""
    positions = layer.positions
    return list(positions) if isinstance(positions, (tuple, list)) else [row for row in positions]
