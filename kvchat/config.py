"""Every tunable default of kvchat, in one place. The CLI and the library both start from these."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs

from kvchat.kv.methods import METHODS  # the method registry; EvalConfig runs them all by default

LAYER_BUDGETS = ("auto", "uniform", "sensitivity", "pyramid", "cake")
POSITION_MODES = ("original", "compact", "auto")
PREFILL_MODES = ("auto", "block", "full")
WEIGHT_MODES = ("float", "int8")  # how the model's Linear weights are held while answering (kvchat.int8_weights)
ANSWER_ROOM = 320  # tokens reserved after the history for a question and its answer
HEAD_BUDGETS = ("uniform", "adaptive")
OFFLOAD_MODES = ("none", "icecache")
CACHE_PRECISIONS = ("full", "int8", "int4")  # kvchat.kv.quantize.PRECISION_BITS gives the bits
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
OFFLOAD_SCORERS = ("centroid", "top-keys", "two-stage", "entries")  # kvchat.kv.retrieval.PAGE_SCORERS, by name
# `ingest --append`: below this mean cosine similarity between the new segments and their nearest episode
# centroid, the new turns are about something no episode covers, and re-clustering (--reingest) is offered.
# MiniLM puts unrelated sentences around 0-0.2 and sentences on one topic above 0.4.
APPEND_FAR_SIMILARITY = 0.25
# Adaptive head budgets: every KV head keeps at least this fraction of its layer's per-head budget M_l
# (AdaKV's safeguard alpha = 0.2), and never less than the protected system prompt, so a head whose
# attention is focused is not starved to nothing by heads that spread theirs.
HEAD_FLOOR_FRACTION = 0.2

# `--cache-precision int8|int4`: each KV head's last history entries stay in full precision beside the quantized
# ones (KIVI's residual; the answer's tokens are appended to it). Chosen on planted-fact conversations
# (benchmarks/int8.py --choose), never on the LoCoMo ones; at 4 bits too (--choose --bits 4: no gain from one).
QUANT_RESIDUAL = 0

# EpiCache's official instruction for the patched prompt (its code; the paper's §3.1 describes it).
EPISODE_INSTRUCTION = (
    "Extract essential information from this conversation segment. Identify speaker names, "
    "personas, key events with dates/times, personal details, commitments, opinions, relationships, "
    "emotional moments, and unique experiences."
)

# The conversation sits in the system turn, the question in a user turn: SmolLM2 answers
# planted-fact questions far better this way than with both in one user message (3/4 vs 1/4 planted facts).
SYSTEM_PROMPT = (
    "You are a helpful assistant with a memory of a past conversation. Answer the user's question "
    "briefly, using only facts from the conversation below.\n\nConversation:\n"
)


def default_home() -> Path:
    """$KVCHAT_HOME, else the platform's user data dir."""
    env = os.environ.get("KVCHAT_HOME")
    return Path(env) if env else Path(platformdirs.user_data_dir("kvchat", appauthor=False))


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and its dtype (`--device`, `--dtype`; kvchat.device resolves them). auto: CUDA in
    bfloat16 when a GPU is visible, else the CPU in float32."""

    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"   # auto | float32 | bfloat16 | float16 (float16: CUDA only)


@dataclass(frozen=True)
class EpisodeConfig:
    """How a history is cut into topical episodes (EpiCache §3.1)."""

    episodes: int = 4          # E: number of K-Means clusters (capped at the number of segments)
    window: int = 4            # w: turns per segment
    prompt_tokens: int = 256   # cap on an episode's patched prompt (instruction + medoid segments)
    seed: int = 0              # K-Means seed, so the same history gives the same episodes


@dataclass(frozen=True)
class CakeConfig:
    """CAKE (Qin et al., ICLR 2025): `--layer-budgets cake` and `--method cake` (kvchat.kv.cascade)."""

    tau1: float = 1.0      # temperature of attention dispersion in the layer preference (eq. 6). The paper
    tau2: float = 1.0      # grid-searches tau1 in 0.2-2 and tau2 in 0.4-3 per model (appendix C); its code's
                           # per-model values lie around 1 (Mistral-7B at 128L: 1.0 / 0.8). 1 / 1 weighs both alike.
    window: int = 32       # S_w: the block's last queries that measure preferences and score (appendix C)
    gamma: float = 200.0   # weight of the attention variance in the eviction indicator (eq. 11, appendix C)
    pool_kernel: int = 5   # average pool of the indicator over neighbouring entries (CAKE's code)
    floor_fraction: float = 0.25  # each layer keeps at least M/4 (and the system prompt plus the window)
    cascade: bool = True   # evict layer by layer during the block's forward (False: once at its end)


@dataclass(frozen=True)
class PagingConfig:
    """How one KV head's offloaded entries become pages (kvchat.kv.pages)."""

    page_size: int = 16     # entries per page at most (IceCache's official page: a 16-entry tree leaf)
    cluster_size: int = 16  # target entries per k-means cluster; clusters over page_size are cut into pages.
                            # 16 beat 64 (KL 0.048 vs 0.059 at R=192, benchmarks/icecache_pages.py)
    iterations: int = 8     # Lloyd iterations of k-means (random init: k-means++ cost 6x for no gain)
    seed: int = 0           # k-means initialisation and the projection that orders entries in a cluster


@dataclass(frozen=True)
class OffloadConfig:
    """IceCache (`--offload icecache`, kvchat.kv.pages): the entries eviction drops are kept on disk, grouped
    into pages of similar keys; while answering, each layer and KV head reads the pages that match the
    question and attends to them beside the resident cache. Defaults measured in benchmarks/icecache_pages.py."""

    mode: str = "none"          # none | icecache
    retrieve: int = 192         # R: entries per layer and KV head read from the pages while answering
    scorer: str = "entries"     # what is read (kvchat.kv.retrieval): centroid | top-keys | two-stage | entries.
                                # Planted facts, R=192: whole pages by centroid 0.083, two-stage (centroids pick
                                # candidates, their keys re-rank the pages) 0.053-0.059, top-keys (every key)
                                # 0.048; entries (the candidates' best R entries, not their pages) 0.031 with 8R
                                # candidates, 0.042 with 4R; the exact top-R keys 0.026 (icecache_pages.md)
    refresh: int = 8            # decoded tokens between re-choosing the pages beyond the question's pinned ones
    pinned_share: float = 0.5   # of R, the question's best pages that stay for the whole answer
    candidates: int = 8         # two-stage, entries: centroids choose pages of up to candidates x R entries,
                                # whose keys are scored exactly. entries: 8 gave KL 0.031 vs 4's 0.042 (R=192) for
                                # 1.4x the scoring time; two-stage: 8 and 4 measured the same
    window: int = 32            # W: every head's last W entries are kept at every eviction whatever the scorer
                                # says, beside M (budgets M + W), so the window slides with the blocks and the
                                # cache ends with the history's last W tokens; --method full: system prompt + W
                                # resident, the rest paged. IceCache's 2 window pages of 16. Planted facts, equal
                                # resident entries: M=64 + W=32 KL 0.031, M=96 without 0.039 (icecache_quality_planted)
    first_paged_layer: int = 0  # layers below keep every entry (nothing evicted or paged). IceCache keeps layers
                                # 0-1; on planted facts that gained KL 0.005 (noise) and cost agreement, for ~3x
                                # the resident memory at 8K tokens, so every layer is paged
    paging: PagingConfig = PagingConfig()
    dtype: str = "float16"      # pages on disk: float16 | float32

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class CacheConfig:
    """How one episode's compressed cache is built by block prefill."""

    method: str = "epicache"   # "epicache" (patched-prompt scoring) or "full" (keep everything)
    budget: int = 1024         # M: kept KV entries per layer and KV head, system prompt included
    block_size: int = 512      # B: tokens fed per block before evicting back to M
    positions: str = "auto"    # original | compact | auto (compact only when the history exceeds the window)
    pool_kernel: int = 7       # max-pool of scores over neighbouring tokens (SnapKV practice); 1 = off
    layer_budgets: str = "auto"  # auto (sensitivity when the model has a profile, else uniform) | uniform |
                                 # sensitivity | pyramid | cake (from each block's attention)
    alpha: float | None = None   # sharpness of sensitivity budgets; None = the profile's suggestion
    cake: CakeConfig = CakeConfig()
    head_budgets: str = "uniform"  # uniform (M_l entries in every KV head) | adaptive (AdaKV: the layer's
                                   # top M_l x kv_heads (head, token) pairs, floor HEAD_FLOOR_FRACTION x M_l)
    memory: bool = True    # indexmem: evicted entries feed a latent memory read while answering (IndexMem §3.2)
    recent_window: int = 16  # indexmem: each block's last entries are always kept (IndexMem §4 keeps a recent
                             # local window besides the budget; its indexer has no positions to see recency by)
    attention_mix: float = 0.75  # indexmem: share of the block's last 64 queries' attention (SnapKV's window)
                                 # blended into the indexer's importance; 0 = the indexer alone (the paper)
    indexer_pool_kernel: int = 1  # indexmem: max-pool of its scores (pool_kernel is the probe methods'); 1 = off
    prefill: str = "auto"  # block (evict after every block: peak flat in the history) | full (keep the whole
                           # history, then each episode keeps its top entries: one prefill for all episodes) |
                           # auto (full when the history fits the model's window and its full KV fits memory)
    offload: OffloadConfig = OffloadConfig()
    precision: str = "full"  # full (the model's dtype) | int8 | int4 (KIVI: keys per channel, values per token, in
                             # 8 or 4 bits; kvchat.kv.quantize), applied to each finished episode cache, stored
                             # and resident
    quant_group: int = 32    # int8: tokens per key group and channels per value group (KIVI's group size)
    quant_group_4bit: int = 16  # int4: the same; smaller, as 15 levels make each group's step 17x coarser (8:
                                # files over half of bfloat16's; 32: 4x the KL; benchmarks/results/int4.md)
    quant_residual: int = QUANT_RESIDUAL  # int8, int4: each head's last entries kept in full precision

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
    readout_scale: float = 0.5     # additive readout: answering adds this share of it: trained by MSE layer by layer,
                                   # the full readout's errors compound over 30 layers (IndexMem section, README)
    readout: str = "mass"          # mass: the memory's entries join attention's softmax as extra mass, weighed
                                   # against the resident entries' (kvchat.kv.latent); additive: the paper's
                                   # o_attn + g m(q). Chosen on planted facts (README, IndexMem section)
    mass_scale: float = 0.5        # mass readout: answering adds this share of its correction; of 1, 0.5, 0.25
                                   # half had the lowest first-token KL on planted facts at budget 128

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


@dataclass(frozen=True)
class TrainConfig:
    """`kvchat train-indexer`: distilling the indexer (and the memory's slow weights) from the frozen model."""

    stage: str = "both"            # indexer | memory | both (indexer first, then memory with it frozen)
    steps: int = 300               # optimizer steps per stage, one chunk each
    chunk_tokens: int = 512        # system prompt + conversation tokens per training chunk
    train_chunks: int = 40
    held_out_chunks: int = 8       # never trained on: the overlap and residual figures come from these
    lr: float = 3e-3               # AdamW, linear warmup then cosine decay to lr / 100
    warmup: int = 20
    seed: int = 0
    memory_queries: int = 64       # memory stage: the chunk's last tokens read the memory of the rest
    memory_budgets: tuple[int, ...] = (64, 128, 256)  # simulated block-prefill budgets, cycled over chunks
    memory_block: int = 128        # simulated block size (chunks are shorter than ingest's blocks of 512)
    # The simulated eviction is ingest's (kvchat.kv.indexer.IndexerScorer.for_cache) with ingest's settings:
    memory_window: int = CacheConfig.recent_window              # each block's last entries always kept
    memory_attention_mix: float = CacheConfig.attention_mix     # share of the block's last queries' attention
    memory_pool_kernel: int = CacheConfig.indexer_pool_kernel   # max-pool of the blended scores; 1 = off
    memory_min_gain: float = 0.0   # a layer whose memory removes less of the held-out residual is shut (g = 0)
    top_fraction: float = 0.25     # held-out metric: overlap of the indexer's and the teacher's top 25%
    checkpoint_every: int = 25     # steps between resumable checkpoints

    def simulated_cache(self) -> CacheConfig:
        """The indexmem settings the memory stage's simulated block prefill evicts with."""
        return CacheConfig(method="indexmem", block_size=self.memory_block, recent_window=self.memory_window,
                           attention_mix=self.memory_attention_mix, indexer_pool_kernel=self.memory_pool_kernel)


TRAIN_STAGES = ("indexer", "memory", "both")
MEMORY_READOUTS = ("additive", "mass")  # IndexMemConfig.readout


@dataclass(frozen=True)
class IngestConfig:
    model: str = "default"
    episodes: EpisodeConfig = EpisodeConfig()
    cache: CacheConfig = CacheConfig()
    system_prompt: str = SYSTEM_PROMPT
    instruction: str = EPISODE_INSTRUCTION


@dataclass(frozen=True)
class BatchConfig:
    """`kvchat ingest-batch`: Ray workers, each ingesting one history at a time (kvchat.batch)."""

    workers: int | None = None  # None: the CPUs Ray has (a local Ray: this machine's usable cores) / threads
    threads: int = 1            # torch threads per worker; workers x threads never exceed the CPUs
    attempts: int = 2           # a history whose worker dies is given to another worker once more
    address: str | None = None  # None: start a local Ray; "auto" or "ray://host:port": join that cluster
    start_timeout_s: float = 600.0  # workers not loaded by then are given up (Ray cannot start them: memory?)
    device: DeviceConfig = DeviceConfig()  # each worker's model; on CUDA the workers share the GPUs (batch.gpu_share)


@dataclass(frozen=True)
class AskConfig:
    max_new_tokens: int = 64
    question_template: str = "{question}"  # what the user turn says; evaluation wraps LoCoMo's QA prompt
    retrieve: int | None = None  # --offload conversations: entries per layer and KV head read from the pages
                                 # (R); None = the conversation's own (OffloadConfig.retrieve at ingest)
    weights: str = "float"  # float (as loaded) | int8 (weight-only, per channel: ~1.3x faster decode on a CPU)


REFERENCES = ("auto", "full", "gold")  # EvalConfig.against

# LoCoMo's own QA prompt (task_eval), "context" read as the conversation the cache holds.
LOCOMO_QA_TEMPLATE = (
    "Based on the conversation, write an answer in the form of a short phrase for the following question. "
    "Answer with exact words from the conversation whenever possible.\n\nQuestion: {question} Short answer:"
)


@dataclass(frozen=True)
class RagConfig:
    """Retrieval of raw turns (kvchat.rag): what a user would run instead of a compressed cache. The history is
    cut into chunks of consecutive turns; a question's top chunks by the sentence encoder are put back in
    history order into the system prompt and prefilled with it. KV entries while answering: top_k x chunk_tokens
    (plus the system prompt and the question)."""

    chunk_tokens: int = 256  # at most this many tokens of consecutive turns per chunk (a longer turn is cut)
    top_k: int = 4           # chunks prefilled per question
    dated: bool = False      # each chunk opens with its first turn's date (plain rag: only a session's first turn)


@dataclass(frozen=True)
class EvalConfig:
    """`kvchat eval`: which questions, and how answers are decoded."""

    methods: tuple[str, ...] = METHODS
    budgets: tuple[int, ...] = (256, 512, 1024)
    max_context: int | None = None     # history tokens kept (whole sessions); None = the model's window
                                       # minus ANSWER_ROOM, so full KV stays inside the window
    questions: int | None = None       # per conversation, spread evenly over the file; None = all
    categories: tuple[int, ...] = (1, 2, 3, 4)  # LoCoMo categories; 5 (adversarial) only when asked
    max_new_tokens: int = 32           # LoCoMo answers are short phrases
    question_template: str = LOCOMO_QA_TEMPLATE
    synthetic_topics: int = 6          # planted-fact set (--synthetic): topics per conversation
    synthetic_turns_per_topic: int = 48
    against: str = "auto"              # full: answers compared with full KV's; gold: scored against the gold
                                       # answers beside rag and recent (kvchat.gold); auto: gold for a history
                                       # that does not fit the model's window, else full
    chunk_tokens: int = RagConfig.chunk_tokens  # against gold: the rag baseline's chunk size


@dataclass(frozen=True)
class ProfileSettings:
    """Layer-sensitivity calibration (`kvchat profile-layers`, EpiCache §3.2)."""

    budget: int = 512            # simulated cache size M
    block_size: int = 256        # simulated prefill block B
    sink: int = 128              # leading tokens always visible (StreamingLLM sink)
    max_tokens: int = 3072       # the calibration text is cut to this many tokens
    suggested_alpha: float = 1.2  # EpiCache uses 1.1-1.3 for the LLaMA family
