"""BERT's encoder, the sentence encoder's model, computed with torch alone from its directory.

transformers' `BertModel` comes with transformers' model code (`transformers.modeling_utils`, which brings
torch.distributed.tensor with sympy, torch._dynamo and SciPy), whose import costs a one-shot question more than
embedding it. The encoder is what is written here, as transformers computes it: word, position and token-type
embeddings and their LayerNorm, then per layer self-attention under the padding mask and a GELU MLP, each added to
its input and normalised; the last layer's states are the output. The weights file is memory-mapped after its
header is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from kvchat.checked_files import FileMismatch, read_bounded, read_safetensors_header
from kvchat.errors import UserError

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class BertConfig:
    """What the encoder's `config.json` says of its shape."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    layer_norm_eps: float
    max_position_embeddings: int
    pad_token_id: int

    @classmethod
    def read(cls, directory: Path) -> BertConfig:
        """The config of the BERT in `directory`; refused (UserError) unless it is the plain BERT encoder computed
        here (absolute positions, GELU, not a decoder)."""
        try:
            raw = json.loads(read_bounded(directory / "config.json", 1 << 20))
            if (raw.get("model_type") != "bert" or raw.get("position_embedding_type", "absolute") != "absolute"
                    or raw.get("hidden_act", "gelu") != "gelu" or raw.get("is_decoder")):
                raise ValueError("not a BERT encoder with absolute positions and GELU")
            config = cls(int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_hidden_layers"]),
                         float(raw.get("layer_norm_eps", 1e-12)), int(raw.get("max_position_embeddings", 512)),
                         int(raw.get("pad_token_id") or 0))
        except (OSError, ValueError, FileMismatch, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"encoder {directory}: not a BERT model kvchat can run ({exc})") from None
        if config.hidden_size % config.num_attention_heads:
            raise UserError(f"encoder {directory}: hidden size is not a multiple of the attention heads")
        return config


class Bert:
    """A BERT encoder's last hidden states for a batch of token ids."""

    def __init__(self, directory: Path) -> None:
        self.config = BertConfig.read(directory)
        path = directory / WEIGHTS
        try:
            read_safetensors_header(path)  # its tensors lie inside the file: mapping it cannot fault
            with safe_open(path, framework="pt", device="cpu") as f:
                weights = {name.removeprefix("bert."): f.get_tensor(name) for name in f.keys()}
        except (OSError, ValueError, FileMismatch, SafetensorError) as exc:
            raise UserError(f"encoder {path}: cannot be read ({exc})") from None
        self._weights = {name: tensor.float() for name, tensor in weights.items()}
        missing = [name for name in self._names() if name not in self._weights]
        if missing:
            raise UserError(f"encoder {path}: not a BERT model's weights (no {missing[0]})")

    def _names(self) -> list[str]:
        names = [f"embeddings.{kind}_embeddings.weight" for kind in ("word", "position", "token_type")]
        names += ["embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
        for i in range(self.config.num_hidden_layers):
            for part in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                         "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm"):
                names += [f"encoder.layer.{i}.{part}.weight", f"encoder.layer.{i}.{part}.bias"]
        return names

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """States `[b, n, hidden]` of token ids `[b, n]`, `mask [b, n]` (1: a token, 0: padding, which no token
        attends to), with every token of type 0."""
        w, config = self._weights, self.config
        n = ids.shape[1]
        x = F.embedding(ids, w["embeddings.word_embeddings.weight"]) + w["embeddings.token_type_embeddings.weight"][0]
        x = self._norm(x + w["embeddings.position_embeddings.weight"][:n], "embeddings.LayerNorm")
        attend_to = None if bool(mask.all()) else mask.bool()[:, None, None, :]     # [b, 1, 1, n]
        for i in range(config.num_hidden_layers):
            x = self._layer(x, f"encoder.layer.{i}.", attend_to)
        return x

    def _layer(self, x: torch.Tensor, layer: str, attend_to: torch.Tensor | None) -> torch.Tensor:
        batch, n, hidden = x.shape
        heads = self.config.num_attention_heads
        q, k, v = (self._linear(x, f"{layer}attention.self.{part}").view(batch, n, heads, -1).transpose(1, 2)
                   for part in ("query", "key", "value"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend_to, scale=(hidden // heads) ** -0.5)
        out = self._linear(out.transpose(1, 2).reshape(batch, n, hidden), f"{layer}attention.output.dense")
        x = self._norm(out + x, f"{layer}attention.output.LayerNorm")
        inner = F.gelu(self._linear(x, f"{layer}intermediate.dense"))
        return self._norm(self._linear(inner, f"{layer}output.dense") + x, f"{layer}output.LayerNorm")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self._weights[name + ".weight"], self._weights[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self._weights[name + ".weight"], self._weights[name + ".bias"],
                            self.config.layer_norm_eps)
