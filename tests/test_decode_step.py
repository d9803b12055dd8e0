"""`kvchat.model.decode_step.DecodeStep`: one answer token through the native Llama's layers without a forward's
bookkeeping computes what the model's forward does, and so does its CUDA graph (kvchat.model.cuda_graph_step)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model, with_kvchat_attention

from kvchat.kv.cache import RaggedLayer
from kvchat.kv.forward import forward
from kvchat.kv.prefill import block_prefill
from kvchat.model import int4_weights, int8_weights, native_llama
from kvchat.model.cuda_graph_step import CudaGraphStep
from kvchat.model.decode_step import DecodeStep


def _step(model: torch.nn.Module) -> DecodeStep:
    """The decode step of transformers' Llama `model`, through the native Llama holding its modules."""
    step = DecodeStep.for_model(native_llama.from_transformers(model))
    assert step is not None
    return step


def _prefilled(model: torch.nn.Module, n: int = 40):
    vocab = model.config.vocab_size
    with torch.inference_mode():
        return block_prefill(model, random_ids(4, vocab=vocab), random_ids(n, seed=2, vocab=vocab), block_size=16,
                             budgets=None, scorer=None).cache


def _decode_both_ways(model: torch.nn.Module, step: DecodeStep | CudaGraphStep, tokens: int = 6):
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
    pairs, fast, slow = _decode_both_ways(model, _step(model))
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # weights regrouped, not changed
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
    forward(native_llama.from_transformers(model), _prefilled(model), torch.tensor([[9]]))  # regroups the weights
    torch.testing.assert_close(forward(model, _prefilled(model), torch.tensor([[9]])), expected, atol=0, rtol=0)


def test_models_and_caches_it_does_not_compute_exactly_take_the_forward():
    qwen = with_kvchat_attention(tiny_model("qwen2"))  # attention biases
    assert native_llama.from_transformers(qwen) is None and DecodeStep.for_model(qwen) is None
    model = with_kvchat_attention(tiny_model("llama"))
    step = _step(model)
    cache = _prefilled(model)
    assert not step.applies(cache, torch.tensor([[5, 6]]))  # more than one token
    cache.layers[0] = RaggedLayer.from_uniform(cache.layers[0])
    assert not step.applies(cache, torch.tensor([[5]]))  # a ragged layer


def test_generate_answers_the_same_through_the_step_and_the_forward(tiny_lm):
    from kvchat.model.llm import generate

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


def _decode_static(step: DecodeStep, cache, tokens: int):
    """Greedy tokens on `cache` through the static step (the computation a CUDA graph records; on the CPU, run as
    it is), re-made whenever the cache's buffers change, as `CudaGraphStep` records again: logits of each."""
    from kvchat.model.cuda_graph_step import StaticStep, graphable

    ids, static, out = torch.tensor([[7]], device=cache.layers[0].keys.device), None, []
    with torch.inference_mode():
        for _ in range(tokens):
            assert graphable(cache)
            if static is None or static.key != _key(cache):
                static = StaticStep(step, cache)
            static.load(cache, ids)
            logits = static.run()
            StaticStep.advance(cache)
            out.append(logits.clone())
            ids = logits[:, -1:].argmax(-1)
    return out


def _key(cache):
    from kvchat.model.cuda_graph_step import _buffers_key

    return _buffers_key(cache)


def test_the_static_step_a_cuda_graph_records_gives_the_steps_logits_and_cache():
    """The step over fixed buffers (write index and position from tensors, attention over the whole room with a
    mask of the live entries) computes what the step computes and leaves the cache as `append_token` does; room
    holding garbage (NaN) beyond the live entries changes nothing."""
    model = with_kvchat_attention(tiny_model("llama", seed=3, kv_heads=2))
    step = _step(model)
    pairs, _, slow = _decode_both_ways(model, step)
    cache = _prefilled(model)
    cache.reserve(len(pairs))
    with torch.inference_mode():
        for layer in cache.layers:
            keys, values, _ = layer.buffers
            keys[:, :, layer.size :], values[:, :, layer.size :] = float("nan"), float("nan")
    for (expected, _), got in zip(pairs, _decode_static(step, cache, len(pairs)), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.next_position == slow.next_position
    for a, b in zip(cache.layers, slow.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.positions, b.positions)
    room = cache.layers[0].writable_room
    with pytest.raises(ValueError, match=f"only {room} fit"):
        cache.layers[0].extend(room + 1)


def test_a_dynamic_rope_is_never_recorded_in_a_cuda_graph():
    """NTK-dynamic RoPE recomputes its frequencies from the position on the host, which a graph cannot replay."""
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert CudaGraphStep(_step(with_kvchat_attention(dynamic))).cuda_graphs is False
    assert CudaGraphStep(_step(with_kvchat_attention(tiny_model("llama")))).cuda_graphs is True


class _Unrecordable(CudaGraphStep):
    """A graphed step whose graph cannot be recorded (a kernel a graph cannot hold)."""

    def _run_graph(self, cache, ids):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_cuda_graph_that_cannot_be_recorded_leaves_the_step_answering_without_graphs(caplog):
    """A step whose graph fails says so once, turns graphs off and leaves the cache as it was, so the eager step
    feeds the token as if no graph had been tried."""
    model = with_kvchat_attention(tiny_model("llama", seed=3, kv_heads=2))
    graphed = _Unrecordable(_step(model))
    cache = _prefilled(model)
    cache.reserve(1)
    sizes, position = cache.sizes, cache.next_position
    with caplog.at_level("WARNING", logger="kvchat"), torch.inference_mode():
        assert graphed._replayed(cache, torch.tensor([[7]])) is None
    assert "answering without CUDA graphs: operation not permitted" in caplog.text
    assert graphed.cuda_graphs is False and graphed._graph is None
    assert cache.sizes == sizes and cache.next_position == position
    pairs, _, _ = _decode_both_ways(model, graphed, tokens=2)
    for expected, got in pairs:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_step_replays_a_cuda_graph_and_answers_as_without_it(tiny_model_dir, tmp_path):
    """`generate` on CUDA through the graphed step (recorded once per set of buffers, replayed per token) answers
    what the un-graphed step answers, across questions that reuse the buffers and one that grows them."""
    from kvchat.model.device import Placement
    from kvchat.model.llm import generate, load_model

    lm = load_model(str(tiny_model_dir), tmp_path, placement=Placement(torch.device("cuda"), torch.float32))
    vocab = lm.model.config.vocab_size
    with torch.inference_mode():
        cache = block_prefill(lm.model, random_ids(4, vocab=vocab).cuda(), random_ids(40, seed=2, vocab=vocab).cuda(),
                              block_size=16, budgets=None, scorer=None).cache
    mark = cache.checkpoint()
    answers = {}
    for graphs in (False, True):
        lm.decode_step.cuda_graphs = graphs
        answers[graphs] = []
        for seed, tokens in ((9, 12), (10, 12), (11, 40)):  # the third needs more room: new buffers, a new graph
            question = random_ids(5, seed=seed, vocab=vocab).cuda()
            answers[graphs].append(list(generate(lm, cache, question, tokens, stop_ids=())))
            cache.rollback(mark)
    assert lm.decode_step._graph is not None
    assert answers[True] == answers[False]
