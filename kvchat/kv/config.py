"""The KV core's settings: how one episode cache is built (`CacheConfig` and its parts), IceCache's offload
and paging, IndexMem's sizes and update rule. Dataclasses and constants only (no torch).

Which of them a conversation saves, under what key, with which option and which values it accepts is said once,
in kvchat.settings_table. They live here, at the KV core's level, so that `kvchat.kv` never imports upwards;
`kvchat.config`, which holds every other default, re-exports them, and callers import them from there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

LAYER_BUDGETS = ("auto", "uniform", "sensitivity", "pyramid", "cake")
POSITION_MODES = ("original", "compact", "auto")
PREFILL_MODES = ("auto", "block", "full")
HEAD_BUDGETS = ("uniform", "adaptive")
OFFLOAD_MODES = ("none", "icecache")  # kvchat.features registers a feature for each but "none"
CACHE_PRECISIONS = ("full", "int8", "int4")  # kvchat.features registers a feature for each but "full"
CACHE_STORAGES = ("model", "float16", "bfloat16", "int8")  # CacheConfig.storage (kvchat.kv.codec)
OFFLOAD_SCORERS = ("centroid", "top-keys", "two-stage", "entries")  # kvchat.kv.retrieval.PAGE_SCORERS, by name
MEMORY_READOUTS = ("additive", "mass")  # IndexMemConfig.readout
# How retrieved chunks of raw turns are ranked (kvchat.answer.rag.RagIndex.top): by their words and, in turn, by the
# turn the sentence encoder finds nearest; by their words; by the sentence encoder; or by reciprocal-rank fusion
RETRIEVALS = ("lexical", "dense", "hybrid", "interleaved")
RRF_K = 60  # reciprocal-rank fusion's constant (Cormack et al., 2009: 1 / (60 + rank))
RECALL_ENTRIES = ("prefilled", "stored")  # RecallConfig.entries
PAGE_DTYPE_NAMES = ("float16", "float32")  # IceCacheConfig.dtype (kvchat.kv.spill.PAGE_DTYPES)


# Adaptive head budgets: every KV head keeps at least this fraction of its layer's per-head budget M_l
# (AdaKV's safeguard alpha = 0.2), and never less than the protected system prompt, so a head whose
# attention is focused is not starved to nothing by heads that spread theirs.
HEAD_FLOOR_FRACTION = 0.2

# `--cache-precision int8|int4`: each KV head's last history entries stay in full precision beside the quantized
# ones (KIVI's residual; the answer's tokens are appended to it). Chosen on planted-fact conversations
# (benchmarks/int8.py --choose), never on the LoCoMo ones.
QUANT_RESIDUAL = 0

# `storage="int8"`: tokens per key group (and channels per value group) of the KIVI codes an episode file holds
# for a cache held in full precision (kvchat.kv.codec); the int8 feature's own default (`CacheConfig.quant_group`)
STORAGE_GROUP = 32

# Prompts and windows of the baselines as EpiCache adapts them to block prefill (its appendix A.2).
INFINIPOT_PROMPT = "Summarize the previous context highlighting the most important parts."
KVZIP_PROMPT = "Repeat the part of the previous context exactly."
SNAPKV_QUERIES = 64       # SnapKV's observation window: the block's last tokens, whose queries score
STREAMING_SINK = 128      # StreamingLLM sink tokens, scaled down to budget // 4 for small budgets


@dataclass(frozen=True)
class CakeConfig:
    """CAKE (Qin et al., ICLR 2025): `cake` layer budgets and `--method cake` (kvchat.kv.cascade)."""

    tau1: float = 1.0      # temperature of attention dispersion in the layer preference (eq. 6); the paper
    tau2: float = 1.0      # grid-searches both per model (appendix C), its code's values lie around 1
    queries: int = 32      # S_w: the block's last queries that measure preferences and score (appendix C)
    gamma: float = 200.0   # weight of the attention variance in the eviction indicator (eq. 11, appendix C)
    pool_kernel: int = 5   # average pool of the indicator over neighbouring entries (CAKE's code)
    floor_fraction: float = 0.25  # each layer keeps at least M/4 (and the system prompt plus the queries)
    cascade: bool = True   # evict layer by layer during the block's forward (False: once at its end)


@dataclass(frozen=True)
class PagingConfig:
    """How one KV head's offloaded entries become pages (kvchat.kv.pages)."""

    page_size: int = 16     # entries per page at most (IceCache's official page: a 16-entry tree leaf)
    cluster_size: int = 16  # target entries per k-means cluster; clusters over page_size are cut into pages
    iterations: int = 8     # Lloyd iterations of k-means (random initialisation)
    seed: int = 0           # k-means initialisation and the projection that orders entries in a cluster


@dataclass(frozen=True)
class IceCacheConfig:
    """IceCache (`--offload icecache`, kvchat.features.icecache): the entries eviction drops are kept on disk,
    grouped into pages of similar keys; while answering, each layer and KV head reads the pages that match
    the question and attends to them beside the resident cache. Defaults chosen in benchmarks/icecache_pages.py
    (its results: benchmarks/results/)."""

    mode: str = "none"          # OFFLOAD_MODES
    retrieve: int = 192         # R: entries per layer and KV head read from the pages while answering
    scorer: str = "entries"     # what is read (kvchat.kv.retrieval, OFFLOAD_SCORERS)
    refresh: int = 8            # decoded tokens between re-choosing the pages beyond the question's pinned ones
    pinned_share: float = 0.5   # of R, the question's best pages that stay for the whole answer
    candidates: int = 8         # two-stage, entries: centroids choose pages of up to candidates x R entries,
                                # whose keys are scored exactly
    recent: int = 32            # W: every head's last W entries are kept at every eviction whatever the scorer
    # says, beside M (budgets M + W), so the cache ends with the history's last W tokens; --method full: system
    # prompt + W resident, the rest paged
    first_paged_layer: int = 0  # layers below keep every entry (nothing evicted or paged; IceCache keeps 0-1)
    paging: PagingConfig = PagingConfig()
    dtype: str = "float16"  # pages on disk: float16 | float32

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


OffloadConfig = IceCacheConfig  # its name before kvchat.features: a generic name for IceCache's settings


@dataclass(frozen=True)
class RecallConfig:
    """`--method recall` (answer.recall): of the budget M, the share `share` goes to chunks of raw turns retrieved
    for each question and prefilled on top of the routed episode cache, which keeps the rest."""

    share: float = 0.5       # of M, in whole chunks (at least one)
    chunk_tokens: int = 256  # consecutive turns of at most this many tokens
    # How a question's chunks are ranked: lexical (TF-IDF of their words, the encoder breaking ties), dense (the
    # encoder alone), hybrid, or interleaved (lexical's best chunk, then the chunk of the turn nearest the question by
    # the encoder, in turn). Interleaved holds planted facts far more often on generated long histories and LoCoMo's
    # evidence as often (benchmarks/results/retrieval*.md), but its turn embeddings are kept in every episode file
    # (+63% disk at 10^5 tokens, 4 episodes): the default once they are stored once per conversation
    retrieval: str = "lexical"
    # Each chunk opens with the date of its first turn: a chunk lifted out of the history keeps its time
    dated: bool = False
    # A recalled chunk's entries: prefilled at each question, or stored (computed at ingest after the chunk before
    # it, kept in one file per conversation, placed at each question: kvchat.answer.recall_entries)
    entries: str = "prefilled"
    # Stored entries are kept as KIVI codes (kvchat.kv.quantize) of this many bits, keys in groups of this many
    # tokens (the file records both)
    stored_bits: int = 4
    stored_group: int = 16
    # Stored entries, repaired: each placed chunk's first `repair` tokens are recomputed at the question with the
    # cache and the chunks placed before it in view (EPIC's LegoLink), and not stored
    repair: int = 0
    # Stored entries, compressed: of each chunk's entries (its `repair` first counted) only this share is kept, chosen
    # at ingest by the attention of the chunk's last tokens (SnapKV, as a block of an episode cache is scored), so the
    # same budget places about 1 / kept as many chunks
    kept: float = 1.0


@dataclass(frozen=True)
class CacheConfig:
    """How one episode's compressed cache is built by block prefill."""

    method: str = "auto"   # kvchat.kv.methods.REGISTRY's, or auto: epicache within the model's window, recall beyond
    budget: int = 1024     # M: kept KV entries per layer and KV head, system prompt included
    block_size: int = 512  # B: tokens fed per block before evicting back to M
    positions: str = "auto"  # original | compact | auto (compact only when the history exceeds the window)
    pool_kernel: int = 7       # max-pool of scores over neighbouring tokens (SnapKV practice); 1 = off
    layer_budgets: str = "auto"
    # auto (sensitivity when the model has a profile, else uniform) | uniform | sensitivity | pyramid | cake (from
    # each block's attention)
    alpha: float | None = None   # sharpness of sensitivity budgets; None = the profile's suggestion
    cake: CakeConfig = CakeConfig()
    head_budgets: str = "uniform"
    # uniform (M_l entries in every KV head) | adaptive (AdaKV: the layer's top M_l x kv_heads (head, token)
    # pairs, floor HEAD_FLOOR_FRACTION x M_l)
    latent_memory: bool = True  # indexmem: evicted entries feed a latent memory read while answering (IndexMem §3.2)
    indexer_recent: int = 16  # indexmem: each block's last entries are always kept (IndexMem §4 keeps a recent
                              # local window besides the budget; its indexer has no positions to see recency by)
    attention_mix: float = 0.75  # indexmem: share of the block's last 64 queries' attention (SnapKV's window)
                                 # blended into the indexer's importance; 0 = the indexer alone (the paper)
    indexer_pool_kernel: int = 1  # indexmem: max-pool of its scores (pool_kernel is the probe methods'); 1 = off
    prefill: str = "auto"
    # block (evict after every block: peak flat in the history) | full (keep the whole history, then each episode
    # keeps its top entries: one prefill for all episodes) | auto (full when the history fits the model's window
    # and its full KV fits memory)
    offload: IceCacheConfig = IceCacheConfig()
    recall: RecallConfig = RecallConfig()
    precision: str = "full"  # full (the model's dtype) | int8 | int4 (KIVI: keys per channel, values per token,
    # in 8 or 4 bits; kvchat.kv.quantize), applied to each finished episode cache, stored and resident
    quant_group: int = 32    # int8: tokens per key group and channels per value group (KIVI's group size)
    quant_group_4bit: int = 16  # int4: the same; smaller, as 15 levels make each group's step 17x coarser
    quant_residual: int = QUANT_RESIDUAL  # int8, int4: each head's last entries kept in full precision
    # How episode files hold keys and values (kvchat.kv.codec): int8 (KIVI codes in groups of STORAGE_GROUP, read back
    # in full precision), float16, bfloat16, or model (the dtype the model built them in: float32 on a CPU). int8: the
    # fewest bytes (32% of float32's) whose answers stay at the noise floor on the in-window LoCoMo eval, as float16's
    # and bfloat16's do (benchmarks/results/storage_precision.md; int4's KL is 2.7x that floor)
    storage: str = "int8"

    @property
    def active_quant_group(self) -> int:
        """The key group of `precision`: `quant_group_4bit` for int4, else `quant_group`."""
        return self.quant_group_4bit if self.precision == "int4" else self.quant_group


@dataclass(frozen=True)
class IndexMemConfig:
    """IndexMem (Yang et al. 2026): sizes of the trained indexer and latent memory, relative to the model, and
    the memory's update rule. The paper's ratios; kvchat.kv.indexer and kvchat.kv.latent say what each is."""

    index_head_ratio: int = 4      # H_index = query heads / 4 (at least 1)
    index_dim_ratio: int = 8       # d_index = head_dim / 8 (at least 1)
    memory_dim_ratio: int = 8      # d_mem = hidden size / 8 (the paper's "d/8", d read as d_model)
    decay: float = 1.0             # lambda: 1 = an old evicted fact weighs as much as a recent one
    write_strength: float = 1.0    # eta
    eps: float = 1e-6              # readout denominator floor
    readout_scale: float = 0.5     # additive readout: answering adds this share of it (its errors compound over
                                   # the layers, see kvchat.kv.latent)
    readout: str = "mass"          # mass: the memory's entries join attention's softmax as extra mass, weighed
                                   # against the resident entries' (kvchat.kv.latent); additive: the paper's
                                   # o_attn + g m(q)
    mass_scale: float = 0.5        # mass readout: answering adds this share of its correction

    def stored(self) -> dict:
        """As weights and episode files store it: without `readout` when it is the paper's additive one, so
        files that do not use the mass readout stay readable by kvchat from before it."""
        out = asdict(self)
        if out["readout"] == "additive":
            del out["readout"], out["mass_scale"]
        return out

    @classmethod
    def from_stored(cls, stored: dict) -> IndexMemConfig:
        """What `stored` wrote (TypeError on unknown keys): no `readout` is the additive one, whatever the
        default is now."""
        return cls(**{"readout": "additive", **stored})
