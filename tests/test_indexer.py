"""IndexMem: the trained indexer (training, its scorer inside the block's forward, the shipped weights) and
the latent memory of evicted entries (exact under GQA, stored with the episode, read while answering)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import raises_said, tiny_model
from memory_helpers import logits_with_shut_and_without_memory

from kvchat.answer.session import Session
from kvchat.cli.words import spell
from kvchat.config import CacheConfig, EpisodeConfig, IndexMemConfig, IngestConfig, TrainConfig
from kvchat.errors import UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.kv import codec
from kvchat.kv.indexer import IndexMemShape, LayerIndexer, causal_importance, top_overlap
from kvchat.kv.latent import LatentMemory, MemoryWeights, read
from kvchat.kv.trained import TrainedIndexMem
from kvchat.store import Store
from kvchat.training import train

SMALL = TrainConfig(steps=3, chunk_tokens=96, train_chunks=4, held_out_chunks=2, checkpoint_every=2, warmup=1,
                    memory_queries=16, memory_budgets=(40, 56), memory_block=24,
                    memory_min_gain=float("-inf"))  # 3 steps help no layer: keep them all open for these tests


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "h.json"
    path.write_text(json.dumps(planted_conversation(seed=4, topics=3, turns_per_topic=16)[0]))
    return path


@pytest.fixture(scope="module")
def trained_home(tmp_path_factory, tiny_lm, history) -> Path:
    """A store home whose profiles/ holds IndexMem weights trained on the tiny model (both stages), with the
    paper's additive readout (tests/test_memory_mass.py covers the default, mass)."""
    home = tmp_path_factory.mktemp("home")
    from kvchat.training import default_out

    train(tiny_lm, default_out(home, tiny_lm), SMALL, files=[history], indexmem=IndexMemConfig(readout="additive"))
    return home


def test_three_steps_write_a_loadable_file_with_provenance(tiny_lm, history, tmp_path):
    out = tmp_path / "w.indexmem.safetensors"
    report = train(tiny_lm, out, SMALL, files=[history])
    trained = TrainedIndexMem.load(out)
    shape = IndexMemShape.of(tiny_lm.model.config)
    assert trained.shape == shape and (shape.index_heads, shape.index_dim, shape.memory_dim) == (1, 2, 8)
    assert trained.memory is not None and report.stages == ["indexer", "memory"]
    assert trained.data_hash == report.data_hash and trained.recipe["train"]["steps"] == 3
    assert 0 <= trained.metrics["indexer"]["top_overlap"] <= 1
    assert set(trained.metrics["memory"]["residual_removed"]) == {"40", "56"}
    assert all(t.dtype == torch.float16 for t in trained.tensors().values())
    assert not out.with_name(out.name + ".ckpt").exists()  # a finished run leaves no checkpoint


def test_training_shuts_the_memory_of_layers_where_it_removes_too_little_held_out_residual(tiny_lm, history,
                                                                                             tmp_path):
    out = tmp_path / "w.indexmem.safetensors"
    train(tiny_lm, out, dataclasses.replace(SMALL, memory_min_gain=0.0), files=[history])
    kept = TrainedIndexMem.load(out).metrics["memory"]
    before = kept["per_layer_before_closing"]
    assert kept["open_layers"] == [layer for layer, gain in enumerate(before) if gain >= 0.0]
    train(tiny_lm, out, dataclasses.replace(SMALL, memory_min_gain=2.0, seed=1), files=[history])
    shut = TrainedIndexMem.load(out)  # no layer can remove twice its residual: every gate is shut
    assert shut.metrics["memory"]["open_layers"] == [] and shut.metrics["memory"]["per_layer"] == [0.0, 0.0]
    assert all(LatentMemory(shut.memory).closed)


def test_twenty_steps_on_one_chunk_lower_the_loss(tiny_lm, history, tmp_path):
    losses = []

    class Record:
        def prepare(self, done, total): ...

        def step(self, stage, done, total, loss):
            losses.append(loss)

    config = dataclasses.replace(SMALL, stage="indexer", steps=20, train_chunks=1, held_out_chunks=0, warmup=2,
                                 lr=1e-2)
    train(tiny_lm, tmp_path / "one.safetensors", config, files=[history], progress=Record())
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3


def test_a_bfloat16_model_trains_in_float32(tiny_model_dir, history, tmp_path):
    """A model loaded in bfloat16 (a GPU's default) teaches in its own dtype: its attention modules run on
    bfloat16 inputs and the stages compute on what they return in float32."""
    from kvchat.model.device import Placement
    from kvchat.model.llm import load_model

    lm = load_model(str(tiny_model_dir), tmp_path / "models", placement=Placement(torch.device("cpu"),
                                                                                  torch.bfloat16))
    report = train(lm, tmp_path / "w.safetensors", SMALL, files=[history])
    trained = TrainedIndexMem.load(tmp_path / "w.safetensors")
    assert report.stages == ["indexer", "memory"] and trained.memory is not None
    assert 0 <= trained.metrics["indexer"]["top_overlap"] <= 1
    assert all(torch.isfinite(t).all() for t in trained.tensors().values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_on_a_gpu_writes_what_training_on_the_cpu_writes(tiny_model_dir, tiny_lm, history, tmp_path):
    """Both stages with the model on CUDA (float32): every tensor the stages make lives where the model runs, the
    checkpoint and the file are written from there, and the weights are the CPU run's up to float rounding."""
    from kvchat.model.device import Placement
    from kvchat.model.llm import load_model

    gpu_lm = load_model(str(tiny_model_dir), tmp_path / "models", placement=Placement(torch.device("cuda"),
                                                                                      torch.float32))
    config = dataclasses.replace(SMALL, checkpoint_every=1)
    train(gpu_lm, tmp_path / "gpu.safetensors", config, files=[history])
    train(tiny_lm, tmp_path / "cpu.safetensors", config, files=[history])
    gpu, cpu = (TrainedIndexMem.load(tmp_path / f"{name}.safetensors") for name in ("gpu", "cpu"))
    assert gpu.tensors().keys() == cpu.tensors().keys()
    for name, tensor in cpu.tensors().items():
        torch.testing.assert_close(gpu.tensors()[name].float(), tensor.float(), rtol=0.05, atol=0.02, msg=name)


def test_a_resumed_run_equals_an_uninterrupted_one(tiny_lm, history, tmp_path):
    """Same seed, same weights; a run stopped after its checkpoint continues from it (steps 2..4)."""
    config = dataclasses.replace(SMALL, stage="indexer", steps=4, checkpoint_every=2)
    straight = tmp_path / "a.safetensors"
    train(tiny_lm, straight, config, files=[history])

    class Stop(Exception):
        pass

    class StopAfter3:
        def prepare(self, done, total): ...

        def step(self, stage, done, total, loss):
            if done == 3:
                raise Stop

    resumed = tmp_path / "b.safetensors"
    with pytest.raises(Stop):
        train(tiny_lm, resumed, config, files=[history], progress=StopAfter3())
    assert resumed.with_name(resumed.name + ".ckpt").is_file()
    report = train(tiny_lm, resumed, config, files=[history])
    assert report.resumed_from == {"indexer": 2}
    a, b = TrainedIndexMem.load(straight).tensors(), TrainedIndexMem.load(resumed).tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_memory_stage_evicts_what_ingest_evicts(trained_home, tiny_lm, history):
    """The memory is trained on the residual of the evictions it makes up for: on the same input, layer 0 of the
    memory stage's simulated block prefill keeps exactly what `block_prefill` with `--method indexmem`'s scorer
    keeps (the indexer blended with the block's last queries' attention, the recent window), at small budgets
    too, and not what the indexer alone would keep."""
    from kvchat.kv.indexer import IndexerScorer
    from kvchat.kv.prefill import block_prefill
    from kvchat.training.chunks import make_chunks
    from kvchat.training.memory_stage import simulate_eviction
    from kvchat.training.teacher import capture

    trained = TrainedIndexMem.load(next((trained_home / "profiles").glob("*.indexmem.safetensors")))
    config = dataclasses.replace(SMALL, chunk_tokens=160, memory_block=32)
    chunk = make_chunks(tiny_lm, config, [history])[0][0]
    captured = capture(tiny_lm, chunk)
    x0, rope = captured.hidden[0].float(), captured.rope[0]
    model, sink, differs = tiny_lm.model, chunk.sink, []
    for budget in (40, 56, 80):
        ingest = block_prefill(model, chunk.ids[None, :sink], chunk.ids[None, sink:], block_size=config.memory_block,
                               budgets=[budget] * tiny_lm.num_layers,
                               scorer=IndexerScorer.for_cache(trained.indexer, model, config.simulated_cache()))
        kept = ingest.cache.layers[0].positions
        scorer = IndexerScorer.for_cache(trained.indexer, model, config.simulated_cache())
        simulated = simulate_eviction(scorer, model, 0, x0, sink, budget, config.memory_block, rope=rope)
        assert kept.shape == (tiny_lm.model.config.num_key_value_heads, budget)
        assert [simulated[h].nonzero()[:, 0].tolist() for h in range(kept.shape[0])] == kept.tolist()
        alone = dataclasses.replace(config, memory_attention_mix=0.0).simulated_cache()
        differs.append(not torch.equal(simulated, simulate_eviction(
            IndexerScorer.for_cache(trained.indexer, model, alone), model, 0, x0, sink, budget, config.memory_block,
            rope=rope)))
    assert differs[0] is False and differs[-1] is True  # at 40 only the sink and the window fit


def test_memory_budgets_within_the_system_prompt_are_refused_in_one_line(tiny_lm, history, tmp_path):
    from kvchat.training.chunks import make_chunks

    sink = make_chunks(tiny_lm, SMALL, [history])[0][0].sink
    with pytest.raises(UserError, match=f"memory budgets {sink} must exceed the system prompt's {sink} tokens") as e:
        train(tiny_lm, tmp_path / "w.indexmem.safetensors", dataclasses.replace(SMALL, memory_budgets=(sink, 48)),
              files=[history])
    assert "\n" not in str(e.value) and not (tmp_path / "w.indexmem.safetensors").exists()


def test_importance_is_causal_and_overlap_counts_shared_top_keys():
    scores = torch.tensor([[[1.0, 9.0, 9.0], [2.0, 3.0, 9.0]]])  # 2 queries over 3 keys
    assert causal_importance(scores, 1).tolist() == [[2.0, 9.0, 9.0]]  # queries are keys 1 and 2
    assert causal_importance(scores, 0).tolist() == [[2.0, 3.0, float("-inf")]]  # key 2 is seen by no query
    teacher, other = torch.tensor([[4.0, 3.0, 2.0, 1.0]]), torch.tensor([[4.0, 0.0, 3.0, 1.0]])
    valid = torch.ones(4, dtype=torch.bool)
    assert top_overlap(teacher, other, valid, 0.5).item() == 0.5


def test_the_scorer_ranks_by_the_indexer_inside_the_forward(tiny_lm):
    """One block's scores from `layer_scores` are the indexer's own importance of those tokens, turned into
    per-head distributions (what adaptive head budgets compare)."""
    from kvchat.kv.attention import LayerView
    from kvchat.kv.indexer import Indexer, IndexerScorer

    torch.manual_seed(0)
    shape = IndexMemShape.of(tiny_lm.model.config)
    indexer = Indexer(shape)
    scorer = IndexerScorer(indexer, tiny_lm.model)
    hidden = torch.randn(1, 6, shape.hidden)
    view = LayerView(0, torch.zeros(shape.kv_heads, shape.group, 1, 8), past=2, queries=torch.zeros(1), hidden=hidden)
    scores = scorer.layer_scores(view)
    layer = indexer.layers[0]
    with torch.no_grad():
        query_map = layer.query_map(tiny_lm.model.model.layers[0].self_attn.q_proj)
        expected = causal_importance(
            LayerIndexer.scores(layer.queries(hidden[0], query_map), layer.weights(hidden[0]), layer.keys(hidden[0])),
            0,
        )
    assert scores.shape == (shape.kv_heads, 8)
    assert torch.allclose(scores[:, 2:] / scores[:, 2:].sum(-1, keepdim=True),
                          expected.softmax(-1), atol=1e-5)  # the 2 protected entries weigh in, not reorder
    assert torch.allclose(scores.sum(-1), torch.ones(shape.kv_heads))
    windowed = IndexerScorer(indexer, tiny_lm.model, recent_window=2).layer_scores(view)
    assert torch.isinf(windowed[:, -2:]).all() and torch.equal(windowed[:, :-2], scores[:, :-2])
    scorer.kept(0, torch.tensor([[0, 1, 5], [0, 1, 7]]))  # an eviction kept 3 entries per head
    assert [k.shape[0] for k in scorer.keys[0]] == [3, 3]
    assert torch.equal(scorer.keys[0][0][2], layer.keys(hidden[0])[3].detach())


def test_the_indexer_and_the_memory_move_to_the_models_device():
    """Trained weights load on the CPU; a model elsewhere (a GPU; here the meta device stands in) gets them where
    it runs, so scoring and writing never mix devices."""
    from kvchat.features.indexmem import IndexMem
    from kvchat.kv.indexer import Indexer, IndexerScorer

    model = tiny_model("llama").to("meta")
    shape = IndexMemShape.of(model.config)
    scorer = IndexerScorer(Indexer(shape), model)
    assert {p.device.type for p in scorer.indexer.parameters()} == {"meta"}
    assert {m.device.type for m, _ in scorer.query_maps} == {"meta"}
    trained = SimpleNamespace(memory=MemoryWeights(shape), config=IndexMemConfig())
    setup = SimpleNamespace(config=SimpleNamespace(latent_memory=True), trained=trained, model=model)
    memory = IndexMem().episode(setup).memory
    assert {t.device.type for t in [*memory.m, *memory.b, memory.ref]} == {"meta"}


def test_memory_returns_v_for_q_equal_k_with_identity_features():
    """phi = identity, lambda = eta = 1, one-hot keys: reading a key gives back exactly its value, per KV head."""
    shape = IndexMemShape(layers=1, q_heads=4, kv_heads=2, head_dim=8, hidden=32, index_heads=1, index_dim=1,
                          memory_dim=8)
    weights = MemoryWeights(shape)
    with torch.no_grad():
        weights.phi[0].weight.copy_(torch.eye(8))
        weights.gate[0].bias.fill_(1e4)  # gate fully open
    memory = LatentMemory(weights, IndexMemConfig(decay=1.0, write_strength=1.0, eps=0.0))
    keys = torch.eye(8)[[1, 4, 6]]
    values = torch.randn(2, 3, 8)
    positions = torch.tensor([3, 7, 9])
    rotary = _IdentityRotary()
    memory.write(0, [(keys, values[0], positions), (keys[:2], values[1, :2], positions[:2])], rotary)
    queries = torch.stack([keys[0], keys[2], keys[1], keys[0]])[:, None]  # query heads 0,1 -> KV 0; 2,3 -> KV 1
    out = read(weights.phi[0], weights.gate[0], memory.m[0], memory.b[0], queries, 0.0)
    assert torch.allclose(out[0, 0], values[0, 0]) and torch.allclose(out[1, 0], values[0, 2])
    assert torch.allclose(out[2, 0], values[1, 1]) and torch.allclose(out[3, 0], values[1, 0])
    assert memory.written == 5


class _IdentityRotary(torch.nn.Module):
    def forward(self, x, position_ids):
        shape = (*position_ids.shape, x.shape[-1])
        return torch.ones(shape), torch.zeros(shape)


def _ingest(home: Path, lm, encoder, history: Path, name: str, **cache) -> Store:
    store = Store(home)
    config = IngestConfig(cache=CacheConfig(method="indexmem", budget=48, block_size=32, prefill="block", **cache),
                          episodes=EpisodeConfig(patched_prompt_tokens=48))
    ingest(history, name=name, config=config, store=store, lm=lm, encoder=encoder, replace=True)
    return store


def test_ingest_keeps_its_peak_bound_and_the_memory_round_trips(trained_home, tiny_lm, encoder, history):
    store = _ingest(trained_home, tiny_lm, encoder, history, "mem")
    record = store.get("mem")
    assert record.settings["method"] == "indexmem" and record.settings["latent_memory"] is True
    assert (record.settings["attention_mix"], record.settings["indexer_pool_kernel"]) == (0.75, 1)
    from kvchat.settings import from_settings

    old = {k: v for k, v in record.settings.items() if k not in ("attention_mix", "indexer_pool_kernel")}
    rebuilt = from_settings(old, record.model).cache  # a store written before the blend: the indexer alone
    assert (rebuilt.attention_mix, rebuilt.indexer_pool_kernel) == (0.0, record.settings["pool_kernel"])
    assert record.stats["peak_layer_entries"] <= 48 + 32  # budget + block: no probe pass
    assert record.stats["peak_total_entries"] <= 2 * 48 + 32  # evicted layer by layer inside the forward
    cache, _ = codec.decode(*store.load_episode(record.episodes[0], tiny_lm.fingerprint))
    trained = TrainedIndexMem.load(next((trained_home / "profiles").glob("*.indexmem.safetensors")))
    assert cache.memory is not None and cache.memory.m[0].abs().sum() > 0  # evicted entries were written
    for ours, theirs in zip(cache.memory.weights.parameters(), trained.memory.parameters(), strict=True):
        assert torch.equal(ours, theirs)  # the slow weights that wrote it are stored with it
    again, _ = codec.decode(*codec.encode(cache, codec.EpisodeMeta.from_metadata(
        store.load_episode(record.episodes[0], tiny_lm.fingerprint)[1])))
    assert all(torch.equal(a, b) for a, b in zip(cache.memory.m + cache.memory.b, again.memory.m + again.memory.b,
                                                 strict=True))
    assert Session(store, record, tiny_lm, encoder).ask("Which gate?").conversation == "mem"


def test_an_indexmem_ingest_with_int4_weights_reads_what_the_packed_projections_stand_for(
        trained_home, tiny_lm, encoder, history, tmp_path):  # fmt: skip
    """`kvchat ingest --weights int4 --method indexmem`: the indexer's query maps are built from the weights the
    packed q_proj multiplies by (`float_weight`), not from its packed bytes."""
    from kvchat.kv.indexer import Indexer
    from kvchat.model.int4_weights import Int4Linear
    from kvchat.model.llm import load_model

    int4 = load_model(tiny_lm.spec, tmp_path / "models", weights="int4")
    q_proj = int4.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Int4Linear)
    x = torch.randn(5, q_proj.in_features)
    torch.testing.assert_close(x @ q_proj.float_weight().T, q_proj(x), atol=0.05, rtol=0.02)  # bfloat16 activations
    layer = Indexer(IndexMemShape.of(int4.model.config)).layers[0]
    with torch.no_grad():
        ours = layer.query_map(q_proj)[0]
        theirs = layer.query_map(tiny_lm.model.model.layers[0].self_attn.q_proj)[0]
    assert (ours - theirs).norm() < 0.2 * theirs.norm()  # the float weights, to 4-bit group rounding
    store = _ingest(trained_home, int4, encoder, history, "int4")
    assert store.get("int4").settings["method"] == "indexmem"
    store.close()


def test_a_zero_gate_makes_the_memory_a_no_op(trained_home, tiny_lm, encoder, history):
    """With the gate shut, answering from a cache with a memory gives exactly the logits without one."""

    store = _ingest(trained_home, tiny_lm, encoder, history, "gate")
    # in the model's dtype, as an answer decodes it (the default int8 storage reads back in float16 "as stored")
    cache, _ = codec.decode(*store.load_episode(store.get("gate").episodes[0], tiny_lm.fingerprint),
                            dtype=tiny_lm.dtype)  # fmt: skip
    question = torch.tensor([[5, 9, 11, 3]])
    with_memory, shut, plain = logits_with_shut_and_without_memory(tiny_lm.model, cache, question)
    assert torch.equal(shut, plain)
    assert not torch.equal(with_memory, plain)  # an open gate does change the answer's logits


def test_no_memory_and_adaptive_heads(trained_home, tiny_lm, encoder, history):
    store = _ingest(trained_home, tiny_lm, encoder, history, "plain", latent_memory=False, head_budgets="adaptive")
    record = store.get("plain")
    assert record.settings["latent_memory"] is False and "latent_memory=false" in _rebuild(record)
    cache, _ = codec.decode(*store.load_episode(record.episodes[0], tiny_lm.fingerprint))
    assert cache.memory is None
    assert any(layer.ragged for layer in cache.layers)  # heads kept different counts
    assert all(sum(layer.lengths) == 48 * len(layer.lengths) for layer in cache.layers)


def _rebuild(record) -> str:
    from kvchat.settings import rebuild_command

    return spell(rebuild_command(record.name, record.model, record.settings))


def test_weights_of_other_model_weights_are_refused_naming_the_train_command(trained_home, tiny_lm, encoder,
                                                                            history, tmp_path):
    path = next((trained_home / "profiles").glob("*.indexmem.safetensors"))
    other = TrainedIndexMem.load(path)
    other.weights = "0123456789abcdef"
    home = tmp_path / "home"
    other.save(home / "profiles" / path.name)
    with pytest.raises(UserError, match="train-indexer") as err:
        _ingest(home, tiny_lm, encoder, history, "x")
    assert "01234567" in str(err.value)


def test_train_indexer_command_writes_where_ingest_looks_and_refuses_a_model_it_cannot_load(
    tmp_path, tiny_model_dir, history
):
    from cli_helpers import run_main

    args = ("--data", str(history), "--steps", "2", "--chunks", "4", "--chunk-tokens", "96", "--json")
    done = run_main(tmp_path, "train-indexer", "--model", str(tiny_model_dir), *args)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert Path(document["out"]).parent == tmp_path / "profiles" and Path(document["out"]).is_file()
    assert document["stages"] == ["indexer", "memory"] and document["timings_ms"]["total"] > 0
    missing = run_main(tmp_path, "train-indexer", "--model", str(tmp_path / "nowhere"), *args)
    assert missing.returncode == 2 and "model not found" in missing.stderr
    small = run_main(tmp_path, "train-indexer", "--model", str(tiny_model_dir), *args, "--memory-budgets", "20,48")
    assert small.returncode == 2 and "memory budgets 20 must exceed the system prompt's" in small.stderr
    assert len(small.stderr.strip().splitlines()) == 1


def test_an_indexmem_conversation_is_not_appended_to_but_reingested(trained_home, tiny_lm, encoder, history):
    from kvchat.ingest.append import append

    store = _ingest(trained_home, tiny_lm, encoder, history, "grow")
    with raises_said(UserError, "--append --reingest"):
        append(history, name="grow", store=store, lm=tiny_lm, encoder=encoder)


@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_cake_layer_budgets_cascade_with_the_indexer(trained_home, tiny_lm, encoder, history, heads):
    """Cascading eviction evicts a layer several times per block: the indexer's keys follow every one."""
    store = _ingest(trained_home, tiny_lm, encoder, history, "cake", layer_budgets="cake", head_budgets=heads)
    record = store.get("cake")
    cache, _ = codec.decode(*store.load_episode(record.episodes[0], tiny_lm.fingerprint))
    assert sum(layer.entries for layer in cache.layers) == 2 * 48 * 2  # layers x budget x KV heads, moved around
    assert record.stats["layer_budgets"] == "cake" and cache.memory is not None


def test_the_scorer_can_read_only_the_last_queries_and_mix_in_their_attention(tiny_lm):
    """`query_window` limits the indexer's query set to the block's last queries (an entry only earlier
    queries saw may then score lower); `attention_mix` blends in the block's last queries' attention over each
    head's entries (SnapKV's observation window), renormalised: 1 = that attention alone."""
    from kvchat.kv.attention import LayerView
    from kvchat.kv.indexer import Indexer, IndexerScorer

    torch.manual_seed(0)
    shape = IndexMemShape.of(tiny_lm.model.config)
    indexer = Indexer(shape)
    hidden = torch.randn(1, 6, shape.hidden)
    layer = indexer.layers[0]
    with torch.no_grad():
        query_map = layer.query_map(tiny_lm.model.model.layers[0].self_attn.q_proj)
        raw = LayerIndexer.scores(layer.queries(hidden[0], query_map), layer.weights(hidden[0]), layer.keys(hidden[0]))
    weights = torch.rand(shape.kv_heads, shape.group, 3, 8)
    view = LayerView(0, weights, past=2, queries=torch.zeros(1), hidden=hidden)

    last = IndexerScorer(indexer, tiny_lm.model, query_window=2).layer_scores(view)
    expected = causal_importance(raw[:, -2:], 4)  # queries 4 and 5 of the 6: every key up to 5 is seen
    assert torch.allclose(last[:, 2:] / last[:, 2:].sum(-1, keepdim=True), expected.softmax(-1), atol=1e-5)

    attention = IndexerScorer(indexer, tiny_lm.model, attention_mix=1.0, attention_window=3)
    assert attention.query_rows == 3 and IndexerScorer(indexer, tiny_lm.model).query_rows == 1
    alone = attention.layer_scores(view)
    snap = weights.amax(dim=(1, 2))  # max over the window's queries and the group, as SnapKV's probe
    assert torch.allclose(alone, snap / snap.sum(-1, keepdim=True), atol=1e-6)
    plain = IndexerScorer(indexer, tiny_lm.model).layer_scores(view)
    half = IndexerScorer(indexer, tiny_lm.model, attention_mix=0.5, attention_window=3).layer_scores(view)
    assert torch.allclose(half, 0.5 * plain + 0.5 * alone, atol=1e-6)
    with pytest.raises(ValueError, match="attention_mix"):
        IndexerScorer(indexer, tiny_lm.model, attention_mix=1.5)


def test_the_readout_scale_shrinks_the_readout_and_a_closed_layer_is_neither_written_nor_read():
    """`readout_scale` multiplies what answering adds; a layer whose gate training shut (`close_gates`) keeps an
    empty state and adds nothing, while the other layers still remember."""
    from kvchat.kv.latent import gate_closed
    from kvchat.training.memory_stage import close_gates

    torch.manual_seed(0)
    shape = IndexMemShape(layers=2, q_heads=4, kv_heads=2, head_dim=8, hidden=32, index_heads=1, index_dim=1,
                          memory_dim=8)
    weights = MemoryWeights(shape)
    evicted = [(torch.randn(3, 8), torch.randn(3, 8), torch.tensor([1, 2, 5])) for _ in range(2)]
    query, positions = torch.randn(1, 4, 2, 8), torch.tensor([[9, 10]])

    def readouts(config: IndexMemConfig) -> tuple[list[torch.Tensor], LatentMemory]:
        memory = LatentMemory(weights, config)
        for layer in range(2):
            memory.write(layer, evicted, _IdentityRotary())
        reader = memory.readout(_IdentityRotary(), positions)
        return [reader(layer, query) for layer in range(2)], memory

    (full, _), (half, _) = readouts(IndexMemConfig(readout_scale=1.0)), readouts(IndexMemConfig(readout_scale=0.5))
    assert full[0].abs().sum() > 0 and torch.allclose(half[0], 0.5 * full[0])
    close_gates(weights, [0])
    assert gate_closed(weights, 0) and not gate_closed(weights, 1)
    shut, memory = readouts(IndexMemConfig(readout_scale=1.0))
    assert memory.m[0].abs().sum() == 0 and memory.b[0].abs().sum() == 0
    assert torch.equal(shut[0], torch.zeros_like(query))
    assert torch.allclose(shut[1], full[1]) and memory.m[1].abs().sum() > 0
