"""How episode files hold keys and values (`CacheConfig.storage`, kvchat.kv.codec): float16, bfloat16 or int8 codes on
disk, read back in the answering model's dtype; the model's dtype as before; files an older kvchat reads."""

from __future__ import annotations

import safetensors.torch
import torch
from conftest import random_ids

from kvchat.kv import codec
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.layers import QuantizedLayer
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import PatchedPromptScorer


def _built(model, heads: str = "uniform") -> EpisodeCache:
    return block_prefill(model, random_ids(4, 1), random_ids(90, 2), block_size=16, budgets=[40, 40],
                         scorer=PatchedPromptScorer(random_ids(6, 3)), heads=HeadBudgets(heads)).cache  # fmt: skip


def _file(cache: EpisodeCache, storage: str) -> tuple[bytes, dict[str, torch.Tensor], dict[str, str]]:
    meta = codec.meta_of(cache, fingerprint="fp", method="epicache", positions="original", storage=storage)
    tensors, metadata = codec.encode(cache, meta)
    data = safetensors.torch.save(tensors, {**metadata, "format_version": codec.format_version(metadata)})
    return data, tensors, metadata


def _keys(layer) -> list[torch.Tensor]:
    return list(layer.keys) if layer.ragged else [layer.keys]


def _values(layer) -> list[torch.Tensor]:
    return list(layer.values) if layer.ragged else [layer.values]


def test_model_storage_writes_the_file_kvchat_wrote_before(model):
    cache = _built(model)
    data, tensors, metadata = _file(cache, "model")
    legacy = codec.encode(cache, codec.meta_of(cache, fingerprint="fp", method="epicache", positions="original"))
    assert "storage" not in metadata and metadata == legacy[1]
    assert all(torch.equal(tensors[k], legacy[0][k]) and tensors[k].dtype == torch.float32
               for k in tensors if k[0] in "kv")  # fmt: skip


def test_half_storage_halves_the_bytes_and_reads_back_in_the_models_dtype(model):
    cache = _built(model, "adaptive")  # ragged layers too
    full, _, _ = _file(cache, "model")
    for storage, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        data, tensors, metadata = _file(cache, storage)
        assert metadata["storage"] == storage and codec.format_version(metadata) == codec.FORMAT_VERSION
        assert {t.dtype for k, t in tensors.items() if k[0] in "kv" and k[1] == "."} == {dtype}
        assert len(data) < 0.6 * len(full)
        back, meta = codec.decode(safetensors.torch.load(data), metadata, dtype=torch.float32)
        assert meta.storage == storage
        for got, want in zip(back.layers, cache.layers, strict=True):
            assert got.lengths == want.lengths
            for k, w in zip(_keys(got), _keys(want), strict=True):
                assert k.dtype == torch.float32
                torch.testing.assert_close(k, w.to(dtype).float(), rtol=0, atol=0)


def test_int8_storage_holds_codes_and_gives_back_a_full_precision_cache(model):
    for heads in ("uniform", "adaptive"):
        cache = _built(model, heads)
        full, _, _ = _file(cache, "model")
        data, tensors, metadata = _file(cache, "int8")
        assert metadata["precision"] == "int8" and metadata["storage"] == "int8"
        assert codec.format_version(metadata) == codec.FORMAT_VERSION  # "4": kvchat before storage reads it
        assert tensors["kq.0"].dtype == torch.uint8
        assert len(data) < 0.5 * len(full)  # a tiny cache: headers and the residual weigh more than in a real one
        back, _ = codec.decode(safetensors.torch.load(data), metadata, dtype=torch.float32)
        assert not any(isinstance(layer, QuantizedLayer) for layer in back.layers)
        assert back.precision == "full"
        for got, want in zip(back.layers, cache.layers, strict=True):
            assert got.lengths == want.lengths
            for k, w in zip(_keys(got) + _values(got), _keys(want) + _values(want), strict=True):
                assert k.dtype == torch.float32
                step = (w.amax() - w.amin()) / 255  # within half a step of the widest group's
                assert (k - w).abs().max() <= step
            assert all(torch.equal(p, q) for p, q in zip(codec._encode_layer(got, 0).values(),
                                                         codec._encode_layer(want, 0).values(), strict=True)
                       if p.dtype == torch.int32)  # positions and lengths exact  # fmt: skip


def test_an_int8_stored_file_is_a_held_int8_cache_to_a_kvchat_before_storage(model):
    """kvchat before `storage` ignores the entry and holds the codes it finds, answering alike."""
    cache = _built(model)
    data, _, metadata = _file(cache, "int8")
    older = {k: v for k, v in metadata.items() if k != "storage"}
    held, meta = codec.decode(safetensors.torch.load(data), older, dtype=torch.float32)
    assert meta.precision == "int8" and held.precision == "int8"
    back, _ = codec.decode(safetensors.torch.load(data), metadata, dtype=torch.float32)
    for a, b in zip(held.layers, back.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)


def test_a_held_quantized_cache_keeps_its_codes_and_stores_the_rest_in_half(model):
    cache = _built(model)
    cache.quantize(16, 4, 4)  # --cache-precision int4 with a residual
    data, tensors, metadata = _file(cache, "int8")
    assert metadata["precision"] == "int4" and metadata["storage"] == "float16"
    assert tensors["k.0"].dtype == torch.float16 and tensors["k.0"].shape[-2] >= 4
    back, _ = codec.decode(safetensors.torch.load(data), metadata, dtype=torch.float32)
    assert back.precision == "int4"  # held in 4 bits, as it was built to be


def test_numbers_float16_cannot_hold_stay_in_the_models_dtype(model):
    cache = _built(model)
    cache.layers[1].keys[0, 0, 5, 0] = 1e6
    data, tensors, metadata = _file(cache, "float16")
    assert tensors["k.0"].dtype == torch.float16 and tensors["k.1"].dtype == torch.float32
    back, _ = codec.decode(safetensors.torch.load(data), metadata, dtype=torch.float32)
    assert back.layers[1].keys[0, 0, 5, 0] == 1e6
