"""The model families users bring (kvchat.kv.families), on tiny random-weight configs: ingest + ask run end to
end on each, what cannot work is refused in one line. That kvchat's attention gives the stock model's logits on
every family is tests/test_kv.py's test_block_prefill_without_eviction_matches_one_shot_forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import run_main
from conftest import FAMILIES, random_ids, tiny_model, tiny_tokenizer, with_kvchat_attention
from transformers import GPT2Config, GPT2LMHeadModel

from kvchat.errors import UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.kv import families
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.prefill import block_prefill

# (family, KV heads): GQA everywhere, MHA on Llama and Gemma2 (4 query heads over 4 KV heads).
CASES = [(arch, 2) for arch in sorted(FAMILIES)] + [("llama", 4), ("gemma2", 4)]
TINY = ("--budget", "64", "--setting", "block_size=32", "--episodes", "2")


def _ids(case) -> str:
    arch, kv = case
    return f"{arch}-{'mha' if kv == 4 else 'gqa'}"


def test_the_softcap_is_applied_not_ignored():
    """Gemma2's tiny config caps logits at 0.5: without the cap the logits differ (so test_kv's comparison with
    the stock model checks the cap)."""
    capped = tiny_model("gemma2")
    uncapped = tiny_model("gemma2", attn_logit_softcapping=None)
    ids = random_ids(40, 4)
    with torch.no_grad():
        assert not torch.allclose(capped(ids).logits, uncapped(ids).logits, atol=1e-3)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_ragged_heads_under_eviction_match_per_head_eager_attention(arch):
    """Adaptive head budgets (ragged layers) on a family with biases / softcap: decoding over the evicted cache
    equals the stock model's eager attention restricted, per KV head, to what that head kept. One layer: its
    keys and values depend on the tokens alone, so the stock model's are the cached ones."""
    from kvchat.kv.scoring import PatchedPromptScorer

    ours = with_kvchat_attention(tiny_model(arch, layers=1))
    prefix, context, prompt = random_ids(4, 1), random_ids(120, 2), random_ids(12, 5)
    result = block_prefill(ours, prefix, context, block_size=32, budgets=[40], scorer=PatchedPromptScorer(prompt),
                           heads=HeadBudgets("adaptive"))
    assert any(layer.ragged for layer in result.cache.layers)
    token = random_ids(1, 6)
    got = forward(ours, result.cache, token)[0, -1]
    want = _masked_reference(tiny_model(arch, layers=1), torch.cat([prefix, context, token], dim=-1), result.cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _masked_reference(model, ids, cache) -> torch.Tensor:
    """The last token's logits from the stock eager model, each layer's KV head h seeing only the positions
    its cache kept (plus the token itself): a 4D mask per layer through a forward pre-hook."""
    model.set_attn_implementation("eager")
    n = ids.shape[-1]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    masks = []
    for layer in cache.layers:
        visible = torch.zeros(model.config.num_attention_heads, n, n, dtype=torch.bool)
        visible[:, :, -1] = True
        for h, positions in enumerate(layer.positions):
            visible[h * group : (h + 1) * group, -1, positions[positions < n - 1]] = True
        visible[:, :-1] = torch.ones(n - 1, n, dtype=torch.bool).tril()  # earlier rows: never read
        masks.append(torch.where(visible, 0.0, float("-inf"))[None])

    def hook(module, args, kwargs):
        kwargs["attention_mask"] = masks[module.layer_idx]
        return args, kwargs

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            return model(ids).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()


def _model_dir(root: Path, arch: str, kv_heads: int, **settings) -> Path:
    path = root / f"{arch}-{kv_heads}"
    if not (path / "config.json").is_file():
        tokenizer = tiny_tokenizer()
        tiny_model(arch, vocab_size=len(tokenizer), kv_heads=kv_heads, **settings).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hist") / "planted.json"
    path.write_text(json.dumps(planted_conversation(seed=2, topics=2, turns_per_topic=8)[0]))
    return path


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ingest_and_ask_end_to_end(case, tmp_path, history):
    arch, kv_heads = case
    model = _model_dir(tmp_path, arch, kv_heads)
    home = tmp_path / "home"
    ingested = run_main(home, "ingest", str(history), "--model", str(model), *TINY,
                        "--setting", "head_budgets=adaptive", "--json")
    assert ingested.returncode == 0, ingested.stderr
    report = json.loads(ingested.stdout)
    assert report["episode_count"] == 2 and report["attention_backend"] == "torch"
    asked = run_main(home, "ask", "What did Maya say?", "--max-new-tokens", "4", "--json")
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["answer_tokens"] >= 0


def test_sliding_window_layers_beyond_their_window_are_refused(tmp_path, history):
    """Gemma2 with a 64-token window: the history does not fit it, so ingest refuses in one line."""
    model = _model_dir(tmp_path, "gemma2", 2, sliding_window=64)
    result = run_main(tmp_path / "home", "ingest", str(history), "--model", str(model), *TINY)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "sliding-window attention layers of 64 tokens" in lines[0], result.stderr
    assert not (tmp_path / "home" / "kvchat.db").exists() or "planted" not in run_main(tmp_path / "home", "list").stdout


def test_sliding_window_rule():
    mistral, gemma3 = FAMILIES["mistral"][0], FAMILIES["gemma3"][0]
    assert families.sliding_window(mistral(sliding_window=None)) is None
    assert families.sliding_window(mistral(sliding_window=4096)) == 4096  # Mistral v0.1: every layer slides
    assert families.sliding_window(FAMILIES["qwen2"][0]()) is None       # use_sliding_window off by default
    assert families.sliding_window(gemma3(num_hidden_layers=6, sliding_window=512)) == 512
    families.check_context(gemma3(sliding_window=512), 512, "m")
    with pytest.raises(UserError, match="sliding-window"):
        families.check_context(gemma3(sliding_window=512), 513, "m")
    with pytest.raises(UserError, match="compact positions are not supported"):
        families.check_positions(gemma3(), "compact", "m")
    families.check_positions(FAMILIES["llama"][0](), "compact", "m")


def test_a_forward_past_the_window_is_refused():
    """A long question on a history that fitted: the forward that would see past the window is refused."""
    model = with_kvchat_attention(tiny_model("gemma2", sliding_window=64))
    result = block_prefill(model, random_ids(4, 1), random_ids(50, 2), block_size=16, budgets=None, scorer=None)
    forward(model, result.cache, random_ids(10, 3))  # 64 in all: fits
    with pytest.raises(UserError, match="sliding-window"):
        forward(model, result.cache, random_ids(1, 4))


def test_a_model_without_rotary_embeddings_is_refused_at_load(tmp_path):
    path = tmp_path / "gpt2"
    tokenizer = tiny_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "x.json").write_text(json.dumps(messages))
    result = run_main(tmp_path / "home", "ingest", str(tmp_path / "x.json"), "--model", str(path))
    assert result.returncode == 2
    assert result.stderr.strip().endswith("this one has none") and len(result.stderr.strip().splitlines()) == 1


def test_ask_refuses_an_answer_that_would_pass_the_window_before_decoding(tmp_path, history):
    """The window must hold the history, the question and --max-new-tokens: refused up front, in one line."""
    model = _model_dir(tmp_path, "gemma2", 2)
    home = tmp_path / "home"
    ingested = run_main(home, "ingest", str(history), "--model", str(model), *TINY, "--json")
    assert ingested.returncode == 0, ingested.stderr
    config = json.loads((model / "config.json").read_text())
    config["sliding_window"] = json.loads(ingested.stdout)["history_tokens"] + 100  # same weights, smaller window
    (model / "config.json").write_text(json.dumps(config))
    fits = run_main(home, "ask", "Where?", "--max-new-tokens", "8", "--json")
    assert fits.returncode == 0, fits.stderr
    refused = run_main(home, "ask", "Where?", "--max-new-tokens", "200")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "sliding-window attention layers" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
