"""A Llama-architecture causal LM built with torch alone from its model directory: the model that answers.

Importing transformers' model code (`transformers.modeling_utils`, which brings torch.distributed.tensor with
sympy, torch._dynamo and SciPy) takes longer than loading the model and answering a question from a stored cache,
and a one-shot `kvchat ask` paid it on every start. `load` builds the model from `config.json` and the
memory-mapped `model.safetensors` as plain torch modules named as transformers' `LlamaForCausalLM` names its own
(the same state-dict keys, the norms' `variance_epsilon`, `model.rotary_emb`, `lm_head`, a `config` with the same
attribute names), so kvchat's decode step, weights fingerprint and int8 weights take it as they take transformers'
model, and `NativeLlama.forward` feeds tokens on top of an `EpisodeCache` as `kv.forward.forward` does through
transformers' model, in the same operations: each layer's attention calls kvchat's attention function as
transformers' `LlamaAttention` calls it, with the keywords `kv.forward.feeding` builds for both, so every cache
layout, recorder and latent memory answers here.

Built only where that holds: the plain Llama architecture (SiLU MLP, no biases, default RoPE), its weights in one
safetensors file holding exactly its tensors; `load` returns None otherwise, and the model loads through
transformers. Where transformers' model is needed after all (ingest, profiling, training), `as_transformers`
puts these very modules into transformers' `LlamaForCausalLM`: one set of weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from kvchat.checked_files import FileMismatch, read_bounded
from kvchat.kv.attention import Recorder, kvchat_attention
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import feeding
from kvchat.kv.rope import rotate_half

if TYPE_CHECKING:
    from transformers import PreTrainedModel

WEIGHTS = "model.safetensors"
_CONFIG_BYTES = 1 << 20
_ROPE_KEYS = {"rope_type", "rope_theta"}
# config.json keys that make a Llama something this module does not compute (when set to anything but null/false)
_NOT_NATIVE = ("auto_map", "quantization_config", "rope_scaling", "partial_rotary_factor", "sliding_window",
               "attention_bias", "mlp_bias")


@dataclass(frozen=True)
class NativeConfig:
    """What kvchat reads of a Llama model's `config.json`, under the names transformers' `LlamaConfig` gives them."""

    name_or_path: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_id: int | list[int] | None = None
    model_type: str = "llama"
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    pretraining_tp: int = 1


@dataclass(frozen=True)
class GenerationDefaults:
    """The end-of-sequence token(s) the model's generation config names (`generation_config.json`, else its config)."""

    eos_token_id: int | list[int] | None


def read_config(directory: Path) -> NativeConfig | None:
    """The Llama config in `directory`, or None where the model is not one this module computes exactly."""
    raw = read_json(directory / "config.json")
    if (not isinstance(raw, dict) or raw.get("model_type") != "llama"
            or (raw.get("architectures") or ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]
            or any(raw.get(key) for key in _NOT_NATIVE) or raw.get("hidden_act", "silu") != "silu"
            or (raw.get("pretraining_tp") or 1) != 1):
        return None
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict) or set(rope) - _ROPE_KEYS or rope.get("rope_type", "default") != "default":
        return None
    try:
        heads = _positive(raw["num_attention_heads"])
        hidden = _positive(raw["hidden_size"])
        config = NativeConfig(
            name_or_path=str(directory), vocab_size=_positive(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=_positive(raw["intermediate_size"]),
            num_hidden_layers=_positive(raw["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=_positive(raw.get("num_key_value_heads") or heads),
            head_dim=_positive(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=_positive(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_id=raw.get("eos_token_id"),
        )
    except (KeyError, TypeError, ValueError):
        return None
    if hidden % heads or heads % config.num_key_value_heads:
        return None
    return config


def read_json(path: Path):
    """A model directory's small JSON file, or None when it cannot be read."""
    try:
        return json.loads(read_bounded(path, _CONFIG_BYTES))
    except (OSError, ValueError, FileMismatch):
        return None


def _positive(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"not a positive integer: {value!r}")
    return value


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed as transformers' `LlamaRMSNorm` computes it (in float32, the weight applied in the
    input's dtype)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Llama's default RoPE: the cos and sin of each position's angles. Its frequencies are computed (on the CPU,
    even while the other modules are built on the meta device) and, as transformers keeps them, not in the state
    dict."""

    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return ((angles.cos() * self.attention_scaling).to(x.dtype),
                (angles.sin() * self.attention_scaling).to(x.dtype))


class Attention(nn.Module):
    """A layer's query, key, value and output projections, its attention's shape, and its attention."""

    def __init__(self, config: NativeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.head_dim**-0.5
        hidden, q_rows = config.hidden_size, config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_rows, bias=False)
        self.k_proj = nn.Linear(hidden, kv_rows, bias=False)
        self.v_proj = nn.Linear(hidden, kv_rows, bias=False)
        self.o_proj = nn.Linear(q_rows, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: EpisodeCache,
                **extra) -> torch.Tensor:
        """The layer's attention output `[1, n, hidden]` for its input `hidden_states [1, n, hidden]`, the tokens'
        keys and values added to `cache`: what transformers' `LlamaAttention` computes with kvchat's attention
        function (the same call, with the mask kvchat's mask function gives it, None, and `extra`, the keywords
        `kv.forward.feeding` builds)."""
        n = hidden_states.shape[1]
        heads = (1, n, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(heads).transpose(1, 2)              # [1, heads, n, D]
        key = self.k_proj(hidden_states).view(heads).transpose(1, 2)
        value = self.v_proj(hidden_states).view(heads).transpose(1, 2)
        query, key = query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
        keys, values = cache.update(key, value, self.layer_idx)
        out, _ = kvchat_attention(self, query, keys, values, None, scaling=self.scaling, **extra)  # [1, n, heads, D]
        return self.o_proj(out.reshape(1, n, -1))


class MLP(nn.Module):
    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: NativeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """The decoder: `embed_tokens`, `layers`, `norm`, `rotary_emb`."""

    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        # given a weight, the embedding skips its random initialisation (on the meta device, that imports torch._dynamo)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class NativeLlama(nn.Module):
    """transformers' `LlamaForCausalLM` in plain torch modules: `model`, `lm_head`, `config`, `generation_config`."""

    def __init__(self, config: NativeConfig, generation: GenerationDefaults) -> None:
        super().__init__()
        self.config, self.generation_config = config, generation
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @torch.inference_mode()
    def forward(self, cache: EpisodeCache, ids: torch.Tensor, *, recorder: Recorder | None = None) -> torch.Tensor:
        """Logits `[1, 1, vocab]` of the token after `ids [1, n]`, fed on top of `cache` at its positions (the cache
        advances): `kv.forward.forward`'s result for any cache and `recorder`, in the same operations."""
        with feeding(self, cache, ids, recorder) as (positions, extra):
            hidden = self.model.embed_tokens(ids)                                    # [1, n, H]
            cos, sin = self.model.rotary_emb(hidden, positions)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                            # [1, 1, n, D]: every head
            for layer in self.model.layers:
                hidden = hidden + layer.self_attn(layer.input_layernorm(hidden), cos, sin, cache, **extra)
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.lm_head(self.model.norm(hidden)[:, -1:])


def load(directory: Path, dtype: torch.dtype, device: torch.device) -> NativeLlama | None:
    """The model in `directory` built natively in `dtype` on `device`, its weights memory-mapped (on the CPU in
    their own dtype, they are the file's pages); None where it is not one this module computes exactly (the caller
    loads it through transformers). The weights file's header must have been checked (`model_files.check_weights`)."""
    config = read_config(directory)
    if config is None or not (directory / WEIGHTS).is_file() or not dtype.is_floating_point:
        return None
    try:
        with safe_open(directory / WEIGHTS, framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError):
        return None  # transformers says what is wrong with it
    state = _state_dict(config, tensors)
    if state is None:
        return None
    with torch.device("meta"):  # no memory and no random initialisation: every weight is the file's
        model = NativeLlama(config, _generation_config(directory, config))
    model.load_state_dict({name: t.to(dtype) for name, t in state.items()}, assign=True, strict=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()


def _state_dict(config: NativeConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The file's tensors under the model's state-dict keys, or None unless it holds exactly them in their shapes,
    in a floating-point dtype. A tied embedding may be stored once, as either key (kvchat's converted copies store
    it as `lm_head.weight`)."""
    embedding, lm_head = "model.embed_tokens.weight", "lm_head.weight"
    tensors = dict(tensors)
    if config.tie_word_embeddings:
        shared = tensors.get(embedding, tensors.get(lm_head))
        if shared is None:
            return None
        tensors[embedding] = tensors[lm_head] = shared  # as transformers ties them: the embedding, when both are there
    shapes = _shapes(config)
    if set(tensors) != set(shapes):
        return None
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name] or not tensor.dtype.is_floating_point:
            return None
    return tensors


def _shapes(config: NativeConfig) -> dict[str, tuple[int, ...]]:
    hidden, inner = config.hidden_size, config.intermediate_size
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (q_rows, hidden), layer + "self_attn.k_proj.weight": (kv_rows, hidden),
            layer + "self_attn.v_proj.weight": (kv_rows, hidden), layer + "self_attn.o_proj.weight": (hidden, q_rows),
            layer + "mlp.gate_proj.weight": (inner, hidden), layer + "mlp.up_proj.weight": (inner, hidden),
            layer + "mlp.down_proj.weight": (hidden, inner), layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def _generation_config(directory: Path, config: NativeConfig) -> GenerationDefaults:
    raw = read_json(directory / "generation_config.json")
    if isinstance(raw, dict) and "eos_token_id" in raw:
        return GenerationDefaults(raw["eos_token_id"])
    return GenerationDefaults(config.eos_token_id)


def as_transformers(model: NativeLlama) -> PreTrainedModel:
    """transformers' `LlamaForCausalLM` of the same directory, holding `model`'s own modules (its linear layers,
    int8 ones included, embedding, norms and rotary embedding) in its own modules' places: one set of weights, for
    what needs transformers' model (kvchat's attention function, recorders, hooks on its attention modules)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    directory = Path(model.config.name_or_path)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    for name, module in model.named_modules():
        if name and next(module.children(), None) is None:  # a leaf: it holds weights (or the RoPE frequencies)
            skeleton.set_submodule(name, module)
    left = [name for name, t in [*skeleton.named_parameters(), *skeleton.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers' {type(skeleton).__name__} has tensors kvchat's model lacks: {left[:3]}")
    if (directory / "generation_config.json").is_file():
        skeleton.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    return skeleton.eval()
