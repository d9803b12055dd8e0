"""`model.native_llama`: the Llama kvchat builds with torch alone computes what transformers' model computes, under
the same fingerprint, and a question is answered without importing transformers' model code."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from cli_helpers import cli_env
from conftest import random_ids, tiny_model, tiny_tokenizer, with_kvchat_attention
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from kvchat.answer.session import Session
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig, OffloadConfig, RecallConfig
from kvchat.eval.qa import planted_sets
from kvchat.ingest.pipeline import ingest
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import KeyDiffScorer
from kvchat.model import int4_weights, int8_weights, native_llama
from kvchat.model.decode_step import DecodeStep
from kvchat.model.files import _write_converted
from kvchat.model.llm import LoadedModel, load_model, model_fingerprint
from kvchat.store import Store

CPU = torch.device("cpu")
HEAVY = {"transformers.modeling_utils", "torch._dynamo", "sympy", "scipy"}


def _both(directory) -> tuple[native_llama.NativeLlama, torch.nn.Module]:
    """The model in `directory` built natively, and as transformers loads it (with kvchat's attention)."""
    native = native_llama.load(directory, torch.float32, CPU)
    assert native is not None
    return native, with_kvchat_attention(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)).eval()


@pytest.fixture(scope="module", params=["untied", "converted"])
def model_dir(request, tiny_model_dir, tmp_path_factory):
    """The tiny Llama as transformers saves it (lm_head apart from the embedding), and a tied one as kvchat converts
    a GGUF model (the tied embedding stored once, as `lm_head.weight`)."""
    if request.param == "untied":
        return tiny_model_dir
    tokenizer = tiny_tokenizer()
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=True, rope_theta=5000.0)
    path = tmp_path_factory.mktemp("converted") / "model"
    _write_converted(LlamaForCausalLM(config).eval(), tokenizer, path, "converted for a test\n")
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys() and "model.embed_tokens.weight" not in f.keys()
    return path


def test_the_native_model_has_transformers_weights_names_and_fingerprint(model_dir):
    native, reference = _both(model_dir)
    ours, theirs = native.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert model_fingerprint("tiny", native) == model_fingerprint("tiny", reference)
    assert native.config.rms_norm_eps == reference.config.rms_norm_eps
    assert native.model.layers[0].input_layernorm.variance_epsilon == reference.config.rms_norm_eps


def test_the_tokenizer_is_the_one_autotokenizer_loads(model_dir, tmp_path):
    """Loaded without AutoTokenizer (which reads the model's config through transformers' config classes), as the
    class AutoTokenizer picks; a converted copy names its added tokens, so loading it need not read them from
    `tokenizer.json` in Python."""
    from transformers import AutoTokenizer

    lm, auto = load_model(str(model_dir), tmp_path), AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(lm.model, native_llama.NativeLlama) and type(lm.tokenizer) is type(auto)
    text = "<|im_start|>user\nHow many tomato plants did Tom plant ?<|im_end|>\n<|im_start|>assistant\n"
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == auto(text, add_special_tokens=False)["input_ids"] and lm.tokenizer.decode(ids) == auto.decode(ids)
    assert lm.tokenizer.added_tokens_decoder == auto.added_tokens_decoder and lm.stop_ids
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert lm.tokenizer.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages,
                                                                                                  tokenize=False)
    saved = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert ("added_tokens_decoder" in saved) == (model_dir.name == "model")  # kvchat's converted copy


def _fed(model: torch.nn.Module):
    """Feeding `model` tokens on a cache (kv.forward.forward: transformers' call, which the native model takes)."""
    return lambda cache, ids: forward(model, cache, ids)


def _greedy(feed, cache: EpisodeCache, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The logits of `ids` fed on `cache`, then of each greedy token fed one at a time."""
    logits = [feed(cache, ids)]
    for _ in range(steps):
        logits.append(feed(cache, logits[-1][:, -1:].argmax(-1)))
    return logits


def _same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        assert int(g[0, -1].argmax()) == int(e[0, -1].argmax())


def test_a_prefill_on_an_empty_cache_and_the_steps_after_it_give_transformers_logits(model_dir):
    native, reference = _both(model_dir)
    layers, ids = native.config.num_hidden_layers, random_ids(30, seed=4, vocab=native.config.vocab_size)
    ours, theirs = EpisodeCache(layers), EpisodeCache(layers)
    _same(_greedy(_fed(native), ours, ids, 6), _greedy(_fed(reference), theirs, ids, 6))
    assert ours.next_position == theirs.next_position == 36
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-6, rtol=1e-6)
        assert torch.equal(a.positions, b.positions)


@pytest.mark.parametrize("compact", [False, True])
def test_a_question_on_a_stored_episode_cache_gives_transformers_logits(model_dir, compact):
    """An episode cache as ingest stores it (each head keeping its own entries, at their original positions or
    re-rotated to compact ones), read back from its file: the question's prefill and the answer's steps."""
    native, reference = _both(model_dir)
    vocab = native.config.vocab_size
    with torch.inference_mode():
        built = block_prefill(reference, random_ids(4, vocab=vocab), random_ids(80, seed=2, vocab=vocab),
                              block_size=16, budgets=[24, 24], scorer=KeyDiffScorer(), compact=compact).cache
    meta = codec.EpisodeMeta("tiny", "keydiff", "compact" if compact else "original", built.next_position, 4)
    tensors, metadata = codec.encode(built, meta)
    ours, theirs = (codec.decode(tensors, metadata)[0] for _ in range(2))
    positions = ours.layers[0].positions                                        # [kv_heads, entries]
    assert positions.shape[-1] == 24 and ours.next_position == (24 if compact else 84)
    if not compact:  # the kept entries' positions have gaps, and differ between heads
        assert int(positions[0, -1]) > 24 and not torch.equal(positions[0], positions[1])
    question = random_ids(9, seed=7, vocab=vocab)
    _same(_greedy(_fed(native), ours, question, 5), _greedy(_fed(reference), theirs, question, 5))


@pytest.mark.parametrize("weights", ["float", "int8", "int4"])
def test_the_decode_step_runs_on_the_native_model(model_dir, weights):
    native, reference = _both(model_dir)
    if weights != "float":
        quantize = {"int8": int8_weights, "int4": int4_weights}[weights].quantize_linears
        quantize(native)
        quantize(reference)
    vocab, layers = native.config.vocab_size, native.config.num_hidden_layers
    step = DecodeStep.for_model(native)
    assert step is not None
    ours, theirs = EpisodeCache(layers), EpisodeCache(layers)
    prompt = random_ids(20, seed=3, vocab=vocab)
    _same([forward(native, ours, prompt)], [forward(reference, theirs, prompt)])
    ids = torch.tensor([[5]])
    for _ in range(4):
        got, expected = step(ours, ids), forward(reference, theirs, ids)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        ids = expected[:, -1:].argmax(-1)


def test_the_loaded_model_is_the_native_one_and_takes_transformers_call(tiny_lm, tiny_model_dir):
    """One model: what feeds transformers' model (ingest's prefill, scorers, profiling's `DynamicCache`, training's
    cacheless call) feeds the native one, with transformers' logits."""
    from transformers import DynamicCache

    assert isinstance(tiny_lm.model, native_llama.NativeLlama)
    reference = with_kvchat_attention(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)).eval()
    vocab, layers = tiny_lm.config.vocab_size, tiny_lm.num_layers
    ids = random_ids(12, seed=6, vocab=vocab)
    torch.testing.assert_close(forward(tiny_lm.model, EpisodeCache(layers), ids),
                               forward(reference, EpisodeCache(layers), ids), atol=1e-6, rtol=1e-6)
    with torch.inference_mode():
        ours, theirs = DynamicCache(), DynamicCache()
        got = tiny_lm.model(input_ids=ids, past_key_values=ours, use_cache=True, logits_to_keep=1).logits
        expected = reference(input_ids=ids, past_key_values=theirs, use_cache=True, logits_to_keep=1).logits
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours.layers[1].keys, theirs.layers[1].keys, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(tiny_lm.model(input_ids=ids, use_cache=False).logits,
                                   reference(input_ids=ids, use_cache=False).logits, atol=1e-6, rtol=1e-6)


def test_a_llama_transformers_loads_runs_as_the_native_model(tmp_path, tiny_model_dir):
    """A Llama kvchat does not build from its file (here: RoPE scaling) loads through transformers and runs as a
    `NativeLlama` holding transformers' modules (its RoPE module too): transformers' logits, the decode step."""
    path = _variant(tmp_path, tiny_model_dir, "scaled-rope",
                    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})
    assert native_llama.load(path, torch.float32, CPU) is None
    lm = load_model(str(path), tmp_path / "models")
    assert isinstance(lm.model, native_llama.NativeLlama) and lm.decode_step is not None
    assert type(lm.model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    reference = with_kvchat_attention(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).eval()
    assert model_fingerprint(lm.fingerprint.split("|")[0], reference) == lm.fingerprint
    layers, vocab = lm.num_layers, lm.config.vocab_size
    ours, theirs = EpisodeCache(layers), EpisodeCache(layers)
    _same([forward(lm.model, ours, random_ids(30, seed=4, vocab=vocab))],
          [forward(reference, theirs, random_ids(30, seed=4, vocab=vocab))])
    ours.reserve(4)
    ids = torch.tensor([[5]])
    for _ in range(4):
        got, expected = lm.decode_step(ours, ids), forward(reference, theirs, ids)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        ids = expected[:, -1:].argmax(-1)


def test_the_stop_tokens_are_the_generation_configs(tiny_model_dir, tmp_path):
    native = load_model(str(tiny_model_dir), tmp_path)
    assert isinstance(native.model, native_llama.NativeLlama)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert native.model.generation_config.eos_token_id == reference.generation_config.eos_token_id
    assert native.stop_ids == {config["eos_token_id"], native.tokenizer.eos_token_id}


def _variant(tmp_path, tiny_model_dir, name: str, config: dict | None = None, tensors: dict | None = None):
    path = tmp_path / name
    path.mkdir()
    for file in tiny_model_dir.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    if config:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(raw | config))
    if tensors:
        save_file(load_file(path / "model.safetensors") | tensors, path / "model.safetensors", {"format": "pt"})
    return path


@pytest.mark.parametrize("name, config, tensors", [
    ("scaled-rope", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, None),
    ("legacy-scaling", {"rope_scaling": {"type": "linear", "factor": 2.0}}, None),
    ("remote-code", {"auto_map": {"AutoModelForCausalLM": "modeling.Model"}}, None),
    ("another-activation", {"hidden_act": "gelu"}, None),
    ("extra-tensor", None, {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
])
def test_a_model_it_does_not_compute_exactly_loads_through_transformers(tmp_path, tiny_model_dir, name, config,
                                                                        tensors):  # fmt: skip
    path = _variant(tmp_path, tiny_model_dir, name, config, tensors)
    assert native_llama.load(path, torch.float32, CPU) is None


def test_another_family_answers_through_transformers(tmp_path):
    path = tmp_path / "qwen"
    tokenizer = tiny_tokenizer()
    tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    lm = load_model(str(path), tmp_path / "models")
    assert type(lm.model).__name__ == "Qwen2ForCausalLM" and lm.decode_step is None
    cache = EpisodeCache(lm.num_layers)
    assert lm.forward(cache, random_ids(8, vocab=len(tokenizer))).shape == (1, 1, len(tokenizer))


@pytest.mark.slow
def test_the_embedded_model_built_natively_is_transformers_own(default_lm):
    """SmolLM2, converted from its GGUF file: the same fingerprint and the same logits for a prefill, a question on
    the cache it left and the answer's steps."""
    directory = default_lm.model.config.name_or_path
    reference = with_kvchat_attention(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)).eval()
    assert model_fingerprint("SmolLM2-135M-Instruct", reference) == default_lm.fingerprint
    layers, vocab = default_lm.num_layers, default_lm.config.vocab_size
    ours, theirs = EpisodeCache(layers), EpisodeCache(layers)
    history, question = random_ids(60, seed=8, vocab=vocab), random_ids(12, seed=9, vocab=vocab)
    _same([forward(default_lm.model, ours, history)], [forward(reference, theirs, history)])
    _same(_greedy(_fed(default_lm.model), ours, question, 4),
          _greedy(lambda c, i: forward(reference, c, i), theirs, question, 4))


ASK_IN_A_NEW_PROCESS = """
import json, sys
from kvchat.cli import run
heavy, question = set(json.loads(sys.argv[1])), sys.argv[2]
for conversation, options in json.loads(sys.argv[3]):
    sys.argv = ["kvchat", "ask", "--local", "--json", *options, "--conversation", conversation, question]
    try:
        run()
    except SystemExit as exc:
        assert not exc.code, exc.code
print(json.dumps(sorted(m for m in sys.modules if m in heavy)))
"""


def test_a_question_is_answered_without_transformers_model_code(tmp_path, tiny_lm, short_lm, encoder):
    """A stored conversation within the model's window (an episode cache) and one beyond it (`--method recall`: a
    compacted cache, recalled chunks prefilled with the question), each asked as `kvchat ask --local` asks, in a
    fresh process: the answers are this process's, and neither transformers' model code nor what it brings
    (torch._dynamo, sympy, SciPy) was imported."""
    store = Store(tmp_path)
    qa = planted_sets(1, topics=6, turns_per_topic=40)[0]
    config = IngestConfig(
        cache=CacheConfig(budget=96, block_size=48, prefill="block", recall=RecallConfig(chunk_tokens=16)),
        episodes=EpisodeConfig(episodes=3, patched_prompt_tokens=48), system_prompt="You are a helpful assistant .\n",
    )
    assert ingest(qa.turns[:40], name="within", config=config, store=store, lm=tiny_lm, encoder=encoder).method != (
        "recall")
    assert ingest(qa.turns, name="beyond", config=config, store=store, lm=short_lm, encoder=encoder).method == "recall"
    question = qa.questions[0].text
    answers = _asked_in_a_new_process(tmp_path, question, [("within", []), ("beyond", [])])
    expected = [Session(store, store.get(name), lm, encoder).ask(question, log=False).text
                for name, lm in (("within", tiny_lm), ("beyond", short_lm))]
    assert [answer["answer"] for answer in answers] == expected


def _asked_in_a_new_process(home, question: str, asks: list[tuple[str, list[str]]]) -> list[dict]:
    """`kvchat ask --local --json [options] --conversation NAME question` for each (NAME, options) in one fresh
    process: the answers' documents, after checking that none of `HEAVY` was imported."""
    process = subprocess.run([sys.executable, "-c", ASK_IN_A_NEW_PROCESS, json.dumps(sorted(HEAVY)), question,
                              json.dumps(asks)], capture_output=True, text=True, env=cli_env(home), timeout=300)
    assert process.returncode == 0, process.stderr
    *answers, imported = process.stdout.strip().splitlines()
    assert json.loads(imported) == []
    return [json.loads(line) for line in answers]


def test_sources_and_quantized_and_paged_caches_are_answered_without_transformers_model_code(tmp_path, tiny_lm,
                                                                                            encoder):
    """`ask --sources` (a recorder in every answer forward), a conversation ingested with `--cache-precision int8`
    (quantized layers) and one with `--offload icecache` (paged layers with a page pool), each asked in a fresh
    process: the answers and sources are those transformers' model gives, and its code was not imported."""
    store = Store(tmp_path)
    qa = planted_sets(1, topics=4, turns_per_topic=16)[0]
    cache = CacheConfig(budget=64, block_size=32, prefill="block")
    episodes = EpisodeConfig(episodes=2, patched_prompt_tokens=48)
    configs = {"int8": CacheConfig(budget=64, block_size=32, prefill="block", precision="int8"),
               "icecache": CacheConfig(budget=64, block_size=32, prefill="block",
                                       offload=OffloadConfig(mode="icecache", retrieve=32, dtype="float32")),
               "plain": cache}
    for name, config in configs.items():
        ingest(qa.turns, name=name, config=IngestConfig(cache=config, episodes=episodes), store=store, lm=tiny_lm,
               encoder=encoder)
    assert store.get("int8").settings["cache_precision"] == "int8"
    assert all(episode.pages is not None for episode in store.get("icecache").episodes)
    question = qa.questions[0].text
    asks = [("plain", ["--sources"]), ("int8", []), ("icecache", []), ("int8", ["--sources"])]
    answers = _asked_in_a_new_process(tmp_path, question, asks)
    reference = AutoModelForCausalLM.from_pretrained(tiny_lm.config.name_or_path, dtype=torch.float32)
    through_transformers = LoadedModel(tiny_lm.spec, tiny_lm.tokenizer, tiny_lm.fingerprint,
                                       with_kvchat_attention(reference).eval())
    for (name, options), answer in zip(asks, answers, strict=True):
        expected = Session(store, store.get(name), through_transformers, encoder).ask(
            question, log=False, sources=bool(options))
        assert answer["answer"] == expected.text
        if options:
            assert answer["sources"] and answer["sources"] == json.loads(json.dumps(
                [dataclasses.asdict(source) for source in expected.sources]))
