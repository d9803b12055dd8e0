"""Layer-sensitivity calibration (EpiCache §3.2, eqs. 8-9): how much block prefill disturbs each layer.

Two forward passes over one long text: with the full causal mask, and with a mask that simulates
block prefill (each token sees the sink tokens plus the entries a cache of `budget` would still hold,
plus the earlier tokens of its own block). Per layer, the mean cosine similarity of the Key states
of the two passes over heads and tokens; sensitivity = 1 - similarity. Profiles depend on the model,
not the input (EpiCache Fig. 4a), so one is computed per model and shipped or stored.
"""

from __future__ import annotations

import importlib.resources
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from kvchat.checked_files import FileMismatch, read_bounded
from kvchat.config import ProfileSettings
from kvchat.errors import UserError, message
from kvchat.kv.causal_lm import config_of
from kvchat.messages import command, option, setting
from kvchat.model.llm import LoadedModel

PROFILE_VERSION = 1
MAX_PROFILE_BYTES = 1 << 24  # a profile is a few numbers per layer; more is not one


def profile_texts(directory: Path) -> dict[str, str]:
    """The user's layer profiles as text by file name (what batch workers are sent): regular files of bounded
    size only, so a FIFO or a huge file among them is refused instead of hanging or filling memory."""
    if not directory.is_dir():
        return {}
    texts = {}
    for path in sorted(directory.glob("*.json")):
        try:
            texts[path.name] = read_bounded(path, MAX_PROFILE_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError, FileMismatch) as exc:
            raise UserError(f"{path}: not a kvchat layer profile ({exc})") from None
    return texts


@dataclass(frozen=True)
class LayerProfile:
    model: str
    weights: str                 # weights fingerprint: a profile applies to these weights only
    settings: dict
    tokens: int
    similarity: list[float]
    sensitivity: list[float]
    alpha: float = ProfileSettings.suggested_alpha
    version: int = PROFILE_VERSION
    text: str = field(default="")  # where the calibration text came from

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> LayerProfile:
        try:
            data = json.loads(read_bounded(Path(path), MAX_PROFILE_BYTES))
            profile = cls(**data)
        except (OSError, ValueError, TypeError, FileMismatch) as exc:
            raise UserError(f"{path}: not a kvchat layer profile ({exc})") from None
        if not all(isinstance(v, list) and all(_is_number(x) for x in v)
                   for v in (profile.similarity, profile.sensitivity)):
            raise UserError(f"{path}: not a kvchat layer profile (similarity and sensitivity must be lists of numbers)")
        return profile


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def block_prefill_mask(n: int, *, budget: int, block_size: int, sink: int,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [n, n] on `device`: token i sees token j <= i if j is a sink token or among the last
    `budget - sink + (i mod block_size)` tokens (what a budget-M cache plus the current block holds)."""
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(n, device=device).unsqueeze(0)
    recent = (budget - sink) + (i % block_size)
    return (j <= i) & ((j < sink) | (i - j < recent))


@torch.inference_mode()
def _keys(lm: LoadedModel, ids: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Post-RoPE Key states of every layer, [kv_heads, n, head_dim]."""
    cache = DynamicCache()
    extra = {"attention_mask": mask[None, None]} if mask is not None else {}
    lm.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **extra)
    keys = []
    for layer in cache.layers:
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None:
            raise RuntimeError(f"the model's cache holds no keys in its {type(layer).__name__}")
        keys.append(layer.keys[0].float())
    return keys


def profile_layers(
    lm: LoadedModel, text: str, settings: ProfileSettings = ProfileSettings(), *, source: str = ""
) -> LayerProfile:
    """Measure each layer's Key-state similarity under full vs simulated block-prefill attention."""
    ids = lm.encode(text)[:, : settings.max_tokens]
    n = ids.shape[-1]
    if n < settings.budget + settings.block_size:
        raise UserError(
            f"the calibration text has {n} tokens; it needs more than budget + block "
            f"({settings.budget + settings.block_size}) for eviction to happen"
        )
    if not 0 < settings.sink < settings.budget:
        raise UserError(f"{option('sink')} must be within 1..budget-1 (got {settings.sink})")
    full = _keys(lm, ids, None)
    blocked = _keys(lm, ids, block_prefill_mask(n, budget=settings.budget, block_size=settings.block_size,
                                                 sink=settings.sink, device=ids.device))
    similarity = [
        float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()) for a, b in zip(full, blocked, strict=True)
    ]
    return LayerProfile(
        model=lm.spec,
        weights=lm.weight_ids[0],
        settings=asdict(settings),
        tokens=n,
        similarity=[round(s, 6) for s in similarity],
        sensitivity=[round(1.0 - s, 6) for s in similarity],
        text=source,
    )


def read_calibration(path: Path | None) -> tuple[str, str]:
    """The calibration text and where it came from: `path`, or the shipped text when None."""
    if path is None:
        return calibration_text(), "kvchat/data/calibration.txt"
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    return path.read_text(errors="replace"), str(path)


def save_profile(profile: LayerProfile, home: Path, out: Path | None = None) -> tuple[Path, Path | None]:
    """Save `profile` at `out` (default: `home`'s profiles dir, where ingest looks first). Returns where,
    and the shipped profile for the same weights that ingest now passes over (None when none is)."""
    user_dir = home / "profiles"
    target = out or user_dir / f"{profile.weights}.json"
    profile.save(target)
    if target.parent != user_dir:
        return target, None
    hidden = [p for p in shipped_profiles() if json.loads(p.read_text()).get("weights") == profile.weights]
    return target, hidden[0] if hidden else None


def shipped_profiles() -> list[Path]:
    """Profiles that ship with kvchat (the repository's profiles/, installed as the package kvchat.profiles)."""
    return sorted(Path(str(p)) for p in importlib.resources.files("kvchat.profiles").iterdir()
                  if p.name.endswith(".json"))  # fmt: skip


def find_profile(lm: LoadedModel, extra_dirs: Sequence[Path] = ()) -> LayerProfile | None:
    """A profile measured on these exact weights: user-made ones (`extra_dirs`) first, then shipped."""
    weights = lm.weight_ids
    candidates = [p for d in extra_dirs if d.is_dir() for p in sorted(d.glob("*.json"))] + shipped_profiles()
    for path in candidates:
        profile = LayerProfile.load(path)
        if profile.weights in weights and len(profile.sensitivity) == lm.num_layers:
            return profile
    return None


def shipped_indexers() -> list[Path]:
    """Trained IndexMem weights that ship with kvchat, beside the layer profiles (kvchat.kv.trained)."""
    from kvchat.kv.trained import SUFFIX

    return sorted(Path(str(p)) for p in importlib.resources.files("kvchat.profiles").iterdir()
                  if p.name.endswith(SUFFIX))  # fmt: skip


def find_indexmem(lm: LoadedModel, extra_dirs: Sequence[Path] = ()):
    """The IndexMem weights trained on these exact weights: user-trained ones (`extra_dirs`, i.e.
    `$KVCHAT_HOME/profiles`) first, then shipped. Refuses, naming the command that trains one, when none
    matches the weights and the model's shape."""
    from kvchat.kv.indexer import IndexMemShape
    from kvchat.kv.trained import SUFFIX, TrainedIndexMem, read_metadata, read_shape

    weights = lm.weight_ids
    shape = IndexMemShape.of(config_of(lm.model)).to_dict()
    candidates = [p for d in extra_dirs if d.is_dir() for p in sorted(d.glob(f"*{SUFFIX}"))] + shipped_indexers()
    others = []
    for path in candidates:
        try:
            meta = read_metadata(path)
        except ValueError as exc:  # a FIFO, a damaged header: never opened blocking, never allocated by
            others.append(f"{path.name} (unreadable: {str(exc).removeprefix(f'{path}: ')})")
            continue
        if meta["weights"] in weights and all(read_shape(meta).get(k) == v for k, v in shape.items()
                                              if k not in ("index_heads", "index_dim", "memory_dim")):
            try:
                return TrainedIndexMem.load(path)
            except ValueError as exc:
                raise UserError(f"{message(exc)}; train another with `{train_command(lm.spec)}`") from None
        others.append(f"{path.name} (weights {meta['weights'][:8]})")
    found = f"; found only: {', '.join(others)}" if others else ""
    raise UserError(f"{setting('method', 'indexmem')} needs an indexer trained on {lm.spec}'s weights "
                    f"({weights[0][:8]}){found}; "
                    f"train one with `{train_command(lm.spec)}`")


def train_command(spec: str) -> str:
    """The command that trains IndexMem weights for the model `spec` (a kvchat.messages reference)."""
    return command("train-indexer") if spec == "default" else command("train-indexer", model=spec)


def calibration_text() -> str:
    """The shipped calibration text (public domain; see kvchat/data/calibration.txt)."""
    return (importlib.resources.files("kvchat.data") / "calibration.txt").read_text()


def save_plot(profile: LayerProfile, path: Path, budget: int | None = None) -> None:
    """Sensitivity per layer and the budgets it gives at `budget` (default: the budget it was measured
    at), needs matplotlib: kvchat[plot]."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(f"{option('plot')} needs matplotlib: pip install 'kvchat[plot]'") from None
    from kvchat.kv.budgets import sensitivity_budgets

    budget = budget or int(profile.settings.get("budget", ProfileSettings.budget))
    layers = range(len(profile.sensitivity))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    top.bar(layers, profile.sensitivity, color="tab:red")
    top.set_ylabel("sensitivity (1 - key cos)")
    name = "the default model" if profile.model == "default" else Path(profile.model).name or profile.model
    top.set_title(f"Block-prefill sensitivity per layer of {name} (weights {profile.weights[:8]})")
    bottom.bar(layers, sensitivity_budgets(profile.sensitivity, budget, profile.alpha), color="tab:blue")
    bottom.axhline(budget, color="gray", linestyle="--", label=f"uniform {budget}")
    bottom.set_ylabel(f"budget (alpha {profile.alpha})")
    bottom.set_xlabel("layer")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
