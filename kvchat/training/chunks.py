"""The text `kvchat train-indexer` distils on, cut into chunks laid out as an ingest lays out a history.

Made locally and never LoCoMo (the evaluation set): chit-chat conversations from the MIT-licensed
`chitchat-dataset` package when installed, kvchat's synthetic planted-fact conversations and the shipped
public-domain calibration text; or the user's own files (`--data`: chat histories or plain text). Each chunk is
the system prompt (the sinks, which ingest never evicts and the losses skip) then `speaker: text` lines, so the
indexer learns on what it will score. The last chunks of every source are held out, and the seed fixes the
order, so a rerun sees the same data (the checkpoint key holds its hash).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.config import SYSTEM_PROMPT, TrainConfig
from kvchat.errors import UserError
from kvchat.history.loading import Turn, format_turns, load_history
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.layer_profiles import calibration_text
from kvchat.messages import option
from kvchat.model.llm import ChatLayout, LoadedModel

DEFAULT_SOURCES = ("chitchat", "synthetic", "calibration")
SHARES = {"chitchat": 0.6, "synthetic": 0.25, "calibration": 0.15}  # of the chunks, when all are there
_NAMES = ("Alex", "Sam", "Jordan", "Riley", "Casey", "Morgan", "Jamie", "Taylor")


@dataclass(frozen=True)
class Chunk:
    ids: torch.Tensor  # [n] token ids
    sink: int          # leading tokens (the system prompt) masked from the losses
    source: str


def make_chunks(lm: LoadedModel, config: TrainConfig, files: Sequence[Path] = (),
                notes: list[str] | None = None) -> tuple[list[Chunk], list[Chunk], list[str]]:
    """(train, held-out, sources used). Deterministic for `config.seed`."""
    notes = notes if notes is not None else []
    layout = ChatLayout.from_tokenizer(lm.tokenizer, SYSTEM_PROMPT)
    prefix = lm.encode(layout.before_conversation)[0]
    room = config.chunk_tokens - prefix.shape[0]
    if room < 16:
        raise UserError(f"chunks of {config.chunk_tokens} tokens leave {room} after the system prompt; use more")
    rng = random.Random(config.seed)
    streams: dict[str, list[str]] = {}
    if files:
        for path in files:
            streams[str(path)] = _file_lines(path)
    else:
        chitchat = _chitchat_lines(rng)
        if chitchat is None:
            notes.append("chitchat-dataset is not installed (pip install 'kvchat[train]'): trained without it")
        else:
            streams["chitchat"] = chitchat
        streams["synthetic"] = [line for seed in range(1000, 1040) for line in
                                format_turns(_planted_turns(seed))]
        streams["calibration"] = [line for line in calibration_text().splitlines() if line.strip()]
    pools = {name: _cut(lm, lines, room) for name, lines in streams.items()}
    total = config.train_chunks + config.held_out_chunks
    quota = _quotas({n: len(p) for n, p in pools.items()}, total, files_given=bool(files))
    train, held = [], []
    for name, pool in pools.items():
        take = pool[: quota[name]]
        held_n = round(config.held_out_chunks * quota[name] / total) if total else 0
        held_n = min(max(held_n, 1 if config.held_out_chunks and len(take) > 1 else 0), len(take) - 1)
        held += [Chunk(torch.cat([prefix, ids]), prefix.shape[0], name) for ids in take[len(take) - held_n:]]
        train += [Chunk(torch.cat([prefix, ids]), prefix.shape[0], name) for ids in take[: len(take) - held_n]]
    train, held = train[: config.train_chunks], held[: config.held_out_chunks]
    if not train:
        raise UserError(f"no training text: give {option('data')} files with at least a chunk of text")
    return train, held, list(pools)


def _quotas(available: dict[str, int], total: int, *, files_given: bool) -> dict[str, int]:
    """Chunks per source: SHARES of `total` (equal shares for user files), what one lacks going to the rest."""
    shares = {n: (1.0 if files_given else SHARES.get(n, 1.0)) for n in available}
    quota = {n: 0 for n in available}
    left = total
    while left > 0:
        open_ = [n for n in available if quota[n] < available[n]]
        if not open_:
            break
        weight = sum(shares[n] for n in open_)
        for n in open_:
            add = min(available[n] - quota[n], max(1, int(left * shares[n] / weight)))
            quota[n] += add
        left = total - sum(quota.values())
    return quota


def _cut(lm: LoadedModel, lines: list[str], room: int) -> list[torch.Tensor]:
    """Consecutive chunks of `room` tokens of the lines joined as a history is (newlines)."""
    ids = lm.encode("\n".join(lines))[0]
    return [ids[i : i + room] for i in range(0, ids.shape[0] - room + 1, room)]


def _chitchat_lines(rng: random.Random) -> list[str] | None:
    """Conversations of the Chit Chat Challenge dataset (BYU PCC lab, MIT), in a seeded order, each with two
    made-up speaker names, one line per message group."""
    try:
        data = json.loads((importlib.resources.files("chitchat_dataset") / "dataset.json").read_text())
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    keys = sorted(data)
    rng.shuffle(keys)
    lines = []
    for key in keys[:1500]:
        names = rng.sample(_NAMES, 2)
        senders: dict[str, str] = {}
        for group in data[key]["messages"]:
            if not group:
                continue
            name = senders.setdefault(group[0]["sender"], names[len(senders) % 2])
            text = " ".join(u["text"].strip() for u in group if u["text"].strip())
            if text:
                lines.append(f"{name}: {text}")
    return lines


def _planted_turns(seed: int) -> list[Turn]:
    history, _facts = planted_conversation(seed=seed, topics=3, turns_per_topic=12)
    return [Turn(m["role"], m["content"]) for m in history]


def _file_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.suffix == ".txt":
        return [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return format_turns(load_history(path))


def data_hash(chunks: Sequence[Chunk]) -> str:
    digest = hashlib.sha256()
    for c in chunks:
        digest.update(c.ids.to("cpu", torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]
