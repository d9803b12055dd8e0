"""Shared fixtures: a tiny random GQA model (fast unit tests) and the embedded model (integration)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvchat.history.loading import format_turns
from kvchat.history.synthetic import _TOPICS, planted_conversation

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data" / "locomo"
# The embedded GGUF is converted once (about 20 s) and reused across test runs.
MODELS_DIR = REPO / ".venv" / "kvchat-test-models"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]


def _vocabulary() -> list[str]:
    words = set("system user assistant conversation question answer : . , ? ! ' [ ] 0 1 2 3 4 5 6 7 8 9".split())
    for filler, template, question, answers in _TOPICS.values():
        for text in (*filler, template, question, *answers):
            words.update(re.findall(r"\w+|[^\w\s]", text))
    words.update(["Maya", "Tom", "You", "are", "a", "helpful", "briefly"])
    return SPECIALS + sorted(words)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(_vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
# The other families users bring (kvchat.kv.families); tests/test_families.py runs each end to end. Kept out of
# ARCHITECTURES, which the older tests parametrize over.
FAMILIES = {
    **ARCHITECTURES,
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),      # q/k norms
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),   # logit softcapping, query_pre_attn_scalar, sliding layers
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),  # q/k norms, sliding layers with their own RoPE base
}
# What makes a tiny random config exercise its family's particularity: a softcap that bites on tiny logits,
# a query scale other than head_dim ** -0.5.
FAMILY_SETTINGS = {
    "gemma2": {"attn_logit_softcapping": 0.5, "query_pre_attn_scalar": 8, "final_logit_softcapping": 30.0},
    "gemma3": {"query_pre_attn_scalar": 8},
}


def tiny_model(
    arch: str = "llama", vocab_size: int = 512, seed: int = 0, layers: int = 2, kv_heads: int = 2, **settings
) -> torch.nn.Module:
    """2 layers (by default), 4 query heads over 2 KV heads (GQA; kv_heads=4: MHA), RoPE. Attention biases
    (Qwen2) get random values and Gemma2's queries and keys are scaled up, so that biases and softcap matter."""
    config_cls, model_cls = FAMILIES[arch]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=4096,
        eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
        **(FAMILY_SETTINGS.get(arch, {}) | settings),
    )
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if arch == "qwen2" and name.endswith("_proj.bias"):
                parameter.normal_(0.0, 0.5)
            if arch == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(8.0)  # attention logits well past the softcap
    return model


def with_kvchat_attention(model: torch.nn.Module) -> torch.nn.Module:
    from kvchat.kv import attention

    model.set_attn_implementation(attention.register())
    return model


def random_ids(n: int, seed: int = 1, vocab: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The tiny Llama with kvchat's attention attached."""
    return with_kvchat_attention(tiny_model("llama"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama + word-level tokenizer with a chat template: loads through load_model(dir)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir, tmp_path_factory):
    from kvchat.model.llm import load_model

    return load_model(str(tiny_model_dir), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def short_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with a window a third of the length of `planted_sets(1, topics=6, turns_per_topic=40)`'s
    history: for histories beyond the model's window."""
    from kvchat.eval.qa import planted_sets

    tokenizer = tiny_tokenizer()
    turns = planted_sets(1, topics=6, turns_per_topic=40)[0].turns
    history_tokens = len(tokenizer("\n".join(format_turns(turns)))["input_ids"])
    path = tmp_path_factory.mktemp("short-llama")
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.config.max_position_embeddings = history_tokens // 3
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def short_lm(short_model_dir, tmp_path_factory):
    from kvchat.model.llm import load_model

    return load_model(str(short_model_dir), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def default_lm():
    from kvchat.model.llm import load_model

    return load_model("default", MODELS_DIR)


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    """A planted-fact history file: 4 topics of 16 turns (a module may define its own `history`)."""
    messages, _ = planted_conversation(seed=3, topics=4, turns_per_topic=16)
    path = tmp_path_factory.mktemp("hist") / "planted.json"
    path.write_text(json.dumps(messages))
    return path


@pytest.fixture(scope="session")
def encoder():
    from kvchat.model.encoder import SentenceEncoder

    return SentenceEncoder()


def centroid(*values: float) -> list[float]:
    """A test store's episode centroid: `values`, then zeros to the encoder's length (which `kvchat doctor` checks
    every centroid against)."""
    from kvchat.model.encoder import embedding_dimension

    return [*values, *[0.0] * ((embedding_dimension() or 384) - len(values))]


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator:
    """Makes a dir read-only for this process: a read-only bind mount as root (root writes through any
    permission bits), file modes otherwise. Returns the path to use."""
    mounts: list[Path] = []
    chmodded: list[Path] = []

    def make(path: Path) -> Path:
        if os.geteuid() != 0:
            for p in [path, *path.rglob("*")]:
                p.chmod(p.stat().st_mode & ~0o222)
                chmodded.append(p)
            return path
        view = tmp_path / f"ro-{uuid.uuid4().hex[:8]}"
        view.mkdir()
        if subprocess.run(["mount", "--bind", str(path), str(view)], capture_output=True).returncode:
            pytest.skip("needs a read-only bind mount (root with CAP_SYS_ADMIN) or a non-root user")
        mounts.append(view)
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True, capture_output=True)
        return view

    yield make
    for view in mounts:
        subprocess.run(["umount", "--lazy", str(view)], check=True)
    for p in chmodded:
        p.chmod(p.stat().st_mode | 0o200)


@contextlib.contextmanager
def raises_said(kind: type[BaseException], match: str):
    """`pytest.raises(kind, match=match)`, matching the message as the CLI says it (its references to settings,
    options and commands spelled: `--budget 64`, `kvchat list`), not as `str()` shows it."""
    from kvchat.cli.words import error_text

    with pytest.raises(kind) as info:
        yield info
    said = error_text(info.value)
    assert re.search(match, said), f"{match!r} not in {said!r}"
