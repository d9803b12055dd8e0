"""Quantized episode caches (`--cache-precision int8|int4`): the quantization in 8 and 4 bits, the layer type,
its file format, the pipelines and the options."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from cli_helpers import run_main
from conftest import centroid, raises_said
from conftest import random_ids as _ids
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat import store as store_module
from kvchat.answer.session import Session
from kvchat.cli.words import spell
from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig, OffloadConfig
from kvchat.errors import UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.append import append
from kvchat.ingest.pipeline import ingest, validate
from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.layers import QuantizedLayer, UniformLayer
from kvchat.kv.prefill import block_prefill
from kvchat.kv.quantize import SCALE_DTYPES, QuantizedEntries, pack4, quantized_length, unpack4
from kvchat.kv.scoring import PatchedPromptScorer
from kvchat.settings import from_settings, rebuild_command, to_settings
from kvchat.store import Store

GROUP = 8  # the tiny model's head_dim is 16: two value groups per token
HEAD_DIM = 16
BITS = pytest.mark.parametrize("bits", [8, 4])
PRECISIONS = pytest.mark.parametrize("precision", ["int8", "int4"])
TOLERANCE = {8: 1e-2, 4: 0.2}  # largest logit difference from full precision on the tiny model


def _codes(q: QuantizedEntries, stored: torch.Tensor) -> torch.Tensor:
    return unpack4(stored) if q.bits == 4 else stored


def _cache(model, heads: str = "uniform", budget: int = 60) -> EpisodeCache:
    return block_prefill(
        model, _ids(3, 1), _ids(200, 2), block_size=32, budgets=[budget, budget],
        scorer=PatchedPromptScorer(_ids(4, 4)), heads=HeadBudgets(heads),
    ).cache  # fmt: skip


# --------------------------------------------------------------------------- the arithmetic


@BITS
@settings(max_examples=150, deadline=None)
@given(
    heads=st.integers(1, 3), groups=st.integers(1, 4), group=st.sampled_from([1, 2, 4, 8]),
    dim=st.sampled_from([4, 8, 12]), magnitude=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_every_number_comes_back_within_half_a_step_of_its_group(bits, heads, groups, group, dim, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, groups * group, dim, generator=g) * magnitude
    values = torch.randn(heads, groups * group, dim, generator=g) * magnitude
    q = QuantizedEntries.quantize(keys, values, group, bits)
    # keys: each (group of tokens, channel) has its own step; values: each (token, group of channels); the
    # steps as stored (float16 at 4 bits, rounded up there so that the bound holds for the stored numbers)
    kstep = q.key_scale.float().repeat_interleave(group, dim=-2)
    vgroup = dim // q.value_scale.shape[-1]
    vstep = q.value_scale.float().repeat_interleave(vgroup, dim=-1)
    slack = 1e-5 * magnitude  # float32 rounding of code * scale + min
    assert ((q.keys() - keys).abs() <= kstep / 2 + slack).all()
    assert ((q.values() - values).abs() <= vstep / 2 + slack).all()
    assert q.key_codes.dtype == q.value_codes.dtype == torch.uint8
    assert q.key_codes.shape[-1] == dim * bits // 8 and q.key_scale.dtype == SCALE_DTYPES[bits]


def test_4_bit_codes_pack_two_per_byte_low_nibble_first():
    codes = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8)
    packed = pack4(codes)
    assert packed.shape == (3, 5, 4) and torch.equal(unpack4(packed), codes)
    assert pack4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]


@BITS
def test_constant_groups_are_exact_and_extremes_land_on_the_end_codes(bits):
    keys = torch.full((1, 8, 4), 3.25)
    values = torch.linspace(-1, 1, 32).reshape(1, 8, 4)
    q = QuantizedEntries.quantize(keys, values, 4, bits)
    assert torch.equal(q.keys(), keys)
    assert _codes(q, q.value_codes).min() == 0 and _codes(q, q.value_codes).max() == 2**bits - 1


def test_4_bit_scales_out_of_float16_range_are_refused():
    with pytest.raises(ValueError, match="4 bits"):
        QuantizedEntries.quantize(torch.full((1, 4, 4), 1e6), torch.zeros(1, 4, 4), 4, 4)


def test_keys_are_grouped_per_channel_and_values_per_token():
    keys, values = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    keys[0, 5, 3] = 1000.0    # an outlier channel in one token
    values[1, 9, 2] = 1000.0  # an outlier in one token
    q = QuantizedEntries.quantize(keys, values, 4)
    assert q.key_scale.shape == (2, 4, 8) and q.value_scale.shape == (2, 16, 2)
    big_k = (q.key_scale > 1).nonzero().tolist()
    big_v = (q.value_scale > 1).nonzero().tolist()
    assert big_k == [[0, 1, 3]]  # only that channel of that head's second group of 4 tokens
    assert big_v == [[1, 9, 0]]  # only that token's first group of channels
    assert QuantizedEntries.quantize(torch.randn(1, 8, 12), torch.randn(1, 8, 12), 8).value_scale.shape == (1, 8, 1)


def test_quantized_length_keeps_the_residual_and_whole_groups():
    assert quantized_length(70, 32, 0) == 64
    assert quantized_length(70, 32, 10) == 32
    assert quantized_length(20, 32, 0) == 0


# --------------------------------------------------------------------------- the layer


@BITS
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_quantized_layer_attends_like_the_full_one_and_holds_fewer_bytes(model, heads, bits):
    cache = _cache(model, heads)
    full = cache.copy()
    cache.quantize(GROUP, 4, bits)
    layer = cache.layers[0]
    assert isinstance(layer, QuantizedLayer) and layer.ragged == (heads == "adaptive") and layer.bits == bits
    assert cache.precision == f"int{bits}"
    assert layer.lengths == full.layers[0].lengths and cache.entries == full.entries
    assert all(q == quantized_length(n, GROUP, 4) for q, n in zip(layer.quantized, layer.lengths, strict=True))
    for a, b in zip(cache.layers[0].positions, full.layers[0].positions, strict=True):
        assert torch.equal(a, b)
    # codes of `bits` each; a scale and minimum (float32 at 8 bits, float16 at 4) per (G tokens, channel) of keys
    # and per (token, G channels) of values; the residual in float32
    dim, scale = HEAD_DIM, SCALE_DTYPES[bits].itemsize
    expected = sum(
        q * dim * 2 * bits // 8 + (q // GROUP) * dim * 2 * scale + q * (dim // GROUP) * 2 * scale
        + (n - q) * dim * 2 * 4
        for layer in cache.layers for q, n in zip(layer.quantized, layer.lengths, strict=True)
    )  # fmt: skip
    assert cache.nbytes() == expected and full.nbytes() == cache.entries * dim * 2 * 4
    logits_full = forward(model, full, _ids(5, 9))
    logits_quantized = forward(model, cache, _ids(5, 9))
    assert (logits_full - logits_quantized).abs().max() < TOLERANCE[bits]


@BITS
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_rollback_after_an_answer_restores_the_layer_exactly(model, heads, bits):
    cache = _cache(model, heads)
    cache.quantize(GROUP, 4, bits)
    before = {k: v.clone() for k, v in codec.encode_layers(cache).items()}
    mark = cache.checkpoint()
    forward(model, cache, _ids(7, 3))
    for _ in range(3):
        forward(model, cache, _ids(1, 5))
    assert [n - 10 for n in cache.layers[1].lengths] == list(mark.lengths[1])
    cache.rollback(mark)
    after = codec.encode_layers(cache)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match=f"{bits} bits"):
        cache.layers[0].truncate_heads([0] * len(cache.layers[0].lengths))


def test_a_copy_answers_without_changing_the_original(model):
    cache = _cache(model)
    cache.quantize(GROUP, 0)
    before = {k: v.clone() for k, v in codec.encode_layers(cache).items()}
    other = cache.copy()
    forward(model, other, _ids(6, 3))
    after = codec.encode_layers(cache)
    assert other.entries == cache.entries + 6 * 2 * 2
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_quantized_layer_is_not_evicted_from_and_dequantizes_for_that(model):
    cache = _cache(model)
    cache.quantize(GROUP, 0)
    with pytest.raises(TypeError, match="dequantize"):
        cache.keep_layer(0, torch.zeros(2, 1, dtype=torch.long))
    keys = cache.layers[0].keys
    cache.dequantize()
    assert type(cache.layers[0]) is UniformLayer and torch.equal(cache.layers[0].keys, keys)
    assert cache.precision == "full"


# --------------------------------------------------------------------------- the file format


@BITS
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_codec_round_trip_of_a_quantized_cache(model, heads, bits):
    cache = _cache(model, heads)
    cache.quantize(GROUP, 4, bits)
    meta = codec.meta_of(cache, fingerprint="fp", method="epicache", positions="original")
    tensors, metadata = codec.encode(cache, meta)
    assert metadata["precision"] == f"int{bits}" and tensors["kq.0"].dtype == tensors["vq.0"].dtype == torch.uint8
    assert tensors["kq.0"].shape[-1] == tensors["vq.0"].shape[-1] == HEAD_DIM * bits // 8  # 4 bits: packed
    assert tensors["ks.0"].dtype == tensors["vz.0"].dtype == SCALE_DTYPES[bits]
    assert codec.format_version(metadata) == {8: "4", 4: "5"}[bits]
    assert ("len.0" in tensors) == (heads == "adaptive")
    back, back_meta = codec.decode(tensors, metadata)
    assert back_meta == meta and isinstance(back.layers[1], QuantizedLayer)
    again, _ = codec.encode(back, back_meta)
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)
    for a, b in zip(back.layers[1].keys, cache.layers[1].keys, strict=True):
        assert torch.equal(a, b)



@BITS
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_a_quantized_cache_answers_in_another_dtype(model, heads, bits):
    """--dtype: a float32-built quantized cache decoded for a bfloat16 model dequantizes into bfloat16, and its
    residual is converted too (codes, scales and minima stay as stored)."""
    cache = _cache(model, heads)
    cache.quantize(GROUP, 4, bits)
    meta = codec.meta_of(cache, fingerprint="fp", method="epicache", positions="original")
    tensors, metadata = codec.encode(cache, meta)
    back, _ = codec.decode(tensors, metadata, dtype=torch.bfloat16)
    layer = back.layers[1]
    assert isinstance(layer, QuantizedLayer) and layer.ragged == (heads == "adaptive")
    for got, full in zip(layer.keys, cache.layers[1].keys, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), full.to(torch.bfloat16).float(), rtol=0.02, atol=0.02)
    assert all(v.dtype == torch.bfloat16 for v in layer.values)
    bodies = [layer.body] if heads == "uniform" else layer.body
    assert all(b.key_scale.dtype == b.value_scale.dtype == SCALE_DTYPES[bits] for b in bodies)


@BITS
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_codec_refuses_quantized_tensors_that_do_not_fit(model, heads, bits):
    cache = _cache(model, heads)
    cache.quantize(GROUP, 0, bits)
    tensors, metadata = codec.encode(cache, codec.meta_of(cache, fingerprint="fp", method="m", positions="original"))
    other_bits = {"precision": {8: "int4", 4: "int8"}[bits]}  # the codes' width or the scales' dtype disagree
    widened = torch.cat([tensors["kq.0"], tensors["kq.0"]], dim=-1)  # a row of D bytes where D / 2 are packed
    for damage, meta in (
        ({"ks.0": tensors["ks.0"][..., :-1, :]}, {}), ({"vq.0": tensors["vq.0"].float()}, {}),
        ({"qlen.0": torch.tensor([-8, 16] if heads == "uniform" else [-8, 16, 8, 8])}, {}),
        ({"ks.0": tensors["ks.0"].double()}, {}), ({}, other_bits),
        ({"kq.0": widened} if bits == 4 else {"kq.0": tensors["kq.0"][..., ::2]}, {}),
    ):  # fmt: skip
        with pytest.raises(ValueError, match="layer 0"):
            codec.decode(tensors | damage, metadata | meta)
    with pytest.raises(ValueError, match="precision|layer 0"):  # 4-bit layers read as 8-bit ones do not fit
        codec.decode(tensors, metadata | {"precision": "full"})


def test_files_of_format_3_still_load(tmp_path, model, monkeypatch):
    store = Store(tmp_path)
    cache = _cache(model)
    tensors, metadata = codec.encode(cache, codec.meta_of(cache, fingerprint="fp", method="m", positions="original"))
    del metadata["precision"]  # what kvchat wrote before format 4
    monkeypatch.setattr(codec, "FORMAT_VERSION", "3")
    with store.begin("old") as pending:
        pending.write_episode(0, tensors, metadata, centroid=centroid(1.0), medoid_text="x", budgets=[60, 60],
                              n_tokens=240)
        pending.commit(model="default", fingerprint="fp", settings={}, stats={})
    monkeypatch.undo()
    loaded, meta = store.load_episode(store.get("old").episodes[0], "fp")
    back, back_meta = codec.decode(loaded, meta)
    assert meta["format_version"] == "3" and back_meta.precision == "full" and back.precision == "full"
    assert codec.FORMAT_VERSION == "4" and codec.READABLE_FORMAT_VERSIONS == ("1", "2", "3", "4", "5", "6", "7")


@pytest.mark.parametrize("precision", ["full", "int8", "int4"])
def test_only_4_bit_files_are_stamped_format_5(tmp_path, model, precision):
    """Full and 8-bit files stay at "4", which kvchat before 4 bits reads; the store reads each back."""
    store = Store(tmp_path)
    cache = _cache(model)
    if precision != "full":
        cache.quantize(GROUP, 0, {"int8": 8, "int4": 4}[precision])
    tensors, metadata = codec.encode(cache, codec.meta_of(cache, fingerprint="fp", method="m", positions="original"))
    with store.begin("c") as pending:
        pending.write_episode(0, tensors, metadata, centroid=centroid(1.0), medoid_text="x", budgets=[60, 60],
                              n_tokens=240)
        pending.commit(model="default", fingerprint="fp", settings={}, stats={})
    loaded, meta = store.load_episode(store.get("c").episodes[0], "fp")
    assert meta["format_version"] == ("5" if precision == "int4" else "4")
    back, back_meta = codec.decode(loaded, meta)
    assert back.precision == back_meta.precision == precision
    assert all(torch.equal(a, b) for a, b in zip(back.layers[1].keys, cache.layers[1].keys, strict=True))


def test_a_file_of_an_unknown_format_version_is_refused(tmp_path, model, monkeypatch):
    store = Store(tmp_path)
    cache = _cache(model)
    cache.quantize(GROUP, 0, 4)
    tensors, metadata = codec.encode(cache, codec.meta_of(cache, fingerprint="fp", method="m", positions="original"))
    monkeypatch.setattr(codec, "INT4_FORMAT_VERSION", "99")
    with store.begin("c") as pending:
        pending.write_episode(0, tensors, metadata, centroid=centroid(1.0), medoid_text="x", budgets=[60, 60],
                              n_tokens=240)
        pending.commit(model="default", fingerprint="fp", settings={}, stats={})
    with pytest.raises(store_module.CacheIntegrityError, match="unsupported format version '99'"):
        store.load_episode(store.get("c").episodes[0], "fp")


# --------------------------------------------------------------------------- pipelines and options


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    messages, _ = planted_conversation(seed=3, topics=3, turns_per_topic=12)
    path = tmp_path_factory.mktemp("hist") / "planted.json"
    path.write_text(json.dumps(messages))
    return path


def _config(**cache) -> IngestConfig:
    groups = {"quant_group": GROUP, "quant_group_4bit": GROUP}
    return IngestConfig(cache=CacheConfig(budget=96, block_size=48, **groups | cache),
                        episodes=EpisodeConfig(episodes=2, patched_prompt_tokens=48))  # fmt: skip


@PRECISIONS
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_quantized_ingest_stores_the_full_caches_quantized_and_answers(
    tmp_path, planted, tiny_lm, encoder, heads, precision
):
    store = Store(tmp_path)
    bits = {"int8": 8, "int4": 4}[precision]
    full = ingest(planted, name="full", config=_config(head_budgets=heads), store=store, lm=tiny_lm, encoder=encoder)
    quantized = ingest(planted, name="q", config=_config(head_budgets=heads, precision=precision), store=store,
                       lm=tiny_lm, encoder=encoder)  # fmt: skip
    assert full.cache_precision == "full" and quantized.cache_precision == precision
    # int8: 2 bytes a number at G = 8 (4 in float32), plus positions; int4: 0.5 + 0.5 at G = 8 in float16
    assert quantized.cache_bytes < {8: 0.6, 4: 0.35}[bits] * full.cache_bytes
    record = store.get("q")
    group_key = {8: "quant_group", 4: "quant_group_4bit"}[bits]
    assert record.settings["cache_precision"] == precision and record.settings[group_key] == GROUP
    for stored_full, stored_quantized in zip(store.get("full").episodes, record.episodes, strict=True):
        reference, _ = codec.decode(*store.load_episode(stored_full, tiny_lm.fingerprint))
        tensors, meta = store.load_episode(stored_quantized, tiny_lm.fingerprint)
        assert meta["format_version"] == {8: "4", 4: "5"}[bits] and meta["precision"] == precision
        reference.quantize(GROUP, CacheConfig.quant_residual, bits)
        expected = codec.encode_layers(reference)
        assert all(torch.equal(expected[k], tensors[k]) for k in expected)
    session = Session(store, record, tiny_lm, encoder)
    first = session.ask("How many tomato plants did Tom plant this spring?", episode=0)
    again = session.ask("How many tomato plants did Tom plant this spring?", episode=0)
    assert first.answer_tokens > 0 and again.text == first.text and again.reused_cache


@PRECISIONS
def test_append_to_a_quantized_conversation_continues_in_full_precision_and_quantizes_again(
    tmp_path, planted, tiny_lm, encoder, precision
):
    store = Store(tmp_path)
    ingest(planted, name="c", config=_config(precision=precision), store=store, lm=tiny_lm, encoder=encoder)
    stored, _ = codec.decode(*store.load_episode(store.get("c").episodes[0], tiny_lm.fingerprint))
    messages, _ = planted_conversation(seed=4, topics=1, turns_per_topic=8)
    more = tmp_path / "more.json"
    more.write_text(json.dumps(messages))
    report = append(more, name="c", store=store, lm=tiny_lm, encoder=encoder)
    assert report.cache_precision == precision
    record = store.get("c")
    assert record.settings["cache_precision"] == precision and record.settings["appended"]
    cache, meta = codec.decode(*store.load_episode(record.episodes[0], tiny_lm.fingerprint))
    assert meta.precision == precision and all(isinstance(layer, QuantizedLayer) for layer in cache.layers)
    assert cache.next_position > stored.next_position  # it went on past the stored history


@PRECISIONS
def test_quantized_with_offload_is_refused_in_one_line(precision):
    with raises_said(UserError, f"--cache-precision {precision} does not combine with --offload icecache"):
        validate(_config(precision=precision, offload=OffloadConfig(mode="icecache")))
    with raises_said(UserError, "unknown --cache-precision"):
        validate(_config(precision="int2"))
    with raises_said(UserError, "--setting quant_group_4bit must be >= 1"):
        validate(_config(precision=precision, quant_group_4bit=0))


@PRECISIONS
def test_settings_round_trip_and_rebuild_command(precision):
    config = _config(precision=precision, quant_group=32 if precision == "int4" else GROUP)
    stored = to_settings(config, source="/h.json")
    assert stored["cache_precision"] == precision and stored["quant_residual"] == CacheConfig.quant_residual
    # the group of that precision only: the other one is left at its default
    assert ("quant_group_4bit" in stored) == (precision == "int4") != ("quant_group" in stored)
    back = from_settings(stored)
    other = {"quant_group": CacheConfig.quant_group} if precision == "int4" else {
        "quant_group_4bit": CacheConfig.quant_group_4bit}  # fmt: skip
    assert back.cache == dataclasses.replace(config.cache, **other)
    assert f"--cache-precision {precision}" in spell(rebuild_command("c", "default", stored))
    plain = to_settings(_config(), source="/h.json")
    assert plain["cache_precision"] == "full" and "quant_group" not in plain
    assert "--cache-precision" not in spell(rebuild_command("c", "default", plain))
    older = {k: v for k, v in plain.items() if k != "cache_precision"}  # a store from before the option
    assert from_settings(older).cache.precision == "full"
    # a full-precision conversation stores no 8-bit settings: they come back as the defaults
    defaults = CacheConfig()
    expected = dataclasses.replace(config.cache, precision="full", quant_group=defaults.quant_group,
                                   quant_group_4bit=defaults.quant_group_4bit)  # fmt: skip
    assert from_settings(plain).cache == expected


@PRECISIONS
def test_cli_cache_precision_option_and_json_key(tmp_path, tiny_model_dir, planted, precision):
    home = tmp_path / "home"
    common = ["ingest", str(planted), "--model", str(tiny_model_dir), "--budget", "80", "--setting", "block_size=32",
              "--episodes", "2"]  # fmt: skip
    bad = run_main(home, *common, "--cache-precision", "int2")
    assert bad.returncode == 2 and "--cache-precision" in bad.stderr
    refused = run_main(home, *common, "--cache-precision", precision, "--offload", "icecache")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0 and "--offload" in refused.stderr
    done = run_main(home, *common, "--cache-precision", precision, "--name", "q", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cache_precision"] == precision
    listed = json.loads(run_main(home, "list", "--json").stdout)["conversations"][0]
    shown = json.loads(run_main(home, "show", "q", "--json").stdout)
    assert listed["cache_precision"] == shown["cache_precision"] == shown["settings"]["cache_precision"] == precision
    asked = run_main(home, "ask", "How many tomato plants did Tom plant?", "--conversation", "q",
                     "--max-new-tokens", "4", "--json")  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["answer_tokens"] > 0
