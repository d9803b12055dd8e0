"""Ingest's prefill multiplies int4 and int8 weights held dense in bfloat16 (`NativeLlama.dense_products`): the
values the kernels multiply by, a faster kernel for many rows; one row (a decode step) still by the kernels, and the
dense copies gone after."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids
from safetensors.torch import load_file
from torch import nn

from kvchat.config import CacheConfig, EpisodeConfig, IngestConfig
from kvchat.ingest.pipeline import IngestProgress, ingest
from kvchat.model.int4_weights import CodeLayout, Int4Linear, bfloat16_weight
from kvchat.model.llm import load_model
from kvchat.model.native_llama import NativeLlama
from kvchat.store import Store

SMALL = IngestConfig(cache=CacheConfig(budget=96, block_size=48, prefill="block"),
                     episodes=EpisodeConfig(patched_prompt_tokens=48))


def _holding(model: NativeLlama) -> list[bool]:
    """Per layer part (attention, MLP), whether its products hold dense weights."""
    return [part.products().holds_dense for layer in model.model.layers for part in (layer.self_attn, layer.mlp)]


@pytest.mark.parametrize("rows, columns", [(16, 32), (64, 96), (80, 64), (208, 128)])  # 80, 208: a short last block
def test_the_dense_weights_are_the_values_the_int4_kernel_multiplies_by(rows, columns):
    torch.manual_seed(rows)
    int4 = Int4Linear.of(nn.Linear(columns, rows, bias=False))
    dense = bfloat16_weight(int4.weight, int4.scale_zero, CodeLayout())
    assert dense.dtype == torch.bfloat16 and dense.shape == (rows, columns)
    assert torch.equal(dense.float(), int4.float_weight())


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_inside_dense_products_a_block_gives_the_kernels_logits_and_one_row_the_kernels_own(
        tiny_model_dir, tmp_path, weights):
    lm = load_model(str(tiny_model_dir), tmp_path, weights=weights)
    model = lm.model
    assert isinstance(model, NativeLlama) and lm.prefill_weight_bytes > 0
    block, one = random_ids(40, seed=3, vocab=40), random_ids(1, seed=4, vocab=40)
    with torch.inference_mode():
        kernels, kernel_row = model(block).logits, model(one).logits
        with lm.prefill_weights():
            assert all(_holding(model))
            with lm.prefill_weights():  # nested: nothing more held, nothing dropped on leaving
                pass
            assert all(_holding(model))
            dense, dense_row = model(block).logits, model(one).logits
    assert not any(_holding(model))
    assert torch.equal(dense_row, kernel_row)  # one row: the kernels
    assert not torch.equal(dense, kernels)     # many: the dense product (another summation order)
    torch.testing.assert_close(dense, kernels, atol=0.05, rtol=0.02)  # bfloat16 rounding of the activations


def test_float_weights_hold_nothing_more(tiny_lm):
    assert tiny_lm.prefill_weight_bytes == 0
    with tiny_lm.prefill_weights():
        assert not any(_holding(tiny_lm.model))


class _Watch(IngestProgress):
    def __init__(self, model: NativeLlama) -> None:
        self.model, self.seen = model, []

    def block(self, done: int, total: int) -> None:
        self.seen.append(all(_holding(self.model)))


def test_an_int4_ingest_prefills_by_dense_weights_and_releases_them(tmp_path, tiny_model_dir, history, encoder):
    lm = load_model(str(tiny_model_dir), tmp_path / "models", weights="int4")
    watch = _Watch(lm.model)
    stores = [Store(tmp_path / name) for name in ("a", "b")]
    for store in stores:
        ingest(history, name="conv", config=SMALL, store=store, lm=lm, encoder=encoder, progress=watch)
    assert watch.seen and all(watch.seen)
    assert not any(_holding(lm.model))
    first, second = (sorted((tmp_path / name).rglob("*.safetensors")) for name in ("a", "b"))
    assert len(first) == len(second) > 0
    for a, b in zip(first, second, strict=True):  # the same caches every time
        ours, theirs = load_file(a), load_file(b)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
