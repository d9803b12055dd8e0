"""Every tunable default of kvchat, in one place (the KV core's own settings are defined in kvchat.kv.config and
re-exported here). The CLI and the library both start from these."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from kvchat.errors import UserError
from kvchat.kv.config import (  # the KV core's settings, re-exported: import them from here
    CACHE_PRECISIONS as CACHE_PRECISIONS,
)
from kvchat.kv.config import (
    CACHE_STORAGES as CACHE_STORAGES,
)
from kvchat.kv.config import (
    HEAD_BUDGETS as HEAD_BUDGETS,
)
from kvchat.kv.config import (
    HEAD_FLOOR_FRACTION as HEAD_FLOOR_FRACTION,
)
from kvchat.kv.config import (
    LAYER_BUDGETS as LAYER_BUDGETS,
)
from kvchat.kv.config import (
    MEMORY_READOUTS as MEMORY_READOUTS,
)
from kvchat.kv.config import (
    OFFLOAD_MODES as OFFLOAD_MODES,
)
from kvchat.kv.config import (
    OFFLOAD_SCORERS as OFFLOAD_SCORERS,
)
from kvchat.kv.config import (
    PAGE_DTYPE_NAMES as PAGE_DTYPE_NAMES,
)
from kvchat.kv.config import (
    POSITION_MODES as POSITION_MODES,
)
from kvchat.kv.config import (
    PREFILL_MODES as PREFILL_MODES,
)
from kvchat.kv.config import (
    QUANT_RESIDUAL as QUANT_RESIDUAL,
)
from kvchat.kv.config import (
    RECALL_ENTRIES as RECALL_ENTRIES,
)
from kvchat.kv.config import (
    RETRIEVALS as RETRIEVALS,
)
from kvchat.kv.config import (
    RRF_K as RRF_K,
)
from kvchat.kv.config import (
    CacheConfig,
)
from kvchat.kv.config import (
    CakeConfig as CakeConfig,
)
from kvchat.kv.config import (
    IceCacheConfig as IceCacheConfig,
)
from kvchat.kv.config import (
    IndexMemConfig as IndexMemConfig,
)
from kvchat.kv.config import (
    OffloadConfig as OffloadConfig,
)
from kvchat.kv.config import (
    PagingConfig as PagingConfig,
)
from kvchat.kv.config import (
    RecallConfig as RecallConfig,
)
from kvchat.kv.methods import METHODS  # the method registry; EvalConfig runs them all by default
from kvchat.messages import option

# how the model's Linear weights are held (model.int8_weights, model.int4_weights) while answering and while
# ingest builds caches; auto: int4 on a CPU where the decoder's weights already are 4-bit groups (the embedded
# model), else float
WEIGHT_MODES = ("auto", "float", "int8", "int4")
WEIGHTS = "auto"
CONVERSION_WEIGHTS_PER_SECOND = 3_000_000  # a first GGUF conversion's time estimate: weights done per second
ANSWER_ROOM = 320  # tokens reserved after the history for a question and its answer
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")

# `ingest --append`: below this mean cosine similarity between the new segments and their nearest episode
# centroid, the new turns are about something no episode covers, and re-clustering (--reingest) is offered.
# MiniLM puts unrelated sentences around 0-0.2 and sentences on one topic above 0.4.
APPEND_FAR_SIMILARITY = 0.25
OFF_TOPIC_SIMILARITY = 0.3  # AskConfig.off_topic_similarity


# EpiCache's official instruction for the patched prompt (its code; the paper's §3.1 describes it).
EPISODE_INSTRUCTION = (
    "Extract essential information from this conversation segment. Identify speaker names, "
    "personas, key events with dates/times, personal details, commitments, opinions, relationships, "
    "emotional moments, and unique experiences."
)

# The conversation sits in the system turn, the question in a user turn: SmolLM2 answers
# planted-fact questions better this way than with both in one user message.
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
    """Where the model runs and its dtype (`--device`, `--dtype`; kvchat.model.device resolves them). auto: CUDA in
    bfloat16 when a GPU is visible, else the CPU in float32."""

    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"   # auto | float32 | bfloat16 | float16 (float16: CUDA only)


DEFAULT_EPISODES = 4  # episodes when --episodes is not given and the history has that many segments
# Routed methods (recall, routed) without a given count: one more episode per this many history tokens beyond
# DEFAULT_EPISODES of them, so a routed episode cache (M/2 entries under recall) stands for at most this span of the
# history (64 tokens per entry at the default budget), whatever its length. Routed caches together prefill the history
# once, so more episodes cost no prefill, only bytes (one file each, a fixed size). Methods that feed every episode
# the whole history keep DEFAULT_EPISODES: each episode there is a pass over the history.
EPISODE_SPAN_TOKENS = 32_768


@dataclass(frozen=True)
class EpisodeConfig:
    """How a history is cut into topical episodes (EpiCache §3.1)."""

    episodes: int | None = None  # E: number of K-Means clusters; None: DEFAULT_EPISODES (routed methods: one per
    # EPISODE_SPAN_TOKENS of the history, if more), or fewer when the history has fewer segments (a given E is not
    # lowered), counted again at every re-ingest (saved as None: a re-ingest of a longer history gets more)
    segment_turns: int = 4     # w: turns per segment
    patched_prompt_tokens: int = 256  # cap on an episode's patched prompt (instruction + medoid segments)
    seed: int = 0              # K-Means seed, so the same history gives the same episodes


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
    memory_recent: int = CacheConfig.indexer_recent              # each block's last entries always kept
    memory_attention_mix: float = CacheConfig.attention_mix     # share of the block's last queries' attention
    memory_pool_kernel: int = CacheConfig.indexer_pool_kernel   # max-pool of the blended scores; 1 = off
    memory_min_gain: float = 0.0   # a layer whose memory removes less of the held-out residual is shut (g = 0)
    top_fraction: float = 0.25     # held-out metric: overlap of the indexer's and the teacher's top 25%
    checkpoint_every: int = 25     # steps between resumable checkpoints

    def simulated_cache(self) -> CacheConfig:
        """The indexmem settings the memory stage's simulated block prefill evicts with."""
        return CacheConfig(method="indexmem", block_size=self.memory_block, indexer_recent=self.memory_recent,
                           attention_mix=self.memory_attention_mix, indexer_pool_kernel=self.memory_pool_kernel)


TRAIN_STAGES = ("indexer", "memory", "both")


@dataclass(frozen=True)
class IngestConfig:
    model: str = "default"  # saved beside the settings, not in them
    episodes: EpisodeConfig = EpisodeConfig()
    cache: CacheConfig = CacheConfig()
    system_prompt: str = SYSTEM_PROMPT
    instruction: str = EPISODE_INSTRUCTION


# A resumable ingest (kvchat.ingest.units) checkpoints an episode's prefill every 1/CHECKPOINTS of all its blocks, so a
# kill loses at most that share of them, but never more often than every CHECKPOINT_MIN_BLOCKS blocks: a checkpoint
# (an episode cache encoded, hashed, written and fsync'd: about 0.1 s for the embedded model's at the defaults) then
# costs under 1% of the 8 blocks before it on a CPU (about 1-2 s each at the default block of 512 tokens).
CHECKPOINTS = 200
CHECKPOINT_MIN_BLOCKS = 8
RAY_CHUNK_SPLIT = 4  # `ingest --ray`: the recall chunks left are cut into this many ranges per worker


@dataclass(frozen=True)
class BatchConfig:
    """`kvchat ingest-batch`: Ray workers, each ingesting one history at a time (kvchat.ingest.batch); `kvchat ingest
    --ray`: one history's units of work spread over them (kvchat.ingest.batch_units)."""

    workers: int | None = None  # None: the CPUs Ray has (a local Ray: this machine's usable cores) / threads
    threads: int = 1            # torch threads per worker; workers x threads never exceed the CPUs
    attempts: int = 2           # a history whose worker dies is given to another worker once more
    address: str | None = None  # None: start a local Ray; "auto" or "ray://host:port": join that cluster
    start_timeout_s: float = 600.0  # workers not loaded by then are given up (Ray cannot start them: memory?)
    device: DeviceConfig = DeviceConfig()  # each worker's model; on CUDA the workers share the GPUs (batch.gpu_share)
    weights: str = WEIGHTS  # the Linear weights each worker builds caches with, as `kvchat ingest --weights`


ECHO_WORDS = 3  # an answer spelling out the question's first this many words repeats it (kvchat.model.echo)
ECHO_RETRIES = 3  # times an answer's decoding goes back before such words, at most


# What the question's user turn says ("{question}" is the question). Every answer path uses it: `kvchat ask`, the
# REPL, `kvchat serve`, `kvchat eval` and the benchmarks (kvchat.answer.decoding). The CLI's until now, kept until
# benchmarks/answer_defaults.py's measurement on LoCoMo and planted-fact histories chooses (it is not yet run).
QUESTION_TEMPLATE = "{question}"
# An answer's own tokens' scores divided by this (CTRL's penalty; 1.0: off). 1.1: on planted-fact histories in three
# export styles it keeps the answers as right as without it and no answer loops (22% looped without it;
# benchmarks/results/answer_defaults_planted.md).
REPETITION_PENALTY = 1.1


@dataclass(frozen=True)
class Sampling:
    """How each answer token is chosen (kvchat.model.sampling). Greedy by default: the same question gets the same
    answer; a temperature above 0 samples, from the smallest set of tokens holding `top_p` of the probability,
    with `seed` for a repeatable draw (None: a fresh one each answer)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = REPETITION_PENALTY
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often a token is in the answer already
    presence_penalty: float = 0.0   # OpenAI's: minus this once a token is in the answer

    def __post_init__(self) -> None:
        """Settings no answer can be decoded with are refused when made, in one line naming the setting."""
        bounds = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "repetition_penalty": (1.0, 2.0),
                  "frequency_penalty": (-2.0, 2.0), "presence_penalty": (-2.0, 2.0)}  # fmt: skip
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if not low <= value <= high or (name == "top_p" and value == 0.0):
                within = "(0, 1]" if name == "top_p" else f"{low:g}..{high:g}"
                raise UserError(f"{option(name)} must be within {within} (got {value:g})")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise UserError(f"the sampling seed must be within 0..2^63-1 (got {self.seed})")  # `seed` names ingest's


@dataclass(frozen=True)
class GroundingConfig:
    """The check of an answer against the turns it drew on (kvchat.answer.grounding); thresholds chosen on generated
    planted-fact histories (benchmarks/results/grounding.md), never on LoCoMo."""

    drawn_on: int = 3                  # the episode's turns matching the question best, checked beside the sources
    max_unsupported_words: float = 0.5  # an answer is flagged when more of its content words than this are not found
    quote_turns: int = 3               # the turns searched for a better quote, the most relevant first
    quote_chars: int = 120             # a better quote, cut at word boundaries
    # A question is off-topic when, beside a weak routing similarity, no turn it could draw on holds this share of
    # its words (the best one: a recalled turn, or one of its episode's).
    off_topic_coverage: float = 0.34


@dataclass(frozen=True)
class AskConfig:
    max_new_tokens: int = 64
    # An answer that repeats the question's opening words is decoded again from before them (kvchat.model.echo).
    echo_guard: bool = True
    question_template: str = QUESTION_TEMPLATE  # what the user turn says
    sampling: Sampling = Sampling()
    system: str | None = None   # the user's own instructions: a system turn after the conversation, before the question
    retrieve: int | None = None  # --offload conversations: entries per layer and KV head read from the pages
                                 # (R); None = the conversation's own (OffloadConfig.retrieve at ingest)
    weights: str = WEIGHTS  # auto | float (as loaded) | int8 (per channel) | int4 (groups of 32): WEIGHT_MODES
    # A question whose routing similarity (cosine to the nearest episode centroid) is below this is flagged
    # off-topic, and with refuse_off_topic not answered (benchmarks/results/receipts.md measures it).
    off_topic_similarity: float = OFF_TOPIC_SIMILARITY
    refuse_off_topic: bool = False
    source_count: int = 3       # `--sources`: the turns shown, most attended first (kvchat.answer.sources)
    # Sources count the attention of the layers from this fraction of the model's depth up: lower layers attend
    # by position more than by content (benchmarks/results/receipts.md compares it with every layer, 0.0).
    source_layers_from: float = 0.5
    quote_chars: int = 100      # a source's quote, cut at a word boundary
    grounding: GroundingConfig = GroundingConfig()
    grounded: bool = False      # an answer not found in the turns it drew on is withheld (finish_reason "unsupported")


REFERENCES = ("auto", "full", "gold")  # EvalConfig.against

# LoCoMo's own QA prompt (task_eval), "context" read as the conversation the cache holds.
LOCOMO_QA_TEMPLATE = (
    "Based on the conversation, write an answer in the form of a short phrase for the following question. "
    "Answer with exact words from the conversation whenever possible.\n\nQuestion: {question} Short answer:"
)


@dataclass(frozen=True)
class RagConfig:
    """Retrieval of raw turns (kvchat.answer.rag): what a user would run instead of a compressed cache. The history is
    cut into chunks of consecutive turns; a question's top chunks by the sentence encoder are put back in
    history order into the system prompt and prefilled with it. KV entries while answering: top_k x chunk_tokens
    (plus the system prompt and the question)."""

    chunk_tokens: int = 256  # at most this many tokens of consecutive turns per chunk (a longer turn is cut)
    top_k: int = 4           # chunks prefilled per question
    dated: bool = False      # each chunk opens with its first turn's date (plain rag: only a session's first turn)
    retrieval: str = "dense"  # RETRIEVALS: plain rag ranks by the sentence encoder alone


@dataclass(frozen=True)
class EvalConfig:
    """`kvchat eval`: which questions, and how answers are decoded."""

    methods: tuple[str, ...] = METHODS
    budgets: tuple[int, ...] = (256, 512, 1024)
    max_context: int | None = None     # history tokens kept (whole sessions); None = the model's window
                                       # minus ANSWER_ROOM, so full KV stays inside the window
    questions: int | None = None       # per conversation, spread evenly over the file; None = all
    categories: tuple[int, ...] = (1, 2, 3, 4)  # LoCoMo categories; 5 (adversarial) only when asked
    max_new_tokens: int = AskConfig.max_new_tokens  # answers as `kvchat ask` gives them (kvchat.answer.decoding)
    question_template: str = AskConfig.question_template
    synthetic_topics: int = 6          # planted-fact set (--synthetic): topics per conversation
    synthetic_turns_per_topic: int = 48
    against: str = "auto"              # full: answers compared with full KV's; gold: scored against the gold
                                       # answers beside rag and recent (kvchat.eval.gold); auto: gold for a history
                                       # that does not fit the model's window, else full
    chunk_tokens: int = RagConfig.chunk_tokens  # against gold: the rag baseline's chunk size
    echo_guard: bool = AskConfig.echo_guard  # every system's answers, rag's too (kvchat.model.echo)
    sampling: Sampling = Sampling()    # how answer tokens are chosen, as `kvchat ask` chooses them
    weights: str = WEIGHTS  # the Linear weights caches are built and answers decoded with, as `kvchat ingest` and
                            # `kvchat ask` hold them (--weights)

    def answering(self) -> AskConfig:
        """How every system's answers are decoded: as `kvchat ask` decodes them (kvchat.answer.decoding)."""
        return AskConfig(max_new_tokens=self.max_new_tokens, question_template=self.question_template,
                         echo_guard=self.echo_guard, sampling=self.sampling)  # fmt: skip


@dataclass(frozen=True)
class ProfileSettings:
    """Layer-sensitivity calibration (`kvchat profile-layers`, EpiCache §3.2)."""

    budget: int = 512            # simulated cache size M
    block_size: int = 256        # simulated prefill block B
    sink: int = 128              # leading tokens always visible (StreamingLLM sink)
    max_tokens: int = 3072       # the calibration text is cut to this many tokens
    suggested_alpha: float = 1.2  # EpiCache uses 1.1-1.3 for the LLaMA family


@dataclass(frozen=True)
class ServeConfig:
    """`kvchat serve` (kvchat.serve): one process keeping the model, the encoder and recent episode caches warm.
    What a client may and may not do with these settings: docs/serve.md, "Threat model"."""

    host: str = "127.0.0.1"     # loopback only unless asked: the API reads every stored conversation
    port: int = 8000
    api_key: str | None = None  # when set, every request but a bare /kvchat/health needs `Authorization: Bearer KEY`
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted beside loopback's and the bound address (DNS
                                         # rebinding: any other name is refused); "*" accepts any
    model: str = "default"      # what POST /kvchat/ingest builds new conversations with (an append: the conversation's)
    history_dir: str | None = None  # POST /kvchat/ingest may read history files from this directory only (None: none)
    max_memory: int = 2**30     # bytes of episode caches kept resident (least recently used dropped first)
    queue_size: int = 8         # answers waiting behind the running one; one more is refused with 429
    max_body_bytes: int = 2**20  # larger request bodies are refused with 413
    max_tokens: int = AskConfig.max_new_tokens  # an answer's length when the request names none
    max_tokens_limit: int = 2048  # the most a request may ask for
    threads: int | None = None  # torch threads of the answering worker (None: $OMP_NUM_THREADS, else the cores)
    device: DeviceConfig = DeviceConfig()
    weights: str = WEIGHTS      # answers' and ingest's Linear weights, as `kvchat ask --weights`
    preload: bool = True        # load the stored conversations' models and the encoder at start, not at the first ask
    log: bool = True            # record answers in `kvchat logs`
    shutdown_grace_s: float = 10.0  # on SIGTERM, answers still streaming after this end with an error event
    keepalive_s: float = 5.0    # a stream waiting for its next event sends a comment this often, so a client can
                                # tell a slow answer from a stopped server (ClientConfig.read_timeout_s)
    replicas: int | None = None  # None: one worker thread in the app's process; N: N Ray Serve replicas


@dataclass(frozen=True)
class ClientConfig:
    """`kvchat ask` through a server (kvchat.serve.client): how long it waits before it calls the server dead."""

    connect_timeout_s: float = 5.0  # to open the connection (a host that drops packets)
    read_timeout_s: float = 30.0    # the longest silence accepted in a reply; a live server's stream is never silent
                                    # longer than ServeConfig.keepalive_s
