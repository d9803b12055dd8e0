"""The causal LM: loading (embedded default, local HF dir, GGUF file: their files found, converted and checked by
kvchat.model.files), chat layout, decoding (greedy, or as a kvchat.model.sampling.Sampler chooses).

No network: hub names resolve only from the local HF cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedTokenizerBase

from kvchat.config import WEIGHT_MODES
from kvchat.errors import UserError, first_line
from kvchat.kv import attention, backends, families
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.causal_lm import ModelConfig, config_of
from kvchat.kv.forward import forward as model_forward
from kvchat.messages import option
from kvchat.model import held_weights, native_llama
from kvchat.model.cores import usable_cores
from kvchat.model.cuda_graph_step import CudaGraphStep
from kvchat.model.decode_step import DecodeStep
from kvchat.model.device import CPU_FLOAT32, Placement
from kvchat.model.echo import EchoGuard, HeldAnswer
from kvchat.model.files import ConversionProgress, resolve
from kvchat.model.sampling import Sampler

_log = logging.getLogger(__name__)  # `kvchat --debug` shows its records
_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers' one tokenizers-backed class

_CONV_MARK = "\x00KVCHAT-CONVERSATION\x00"
_QUESTION_MARK = "\x00KVCHAT-QUESTION\x00"
_SYSTEM_MARK = "\x00KVCHAT-SYSTEM\x00"


@dataclass(frozen=True)
class ChatLayout:
    """The chat template cut around the conversation (in the system turn) and the question (a user
    turn), so the conversation can be prefilled once and any question appended later. `before_system` opens a
    second system turn after the conversation (the user's own instructions), where the template has one; None
    where it has not (instructions then open the question's turn)."""

    before_conversation: str
    before_question: str
    after_question: str
    before_system: str | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, system_prompt: str) -> ChatLayout:
        if not tokenizer.chat_template:
            return cls(system_prompt, "\n\nQuestion: ", "\nAnswer:")
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": system_prompt + _CONV_MARK},
                {"role": "user", "content": _QUESTION_MARK},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        head, rest = rendered.split(_CONV_MARK)
        middle, tail = rest.split(_QUESTION_MARK)
        return cls(head, middle, tail, _system_turn(tokenizer, system_prompt, head, middle, tail))

    def question(self, text: str, earlier: Sequence[tuple[str, str]] = (), system: str | None = None) -> str:
        """The question's turns; `earlier` (question, answer) pairs come first as the follow-up they are, and
        `system` (instructions) before them all."""
        pairs, opening = list(earlier), ""
        if system and self.before_system is not None:
            opening = self.before_system + system
        elif system and pairs:  # no system turn to open: the instructions open the first user turn
            pairs[0] = (f"{system}\n\n{pairs[0][0]}", pairs[0][1])
        elif system:
            text = f"{system}\n\n{text}"
        turns = "".join(self.before_question + q + self.after_question + a for q, a in pairs)
        return opening + turns + self.before_question + text + self.after_question


def _system_turn(tokenizer: PreTrainedTokenizerBase, system_prompt: str, head: str, middle: str,
                 tail: str) -> str | None:  # fmt: skip
    """What opens a second system turn after the conversation's, as the template renders one; None where it refuses
    one (some templates allow a system message only first) or renders it otherwise than between the two turns."""
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": system_prompt + _CONV_MARK}, {"role": "system", "content": _SYSTEM_MARK},
             {"role": "user", "content": _QUESTION_MARK}], tokenize=False, add_generation_prompt=True)  # fmt: skip
    except Exception:  # noqa: BLE001 - a template's own error (jinja's, raise_exception): it takes no second one
        return None
    before, found, rest = rendered.partition(_CONV_MARK)
    opening, found_system, after = rest.partition(_SYSTEM_MARK)
    if not found or not found_system or before != head or after != middle + _QUESTION_MARK + tail:
        return None
    return opening


@dataclass(frozen=True)
class ModelIdentity:
    """What the store records of the model that built a cache: what a batch worker, which holds the model,
    tells the driver that commits (kvchat.ingest.batch)."""

    spec: str
    fingerprint: str
    device: str = "cpu"             # where it ran and in which dtype: reported, never part of the fingerprint
    dtype: str = "float32"
    attention_backend: str = "torch"  # the decode attention kernel (kvchat.kv.backends)
    weights: str = "float"          # how its Linear weights were held: float | int8 | int4 (--weights)


@dataclass
class LoadedModel:
    """A model ready for kvchat: tokenizer, identity, and `model`, the one model everything runs on.

    `model` is kvchat's own Llama (model.native_llama: built from the model's file, or around transformers' Llama
    modules where transformers loads it) for every Llama-architecture model, and transformers' model, with kvchat's
    attention attached, only for the architectures the native one does not build (Qwen, Mistral, Gemma). Both take
    transformers' forward call and name their modules as transformers does, so ingest, scorers, profiling,
    training and answers use either alike; answering with the native one imports none of transformers' model
    code."""

    spec: str
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str
    model: nn.Module = field(repr=False)
    weights: str = "float"  # how the Linear weights are held: float, int8 or int4 (`hold_weights`)
    _decode_step: DecodeStep | CudaGraphStep | bool | None = field(default=None, init=False, repr=False,
                                                                    compare=False)
    _weight_ids: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def weight_ids(self) -> tuple[str, ...]:
        """The fingerprints a layer profile or IndexMem weights file made for this model may carry (`weights_ids`),
        of the weights as loaded: an int8 or int4 model (`hold_weights`) finds the files of its float weights."""
        if self._weight_ids is None:
            self._weight_ids = weights_ids(self.model)
        return self._weight_ids

    def hold_weights(self, weights: str, models_dir: Path | None = None, source: Path | None = None) -> None:
        """Hold the Linear weights as `weights` (auto, int8 or int4: `held_weights.hold`, which reads them from
        `models_dir` when they were kept there for the float weights file `source`), fingerprints taken first."""
        fingerprint = self.weight_ids[0]  # taken (and kept) from the float weights, before they change
        self.weights = held_weights.hold(self.model, weights, fingerprint, models_dir, source)

    @property
    def config(self) -> ModelConfig:
        """The model's config (the attributes transformers' config names)."""
        return config_of(self.model)

    def forward(self, cache: EpisodeCache, ids: torch.Tensor, *, recorder: attention.Recorder | None = None
                ) -> torch.Tensor:  # fmt: skip
        """Logits `[1, 1, vocab]` of the token after `ids`, fed on top of `cache` (kv.forward.forward)."""
        return model_forward(self.model, cache, ids, recorder=recorder)

    @property
    def decode_step(self) -> DecodeStep | CudaGraphStep | None:
        """The decode step for this model (kvchat.model.decode_step; on a GPU replayed as CUDA graphs,
        kvchat.model.cuda_graph_step), built at the second answer token; None where the model's forward must run."""
        if self._decode_step is None:
            step = DecodeStep.for_model(self.model)
            if step is not None and self.device.type == "cuda":
                step = CudaGraphStep(step)
            self._decode_step = step or False
        return self._decode_step or None

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity(self.spec, self.fingerprint, self.device.type, str(self.dtype).removeprefix("torch."),
                             self.attention_backend, self.weights)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def attention_backend(self) -> str:
        """The kernel decode attention runs on here: `flashinfer` or `torch` (kvchat.kv.backends)."""
        return backends.decode_backend(self.device, self.dtype)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def context_window(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids [1, n] of `text`, without added special tokens (the template carries them)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def stop_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return {i for i in ids if i is not None}


def weights_fingerprint(model: nn.Module) -> str:
    """Cheap hash of the weights: names, shapes and a strided sample of every tensor's values, rounded to
    bfloat16 first. The rounding is what makes it dtype- and device-independent: a float32 and a bfloat16
    load of one checkpoint hash alike (from_pretrained's cast rounds to nearest even, as `.to` does here), and
    so does a float16 load of a bfloat16 or float16 checkpoint. A float16 load of a float32 checkpoint rounds
    twice and hashes differently (its caches are refused with the command that rebuilds them)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(flat[::step].to(torch.bfloat16).float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def legacy_weights_fingerprint(model: nn.Module) -> str | None:
    """The weights fingerprint of kvchat before caches could change dtype (exact values with their dtype):
    profiles and IndexMem weights made then carry it. Computable only on a float32 model, None otherwise."""
    dtype = next((t.dtype for t in model.state_dict().values() if t.is_floating_point()), None)
    if dtype != torch.float32:  # the first floating tensor's, as transformers' `model.dtype`
        return None
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(flat[::step].float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def weights_ids(model: nn.Module) -> tuple[str, ...]:
    """The weights fingerprints a profile or IndexMem weights file made for this model may carry: the current
    one, and on a float32 model the legacy one too."""
    legacy = legacy_weights_fingerprint(model)
    return (weights_fingerprint(model),) + ((legacy,) if legacy else ())


def model_fingerprint(name: str, model: nn.Module) -> str:
    """Identity a stored cache must match: model name, weights (dtype-independent, `weights_fingerprint`),
    attention shapes, transformers version. Neither dtype nor device is part of it: a cache built on a GPU in
    bfloat16 answers on a CPU in float32 (the codec converts it on load). A fingerprint of older kvchat
    versions carried the dtype (`|torch.float32|`): `is_legacy_fingerprint`."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (
        f"{name}|w={weights_fingerprint(model)}|"
        f"L{cfg.num_hidden_layers}xKV{cfg.num_key_value_heads}xD{head_dim}|transformers={transformers.__version__}"
    )


def use_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads for this process and return the count: `threads`, else
    $OMP_NUM_THREADS, else the cores this process may use. More threads than cores, or two processes
    each taking every core, make every step wait on the others (two default-thread ingests on 2 cores
    took 24 minutes instead of 21 s)."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else usable_cores()
    if threads < 1:
        raise UserError(f"{option('threads')} must be >= 1 (got {threads})")
    torch.set_num_threads(threads)
    return threads


def load_model(
    spec: str, models_dir: Path, *, trust_remote_code: bool = False, placement: Placement = CPU_FLOAT32,
    weights: str = "float", conversion: ConversionProgress | None = None,
) -> LoadedModel:
    """Load a causal LM for kvchat with its attention attached, in `placement`'s dtype on its device (the
    library's default: the CPU in float32; the CLI resolves --device/--dtype, kvchat.model.device). Raises
    UserError when not found, or when the architecture is one kvchat would answer wrongly with
    (kvchat.kv.families). `weights="int8"` then holds its Linear weights as int8 (model.int8_weights), `"int4"` its
    decoder's in 4-bit groups (kvchat.model.int4_weights), for answering on a CPU; `"auto"` is int4 on a CPU where the
    decoder's weights already are 4-bit groups (the embedded model's are), else float. The fingerprint is the loaded
    weights', so caches built with them answer with it.
    `conversion` hears of a first GGUF conversion (kvchat.model.files.convert_gguf), if one is needed."""
    if weights not in WEIGHT_MODES:
        raise UserError(f"unknown weights {weights!r} (choose from {', '.join(WEIGHT_MODES)})")
    if weights not in ("auto", "float") and placement.device.type != "cpu":
        raise UserError(f"{option('weights', weights)} runs on the CPU (its kernel is torch's CPU one), not on "
                        f"{placement.device.type}: add {option('device', 'cpu')}, or use {option('weights', 'float')}")
    name, source = resolve(spec, models_dir, conversion)
    built = native_llama.load(source, placement.dtype, placement.device) if isinstance(source, Path) else None
    with _load_errors(spec, source):
        tokenizer = _load_tokenizer(source, built is not None, trust_remote_code)
        if built is None:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(  # weights_only: a legacy .bin is never fully unpickled
                source, dtype=placement.dtype, local_files_only=True, trust_remote_code=trust_remote_code,
                weights_only=True,
            )
    if built is not None:
        model = built
    else:
        families.check_supported(loaded, spec)
        loaded.set_attn_implementation(attention.register())
        loaded.to(placement.device).eval()
        model = native_llama.from_transformers(loaded) or loaded  # a Llama runs natively all the same
    lm = LoadedModel(spec, tokenizer, model_fingerprint(name, model), model)
    if weights == "auto" and placement.device.type != "cpu":  # the int8 and int4 kernels are the CPU's
        weights = "float"
    if weights != "float":  # kvchat's own model is read from one file: its quantized form is kept beside it
        kept = (models_dir, Path(source) / native_llama.WEIGHTS) if built is not None else ()
        lm.hold_weights(weights, *kept)
    _log.debug("%s on %s, decode attention: %s, %s weights", spec, placement.describe(), lm.attention_backend,
               lm.weights)
    return lm


def _load_tokenizer(source: Path | str, native: bool, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The model's tokenizer as AutoTokenizer loads it. For a native model (a Llama) whose `tokenizer_config.json`
    names transformers' tokenizers-backed class, the class AutoTokenizer would pick, without AutoTokenizer: it reads
    the model's config through transformers' config classes, whose imports bring torch._dynamo and sympy."""
    if native:
        config = native_llama.read_json(Path(source) / "tokenizer_config.json")
        if isinstance(config, dict) and config.get("tokenizer_class") in _BACKEND_CLASSES and "auto_map" not in config:
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(source, local_files_only=True)
    from transformers import AutoTokenizer  # its model-type tables cost a start that does not need them

    return AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)


@contextmanager
def _load_errors(spec: str, source: Path | str) -> Iterator[None]:
    """What loading a model or its tokenizer raises for missing or damaged files, in one line (exit 2)."""
    try:
        yield
    except (OSError, ValueError, SafetensorError) as exc:  # SafetensorError: a truncated or damaged file
        if isinstance(source, str):
            raise UserError(
                f"model not found: {spec!r} (expected 'default', a model directory, a .gguf file, "
                "or a hub name already in the local cache)"
            ) from exc
        raise UserError(f"cannot load model {spec!r}: {first_line(exc)}") from exc


def longest_answer(lm: LoadedModel) -> int:
    """The most tokens an answer may have: the model's context (positions it was trained on)."""
    return int(getattr(lm.config, "max_position_embeddings", None) or 1 << 16)


def generate(
    lm: LoadedModel,
    cache: EpisodeCache,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    on_first_logits: Callable[[torch.Tensor], None] | None = None,
    *,
    stop_ids: Collection[int] | None = None,
    first_recorder: attention.Recorder | None = None,
    echo: EchoGuard | None = None,
    sampler: Sampler | None = None,
) -> Generator[int, None, None]:
    """Decoding of an answer on top of `cache` (which it extends; see EpisodeCache.rollback): greedy, or each token
    as `sampler` chooses it from the scores and the answer so far (kvchat.model.sampling).
    `on_first_logits` receives the logits [vocab] the first answer token is chosen from; `first_recorder`
    sees every layer's attention in that forward (the prompt's). The answer ends at one of `stop_ids`
    (default: the model's end-of-turn tokens; empty: always `max_new_tokens`).

    `echo` holds tokens back while they could begin the question's opening words, and when they spell them out,
    goes back to the token where they began and takes the next best there (kvchat.model.echo).

    The cache first makes room for the prompt and the longest answer, so no step copies it; each step
    feeds the chosen token through one reused `[1, 1]` tensor, through `lm.decode_step` where it applies."""
    stop = lm.stop_ids if stop_ids is None else stop_ids
    longest = longest_answer(lm)
    if not 1 <= max_new_tokens <= longest:  # the cache reserves room for it: never an absurd allocation
        raise UserError(f"{option('max_new_tokens')} must be within 1..{longest}, the model's context (got "
                        f"{max_new_tokens})")
    cache.reserve(prompt_ids.shape[-1] + max_new_tokens)
    scores = lm.forward(cache, prompt_ids, recorder=first_recorder)[0, -1]
    if on_first_logits is not None:
        on_first_logits(scores)
    step_ids = torch.empty(1, 1, dtype=torch.long, device=prompt_ids.device)
    answer = HeldAnswer(echo, cache)
    while True:
        token = int(scores.argmax()) if sampler is None else sampler.choose(scores, answer.tokens)
        if token in stop:
            yield from answer.flush()
            return
        give, again = answer.push(token, scores)
        yield from give
        if again is not None:  # it went back before an echo of the question: choose there again
            scores = again
            continue
        if len(answer.tokens) == max_new_tokens:
            yield from answer.flush()
            return
        step_ids.fill_(token)
        fast = lm.decode_step  # built once, after the first token is out
        if fast is not None and fast.applies(cache, step_ids):
            scores = fast(cache, step_ids)[0, -1]
        else:
            scores = lm.forward(cache, step_ids)[0, -1]
