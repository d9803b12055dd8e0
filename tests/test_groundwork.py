"""The seams later features build on: resumable prefill, the eviction observer, the scorer's view of a
layer during the forward, the episode codec, the method registry and the settings round-trip."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import torch
from conftest import raises_said
from conftest import random_ids as _ids

from kvchat.cli.words import spell
from kvchat.config import CacheConfig, CakeConfig, EpisodeConfig, IngestConfig, OffloadConfig, PagingConfig
from kvchat.kv import codec
from kvchat.kv.attention import LayerView
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.cascade import CakeBudgets
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.methods import METHODS, REGISTRY, ScorerInputs
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import BlockScorer, CakeScorer, PatchedPromptScorer
from kvchat.settings import from_settings, rebuild_command, to_settings

CAKE_BUDGETS = CakeBudgets(24, window=8, tau1=1.0, tau2=1.0, floor_fraction=0.25, cascade=True)
PREFILLS = {
    "patched prompt": dict(budgets=[24, 24], scorer=PatchedPromptScorer(_ids(5, 9), pool_kernel=3)),
    "adaptive heads": dict(budgets=[24, 24], scorer=PatchedPromptScorer(_ids(5, 9)), heads=HeadBudgets("adaptive")),
    "cake in forward": dict(budgets=CAKE_BUDGETS, scorer=CakeScorer(window=8, gamma=200.0, pool_kernel=5)),
    "full": dict(budgets=None, scorer=None),
}


def _same_cache(a: EpisodeCache, b: EpisodeCache) -> None:
    assert (a.next_position, a.protected, a.sizes) == (b.next_position, b.protected, b.sizes)
    ta, tb = codec.encode_layers(a), codec.encode_layers(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("kind", sorted(PREFILLS))
def test_prefilling_a_then_resuming_with_b_equals_prefilling_a_and_b(model, kind):
    settings = PREFILLS[kind]
    prefix, a, b = _ids(3, 1), _ids(48, 2), _ids(37, 3)  # A ends on a block boundary (3 blocks of 16)
    once = block_prefill(model, prefix, torch.cat([a, b], -1), block_size=16, **settings).cache
    first = block_prefill(model, prefix, a, block_size=16, **settings).cache
    resumed = block_prefill(model, None, b, block_size=16, resume=first, **settings)
    assert resumed.cache is first and resumed.blocks == 3
    _same_cache(resumed.cache, once)


def test_a_resumed_cache_survives_its_file(model):
    """Resume from what an episode file holds, as an append will: decode, continue, same cache."""
    prefix, a, b = _ids(3, 1), _ids(32, 2), _ids(20, 3)
    settings = PREFILLS["patched prompt"]
    once = block_prefill(model, prefix, torch.cat([a, b], -1), block_size=16, **settings).cache
    first = block_prefill(model, prefix, a, block_size=16, **settings).cache
    meta = codec.meta_of(first, fingerprint="fp", method="epicache", positions="original")
    stored, meta = codec.decode(*codec.encode(first, meta))
    assert meta.next_position == 35 and meta.budgets == (24, 24)
    _same_cache(block_prefill(model, None, b, block_size=16, resume=stored, **settings).cache, once)


def test_resume_refuses_a_second_prefix(model):
    cache = block_prefill(model, _ids(3, 1), _ids(16, 2), block_size=16, budgets=None, scorer=None).cache
    with pytest.raises(ValueError, match="prefix"):
        block_prefill(model, _ids(3, 1), _ids(16, 2), block_size=16, budgets=None, scorer=None, resume=cache)


@pytest.mark.parametrize("kind", ["patched prompt", "adaptive heads", "cake in forward"])
def test_every_eviction_reaches_the_observer_and_partitions_the_history(model, kind):
    """What each head keeps and what the observer was given are disjoint and together every position."""
    prefix, context = _ids(3, 1), _ids(70, 2)
    seen: dict[tuple[int, int], list[torch.Tensor]] = {}

    def observe(layer: int, heads: list) -> None:
        for h, (keys, values, positions, origins) in enumerate(heads):
            assert keys.shape == values.shape == (positions.shape[0], 16)
            assert torch.equal(origins, positions)  # nothing was compacted
            seen.setdefault((layer, h), []).append(positions)

    cache = EpisodeCache(2)
    cache.on_evict = observe
    forward(model, cache, prefix)  # an observed cache: resume from one holding just the prefix
    cache.protected = 3
    block_prefill(model, None, context, block_size=16, resume=cache, **PREFILLS[kind])
    for layer_idx, layer in enumerate(cache.layers):
        kept = layer.positions if layer.ragged else list(layer.positions)
        for h, positions in enumerate(kept):
            evicted = torch.cat(seen.get((layer_idx, h), [torch.zeros(0, dtype=torch.long)]))
            both = torch.cat([positions, evicted]).sort().values
            assert torch.equal(both, torch.arange(73)), (layer_idx, h)
            assert evicted.min() >= 3  # the system prompt is never evicted


class _HiddenStateScorer(BlockScorer):
    """An in-forward scorer reading hidden states: keeps the entries with the largest key norm, and checks
    that the view's hidden states are the attention input and its queries their projection."""

    in_forward, query_rows, needs_hidden = True, 4, True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.views = model, []

    def layer_scores(self, view: LayerView) -> torch.Tensor:
        self.views.append(view)
        attention = self.model.model.layers[view.layer_idx].self_attn
        rows = view.queries.shape[2]  # the hidden states cover the whole block; the queries its last rows
        projected = attention.q_proj(view.hidden[:, -rows:]).view(1, rows, 4, 16).transpose(1, 2)  # [1, 4, rows, 16]
        assert projected.shape == view.queries.shape
        # RoPE rotates each query: the projection of the hidden states matches the queries up to rotation.
        torch.testing.assert_close(projected.norm(dim=-1), view.queries.norm(dim=-1))
        layer = view.weights.shape[-1]
        return torch.arange(layer, dtype=torch.float32).expand(view.weights.shape[0], layer)  # keep the latest


def test_an_in_forward_scorer_sees_queries_and_hidden_states_of_the_block(model):
    scorer = _HiddenStateScorer(model)
    hooks, inputs = [], {}
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.input_layernorm.register_forward_hook(lambda m, a, out, i=i: inputs.__setitem__(i, out)))
    try:
        result = block_prefill(model, _ids(3, 1), _ids(40, 2), block_size=16, budgets=[20, 20], scorer=scorer)
    finally:
        for hook in hooks:
            hook.remove()
    assert scorer.views and {v.layer_idx for v in scorer.views} == {0, 1}
    last = scorer.views[-1]  # the last block: 40 = 16 + 16 + 8 tokens
    assert last.hidden.shape[1] == 8 and last.queries.shape[2] == 4
    torch.testing.assert_close(last.hidden, inputs[last.layer_idx])
    for layer in result.cache.layers:  # evicted in the forward by this scorer: the latest entries stay
        assert layer.positions[0].tolist() == [0, 1, 2, *range(43 - 17, 43)]


# --------------------------------------------------------------------------- codec


def test_episode_meta_round_trips_and_names_what_is_missing():
    meta = codec.EpisodeMeta("fp", "cake", "compact", 96, 4, (10, 12))
    assert codec.EpisodeMeta.from_metadata(meta.to_metadata()) == meta
    assert all(isinstance(v, str) for v in meta.to_metadata().values())
    with pytest.raises(ValueError, match="next_position"):
        codec.EpisodeMeta.from_metadata({"fingerprint": "fp"})
    with pytest.raises(ValueError, match="malformed"):
        codec.EpisodeMeta.from_metadata({"fingerprint": "fp", "next_position": "x"})


def test_decode_refuses_tensors_that_are_not_a_layer():
    tensors = {"k.0": torch.ones(2, 3, 4), "v.0": torch.ones(2, 3, 4), "pos.0": torch.zeros(2, 4, dtype=torch.int32)}
    with pytest.raises(ValueError, match="uniform layer"):
        codec.decode_layers(tensors, next_position=3, protected=0)
    with pytest.raises(ValueError, match="incomplete"):
        codec.decode_layers({"k.0": torch.ones(2, 3, 4)}, next_position=3, protected=0)


# --------------------------------------------------------------------------- registry


class _Layout:
    before_question, after_question = "<u>", "</u>"

    def question(self, text: str) -> str:
        return f"<u>{text}</u>"


@pytest.mark.parametrize("name", METHODS)
def test_every_registered_method_builds_the_scorer_its_entry_describes(name, model):
    entry = REGISTRY[name]
    assert entry.name == name and entry.summary
    if entry.scorer is None:
        return
    encode = lambda text: torch.tensor([[len(text) % 7 + 1] * max(len(text.split()), 1)])  # noqa: E731
    inputs = ScorerInputs(encode, _Layout(), CacheConfig(), episode_prompt="about tomatoes")
    if entry.trained:  # built from weights trained for the model (here untrained ones of its shape)
        from kvchat.kv.indexer import Indexer, IndexMemShape
        from kvchat.kv.trained import TrainedIndexMem

        with pytest.raises(ValueError, match="trained"):
            entry.scorer(inputs)
        shape = IndexMemShape.of(model.config)
        inputs = dataclasses.replace(inputs, model=model, trained=TrainedIndexMem(shape, Indexer(shape), None, "w"))
    scorer = entry.scorer(inputs)
    assert bool(getattr(scorer, "in_forward", False)) == entry.in_forward
    assert scorer.transient_tokens >= 0


# --------------------------------------------------------------------------- settings


RESOLVED = [
    IngestConfig(model="m", cache=CacheConfig(positions="original", layer_budgets="sensitivity", alpha=1.3)),
    IngestConfig(cache=CacheConfig(method="cake", budget=300, positions="compact", layer_budgets="cake",
                                   cake=CakeConfig(tau1=0.5, tau2=2.0, gamma=50.0, queries=16))),
    IngestConfig(episodes=EpisodeConfig(episodes=3, segment_turns=2, patched_prompt_tokens=128, seed=7),
                 cache=CacheConfig(method="snapkv", positions="original", layer_budgets="uniform",
                                   head_budgets="adaptive", pool_kernel=5),
                 system_prompt="Be brief.\n", instruction="Find facts."),
    IngestConfig(cache=CacheConfig(method="full", positions="original")),
]  # fmt: skip


@pytest.mark.parametrize("config", RESOLVED, ids=lambda c: c.cache.method)
def test_saved_settings_turn_back_into_the_config_that_built_them(config):
    settings = to_settings(config, source="/h/chat.json")
    assert from_settings(settings, model=config.model) == config
    assert to_settings(from_settings(settings, config.model), source="/h/chat.json") == settings


def test_settings_of_an_older_store_take_the_defaults():
    old = {"method": "epicache", "budget": 256, "block_size": 128, "positions": "original", "layer_budgets": "uniform"}
    config = from_settings(old)
    assert (config.cache.budget, config.cache.block_size, config.episodes) == (256, 128, EpisodeConfig())


def test_the_rebuild_command_replaces_when_asked():
    settings = to_settings(RESOLVED[0], source="/h/my chat.json")
    words = shlex.split(spell(rebuild_command("chat", "m", settings, replace=True)))
    assert words[:5] == ["kvchat", "ingest", "/h/my chat.json", "--name", "chat"] and words[-1] == "--replace"
    assert words[words.index("alpha=1.3") - 1] == "--setting"


@pytest.mark.parametrize("config", [
    IngestConfig(cache=CacheConfig(method="epicache", budget=64, block_size=32, positions="original",
                                   layer_budgets="uniform", prefill="block", pool_kernel=5, offload=OffloadConfig(
                                       mode="icecache", retrieve=32, scorer="centroid", refresh=4, candidates=2,
                                       dtype="float32", paging=PagingConfig(page_size=8, iterations=3, seed=1))),
                 episodes=EpisodeConfig(episodes=2, patched_prompt_tokens=48, seed=2), system_prompt="Be brief.\n",
                 instruction="Find the facts."),
    IngestConfig(cache=CacheConfig(method="cake", budget=64, block_size=32, positions="original",
                                   layer_budgets="cake", prefill="block", precision="int4", quant_group_4bit=8,
                                   quant_residual=2, cake=CakeConfig(tau1=0.5, gamma=100.0, cascade=False)),
                 episodes=EpisodeConfig(episodes=2, segment_turns=2)),
], ids=["icecache", "cake-int4"])  # fmt: skip
def test_the_rebuild_command_builds_the_same_settings_through_the_cli(config, tmp_path, tiny_model_dir, history):
    """Library-only settings too (`--setting KEY=VALUE`): the conversation the printed command builds has
    exactly the settings of the one it rebuilds."""
    from cli_helpers import run_main

    from kvchat.store import Store

    config = dataclasses.replace(config, model=str(tiny_model_dir))
    settings = to_settings(config, source=str(history))
    command = spell(rebuild_command("chat", config.model, settings))
    assert "--setting" in command
    done = run_main(tmp_path, *shlex.split(command)[1:])
    assert done.returncode == 0, done.stderr
    assert Store(tmp_path).get("chat").settings == settings


def test_a_setting_of_the_wrong_kind_or_name_is_a_user_error():
    from kvchat.errors import UserError
    from kvchat.settings import with_settings

    assert with_settings(IngestConfig(), ["page_scorer=centroid", "cake_gamma=3"]).cache.offload.scorer == "centroid"
    for pair in ("no_such_key=1", "budget", "budget=\"many\"", "source=\"x\""):
        with raises_said(UserError, "--setting"):
            with_settings(IngestConfig(), [pair])


FEATURED = IngestConfig(cache=CacheConfig(method="indexmem", precision="int8", offload=OffloadConfig(mode="icecache")))


@pytest.mark.parametrize("config", [*RESOLVED, FEATURED], ids=lambda c: c.cache.method)
def test_every_saved_key_names_one_config_field(config):
    from kvchat.settings_table import BY_KEY

    saved = to_settings(config, source="/h.json", appended=["/a.json"])
    assert set(saved) - {"source", "appended"} <= set(BY_KEY)
