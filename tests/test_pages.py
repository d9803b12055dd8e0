"""IceCache core on small random tensors: pages, retrieval, attention over retrieved entries, the
pages file and the spill writer."""

from __future__ import annotations

import hashlib

import pytest
import safetensors.torch
import torch

from kvchat.config import OFFLOAD_SCORERS, PagingConfig
from kvchat.kv.attention import HeadList, attention_with_retrieved, with_retrieved
from kvchat.kv.pagefile import decode, encode, open_pages, pages_metadata, write_layers
from kvchat.kv.pages import HeadPages, mips_keys, mips_queries, positional_pages, semantic_pages
from kvchat.kv.retrieval import PAGE_SCORERS, EntryScorer, PagePool, Retrieved, choose_rows, retrieve, select_pages
from kvchat.kv.spill import SpillWriter


def _entries(n: int, dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    positions = torch.randperm(4 * n + 1, generator=g)[:n].sort().values
    return torch.randn(n, dim, generator=g), torch.randn(n, dim, generator=g), positions


def _clustered(clusters: int, per_cluster: int, dim: int = 32, seed: int = 0):
    """Keys around well-separated random centres, cluster members interleaved in position order."""
    g = torch.Generator().manual_seed(seed)
    centres = 5 * torch.randn(clusters, dim, generator=g)
    label = torch.arange(clusters * per_cluster) % clusters
    keys = centres[label] + 0.1 * torch.randn(len(label), dim, generator=g)
    values = torch.randn(len(label), dim, generator=g)
    return keys, values, torch.arange(len(label)), label


def _assert_partition(pages: HeadPages, keys, values, positions, page_size: int) -> None:
    assert pages.num_entries == keys.shape[0] == int(pages.lengths.sum())
    assert bool((pages.lengths >= 1).all()) and bool((pages.lengths <= page_size).all())
    assert torch.equal(pages.positions.sort().values, positions.sort().values)
    row_of = {int(p): i for i, p in enumerate(positions)}
    source = torch.tensor([row_of[int(p)] for p in pages.positions], dtype=torch.long)
    assert torch.equal(pages.keys, keys[source]) and torch.equal(pages.values, values[source])
    page = pages.page_of_entry()
    means = torch.stack([pages.keys[page == i].mean(0) for i in range(pages.num_pages)]) if pages.num_pages else None
    if means is not None:
        torch.testing.assert_close(pages.centroids, means)


@pytest.mark.parametrize(("n", "page_size", "cluster_size"), [(0, 16, 16), (1, 16, 16), (7, 16, 16), (137, 16, 16),
                                                                (200, 8, 64), (50, 1, 4)])
def test_semantic_pages_partition_the_entries_with_their_positions(n, page_size, cluster_size):
    keys, values, positions = _entries(n)
    config = PagingConfig(page_size=page_size, cluster_size=cluster_size)
    _assert_partition(semantic_pages(keys, values, positions, config), keys, values, positions, page_size)


def test_identical_keys_still_partition():
    """Fewer distinct keys than clusters: k-means leaves clusters empty, pages still hold every entry."""
    keys = torch.ones(40, 8)
    values, positions = torch.randn(40, 8), torch.arange(40)
    _assert_partition(semantic_pages(keys, values, positions), keys, values, positions, 16)


def test_positional_pages_are_contiguous_runs():
    keys, values, positions = _entries(37)
    pages = positional_pages(keys, values, positions, page_size=16)
    _assert_partition(pages, keys, values, positions, 16)
    assert pages.lengths.tolist() == [16, 16, 5]
    assert torch.equal(pages.positions, positions.sort().values)


def _purity(pages: HeadPages, label: torch.Tensor) -> float:
    """Share of entries whose page's most common cluster is their own."""
    page = pages.page_of_entry()
    agree = sum(int(torch.bincount(label[pages.positions[page == i]]).max()) for i in range(pages.num_pages))
    return agree / pages.num_entries


def test_semantic_pages_group_similar_keys():
    """Pages follow the key clusters although the clusters' entries interleave in position order."""
    keys, values, positions, label = _clustered(clusters=12, per_cluster=10)
    assert _purity(semantic_pages(keys, values, positions), label) >= 0.8
    assert _purity(positional_pages(keys, values, positions), label) <= 0.2


def test_mips_transform_turns_inner_product_into_nearest_neighbour():
    keys, _, _ = _entries(300, dim=24, seed=3)
    keys = keys * torch.rand(300, 1)  # varied norms: plain nearest neighbour would pick a different key
    queries = torch.randn(20, 24, generator=torch.Generator().manual_seed(4))
    nearest = torch.cdist(mips_queries(queries), mips_keys(keys)).argmin(dim=-1)
    assert torch.equal(nearest, (queries @ keys.T).argmax(dim=-1))
    assert torch.allclose(mips_keys(keys).norm(dim=-1), torch.ones(300))


@pytest.mark.parametrize("scorer", sorted(PAGE_SCORERS))
def test_a_query_equal_to_a_stored_key_retrieves_that_keys_page(scorer):
    keys, values, positions, _ = _clustered(clusters=12, per_cluster=10)
    pages = semantic_pages(keys, values, positions)
    for row in (0, 17, 59, 118):
        query = keys[row].view(1, 1, 1, -1).expand(1, 2, 3, -1)  # one KV head: its group of 2 query heads
        (got,) = retrieve(query, [pages], budget=16, scorer=PAGE_SCORERS[scorer])
        assert int(positions[row]) in got.positions.tolist()
        assert got.keys.shape[0] <= 16


def test_top_keys_scorer_finds_a_stored_key_without_cluster_structure():
    keys, values, positions = _entries(300, dim=64, seed=5)
    pages = semantic_pages(keys, values, positions)
    for row in range(0, 300, 37):
        (got,) = retrieve(keys[row].view(1, 1, 1, -1), [pages], budget=16, scorer=PAGE_SCORERS["top-keys"])
        assert int(positions[row]) in got.positions.tolist()


def test_the_configurable_scorers_are_the_implemented_ones():
    assert tuple(PAGE_SCORERS) == OFFLOAD_SCORERS


def test_entry_scorer_reads_the_exact_best_entries_of_its_candidates():
    """With every page a candidate, `entries` reads the R entries of highest attention (max over the query
    rows of the softmax over the head's entries), not whole pages."""
    keys, values, positions = _entries(200, dim=16, seed=3)
    pages = semantic_pages(keys, values, positions, PagingConfig(page_size=16))
    queries = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    rows = EntryScorer(candidates=100).rows(queries, pages, 0.25, 10)
    weights = (queries @ pages.keys.T * 0.25).softmax(-1).amax(0)
    assert rows.tolist() == weights.topk(10).indices.tolist()
    assert torch.equal(pages.take(rows)[2], pages.positions[rows].long())


def test_entry_scorer_takes_pinned_rows_first_and_only_candidates_after():
    keys, values, positions, label = _clustered(clusters=12, per_cluster=10, dim=16)
    pages = semantic_pages(keys, values, positions)
    far = int((label == 3).nonzero()[0])
    row_of = {int(p): i for i, p in enumerate(pages.positions)}
    pinned = torch.tensor([row_of[far]])
    query = keys[0].view(1, -1)  # cluster 0: its 10 entries are the only candidates of budget 10
    rows = EntryScorer(candidates=1).rows(query, pages, 0.2, 10, pinned)
    assert rows[0] == row_of[far] and rows.numel() == 10
    assert set(label[pages.positions[rows[1:]]].tolist()) == {0}


def test_a_page_scorer_pins_only_the_pages_the_pinned_rows_fill():
    """PagePool pins a prefix of the rows read; a page scorer keeps the pages wholly inside it."""
    lengths = torch.tensor([4, 4, 4])
    pages = HeadPages(torch.randn(12, 8), torch.randn(12, 8), torch.arange(12), lengths, torch.randn(3, 8))

    def favour_page_2(queries, pages, scale, budget):
        return torch.tensor([0.5, 0.1, 0.9])

    rows = choose_rows(favour_page_2, torch.randn(1, 8), pages, 1.0, 8, pinned=torch.tensor([4, 5, 6, 7, 0]))
    assert rows.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # page 1 pinned whole; page 0's one row pins nothing


def test_select_pages_takes_best_pages_within_the_budget():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.2])
    lengths = torch.tensor([16, 10, 16, 4, 3])
    assert select_pages(scores, lengths, 14).tolist() == [1, 3]
    assert select_pages(scores, lengths, 29).tolist() == [1, 3]  # page 2 does not fit: stop there
    assert select_pages(scores, lengths, 30).tolist() == [1, 3, 2]
    assert select_pages(scores, lengths, 5).tolist() == []


def _reference_attention(query, keys, values, new_tokens, scale):
    """Softmax attention per KV head over its own keys (cached first, the last `new_tokens` causal)."""
    outs = []
    group = query.shape[1] // len(keys)
    for h, (k, v) in enumerate(zip(keys, values, strict=True)):
        q = query[0, h * group : (h + 1) * group]                     # [group, q, D]
        logits = q @ k.T * scale                                       # [group, q, n]
        past = k.shape[0] - new_tokens
        visible = torch.ones(new_tokens, k.shape[0], dtype=torch.bool)
        visible[:, past:] = torch.ones(new_tokens, new_tokens, dtype=torch.bool).tril()
        outs.append(logits.masked_fill(~visible, float("-inf")).softmax(-1) @ v)
    return torch.cat(outs).transpose(0, 1).unsqueeze(0)                # [1, q, q_heads, D]


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("scorer", sorted(PAGE_SCORERS))
def test_all_pages_retrieved_gives_full_attention(q_len, ragged, scorer):
    """Resident + every retrieved page == attention over resident and offloaded entries together."""
    g = torch.Generator().manual_seed(1)
    kv_heads, group, dim = 2, 3, 16
    resident = [11, 11] if not ragged else [7, 13]
    spilled = [[_entries(n, dim, seed=10 + h)] for h, n in enumerate([40, 25])]
    layer = [semantic_pages(*s[0], PagingConfig(page_size=8)) for s in spilled]
    res_k = [torch.randn(n + q_len, dim, generator=g) for n in resident]
    res_v = [torch.randn(n + q_len, dim, generator=g) for n in resident]
    query = torch.randn(1, kv_heads * group, q_len, dim, generator=g)
    got = retrieve(query, layer, budget=10_000, scorer=PAGE_SCORERS[scorer])
    if ragged:
        keys, values = HeadList(k.view(1, 1, -1, dim) for k in res_k), HeadList(v.view(1, 1, -1, dim) for v in res_v)
    else:
        keys, values = torch.stack(res_k).unsqueeze(0), torch.stack(res_v).unsqueeze(0)
    out = attention_with_retrieved(query, keys, values, got)

    full_k = [torch.cat([k[:-q_len], s[0][0], k[-q_len:]]) for k, s in zip(res_k, spilled, strict=True)]
    full_v = [torch.cat([v[:-q_len], s[0][1], v[-q_len:]]) for v, s in zip(res_v, spilled, strict=True)]
    want = _reference_attention(query, full_k, full_v, q_len, dim**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scorer", sorted(PAGE_SCORERS))
def test_pages_off_the_gpu_answer_a_gpu_query_as_on_the_cpu(scorer):
    """IceCache on a GPU: the pages stay in host memory, the query and the resident entries are on the GPU; the
    same entries are read and attention over them is the CPU's."""
    g = torch.Generator().manual_seed(3)
    dim = 16
    layer = [semantic_pages(*_entries(n, dim, seed=20 + h)[:3], PagingConfig(page_size=8))
             for h, n in enumerate([40, 25])]
    resident = torch.randn(1, 2, 12, dim, generator=g)
    query = torch.randn(1, 6, 1, dim, generator=g)
    want = retrieve(query, layer, budget=16, scorer=PAGE_SCORERS[scorer])
    got = retrieve(query.cuda(), layer, budget=16, scorer=PAGE_SCORERS[scorer])
    assert [r.rows.tolist() for r in got] == [r.rows.tolist() for r in want]
    out = attention_with_retrieved(query.cuda(), resident.cuda(), resident.cuda(), got)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), attention_with_retrieved(query, resident, resident, want))


@pytest.mark.parametrize("ragged", [False, True])
def test_heads_of_equal_length_are_joined_into_one_tensor(ragged):
    """Resident heads of one length, R read by each: one `[1, H, n, D]` (one attention call for every head),
    each head's cached entries, then its retrieved ones, then the new tokens; unequal heads stay a HeadList."""
    g = torch.Generator().manual_seed(2)
    dim, new = 8, 2
    resident = torch.randn(1, 3, 10 + new, dim, generator=g)
    keys = HeadList(resident[:, h : h + 1] for h in range(3)) if ragged else resident
    got = [Retrieved(*(torch.randn(4, dim, generator=g) for _ in range(2)), torch.arange(4), torch.arange(4))
           for _ in range(3)]
    joined, _ = with_retrieved(keys, keys, got, new)
    assert isinstance(joined, torch.Tensor) and joined.shape == (1, 3, 16, dim)
    for h in range(3):
        want = torch.cat([resident[0, h, :10], got[h].keys, resident[0, h, 10:]])
        assert torch.equal(joined[0, h], want)
    shorter = [*got[:2], Retrieved(got[2].keys[:3], got[2].values[:3], torch.arange(3), torch.arange(3))]
    assert isinstance(with_retrieved(keys, keys, shorter, new)[0], HeadList)


def test_heads_retrieve_their_own_pages_within_the_budget():
    keys, values, positions, _ = _clustered(clusters=12, per_cluster=10, dim=16)
    layer = [semantic_pages(keys, values, positions), semantic_pages(-keys, values, positions)]
    query = keys[5].view(1, 1, 1, -1).expand(1, 2, 1, -1)  # 2 KV heads, 1 query head each
    first, second = retrieve(query, layer, budget=20)
    assert first.positions.numel() <= 20 and second.positions.numel() <= 20
    assert 5 in first.positions.tolist() and 5 not in second.positions.tolist()


@pytest.mark.parametrize("scorer", ["centroid", "entries"])
def test_page_pool_pins_the_questions_best_pages_and_refreshes_the_rest(scorer):
    keys, values, positions, label = _clustered(clusters=12, per_cluster=10)
    layer = [semantic_pages(keys, values, positions)]
    a, b = (int((label == c).nonzero()[0]) for c in (0, 1))  # a key of cluster 0 and one of cluster 1

    def query(row):
        return keys[row].view(1, 1, 1, -1)

    pool = PagePool(layer, budget=20, scorer=PAGE_SCORERS[scorer], refresh=2, pinned_share=0.5)
    asked = pool.retrieved(query(a).expand(1, 1, 4, -1))           # the question: about cluster 0
    assert a in asked[0].positions.tolist()
    assert pool.retrieved(query(b))[0] is asked[0]                   # decode step 1: no refresh yet
    refreshed = pool.retrieved(query(b))[0]                          # step 2: the rest follows cluster 1
    assert a in refreshed.positions.tolist() and b in refreshed.positions.tolist()
    assert refreshed.positions.numel() <= 20
    pool.clear()                                                     # rollback: the next question starts anew
    assert a not in pool.retrieved(query(b).expand(1, 1, 4, -1))[0].positions.tolist()


def _random_layers(dtype=torch.float32) -> list[list[HeadPages]]:
    layers = []
    for layer, counts in enumerate([[30, 0], [5, 70], [0, 0]]):
        heads = []
        for h, n in enumerate(counts):
            keys, values, positions = _entries(n, dim=8, seed=100 * layer + h)
            heads.append(semantic_pages(keys.to(dtype), values.to(dtype), positions))
        layers.append(heads)
    return layers


def _assert_same_pages(a: list[list[HeadPages]], b: list[list[HeadPages]]) -> None:
    assert len(a) == len(b)
    for layer_a, layer_b in zip(a, b, strict=True):
        assert len(layer_a) == len(layer_b)
        for x, y in zip(layer_a, layer_b, strict=True):
            for name in ("keys", "values", "positions", "lengths", "centroids"):
                tx, ty = getattr(x, name), getattr(y, name)
                assert tx.shape == ty.shape and torch.equal(tx.to(ty.dtype), ty), name


def test_pages_file_round_trip_in_memory(tmp_path):
    layers = _random_layers()
    tensors, metadata = encode(layers, page_size=16, dtype=torch.float32)
    path = tmp_path / "pages.safetensors"
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    loaded = safetensors.torch.load_file(path)
    _assert_same_pages(layers, decode(loaded, metadata))


def test_streamed_pages_file_is_a_safetensors_file_read_memory_mapped(tmp_path):
    """The streaming writer gives the tensors `encode` gives, safetensors reads it, and mapping it for
    answering reads the same pages without changing the file."""
    layers = _random_layers(torch.float16)
    path = tmp_path / "pages.safetensors"
    metadata = pages_metadata(3, 2, 8, 16)
    size, sha = write_layers(path, iter(layers), metadata)
    data = path.read_bytes()
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pages.safetensors"]  # no part files left

    want, _ = encode(layers, page_size=16)
    got = safetensors.torch.load(data)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with safetensors.safe_open(path, framework="pt") as f:
        assert f.metadata() == metadata

    mapped = open_pages(path)
    _assert_same_pages(layers, mapped)
    head = mapped[1][1]
    chosen = torch.tensor([2, 0])
    keys, values, positions = head.take(head.rows(chosen))
    rows = head.rows(chosen)
    assert torch.equal(keys, layers[1][1].keys[rows]) and torch.equal(positions, layers[1][1].positions[rows])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha


def test_damaged_page_table_is_refused():
    tensors, metadata = encode(_random_layers(), page_size=16)
    tensors["page_len.1"] = tensors["page_len.1"].clone()
    tensors["page_len.1"][0] += 1
    with pytest.raises(ValueError, match="page table"):
        decode(tensors, metadata)
    del tensors["centroid.0"]
    with pytest.raises(ValueError, match="centroid.0"):
        decode(tensors, metadata)
    with pytest.raises(ValueError, match="format"):
        decode(tensors, {**metadata, "pages_format": "9"})


def test_spill_writer_pages_exactly_what_was_spilled(tmp_path):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    writer = SpillWriter(spill_dir, num_layers=2, kv_heads=2, head_dim=8)
    spilled: dict[tuple[int, int], list] = {}
    for block in range(4):  # blocks evict different counts per layer and head
        for layer in range(2):
            evicted = []
            for head in range(2):
                n = (block * 7 + layer * 3 + head * 5) % 11
                keys, values, _ = _entries(n, dim=8, seed=block * 10 + layer * 2 + head)
                evicted.append((keys, values, torch.arange(n) + 100 * block + 1000 * head))
                spilled.setdefault((layer, head), []).append(evicted[-1])
            writer(layer, evicted)
    assert writer.entries == sum(sum(x[2].numel() for x in v) for v in spilled.values())
    path = tmp_path / "pages.safetensors"
    writer.write_pages(path, PagingConfig(page_size=4))
    assert list(spill_dir.iterdir()) == []

    layers = open_pages(path)
    for (layer, head), parts in spilled.items():
        keys, values, positions = (torch.cat([p[i] for p in parts]) for i in range(3))
        _assert_partition(layers[layer][head], keys.half(), values.half(), positions, page_size=4)


def test_pages_are_deterministic_for_a_seed():
    keys, values, positions = _entries(300, dim=16, seed=9)
    a = semantic_pages(keys, values, positions, PagingConfig(seed=3))
    b = semantic_pages(keys, values, positions, PagingConfig(seed=3))
    _assert_same_pages([[a]], [[b]])
    c = semantic_pages(keys, values, positions, PagingConfig(seed=4))
    assert not torch.equal(a.positions, c.positions)
