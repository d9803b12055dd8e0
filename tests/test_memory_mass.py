"""IndexMem's mass readout (`IndexMemConfig.readout = "mass"`, kvchat.kv.latent): the memory's entries join
attention's softmax as extra mass, weighed against attention's own log-sum-exp over the entries it attends to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from memory_helpers import logits_with_shut_and_without_memory

from kvchat.config import CacheConfig, EpisodeConfig, IndexMemConfig, IngestConfig, TrainConfig
from kvchat.ingest.pipeline import ingest
from kvchat.kv import codec
from kvchat.kv.attention import HeadList, kvchat_attention
from kvchat.kv.indexer import IndexMemShape
from kvchat.kv.latent import LatentMemory, MemoryWeights
from kvchat.kv.trained import TrainedIndexMem, read_metadata
from kvchat.store import Store
from kvchat.training import default_out, train

SMALL = TrainConfig(steps=3, chunk_tokens=96, train_chunks=4, held_out_chunks=2, checkpoint_every=2, warmup=1,
                    memory_queries=16, memory_budgets=(40, 56), memory_block=24, memory_min_gain=float("-inf"))
SHAPE = IndexMemShape(layers=1, q_heads=4, kv_heads=2, head_dim=8, hidden=32, index_heads=1, index_dim=1,
                      memory_dim=4)
SCALE = 8**-0.5
AS_TRAINED = IndexMemConfig(mass_scale=1.0)  # the whole correction: what the exact cases compare


class _IdentityRotary(torch.nn.Module):
    """RoPE that rotates nothing: pre- and post-RoPE keys and queries are the same, so a hand-built feature
    map can reproduce attention's own logits."""

    def forward(self, x, position_ids):
        shape = (*position_ids.shape, x.shape[-1])
        return torch.ones(shape), torch.zeros(shape)


class _Layer(torch.nn.Module):
    layer_idx = 0


def _exp_kernel_memory(evicted_key: torch.Tensor, gamma: float = 0.0) -> MemoryWeights:
    """phi(x) = exp(SCALE k.x) in every feature and c = -SCALE |k|^2 - log d_mem, so for the one evicted key k,
    exp(c) phi(q).phi(k) = exp(SCALE q.k) for every q: the memory's mass is exactly the evicted entry's (times
    the distance decay exp(-gamma (t - p)))."""
    weights = MemoryWeights(SHAPE, "mass")
    with torch.no_grad():
        weights.decay_rate.fill_(gamma)
        weights.phi[0].weight.copy_((SCALE * evicted_key).expand(SHAPE.memory_dim, -1))
        weights.gate[0].bias.fill_(40.0)  # g = 1 (log g = -4e-18)
        weights.log_scale[0] = -SCALE * evicted_key.dot(evicted_key) - torch.log(torch.tensor(SHAPE.memory_dim))
    return weights


def _attend(query, keys, values, memory=None):
    position_ids = torch.arange(20, 20 + query.shape[2])[None]
    reader = None if memory is None else memory.readout(_IdentityRotary(), position_ids)
    out, _ = kvchat_attention(_Layer(), query, keys, values, None, SCALE, kvchat_memory=reader)
    return out


def test_with_nothing_written_the_mass_readout_returns_attention_exactly():
    torch.manual_seed(0)
    weights = MemoryWeights(SHAPE, "mass")
    with torch.no_grad():
        weights.gate[0].bias.fill_(40.0)
        weights.log_scale[0] = 5.0
    memory = LatentMemory(weights, AS_TRAINED)
    query, keys, values = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    assert torch.equal(_attend(query, keys, values, memory), _attend(query, keys, values))


@pytest.mark.parametrize("ragged", [False, True])
def test_exp_kernel_features_give_full_attention_over_kept_and_evicted_entries(ragged):
    """One evicted entry per KV head (the same key, each head its own value), phi matching exp(SCALE q.k):
    the mass readout over the kept entries equals full attention over kept + evicted, for a multi-token
    question (causal among its own tokens), uniform or ragged (per-head lengths) layers."""
    torch.manual_seed(1)
    evicted_key, evicted_values = torch.randn(8), torch.randn(2, 8)
    memory = LatentMemory(_exp_kernel_memory(evicted_key), AS_TRAINED)
    memory.write(0, [(evicted_key[None], evicted_values[h, None], torch.tensor([3])) for h in range(2)],
                 _IdentityRotary())
    query = torch.randn(1, 4, 3, 8)
    lengths = (6, 4) if ragged else (6, 6)
    keys = [torch.randn(1, 1, n + 3, 8) for n in lengths]  # kept entries, then the question's 3 tokens
    values = [torch.randn(1, 1, n + 3, 8) for n in lengths]
    full_k = [torch.cat([evicted_key.view(1, 1, 1, 8), k], 2) for k in keys]
    full_v = [torch.cat([evicted_values[h].view(1, 1, 1, 8), v], 2) for h, v in enumerate(values)]
    if ragged:
        ours = _attend(query, HeadList(keys), HeadList(values), memory)
        full = _attend(query, HeadList(full_k), HeadList(full_v))
    else:
        ours = _attend(query, torch.cat(keys, 1), torch.cat(values, 1), memory)
        full = _attend(query, torch.cat(full_k, 1), torch.cat(full_v, 1))
    plain = _attend(query, HeadList(keys), HeadList(values))
    assert (full - plain).abs().max() > 1e-2  # the evicted entry matters
    assert torch.allclose(ours, full, atol=1e-5, rtol=0)


def test_the_distance_decay_weighs_the_evicted_entry_by_its_distance_to_each_query():
    """With gamma > 0 the memory's mass for an entry evicted at p and a query at t is exp(SCALE q.k - gamma
    (t - p)): full attention with that bias on the evicted logit. Written in two evictions (the state rebased
    to the later one) it reads the same as computed by hand."""
    torch.manual_seed(3)
    gamma, evicted_key, evicted_values = 0.05, torch.randn(8), torch.randn(2, 8)
    memory = LatentMemory(_exp_kernel_memory(evicted_key, gamma), AS_TRAINED)
    rotary = _IdentityRotary()
    memory.write(0, [(evicted_key[None], evicted_values[h, None], torch.tensor([3])) for h in range(2)], rotary)
    memory.write(0, [(torch.zeros(0, 8), torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)),
                     (evicted_key[None], torch.zeros(1, 8), torch.tensor([11]))], rotary)  # moves the reference
    assert float(memory.ref[0]) == 11.0
    query, keys, values = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    ours = _attend(query, keys, values, memory)                                  # queries at positions 20..22
    expected = torch.empty_like(ours)
    for head in range(4):
        kv = head // 2
        for i, t in enumerate(range(20, 23)):
            visible = 6 + i + 1                                                  # 6 kept entries, then causal
            logits = SCALE * keys[0, kv, :visible] @ query[0, head, i]
            vals = [values[0, kv, :visible]]
            extra = [SCALE * evicted_key @ query[0, head, i] - gamma * (t - 3)]
            vals.append(evicted_values[kv, None])
            if kv == 1:                                                          # head 1 also evicted at 11
                extra.append(SCALE * evicted_key @ query[0, head, i] - gamma * (t - 11))
                vals.append(torch.zeros(1, 8))
            weights = torch.cat([logits, torch.stack(extra)]).softmax(-1)
            expected[0, i, head] = weights @ torch.cat(vals)
    assert torch.allclose(ours, expected, atol=1e-5, rtol=0)


def test_a_shut_gate_makes_the_mass_readout_a_no_op_and_mass_scale_scales_its_correction():
    torch.manual_seed(2)
    evicted_key = torch.randn(8)
    weights = _exp_kernel_memory(evicted_key)
    memory = LatentMemory(weights, AS_TRAINED)
    memory.write(0, [(evicted_key[None], torch.randn(1, 8), torch.tensor([3])) for _ in range(2)], _IdentityRotary())
    query, keys, values = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    plain = _attend(query, keys, values)
    assert not torch.equal(_attend(query, keys, values, memory), plain)
    half = LatentMemory(weights, IndexMemConfig(mass_scale=0.5), memory.m, memory.b, memory.ref)
    full_correction = _attend(query, keys, values, memory) - plain
    assert torch.allclose(_attend(query, keys, values, half) - plain, 0.5 * full_correction, atol=1e-6)
    with torch.no_grad():
        weights.gate[0].bias.fill_(-1e4)
    assert torch.equal(_attend(query, keys, values, memory), _attend(query, keys, values))


@pytest.fixture(scope="module")
def mass_home(tmp_path_factory, tiny_lm, history) -> Path:
    home = tmp_path_factory.mktemp("home")
    train(tiny_lm, default_out(home, tiny_lm), SMALL, files=[history], indexmem=IndexMemConfig(readout="mass"))
    return home


def test_training_writes_a_mass_memory_with_data_set_log_scales(mass_home):
    path = next((mass_home / "profiles").glob("*.indexmem.safetensors"))
    trained = TrainedIndexMem.load(path)
    assert trained.config.readout == "mass" and trained.memory.readout == "mass"
    assert json.loads(read_metadata(path)["config"])["readout"] == "mass"
    assert trained.memory.log_scale.abs().min() > 0  # set from the data (L_K - log phi(q).z), not left at 0
    assert set(trained.metrics["memory"]["residual_removed"]) == {"40", "56"}


def test_a_mass_memory_round_trips_through_the_store_and_changes_the_answer_unless_shut(mass_home, tiny_lm,
                                                                                         encoder, history):

    store = Store(mass_home)
    config = IngestConfig(cache=CacheConfig(method="indexmem", budget=48, block_size=32, prefill="block"),
                          episodes=EpisodeConfig(patched_prompt_tokens=48))
    ingest(history, name="mass", config=config, store=store, lm=tiny_lm, encoder=encoder, replace=True)
    tensors, metadata = store.load_episode(store.get("mass").episodes[0], tiny_lm.fingerprint)
    assert metadata["format_version"] == codec.MASS_MEMORY_FORMAT_VERSION
    cache, _ = codec.decode(tensors, metadata, dtype=tiny_lm.dtype)  # the model's dtype, as an answer decodes it
    trained = TrainedIndexMem.load(next((mass_home / "profiles").glob("*.indexmem.safetensors")))
    assert cache.memory.weights.readout == "mass" and cache.memory.b[0].min() >= 0  # z: a sum of exp features
    assert torch.equal(cache.memory.weights.log_scale, trained.memory.log_scale)
    assert torch.equal(cache.memory.weights.decay_rate, trained.memory.decay_rate)
    assert cache.memory.ref.min() > 0  # every layer was written, up to a position past the system prompt
    again, _ = codec.decode(*codec.encode(cache, codec.EpisodeMeta.from_metadata(metadata)))
    assert all(torch.equal(a, b) for a, b in zip(cache.memory.m + cache.memory.b, again.memory.m + again.memory.b,
                                                 strict=True))
    assert torch.equal(cache.memory.ref, again.memory.ref)
    question = torch.tensor([[5, 9, 11, 3]])
    with_memory, shut, plain = logits_with_shut_and_without_memory(tiny_lm.model, cache, question)
    assert torch.equal(shut, plain) and not torch.equal(with_memory, plain)


def test_files_without_the_mass_readout_keep_their_format_and_config():
    """An additive memory's config is stored without `readout`, its episode files keep format "4": kvchat from
    before the mass readout reads both."""
    additive = IndexMemConfig(readout="additive")
    assert not {"readout", "mass_scale"} & set(additive.stored())
    assert IndexMemConfig.from_stored(additive.stored()) == additive  # absent: additive, whatever the default
    assert IndexMemConfig.from_stored(IndexMemConfig(readout="mass").stored()).readout == "mass"
    assert IndexMemConfig(readout="mass").stored()["readout"] == "mass"
    memory = json.dumps({"shape": {}, "config": IndexMemConfig(readout="additive").stored()})
    assert codec.format_version({"memory": memory}) == codec.FORMAT_VERSION
    mass = json.dumps({"shape": {}, "config": IndexMemConfig(readout="mass").stored()})
    assert codec.format_version({"memory": mass, "precision": "int4"}) == codec.MASS_MEMORY_FORMAT_VERSION
