"""IceCache's paged decode (kvchat.kv.paged_decode): the slot buffer and page table of a paged layer, the torch
reference of flashinfer's paged decode against the ragged path, end to end on an offload episode, and on a GPU
flashinfer against the reference."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import random_ids as _ids
from conftest import tiny_model, with_kvchat_attention

from kvchat.config import PagingConfig
from kvchat.kv import backends
from kvchat.kv.attention import HeadList, kvchat_attention, with_retrieved
from kvchat.kv.forward import forward
from kvchat.kv.layers import PagedLayer
from kvchat.kv.paged_decode import (
    ROOM,
    FlashinferPagedDecode,
    PagedDecode,
    PageTable,
    PoolSlots,
    paged_decode_reference,
)
from kvchat.kv.pagefile import open_pages
from kvchat.kv.prefill import block_prefill, keep_sink_and_window
from kvchat.kv.retrieval import Retrieved, attach_pages
from kvchat.kv.spill import SpillWriter

CUDA = torch.cuda.is_available()
DIM = 16


class _Module:
    layer_idx = 0


def _retrieved(lengths, seed, dim=DIM, dtype=torch.float32) -> list[Retrieved]:
    g = torch.Generator().manual_seed(seed)
    return [Retrieved(torch.randn(n, dim, generator=g).to(dtype), torch.randn(n, dim, generator=g).to(dtype),
                      torch.arange(n), torch.arange(n)) for n in lengths]  # fmt: skip


def _ragged(query, keys, values, retrieved, scale, softcap):
    """Today's path: each head's entries concatenated with its retrieved ones, one attention per head."""
    k, v = with_retrieved(HeadList(keys), HeadList(values), retrieved, 1)
    out, _ = kvchat_attention(_Module(), query, k, v, None, scaling=scale, softcap=softcap)
    return out


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_the_page_table_attends_as_the_ragged_path_through_refreshes_and_appended_tokens(softcap):
    """Three KV heads of different resident and retrieved lengths, a GQA group of 2: at every step (the first,
    after appended tokens, after a refresh, after a refresh retrieving more than the buffer holds, past a
    head's room) the reference over the page table gives the ragged path's output."""
    g = torch.Generator().manual_seed(0)
    heads, group, scale = 3, 2, 0.5
    keys = [torch.randn(1, 1, n, DIM, generator=g) * 2 for n in (7, 30, 1)]
    values = [torch.randn(1, 1, n, DIM, generator=g) for n in (7, 30, 1)]
    retrieved = _retrieved([5, 0, 11], seed=1)
    paged = PagedDecode()

    def step(retrieved):
        query = torch.randn(1, heads * group, 1, DIM, generator=g) * 2
        got = paged(query, keys, values, retrieved, scale, softcap)
        torch.testing.assert_close(got, _ragged(query, keys, values, retrieved, scale, softcap), rtol=1e-5, atol=1e-5)
        table = paged.slots.table(keys, values, retrieved)  # nothing changed: the same table again
        sizes = [k.shape[2] + r.keys.shape[0] for k, r in zip(keys, retrieved, strict=True)]
        assert table.indptr.tolist() == [0, *torch.tensor(sizes).cumsum(0).tolist()]
        assert table.last_page_len.tolist() == [1] * heads and table.indices.dtype == torch.int32
        assert len(set(table.indices.tolist())) == sum(sizes)  # every entry its own slot

    def append():
        for h in range(heads):
            keys[h] = torch.cat([keys[h], torch.randn(1, 1, 1, DIM, generator=g)], dim=2)
            values[h] = torch.cat([values[h], torch.randn(1, 1, 1, DIM, generator=g)], dim=2)

    step(retrieved)
    buffer = paged.slots.keys
    for _ in range(3):  # decode steps: only the new token is written, into the same buffer
        append()
        step(retrieved)
    assert paged.slots.keys is buffer
    step(_retrieved([2, 9, 4], seed=2))  # a refresh: the retrieved ranges are written again
    assert paged.slots.keys is buffer
    step(_retrieved([300, 1, 0], seed=3))  # more than the buffer holds: laid out again
    for _ in range(ROOM + 1):  # past each head's room
        append()
    step(_retrieved([3, 3, 3], seed=4))
    paged.slots.clear()
    assert paged.slots.keys is None
    step(_retrieved([3, 3, 3], seed=4))


def test_the_reference_reads_only_each_requests_pages():
    """Slots outside a request's page table change nothing: a key set to dominate every logit is ignored."""
    g = torch.Generator().manual_seed(3)
    slots = PoolSlots()
    keys = [torch.randn(1, 1, n, DIM, generator=g) for n in (4, 6)]
    values = [torch.randn(1, 1, n, DIM, generator=g) for n in (4, 6)]
    table = slots.table(keys, values, _retrieved([2, 3], seed=5))
    query = torch.randn(2, 2, DIM, generator=g)
    want = paged_decode_reference(query, table, 0.25)
    unused = sorted(set(range(table.keys.shape[0])) - set(table.indices.tolist()))
    table.keys[unused] = 1e4 * query[0, 0]
    table.values[unused] = 1e4
    torch.testing.assert_close(paged_decode_reference(query, table, 0.25), want)


# --------------------------------------------------------------------------- an offload episode end to end


def _paged_cache(directory: Path, model, prefix, context, paged_decode: bool, **pool):
    directory.mkdir()
    cfg = model.config
    spill = SpillWriter(directory, num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, dtype=torch.float32)  # fmt: skip
    cache = block_prefill(model, prefix, context, block_size=16, budgets=None, scorer=None, on_evict=spill).cache
    keep_sink_and_window(cache, window=8)
    spill.write_pages(directory / "pages.safetensors", PagingConfig(page_size=4, cluster_size=4))
    attach_pages(cache, open_pages(directory / "pages.safetensors"), paged_decode=paged_decode, **pool)
    return cache


def _answer_logits(model, cache, question, steps, before_rollback=lambda: None):
    mark = cache.checkpoint()
    logits = [forward(model, cache, question)[0, -1]]
    for _ in range(steps):
        logits.append(forward(model, cache, logits[-1].argmax().view(1, 1))[0, -1])
    before_rollback()
    cache.rollback(mark)
    return logits


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: the attention logit softcap
def test_an_offload_episode_answers_through_the_paged_decode_as_through_the_ragged_path(tmp_path, family):
    """Retrieving R=8 entries, refreshed every 2 tokens, over two questions (the second after a rollback): the
    paged decode's logits are the ragged path's."""
    model = with_kvchat_attention(tiny_model(family))
    prefix, context = _ids(5, 1), _ids(90, 2)
    pool = dict(budget=8, refresh=2)
    today = _paged_cache(tmp_path / "ragged", model, prefix, context, paged_decode=False, **pool)
    paged = _paged_cache(tmp_path / "paged", model, prefix, context, paged_decode=True, **pool)
    layers = [layer for layer in paged.layers if isinstance(layer, PagedLayer)]
    assert layers and all(isinstance(layer.pool.paged, PagedDecode) for layer in layers)
    assert all(layer.pool.paged is None for layer in today.layers if isinstance(layer, PagedLayer))
    for question in (_ids(7, 3), _ids(6, 4)):
        want = _answer_logits(model, today, question, steps=ROOM // 8)
        held: list[torch.Tensor | None] = []

        def look(held=held):
            held.extend(layer.pool.paged.slots.keys for layer in layers)

        got = _answer_logits(model, paged, question, steps=ROOM // 8, before_rollback=look)
        assert held and all(keys is not None for keys in held)  # the answer's decode went through the slots
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert all(layer.pool.paged.slots.keys is None for layer in layers)  # rollback freed the slots


def test_the_paged_decode_is_on_where_flashinfer_runs(tmp_path, model):
    """By default (paged_decode=None) the paged decode follows the decode backend: off on the CPU."""
    cache = _paged_cache(tmp_path / "auto", model, _ids(5, 1), _ids(40, 2), paged_decode=None, budget=8)
    pools = [layer.pool for layer in cache.layers if isinstance(layer, PagedLayer)]
    assert pools and all(pool.paged is None for pool in pools)
    assert backends.decode_backend(torch.device("cpu"), torch.float32) == "torch"


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA or not backends.flashinfer_installed(), reason="needs CUDA and the flashinfer extra")
@pytest.mark.parametrize("group", [4, 3])  # 3: flashinfer's tensor-core decode
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_flashinfers_paged_decode_equals_the_reference(group, softcap):
    """flashinfer's BatchDecodeWithPagedKVCacheWrapper over a paged layer's table (page_size 1, one request per
    KV head) against the torch reference on the same table, then through a step after appended tokens."""
    device, dtype, heads, dim = torch.device("cuda"), torch.bfloat16, 8, 128
    torch.manual_seed(0)
    lengths, got_lengths = [1000, 17, 600, 300, 1, 999, 64, 512], [192, 0, 37, 192, 5, 192, 1, 100]
    keys = [torch.randn(1, 1, n, dim, device=device, dtype=dtype) for n in lengths]
    values = [torch.randn(1, 1, n, dim, device=device, dtype=dtype) for n in lengths]
    retrieved = _retrieved(got_lengths, seed=1, dim=dim, dtype=torch.float16)  # on the host, as pages are
    assert backends.decode_backend(device, dtype) == "flashinfer"
    kernel = FlashinferPagedDecode()
    paged = PagedDecode(kernel)
    for _ in range(2):
        query = torch.randn(1, heads * group, 1, dim, device=device, dtype=dtype)
        table = paged.slots.table(keys, values, retrieved)
        q = query[0, :, 0].reshape(heads, group, dim)
        want = paged_decode_reference(q.float(), _in_float32(table), dim**-0.5, softcap).to(dtype)
        torch.testing.assert_close(kernel(q, table, dim**-0.5, softcap), want, rtol=2e-2, atol=2e-2)
        got = paged(query, keys, values, retrieved, dim**-0.5, softcap)  # through the layer's PagedDecode
        torch.testing.assert_close(got.view(heads, group, dim), want, rtol=2e-2, atol=2e-2)
        keys = [torch.cat([k, torch.randn_like(k[:, :, :1])], dim=2) for k in keys]
        values = [torch.cat([v, torch.randn_like(v[:, :, :1])], dim=2) for v in values]


def _in_float32(table: PageTable) -> PageTable:
    """The same table over float32 copies of the slots (the reference computed in float32)."""
    return replace(table, keys=table.keys.float(), values=table.values.float())
