"""A Llama-architecture causal LM built with torch alone: the model every Llama runs on in kvchat.

Importing transformers' model code (`transformers.modeling_utils`, which brings torch.distributed.tensor with
sympy, torch._dynamo and SciPy) takes longer than loading the model and answering a question from a stored cache,
and a one-shot `kvchat ask` paid it on every start. `load` builds the model from `config.json` and the
memory-mapped `model.safetensors` as plain torch modules named as transformers' `LlamaForCausalLM` names its own
(the same state-dict keys, the norms' `variance_epsilon`, `model.rotary_emb`, `lm_head`, a `config` with the same
attribute names), so the weights fingerprint, int8/int4 weights, scorers, features and training take it as they
take transformers' model. Its forward takes transformers' call (`NativeLlama.forward`, so `kv.forward.forward`
feeds it as it feeds transformers' model: ingest's prefill, probes, answers) and each layer's attention calls
kvchat's attention function as transformers' `LlamaAttention` calls it, so every cache layout, recorder and latent
memory runs here; one token on a plain cache takes the same layers through the decode step
(kvchat.model.decode_step), which differs only in how a layer stores and attends. Layers compute their products
in few calls (kvchat.model.products).

Built from the file only where that holds: the plain Llama architecture (SiLU MLP, no biases, default RoPE), its
weights in one safetensors file holding exactly its tensors; `load` returns None otherwise, and the model loads
through transformers, after which `from_transformers` puts transformers' Llama modules (its RoPE module included,
whatever scaling it computes) into a `NativeLlama` all the same. Other architectures stay transformers' model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from kvchat.checked_files import FileMismatch, read_bounded
from kvchat.kv.attention import kvchat_attention
from kvchat.model.int4_weights import CodeLayout
from kvchat.model.products import Products, Projection, dense_bytes, product, rms_norm

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
    rope: dict[str, Any] = raw.get("rope_parameters") or {}
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
            rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or 10000.0),
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
    input's dtype; `products.rms_norm`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self)


class RotaryEmbedding(nn.Module):
    """Llama's default RoPE: the cos and sin of each position's angles. Its frequencies are computed (on the CPU,
    even while the other modules are built on the meta device) and, as transformers keeps them, not in the state
    dict."""

    inv_freq: torch.Tensor  # a buffer (register_buffer), typed here for what reads it

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


# (layer, query [1, heads, n, D], key and value [1, kv_heads, n, D], scale) -> the layer's attention
# [1, n, heads, D], the tokens' keys and values stored as the cache layout stores them
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class Attention(nn.Module):
    """A layer's query, key, value and output projections, its attention's shape, and its attention."""

    def __init__(self, config: NativeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.heads // self.kv_heads
        self.scaling = config.head_dim**-0.5
        hidden, q_rows = config.hidden_size, config.num_attention_heads * config.head_dim
        kv_rows = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_rows, bias=False)
        self.k_proj = nn.Linear(hidden, kv_rows, bias=False)
        self.v_proj = nn.Linear(hidden, kv_rows, bias=False)
        self.o_proj = nn.Linear(q_rows, hidden, bias=False)
        self._products = Products(lambda q, k, v, o: (Projection([q, k, v]), product(o)))

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, past_key_values=None, **kwargs
                ) -> tuple[torch.Tensor, None]:  # fmt: skip
        """transformers' `LlamaAttention` call, with kvchat's attention function: `hidden_states [1, n, hidden]`
        and the RoPE `position_embeddings` (cos, sin) `[1, n, D]` -> `([1, n, hidden], None)`, the tokens' keys and
        values added to `past_key_values` (any cache with transformers' `update`; None: attention over the tokens
        alone), `kwargs` the keywords kvchat's attention takes (`kv.forward.feeding`'s). What a forward on any cache
        calls (through the module, so hooks on it see its inputs), and what calls an attention module itself
        (training's teacher)."""

        def cached(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float):
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, layer)
            return kvchat_attention(self, query, key, value, attention_mask, scaling=scale, **kwargs)[0]

        cos, sin = position_embeddings
        out = self.attend_with(hidden_states[0], cos[0], sin[0], cached)
        return out.to(hidden_states.dtype)[None], None

    def attend_with(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The layer's attention output `[n, hidden]` for its input `x [n, hidden]` (after the norm) at the positions
        of `cos`, `sin` `[n, D]`: the query, key and value rows in one product, RoPE on query and key heads at once
        (a roll, the sign carried by the sine), `attend` (the cache layout's: storing the keys and values and
        attending over what the layer holds), the output projection. Whatever the cache, the one computation."""
        qkv, o_proj = self._products.of(self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        n, dim, half = x.shape[0], self.head_dim, self.head_dim // 2
        rotated = self.heads + self.kv_heads
        projected = qkv(x).to(x.dtype)                                              # [n, (heads + 2 kv) D]
        qk = projected[:, : rotated * dim].view(n, rotated, dim)
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half(x) * sin == roll(x, half) * signed
        qk = qk * cos[:, None] + qk.roll(half, -1) * signed[:, None]               # in the cos's dtype, the model's
        query = qk[:, : self.heads].transpose(0, 1)[None]                           # [1, heads, n, D]
        key = qk[:, self.heads :].transpose(0, 1)[None]                             # [1, kv_heads, n, D]
        value = projected[:, rotated * dim :].view(n, self.kv_heads, dim).transpose(0, 1)[None]
        return o_proj(attend(self.layer_idx, query, key, value, self.scaling).reshape(n, self.heads * dim))

    def products(self) -> Products:
        """Its products, built (`Products.hold_dense` takes them so)."""
        self._products.of(self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        return self._products


class MLP(nn.Module):
    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self._products = Products(lambda gate, up, down: (Projection([gate, up]), product(down)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` -> `[n, hidden]`: SiLU(gate) * up, down; the gate and up rows in one product."""
        gate_up, down = self._products.of(self.gate_proj, self.up_proj, self.down_proj)
        gate, up = gate_up(x).to(x.dtype).chunk(2, dim=-1)
        return down(F.silu(gate) * up)

    def products(self) -> Products:
        """Its products, built."""
        self._products.of(self.gate_proj, self.up_proj, self.down_proj)
        return self._products


# (the layer's attention module, its input x [n, hidden] after the norm, cos, sin [n, D]) -> its output [n, hidden]
LayerAttention = Callable[[Attention, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, config: NativeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: LayerAttention
                ) -> torch.Tensor:  # fmt: skip
        """`hidden [n, hidden]` through the layer, its attention through `attention` (norms as `products.rms_norm`
        computes them, from the modules' weights: transformers' own norm modules, in a model `from_transformers`
        builds, serve alike)."""
        hidden = hidden + attention(self.self_attn, rms_norm(hidden, self.input_layernorm), cos, sin)
        return hidden + self.mlp(rms_norm(hidden, self.post_attention_layernorm))


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

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers`, typed (an `nn.ModuleList` yields plain modules)."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]


@dataclass(frozen=True)
class NativeOutput:
    """What the forward returns, as transformers' models name it."""

    logits: torch.Tensor


class NativeLlama(nn.Module):
    """transformers' `LlamaForCausalLM` in plain torch modules: `model`, `lm_head`, `config`, `generation_config`.

    `forward` takes transformers' call, so whatever feeds transformers' model (kv.forward.forward: ingest's prefill,
    scorers, answers; layer profiling; training) feeds it; `run` is the computation under it and under the decode
    step (kvchat.model.decode_step), which differ only in how a layer stores and attends (`LayerAttention`)."""

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

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, past_key_values=None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = True, logits_to_keep: int = 0,
                **kwargs) -> NativeOutput:  # fmt: skip
        """transformers' call for batch 1: logits `[1, k, vocab]` of the last `logits_to_keep` tokens of
        `input_ids [1, n]` (0: all), at `position_ids [1, n]` (default 0..n-1), on `past_key_values` (an
        `EpisodeCache` or any cache with transformers' `update`; with `use_cache=False`, none), a prepared 4D
        `attention_mask` replacing the causal one; other keywords go to kvchat's attention (the recorder, the
        memory's readout, the hidden states' dict: `kv.forward.feeding`). Each layer's attention runs through its
        module, as in transformers' model."""
        if input_ids.shape[0] != 1:
            raise ValueError("kvchat's native Llama runs one sequence at a time (batch size 1)")
        n = input_ids.shape[-1]
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None]
        cache = past_key_values if use_cache else None

        def attention(module: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return module(hidden_states=x[None], position_embeddings=(cos[None], sin[None]),
                          attention_mask=attention_mask, past_key_values=cache, **kwargs)[0][0]

        return NativeOutput(self.run(input_ids[0], position_ids, attention, logits_to_keep))

    @contextmanager
    def dense_products(self) -> Iterator[None]:
        """While inside, the layers' int8 and int4 products of many rows (a prefill's block, a scorer's probe) multiply
        by their weights held dense in bfloat16 (kvchat.model.products: the same values, a faster kernel); the dense
        copies (`dense_weight_bytes`) are released on leaving. Float weights are untouched; inside an enclosing call,
        nothing more is held."""
        held = [layer_part.products() for layer in self.model.decoder_layers
                for layer_part in (layer.self_attn, layer.mlp)]  # fmt: skip
        if any(products.holds_dense for products in held) or not self.dense_weight_bytes():
            yield
            return
        layout = CodeLayout()
        try:
            for products in held:
                products.hold_dense(layout)
            yield
        finally:
            for products in held:
                products.drop_dense()

    def dense_weight_bytes(self) -> int:
        """The bytes `dense_products` holds while inside."""
        return sum(dense_bytes(layer_part.products()) for layer in self.model.decoder_layers
                   for layer_part in (layer.self_attn, layer.mlp))  # fmt: skip

    def run(self, ids: torch.Tensor, positions: torch.Tensor, attention: LayerAttention, logits_to_keep: int = 1
            ) -> torch.Tensor:  # fmt: skip
        """The model's computation: logits `[1, k, vocab]` of the last `logits_to_keep` (0: all) of tokens `ids [n]`
        at `positions [1, n]`, each layer's attention through `attention`."""
        hidden = F.embedding(ids, self.model.embed_tokens.weight)                  # [n, H]: no batch axis
        cos, sin = self.model.rotary_emb(hidden, positions)                          # [1, n, D]
        for layer in self.model.layers:
            hidden = layer(hidden, cos[0], sin[0], attention)
        kept = hidden[-logits_to_keep:] if logits_to_keep else hidden
        return self.lm_head(rms_norm(kept, self.model.norm)).to(hidden.dtype)[None]


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


def from_transformers(model: PreTrainedModel) -> NativeLlama | None:
    """transformers' Llama `model` as a `NativeLlama` holding its very modules (linear layers, embedding, norms, and
    its rotary embedding, so whatever RoPE scaling it computes), its config and generation config: a Llama `load`
    does not build (a hub name, RoPE scaling, weights in several files) then runs kvchat's forward and decode step
    all the same. None for another architecture, or a Llama computing what these layers do not (biases, another
    activation, tensor-parallel slices, partial rotary)."""
    config = model.config
    if (type(model).__name__ != "LlamaForCausalLM" or getattr(config, "model_type", None) != "llama"
            or getattr(config, "hidden_act", None) != "silu" or getattr(config, "attention_bias", False)
            or getattr(config, "mlp_bias", False) or (getattr(config, "pretraining_tp", 1) or 1) != 1
            or (getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0 or model.training):
        return None
    heads = config.num_attention_heads
    sizes: dict[str, Any] = {f.name: getattr(config, f.name, None) for f in fields(NativeConfig)} | {
        "name_or_path": str(config.name_or_path), "rope_theta": 10000.0,  # the RoPE module is transformers' own
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "num_key_value_heads": config.num_key_value_heads or heads,
    }  # fmt: skip
    with torch.device("meta"):
        native = NativeLlama(NativeConfig(**sizes), GenerationDefaults(None))
    for name, module in model.named_modules():
        holds = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if name and next(module.children(), None) is None and holds:  # a leaf holding weights or RoPE frequencies
            native.set_submodule(name, module)
    if any(t.is_meta for t in [*native.parameters(), *native.buffers()]):
        return None
    # transformers' own config and generation defaults, read by the attribute names NativeConfig shares with them
    native.config, native.generation_config = config, model.generation_config  # type: ignore[assignment]
    return native.eval()
