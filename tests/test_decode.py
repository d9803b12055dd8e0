"""Decoding: cache buffers that grow in place (append, keep, rollback, copies, files), the decode loop."""

from __future__ import annotations

import os
import shutil

import pytest
import safetensors.torch
import torch
from conftest import random_ids as _ids

from kvchat.kv import codec
from kvchat.kv.attention import PagedKeys
from kvchat.kv.cache import EpisodeCache, RaggedLayer, UniformLayer
from kvchat.kv.forward import forward
from kvchat.kv.layers import PagedLayer
from kvchat.kv.prefill import block_prefill
from kvchat.kv.scoring import PatchedPromptScorer

HEADS, DIM = 3, 4


def _entries(n: int, start: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HEADS, n, DIM, generator=g)
    values = torch.randn(1, HEADS, n, DIM, generator=g)
    return keys, values, torch.arange(start, start + n).expand(HEADS, n)


def _uniform(n: int = 10, seed: int = 0) -> UniformLayer:
    return UniformLayer.of(*_entries(n, 0, seed))


def _ragged(lengths=(5, 9, 2), seed: int = 0) -> RaggedLayer:
    g = torch.Generator().manual_seed(seed)
    return RaggedLayer(
        [torch.randn(1, 1, n, DIM, generator=g) for n in lengths],
        [torch.randn(1, 1, n, DIM, generator=g) for n in lengths],
        [torch.arange(n) * 2 for n in lengths],
    )


def _snapshot(layer) -> list[torch.Tensor]:
    """Every head's keys, values and positions, copied."""
    heads = range(len(layer.lengths))
    if layer.ragged:
        return [t.clone() for h in heads for t in (layer.keys[h][0, 0], layer.values[h][0, 0], layer.positions[h])]
    return [t.clone() for h in heads for t in (layer.keys[0, h], layer.values[0, h], layer.positions[h])]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _appended(snapshot: list[torch.Tensor], keys, values, positions) -> list[torch.Tensor]:
    """What a layer holding `snapshot` holds after appending these entries (concatenation, the reference)."""
    out = []
    for h in range(HEADS):
        k, v, p = snapshot[3 * h : 3 * h + 3]
        out += [torch.cat([k, keys[0, h]]), torch.cat([v, values[0, h]]), torch.cat([p, positions[h]])]
    return out


@pytest.mark.parametrize("make", [_uniform, _ragged], ids=["uniform", "ragged"])
def test_appending_token_by_token_equals_concatenation_and_writes_in_place_once_reserved(make):
    layer = make()
    expected = _snapshot(layer)
    layer.reserve(40)
    storage = layer.values[0].untyped_storage().data_ptr()
    for i in range(40):
        new = _entries(1, 100 + i, seed=i + 1)
        layer.append(*new)
        expected = _appended(expected, *new)
        assert _same(_snapshot(layer), expected)
    assert layer.values[0].untyped_storage().data_ptr() == storage  # no reallocation within the reservation
    assert layer.nbytes() == sum(t.nbytes for t in expected if t.is_floating_point())  # spare room not counted


@pytest.mark.parametrize("make", [_uniform, _ragged], ids=["uniform", "ragged"])
def test_a_growing_buffer_reallocates_geometrically_not_per_token(make):
    layer = make()
    storages = set()
    for i in range(500):
        layer.append(*_entries(1, 100 + i, seed=i))
        storages.add(layer.keys[0].untyped_storage().data_ptr())
    assert len(storages) <= 12  # a quarter more each time (at least 64): a handful of moves for 500 tokens


@pytest.mark.parametrize("make", [_uniform, _ragged], ids=["uniform", "ragged"])
def test_tensors_a_layer_was_built_from_are_never_written(make):
    """A decoded file's tensors (possibly memory-mapped) are copied out before the first append."""
    layer = make()
    source = [t for t in (*layer.keys, *layer.values)] if layer.ragged else [layer.keys, layer.values]
    before = [t.clone() for t in source]
    layer.truncate_heads([1] * HEADS)
    layer.append(*_entries(3, 50, seed=9))
    assert _same(source, before)


@pytest.mark.parametrize("make", [_uniform, _ragged], ids=["uniform", "ragged"])
def test_rollback_then_append_overwrites_only_the_rolled_back_entries(make):
    layer = make()
    base = _snapshot(layer)
    mark = list(layer.lengths)
    layer.reserve(8)
    layer.append(*_entries(5, 30, seed=1))
    layer.truncate_heads(mark)
    assert _same(_snapshot(layer), base)
    new = _entries(2, 30, seed=2)
    layer.append(*new)
    assert _same(_snapshot(layer), _appended(base, *new))


@pytest.mark.parametrize("make", [_uniform, _ragged], ids=["uniform", "ragged"])
def test_copies_share_tensors_but_appends_evictions_and_rollbacks_stay_their_own(make):
    a = EpisodeCache.of_layers([make()], next_position=20, protected=1)
    a.reserve(16)  # spare room the copy must not write into
    a.layers[0].append(*_entries(2, 20, seed=3))
    base = _snapshot(a.layers[0])
    b = a.copy()
    assert b.layers[0].keys[0].data_ptr() == a.layers[0].keys[0].data_ptr()  # shared, not copied

    new_a, new_b = _entries(3, 22, seed=4), _entries(3, 22, seed=5)
    a.layers[0].append(*new_a)
    b.layers[0].append(*new_b)
    assert _same(_snapshot(a.layers[0]), _appended(base, *new_a))
    assert _same(_snapshot(b.layers[0]), _appended(base, *new_b))

    a.layers[0].truncate_heads([1] * HEADS)  # a rolls back below what b holds, then writes again
    a.layers[0].append(*_entries(4, 1, seed=6))
    assert _same(_snapshot(b.layers[0]), _appended(base, *new_b))

    held_by_a = _snapshot(a.layers[0])
    index = [torch.tensor([0, 2])] * HEADS
    b.keep_layer(0, torch.stack(index) if not b.layers[0].ragged else index)
    assert b.layers[0].lengths == [2] * HEADS
    assert _same(_snapshot(a.layers[0]), held_by_a) and a.layers[0].lengths == [1 + 4] * HEADS


@pytest.mark.parametrize("make", [_uniform, _ragged], ids=["uniform", "ragged"])
def test_a_file_holds_only_the_live_entries(make):
    """Spare room and rolled-back entries never reach an episode file: it is byte for byte the file of
    a layer holding the same entries without spare room."""
    layer = make()
    layer.reserve(100)
    layer.append(*_entries(7, 40, seed=8))
    mark = list(layer.lengths)
    layer.append(*_entries(5, 47, seed=9))
    layer.truncate_heads(mark)
    cache = EpisodeCache.of_layers([layer], next_position=47, protected=0)
    snap = _snapshot(layer)
    if layer.ragged:
        tight = RaggedLayer([k.view(1, 1, -1, DIM) for k in snap[0::3]], [v.view(1, 1, -1, DIM) for v in snap[1::3]],
                            snap[2::3])  # fmt: skip
    else:
        tight = UniformLayer.of(torch.stack(snap[0::3]).unsqueeze(0), torch.stack(snap[1::3]).unsqueeze(0),
                                torch.stack(snap[2::3]))  # fmt: skip
    reference = EpisodeCache.of_layers([tight], next_position=47, protected=0)
    assert safetensors.torch.save(codec.encode_layers(cache)) == safetensors.torch.save(codec.encode_layers(reference))


def test_a_paged_layer_keeps_its_pool_through_growth_and_rollback():
    class Pool:
        cleared = 0

        def retrieved(self, query, scale=None):
            raise AssertionError("not attended here")

        def clear(self):
            self.cleared += 1

    pool = Pool()
    layer = PagedLayer.over(_uniform(), pool)
    layer.reserve(4)
    layer.append(*_entries(70, 10, seed=1))  # beyond the reservation: the buffers grow
    assert isinstance(layer.keys, PagedKeys) and layer.keys.pool is pool
    layer.truncate_heads([10] * HEADS)
    assert isinstance(layer.keys, PagedKeys) and layer.lengths == [10] * HEADS and pool.cleared == 1


def test_a_prefilled_cache_decodes_the_same_with_and_without_spare_room(model):
    """Reserving room (what the decode loop does) changes where entries live, not what attention sees."""
    def cache():
        return block_prefill(model, _ids(3, 1), _ids(60, 2), block_size=16, budgets=[20, 20],
                             scorer=PatchedPromptScorer(_ids(4, 5))).cache  # fmt: skip

    plain, roomy = cache(), cache()
    roomy.reserve(32)
    for ids in (_ids(6, 3), torch.tensor([[9]]), torch.tensor([[11]])):
        torch.testing.assert_close(forward(model, roomy, ids), forward(model, plain, ids), rtol=0, atol=0)


# --------------------------------------------------------------------------- the decode loop


def test_the_decode_loop_makes_room_once_and_answers_as_asked(tiny_lm):
    from kvchat.model.llm import generate

    cache = block_prefill(tiny_lm.model, _ids(3, 1, vocab=40), _ids(50, 2, vocab=40), block_size=16, budgets=None,
                          scorer=None).cache  # fmt: skip
    storages: list[list[int]] = []

    def where(_logits) -> None:
        storages.append([layer.keys.untyped_storage().data_ptr() for layer in cache.layers])

    mark = cache.checkpoint()
    tokens = list(generate(tiny_lm, cache, _ids(5, 3, vocab=40), 12, where, stop_ids=()))
    assert len(tokens) == 12  # no stop token: exactly max_new_tokens
    where(None)
    assert storages[0] == storages[1]  # the prompt and every answer token were written in place
    cache.rollback(mark)
    again = list(generate(tiny_lm, cache, _ids(5, 3, vocab=40), 12, stop_ids=()))
    assert again == tokens


# --------------------------------------------------------------------------- int8 and int4 weights


def test_int8_linear_holds_int8_rows_and_multiplies_like_the_float_layer():
    from kvchat.model.int8_weights import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    q = Int8Linear.of(linear)
    assert q.weight.dtype == torch.int8 and q.scale.shape == (48,)
    dequantized = q.weight.float() * q.scale.float()[:, None]
    # half a step of rounding, plus the bfloat16 scale's own rounding (up to 2^-8 relative) over 127 steps
    assert ((dequantized - linear.weight).abs() <= q.scale.float()[:, None] * (0.5 + 127 * 2**-8)).all()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = linear(x)
    got = q(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert (got - want).norm() / want.norm() < 0.02


def test_a_model_loaded_with_int8_weights_keeps_its_fingerprint_and_answers_close_to_float(tiny_model_dir, tmp_path):
    from kvchat.errors import UserError
    from kvchat.model.int8_weights import Int8Linear
    from kvchat.model.llm import load_model

    plain = load_model(str(tiny_model_dir), tmp_path)
    int8 = load_model(str(tiny_model_dir), tmp_path, weights="int8")
    assert int8.fingerprint == plain.fingerprint  # caches built with float weights answer with int8 ones
    linears = [m for m in int8.model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and any(isinstance(m, Int8Linear) for m in int8.model.modules())
    ids = _ids(40, 4, vocab=40)
    with torch.no_grad():
        p = plain.model(ids).logits[0, -1].log_softmax(-1)
        q = int8.model(ids).logits[0, -1].log_softmax(-1)
    assert float((p.exp() * (p - q)).sum()) < 0.01
    with pytest.raises(UserError, match="unknown weights"):
        load_model(str(tiny_model_dir), tmp_path, weights="int2")


def _on_4_bit_grid(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4_1 file holds them: per group of 32 columns, 16 levels `code * step + low` (a step and low
    that bfloat16 holds exactly, as kvchat's scale and offset are stored)."""
    g = torch.Generator().manual_seed(seed)
    groups = columns // 32
    step = (torch.rand(rows, groups, 1, generator=g) * 0.1 + 0.01).to(torch.bfloat16).float()
    low = -8 * step + (torch.randn(rows, groups, 1, generator=g) * 0.05).to(torch.bfloat16).float()
    codes = torch.randint(0, 16, (rows, groups, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans its 16 levels, as Q4_1's minimum and maximum do
    return (codes * step + low).reshape(rows, columns)


def test_int4_linear_finds_the_codes_of_weights_already_in_4_bit_groups():
    from kvchat.model.int4_weights import Int4Linear

    linear = torch.nn.Linear(96, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(_on_4_bit_grid(48, 96))
    q = Int4Linear.of(linear)
    assert q.weight.dtype == torch.uint8 and q.weight.numel() == 48 * 96 // 2
    assert q.scale_zero.shape == (3, 48, 2) and q.scale_zero.dtype == torch.bfloat16
    x = torch.randn(3, 96)
    want = x.to(torch.bfloat16).double() @ linear.weight.double().t()  # the activations' rounding only
    got = q(x)
    assert got.dtype == x.dtype and got.shape == (3, 48)
    # the bfloat16 output's own rounding: the weights came back exactly
    torch.testing.assert_close(got.double(), want, atol=0.02, rtol=2**-7)


def test_int4_linear_of_any_weights_stays_within_4_bit_group_rounding():
    from kvchat.model.int4_weights import Int4Linear

    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 32, bias=True)
    q = Int4Linear.of(linear)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want = linear(x)
    got = q(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert (got - want).norm() / want.norm() < 0.1  # 16 levels a group of 32: a few percent
    with pytest.raises(ValueError, match="int4"):
        Int4Linear.of(torch.nn.Linear(40, 32))  # 40 columns: not whole groups


def test_int4_weights_put_the_decoder_in_4_bits_and_the_lm_head_in_8(tiny_model_dir, tmp_path):
    from kvchat.model.int4_weights import Int4Linear
    from kvchat.model.int8_weights import Int8Linear
    from kvchat.model.llm import load_model, weights_ids

    plain = load_model(str(tiny_model_dir), tmp_path)
    int4 = load_model(str(tiny_model_dir), tmp_path, weights="int4")
    assert int4.fingerprint == plain.fingerprint  # caches built with float weights answer with int4 ones
    # layer profiles and IndexMem weights are found by the float weights' fingerprints
    assert int4.weights == "int4" and int4.weight_ids == plain.weight_ids == weights_ids(plain.model)
    kinds = {name: type(m) for name, m in int4.model.named_modules() if name.endswith(("_proj", "lm_head"))}
    assert kinds.pop("lm_head") is Int8Linear
    assert set(kinds.values()) == {Int4Linear} and len(kinds) == 7 * int4.num_layers
    ids = _ids(40, 4, vocab=40)
    with torch.no_grad():
        p = plain.model(ids).logits[0, -1].log_softmax(-1)
        q = int4.model(ids).logits[0, -1].log_softmax(-1)
    assert float((p.exp() * (p - q)).sum()) < 0.05
    assert not torch.equal(p, q)  # the 4-bit weights answered, not the float ones


def test_auto_weights_are_int4_only_where_the_decoder_already_holds_4_bit_groups(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from kvchat.model.int4_weights import Int4Linear, holds_4_bit_groups, on_4_bit_grid
    from kvchat.model.llm import load_model

    random = load_model(str(tiny_model_dir), tmp_path, weights="auto")  # random float weights: kept as loaded
    assert random.weights == "float" and not holds_4_bit_groups(random.model)
    assert not any(isinstance(m, Int4Linear) for m in random.model.modules())

    grid = tmp_path / "on-grid"  # the same model with its decoder's weights put on 4-bit groups, as a Q4_1 GGUF's
    shutil.copytree(tiny_model_dir, grid)
    tensors = load_file(grid / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):
            tensors[name] = _on_4_bit_grid(*tensor.shape, seed=len(name))
            assert on_4_bit_grid(tensors[name]) and not on_4_bit_grid(tensors[name] + 1e-3 * torch.randn(tensor.shape))
    save_file(tensors, grid / "model.safetensors", metadata={"format": "pt"})
    four = load_model(str(grid), tmp_path, weights="auto")
    assert four.weights == "int4" and any(isinstance(m, Int4Linear) for m in four.model.modules())
    assert load_model(str(grid), tmp_path).weights == "float"  # the library's default: as loaded


def test_quantized_weights_are_kept_beside_the_models_and_read_back_not_computed(tiny_model_dir, tmp_path, caplog):
    from kvchat.model.int4_weights import Int4Linear
    from kvchat.model.llm import load_model

    models = tmp_path / "models"
    first = load_model(str(tiny_model_dir), models, weights="int4")
    kept = sorted((models / "held").iterdir())
    assert [p.name.split(".")[1] for p in kept] == ["int4"] and not list(models.glob(".tmp-*"))
    with caplog.at_level("DEBUG", logger="kvchat.model.held_weights"):
        again = load_model(str(tiny_model_dir), models, weights="int4")
    assert any("read from" in r.getMessage() for r in caplog.records)
    assert again.weights == "int4" and again.weight_ids == first.weight_ids
    ours, theirs = dict(again.model.named_buffers()), dict(first.model.named_buffers())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(isinstance(m, Int4Linear) for m in again.model.modules())
    ids = _ids(30, 5, vocab=40)
    with torch.no_grad():
        torch.testing.assert_close(again.model(ids).logits, first.model(ids).logits, atol=0, rtol=0)


def test_weights_packed_by_another_torch_are_replaced_and_other_files_left_alone(tiny_model_dir, tmp_path):
    from kvchat.model.llm import load_model

    held = tmp_path / "models" / "held"
    held.mkdir(parents=True)
    fingerprint = load_model(str(tiny_model_dir), tmp_path / "models").weight_ids[0]
    stale = held / f"{fingerprint}.int4.torch-0.1.safetensors"  # these weights, packed by an older torch
    others = [held / f"{fingerprint}.int8.torch-0.1.safetensors", held / "0123456789abcdef.int4.torch-0.1.safetensors"]
    for path in (stale, *others):
        path.write_bytes(b"")
    load_model(str(tiny_model_dir), tmp_path / "models", weights="int4")
    assert not stale.exists() and all(path.exists() for path in others)
    assert len(list(held.glob(f"{fingerprint}.int4.*"))) == 1


def test_kept_weights_that_do_not_fit_are_computed_again(tiny_model_dir, tmp_path, caplog):
    from kvchat.model.llm import load_model

    models = tmp_path / "models"
    first = load_model(str(tiny_model_dir), models, weights="int8")
    (kept,) = (models / "held").iterdir()
    kept.write_bytes(kept.read_bytes()[:-100])  # cut short
    with caplog.at_level("DEBUG", logger="kvchat.model.held_weights"):
        again = load_model(str(tiny_model_dir), models, weights="int8")
    assert not any("read from" in r.getMessage() for r in caplog.records)
    ids = _ids(30, 5, vocab=40)
    with torch.no_grad():
        torch.testing.assert_close(again.model(ids).logits, first.model(ids).logits, atol=0, rtol=0)
    caplog.clear()
    with caplog.at_level("DEBUG", logger="kvchat.model.held_weights"):
        load_model(str(tiny_model_dir), models, weights="int8")  # written again, whole
    assert any("read from" in r.getMessage() for r in caplog.records)

    caplog.clear()  # the model's weights file written again (its time changed): what was kept for it is not used
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    load_model(str(copy), models, weights="int8")
    weights_file = copy / "model.safetensors"
    os.utime(weights_file, ns=(weights_file.stat().st_atime_ns, weights_file.stat().st_mtime_ns + 10**9))
    with caplog.at_level("DEBUG", logger="kvchat.model.held_weights"):
        reread = load_model(str(copy), models, weights="int8")
    assert not any("read from" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(reread.model(ids).logits, first.model(ids).logits, atol=0, rtol=0)


def test_auto_keeps_its_verdict_and_a_read_only_home_still_answers(tiny_model_dir, tmp_path, caplog):
    from kvchat.model.llm import load_model

    models = tmp_path / "models"
    assert load_model(str(tiny_model_dir), models, weights="auto").weights == "float"
    (verdict,) = (models / "held").iterdir()
    assert verdict.name.split(".")[1] == "auto" and verdict.stat().st_size < 1024  # no tensors: float stays float
    with caplog.at_level("DEBUG", logger="kvchat.model.held_weights"):
        assert load_model(str(tiny_model_dir), models, weights="auto").weights == "float"
    assert any("float weights read from" in r.getMessage() for r in caplog.records)

    blocked = tmp_path / "blocked"  # nothing can be kept there (as in a read-only home): computed, and answers
    blocked.mkdir()
    (blocked / "held").write_text("not a directory")
    lm = load_model(str(tiny_model_dir), blocked, weights="int4")
    assert lm.weights == "int4" and sorted(p.name for p in blocked.iterdir()) == ["held"]


def test_quantized_weights_are_not_kept_where_they_would_nearly_fill_the_disk(tiny_model_dir, tmp_path, monkeypatch):
    from kvchat.model import held_weights
    from kvchat.model.llm import load_model

    monkeypatch.setattr(held_weights, "SPARE_BYTES", shutil.disk_usage(tmp_path).free)  # no room to spare
    lm = load_model(str(tiny_model_dir), tmp_path / "models", weights="int4")
    assert lm.weights == "int4" and not list((tmp_path / "models").rglob("*.safetensors"))
