"""The KV core on tiny random GQA models: attention, cache bounds, selection, RoPE, decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, tiny_model
from conftest import random_ids as _ids
from conftest import with_kvchat_attention as _with_kvchat_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.kv import codec
from kvchat.kv.attention import AttentionRecorder
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.prefill import block_prefill
from kvchat.kv.rope import reposition_keys
from kvchat.kv.scoring import PatchedPromptScorer, pool_scores, probe_scores, select_top

# Every family (tests/test_families.py), GQA, and MHA on Llama and Gemma2 (4 query heads over 4 KV heads).
FAMILY_CASES = [(arch, 2) for arch in sorted(FAMILIES)] + [("llama", 4), ("gemma2", 4)]


@pytest.mark.parametrize(("arch", "kv_heads"), FAMILY_CASES, ids=[f"{a}-{'mha' if k == 4 else 'gqa'}"
                                                                  for a, k in FAMILY_CASES])
def test_block_prefill_without_eviction_matches_one_shot_forward(arch, kv_heads):
    """Our attention + cache, fed in blocks, gives the logits of the stock model on the whole input (its own
    attention: eager for Gemma2, which applies the softcap; biases, q/k norms and query scales included)."""
    reference = tiny_model(arch, kv_heads=kv_heads)
    ours = _with_kvchat_attention(tiny_model(arch, kv_heads=kv_heads))
    prefix, context, question = _ids(5, 1), _ids(90, 2), _ids(7, 3)
    result = block_prefill(ours, prefix, context, block_size=16, budgets=None, scorer=None)
    got = forward(ours, result.cache, question, last_logits_only=False)[0]
    with torch.no_grad():
        want = reference(torch.cat([prefix, context, question], dim=-1)).logits[0, -7:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_probe_scores_are_eq3_max_over_prompt_queries_and_gqa_group(model):
    """Scores equal the eager attention weights of the prompt rows, maxed over rows and group heads."""
    context, prompt = _ids(40, 4), _ids(6, 5)
    cache = EpisodeCache(2)
    forward(model, cache, context)
    scores = probe_scores(model, cache, prompt)
    assert cache.sizes == [40, 40] and cache.next_position == 40  # the probe left nothing behind

    eager = tiny_model("llama")
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attn = eager(torch.cat([context, prompt], -1), output_attentions=True).attentions
    for layer, weights in enumerate(attn):
        rows = weights[0, :, 40:, :40]                       # [q_heads, prompt, context]
        want = rows.reshape(2, 2, 6, 40).amax(dim=(1, 2))    # GQA group of 2 query heads per KV head
        torch.testing.assert_close(scores[layer], want, rtol=1e-4, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(
    history=st.integers(1, 400),
    budget=st.integers(20, 120),
    block=st.integers(16, 96),
    prompt=st.integers(1, 12),
)
def test_cache_never_exceeds_budget_plus_block(model, history, budget, block, prompt):
    prefix = _ids(4, 6)
    scorer = PatchedPromptScorer(_ids(prompt, 7))
    result = block_prefill(
        model, prefix, _ids(history, 8), block_size=block, budgets=[budget, budget], scorer=scorer
    )
    assert result.peak_layer_entries <= budget + block + prompt
    assert max(result.cache.sizes) <= max(budget, 4 + history)
    assert result.cache.next_position == 4 + history  # original positions: logical length kept


def test_peak_is_flat_in_history_length(model):
    """The product's promise: peak entries do not grow with the history."""
    scorer = PatchedPromptScorer(_ids(8, 9))
    peaks = [
        block_prefill(model, _ids(4, 6), _ids(n, 10), block_size=32, budgets=[64, 64], scorer=scorer).peak_layer_entries
        for n in (200, 800, 1600)
    ]
    assert peaks[0] == peaks[1] == peaks[2] <= 64 + 32 + 8


def test_kept_entries_are_exactly_the_top_scored():
    torch.manual_seed(0)
    scores = torch.rand(2, 50)
    index = select_top(scores, budget=20, protected=3)
    for head in range(2):
        kept = set(index[head].tolist())
        assert {0, 1, 2} <= kept
        rest = torch.topk(scores[head, 3:], 17).indices + 3
        assert kept == {0, 1, 2} | set(rest.tolist())
        assert index[head].tolist() == sorted(kept)  # position order preserved
    assert select_top(scores, budget=50, protected=3) is None


def test_eviction_keeps_what_the_scorer_ranks_highest(model):
    """End to end through the prefill loop: a scorer that prefers even positions keeps exactly them."""

    class EvenPositions:
        transient_tokens = 0

        def __call__(self, model, cache, block):
            return [(layer.positions % 2 == 0).float() + layer.positions * 1e-6 for layer in cache.layers]

    result = block_prefill(model, _ids(2, 1), _ids(60, 2), block_size=16, budgets=[20, 20], scorer=EvenPositions())
    for layer in result.cache.layers:
        positions = layer.positions[0].tolist()
        assert positions[:2] == [0, 1]  # protected system prompt
        assert all(p % 2 == 0 for p in positions[2:])
        assert positions[2:] == list(range(62 - 2 * 18, 62, 2))  # the latest even ones win the tie-breaker


def test_pooling_spreads_a_peak_to_its_neighbours():
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    assert pool_scores(scores, 3).tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
    assert pool_scores(scores, 1) is scores


def test_rerotation_matches_rope_applied_at_the_new_positions(model):
    """Layer-0 keys depend only on token and position: compute them at p, move them to p', compare."""
    ids = _ids(12, 11)
    at_p = EpisodeCache(2)
    at_p.next_position = 100
    forward(model, at_p, ids)
    at_new = EpisodeCache(2)
    at_new.next_position = 7
    forward(model, at_new, ids)
    old = at_p.layers[0].positions
    new = at_new.layers[0].positions
    moved = reposition_keys(at_p.layers[0].keys, old, new, model.model.rotary_emb)
    torch.testing.assert_close(moved, at_new.layers[0].keys, rtol=1e-4, atol=1e-5)


def test_compact_makes_positions_contiguous_and_keeps_attention_consistent(model):
    scorer = PatchedPromptScorer(_ids(4, 12))
    result = block_prefill(
        model, _ids(3, 1), _ids(200, 2), block_size=32, budgets=[40, 40], scorer=scorer, compact=True
    )
    cache = result.cache
    for layer in cache.layers:
        assert layer.positions.tolist() == [list(range(40))] * 2
    assert cache.next_position == 40


def test_rollback_restores_the_cache_exactly(model):
    cache = block_prefill(model, _ids(3, 1), _ids(50, 2), block_size=16, budgets=None, scorer=None).cache
    before = {k: v.clone() for k, v in codec.encode_layers(cache).items()}
    mark = cache.checkpoint()
    forward(model, cache, _ids(9, 3))
    cache.rollback(mark)
    after = codec.encode_layers(cache)
    assert cache.next_position == 53
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_rollback_into_a_forwards_tokens_keeps_those_before_the_mark_it_extends(model):
    cache = block_prefill(model, _ids(3, 1), _ids(50, 2), block_size=16, budgets=None, scorer=None).cache
    mark = cache.checkpoint()
    forward(model, cache, _ids(9, 3))
    kept = codec.encode_layers(cache)
    cache.rollback(mark.extended(6))  # the 9 tokens' first 6 stay, as the forward cached them
    after = codec.encode_layers(cache)
    assert cache.next_position == 53 + 6 and all(layer.positions[0, -1] == 58 for layer in cache.layers)
    assert all(torch.equal(after[k], kept[k][:, :-3]) for k in after)


def test_tensors_round_trip(model):
    cache = block_prefill(
        model, _ids(3, 1), _ids(70, 2), block_size=16, budgets=[30, 30], scorer=PatchedPromptScorer(_ids(3, 4))
    ).cache
    tensors = codec.encode_layers(cache)
    assert set(tensors) == {"k.0", "v.0", "pos.0", "k.1", "v.1", "pos.1"}
    assert tensors["k.0"].shape == (2, 30, 16) and tensors["pos.0"].dtype == torch.int32
    back = codec.decode_layers(tensors, next_position=cache.next_position, protected=3)
    assert all(torch.equal(a, b) for a, b in zip(tensors.values(), codec.encode_layers(back).values(), strict=True))


def test_recorder_only_scores_entries_cached_before_the_forward(model):
    cache = EpisodeCache(2)
    forward(model, cache, _ids(10, 1))
    recorder = AttentionRecorder()
    with cache.probing():
        forward(model, cache, _ids(4, 2), recorder=recorder)
    assert recorder.scores[0].shape == (2, 10)
    assert cache.sizes == [10, 10]


def test_peaks_are_measured_where_entries_are_added(model):
    cache = EpisodeCache(2)
    forward(model, cache, _ids(10, 1))
    assert (cache.peak_layer_entries, cache.peak_total_entries) == (10, 20)
    with cache.probing():  # the probe's 4 tokens sit in one layer at a time
        forward(model, cache, _ids(4, 2))
    assert (cache.peak_layer_entries, cache.peak_total_entries) == (14, 24)


def test_a_recorder_may_ask_for_the_last_queries_only(model):
    """CAKE's window needs only the block's last queries: the same rows as the full weights, mask included."""

    class Weights:
        def __init__(self, rows):
            self.query_rows, self.weights = rows, {}

        def record(self, view):
            self.weights[view.layer_idx] = view.weights

    cache = EpisodeCache(2)
    forward(model, cache, _ids(10, 1))
    full, last = Weights(None), Weights(3)
    with cache.probing():
        forward(model, cache, _ids(6, 2), recorder=full)
        forward(model, cache, _ids(6, 2), recorder=last)
    for layer in (0, 1):
        assert last.weights[layer].shape == (2, 2, 3, 16)
        torch.testing.assert_close(last.weights[layer], full.weights[layer][..., -3:, :])
