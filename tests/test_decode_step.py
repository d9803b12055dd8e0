"""`kvchat.decode_step.DecodeStep`: one answer token in few torch calls computes what the model's forward does."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model, with_kvchat_attention

from kvchat import int4_weights, int8_weights
from kvchat.decode_step import DecodeStep
from kvchat.kv.cache import RaggedLayer
from kvchat.kv.forward import forward
from kvchat.kv.prefill import block_prefill


def _prefilled(model: torch.nn.Module, n: int = 40):
    vocab = model.config.vocab_size
    with torch.inference_mode():
        return block_prefill(model, random_ids(4, vocab=vocab), random_ids(n, seed=2, vocab=vocab), block_size=16,
                             budgets=None, scorer=None).cache


def _decode_both_ways(model: torch.nn.Module, step: DecodeStep, tokens: int = 6):
    """Greedy tokens from the same cache through the model's forward and through `step`: logits of each."""
    fast, slow = _prefilled(model), _prefilled(model)
    fast.reserve(tokens)
    slow.reserve(tokens)
    ids = torch.tensor([[7]])
    pairs = []
    for _ in range(tokens):
        assert step.applies(fast, ids)
        expected, got = forward(model, slow, ids), step(fast, ids)
        pairs.append((expected, got))
        ids = expected[:, -1:].argmax(-1)
    return pairs, fast, slow


@pytest.mark.parametrize(("weights", "kv_heads"), [("float", 2), ("int8", 2), ("int4", 2), ("int4", 4)])
def test_the_decode_step_gives_the_forwards_logits_and_cache(weights, kv_heads):
    """int4 with 2 KV heads: key and value rows (32) that do not fill the kernel's packed blocks, multiplied one by
    one; with 4 (64 rows) the query, key and value rows are one product."""
    model = with_kvchat_attention(tiny_model("llama", seed=3, kv_heads=kv_heads))
    if weights != "float":
        {"int8": int8_weights, "int4": int4_weights}[weights].quantize_linears(model)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    step = DecodeStep.for_model(model)
    assert step is not None
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # weights regrouped, not changed
    pairs, fast, slow = _decode_both_ways(model, step)
    for expected, got in pairs:
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert fast.next_position == slow.next_position
    for a, b in zip(fast.layers, slow.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.positions, b.positions)


def test_the_model_forward_is_unchanged_by_the_regrouped_weights():
    model = with_kvchat_attention(tiny_model("llama", seed=4))
    expected = forward(model, _prefilled(model), torch.tensor([[9]]))
    DecodeStep.for_model(model)
    torch.testing.assert_close(forward(model, _prefilled(model), torch.tensor([[9]])), expected, atol=0, rtol=0)


def test_models_and_caches_it_does_not_compute_exactly_take_the_forward():
    assert DecodeStep.for_model(with_kvchat_attention(tiny_model("qwen2"))) is None  # attention biases
    model = with_kvchat_attention(tiny_model("llama"))
    step = DecodeStep.for_model(model)
    cache = _prefilled(model)
    assert not step.applies(cache, torch.tensor([[5, 6]]))  # more than one token
    cache.layers[0] = RaggedLayer.from_uniform(cache.layers[0])
    assert not step.applies(cache, torch.tensor([[5]]))  # a ragged layer


def test_generate_answers_the_same_through_the_step_and_the_forward(tiny_lm):
    from kvchat.llm import generate

    assert tiny_lm.decode_step is not None
    cache, question = _prefilled(tiny_lm.model), random_ids(5, seed=9, vocab=tiny_lm.model.config.vocab_size)
    mark = cache.checkpoint()
    fast = list(generate(tiny_lm, cache, question, 12, stop_ids=()))
    cache.rollback(mark)
    slow = []
    logits = forward(tiny_lm.model, cache, question)
    for _ in range(12):
        slow.append(int(logits[0, -1].argmax()))
        logits = forward(tiny_lm.model, cache, torch.tensor([[slow[-1]]]))
    assert fast == slow
