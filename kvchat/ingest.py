"""The ingest pipeline as library calls: plan -> build each episode's cache -> commit; `ingest` runs all three.

- `plan_ingest`: validate the settings, load and tokenize the history, resolve layer budgets and positions,
  check memory before anything runs, and cut the history into episodes. Nothing is written.
- `build_episode`: one episode's block prefill, the expensive step (a batch runner can run it elsewhere;
  an append can resume a stored cache through `block_prefill(resume=...)`).
- `write_episode` and `commit_ingest`: encode each cache to its file (kvchat.kv.codec) in the store's
  pending conversation, then make the conversation visible at once with its resolved settings. A batch
  worker (kvchat.batch) encodes where it builds (`encode_episode`) and its driver writes and commits.
One episode cache is held at a time, so peak memory stays at one prefill's bound.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvchat import preflight
from kvchat.config import (
    ANSWER_ROOM,
    CACHE_PRECISIONS,
    HEAD_BUDGETS,
    LAYER_BUDGETS,
    OFFLOAD_MODES,
    OFFLOAD_SCORERS,
    POSITION_MODES,
    PREFILL_MODES,
    CacheConfig,
    IngestConfig,
    OffloadConfig,
)
from kvchat.encoder import SentenceEncoder
from kvchat.episodes import Episode, build_episodes, segment
from kvchat.errors import UserError
from kvchat.history import Turn, format_turns, load_history
from kvchat.kv import codec, families
from kvchat.kv.budgets import layer_budgets
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.cascade import CakeBudgets
from kvchat.kv.heads import HeadBudgets, head_floor
from kvchat.kv.methods import REGISTRY, ScorerInputs, across_heads_methods, method
from kvchat.kv.prefill import block_prefill, keep_sink_and_window, select_from
from kvchat.kv.quantize import PRECISION_BITS
from kvchat.kv.scoring import Scorer
from kvchat.kv.spill import PAGE_DTYPES, SpillWriter
from kvchat.llm import ChatLayout, LoadedModel, ModelIdentity
from kvchat.profile import find_indexmem, find_profile
from kvchat.settings import to_settings
from kvchat.store import EpisodeRecord, PagesRecord, PendingConversation, Store, validate_name


class IngestProgress:
    """Hooks for a progress display; the default does nothing."""

    def history(self, done: int, total: int) -> None:
        """Blocks of the one full prefill that `--prefill full` shares among the episodes."""

    def episode(self, index: int, total: int) -> None: ...

    def block(self, done: int, total: int) -> None: ...


@dataclass(frozen=True)
class IngestReport:
    name: str
    method: str
    positions: str
    turns: int
    history_tokens: int
    episodes: int
    budgets: list[int]
    layer_budgets: str
    peak_layer_entries: int   # most entries one layer held at once during any episode's prefill
    peak_total_entries: int  # most entries all layers held together at once (per KV head), same counting
    estimated_peak_bytes: int  # the pre-flight memory estimate (kvchat.preflight)
    cache_bytes: int
    seconds: float
    head_budgets: str = "uniform"
    head_entries: list[int] = dataclasses.field(default_factory=list)  # [fewest, most] entries one KV head kept
    prefill: str = "block"  # how the caches were built: block by block, or selected from the full history
    episode_segments: list[int] = dataclasses.field(default_factory=list)  # history segments in each episode
    notes: list[str] = dataclasses.field(default_factory=list)  # things the user should know, said once
    offload: str = "none"       # none | icecache (evicted entries kept in each episode's pages file)
    offloaded_entries: int = 0  # entries written to the pages files, over episodes, layers and KV heads
    pages_bytes: int = 0        # the pages files' size on disk, over episodes
    cache_precision: str = "full"  # full | int8 | int4 (caches held in 8 or 4 bits, kvchat.kv.quantize)
    device: str = "cpu"         # where the model ran (--device) and its dtype, which the caches are stored in
    dtype: str = "float32"
    attention_backend: str = "torch"  # decode attention's kernel on that device: torch | flashinfer (kv.backends)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def validate(config: IngestConfig) -> None:
    """Reject option values that cannot work, before anything is loaded or written."""
    cache, eps = config.cache, config.episodes
    if cache.method not in REGISTRY:
        raise UserError(f"unknown --method {cache.method!r} (choose from {', '.join(REGISTRY)})")
    if cache.prefill not in PREFILL_MODES:
        raise UserError(f"unknown --prefill {cache.prefill!r} (choose from {', '.join(PREFILL_MODES)})")
    if cache.positions not in POSITION_MODES:
        raise UserError(f"unknown --positions {cache.positions!r} (choose from {', '.join(POSITION_MODES)})")
    if cache.budget < 1:
        raise UserError(f"--budget must be >= 1 (got {cache.budget})")
    if cache.block_size < 16:
        raise UserError(f"--block-size must be >= 16 (got {cache.block_size})")
    if cache.block_size > cache.budget * 8 and cache.method != "full":
        raise UserError(
            f"--block-size {cache.block_size} is more than 8x --budget {cache.budget}: "
            "peak memory would be dominated by the block"
        )
    if eps.episodes < 1:
        raise UserError(f"--episodes must be >= 1 (got {eps.episodes})")
    if eps.window < 1:
        raise UserError(f"--window must be >= 1 (got {eps.window})")
    if cache.layer_budgets not in LAYER_BUDGETS:
        raise UserError(
            f"unknown --layer-budgets {cache.layer_budgets!r} (choose from {', '.join(LAYER_BUDGETS)})"
        )
    if cache.head_budgets not in HEAD_BUDGETS:
        raise UserError(
            f"unknown --head-budgets {cache.head_budgets!r} (choose from {', '.join(HEAD_BUDGETS)})"
        )
    if cache.head_budgets == "adaptive" and not method(cache.method).across_heads:
        raise UserError(
            f"--head-budgets adaptive needs attention scores to compare across heads; --method {cache.method} "
            f"has none (use it with {', '.join(across_heads_methods())})"
        )
    if cache.alpha is not None and not 0 < cache.alpha <= 10:
        raise UserError(f"--alpha must be in (0, 10] (got {cache.alpha})")
    if cache.recent_window < 0:
        raise UserError(f"recent window must be >= 0 (got {cache.recent_window})")
    if not 0 <= cache.attention_mix <= 1:
        raise UserError(f"attention mix must be in [0, 1] (got {cache.attention_mix})")
    for kernel in (cache.pool_kernel, cache.indexer_pool_kernel):
        if kernel < 1 or kernel % 2 == 0:
            raise UserError(f"pool kernel must be an odd number >= 1 (got {kernel})")
    cake = cache.cake
    for option, tau in (("--tau1", cake.tau1), ("--tau2", cake.tau2)):
        if not 0 < tau <= 10:  # also refuses nan and inf
            raise UserError(f"{option} must be in (0, 10] (got {tau})")
    if cake.window < 1 or not 0 <= cake.gamma < float("inf") or not 0 <= cake.floor_fraction <= 1:
        raise UserError("CAKE settings: window must be >= 1, gamma finite and >= 0, floor_fraction in [0, 1]")
    if cake.pool_kernel < 1 or cake.pool_kernel % 2 == 0:
        raise UserError(f"CAKE pool kernel must be an odd number >= 1 (got {cake.pool_kernel})")
    _validate_offload(cache.offload)
    _validate_precision(cache)


def _validate_precision(cache: CacheConfig) -> None:
    """`--cache-precision` and its library-only settings."""
    if cache.precision not in CACHE_PRECISIONS:
        raise UserError(f"unknown --cache-precision {cache.precision!r} (choose from {', '.join(CACHE_PRECISIONS)})")
    if min(cache.quant_group, cache.quant_group_4bit) < 1 or cache.quant_residual < 0:
        raise UserError(f"quantization group sizes must be >= 1 and residual >= 0 (got {cache.quant_group}, "
                        f"{cache.quant_group_4bit}, {cache.quant_residual})")  # fmt: skip
    if cache.precision != "full" and cache.offload.enabled:
        raise UserError(f"--cache-precision {cache.precision} does not combine with --offload {cache.offload.mode} "
                        "(its pages are stored at half precision and attached to full-precision layers); "
                        "choose one")  # fmt: skip


def finish_cache(cache: EpisodeCache, config: CacheConfig) -> EpisodeCache:
    """A built episode cache as it is stored and answered from: in 8 or 4 bits with `--cache-precision int8|int4`."""
    if config.precision != "full":
        cache.quantize(config.active_quant_group, config.quant_residual, PRECISION_BITS[config.precision])
    return cache


def _validate_offload(offload: OffloadConfig) -> None:
    """IceCache's settings (`--offload`, `--retrieve`, `--page-size` and the library-only ones)."""
    for what, value, choices in (
        ("--offload", offload.mode, OFFLOAD_MODES), ("page scorer", offload.scorer, OFFLOAD_SCORERS),
        ("pages dtype", offload.dtype, tuple(PAGE_DTYPES)),
    ):
        if value not in choices:
            raise UserError(f"unknown {what} {value!r} (choose from {', '.join(choices)})")
    if offload.retrieve < 0:
        raise UserError(f"--retrieve must be >= 0 (got {offload.retrieve})")
    paging = offload.paging
    if paging.page_size < 1 or paging.cluster_size < 1 or paging.iterations < 1:
        raise UserError(f"--page-size must be >= 1 (got {paging.page_size}), and so must the cluster size and "
                        "k-means iterations")
    if offload.window < 0:
        raise UserError(f"--offload-window must be >= 0 (got {offload.window})")
    if offload.refresh < 0 or offload.first_paged_layer < 0 or offload.candidates < 1:
        raise UserError("offload refresh and first paged layer must be >= 0, page candidates >= 1")
    if not 0 <= offload.pinned_share <= 1:
        raise UserError(f"pinned share must be in [0, 1] (got {offload.pinned_share})")


@dataclass(frozen=True)
class IngestPlan:
    """Everything an ingest decided before the first episode is built (see the module docstring)."""

    name: str
    config: IngestConfig                     # resolved: positions, layer budgets and alpha as they run
    source: str | None                       # the history's path, recorded for rebuild commands
    turns: int
    layout: ChatLayout
    prefix_ids: torch.Tensor                 # system prompt up to the conversation: never evicted
    context_ids: torch.Tensor                # the history (an append: its new turns only)
    history_tokens: int                      # tokens of the whole history the caches hold
    budgets: list[int] | CakeBudgets | None  # per layer (None: full KV)
    heads: HeadBudgets
    prefill: str                             # block | full, as resolved from the config's (kvchat.config)
    episodes: list[Episode]
    estimated_peak_bytes: int
    notes: list[str]
    episode_segments: list[int] = dataclasses.field(default_factory=list)  # history segments per episode
    appended: tuple[str, ...] = ()           # histories appended after `source` (kvchat.append)
    trained: object | None = None            # a trained method's weights (kvchat.kv.trained.TrainedIndexMem)
    episode_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # routed: each episode's own turns


@dataclass(frozen=True)
class EpisodeStats:
    """What the report needs of a built episode once its cache is written and released."""

    budgets: list[int]        # kept entries per KV head of each layer
    head_entries: list[int]   # kept entries of every (layer, KV head)
    peak_layer_entries: int
    peak_total_entries: int
    offloaded_entries: int = 0  # entries its pages file holds


@dataclass(frozen=True)
class BuiltEpisode:
    episode: Episode
    cache: EpisodeCache
    peak_layer_entries: int
    peak_total_entries: int
    spill: SpillWriter | None = None  # what eviction dropped, on disk (`--offload icecache`)

    def stats(self) -> EpisodeStats:
        heads = [n for layer in self.cache.layers for n in layer.lengths]
        offloaded = self.spill.entries if self.spill is not None else 0
        return EpisodeStats(self.cache.sizes, heads, self.peak_layer_entries, self.peak_total_entries, offloaded)


def plan_ingest(
    history: str | os.PathLike | Sequence[Turn],
    *,
    name: str | None,
    config: IngestConfig,
    store: Store | None,
    lm: LoadedModel,
    encoder: SentenceEncoder,
    replace: bool = False,
    source: str | None = None,
    force: bool = False,
    profile_dirs: Sequence[Path] | None = None,
    max_memory: int | None = None,
    appended: Sequence[str] = (),
) -> IngestPlan:
    """Decide everything about an ingest without building a cache or writing anything (`ingest` describes
    the arguments). `store` may be None with `replace` and `profile_dirs` given: a batch worker plans
    without the store, which only its driver opens (kvchat.batch)."""
    if store is None and (not replace or profile_dirs is None):
        raise ValueError("plan_ingest without a store needs replace=True and profile_dirs")
    validate(config)
    from_file = isinstance(history, (str, os.PathLike))
    if not from_file and not name:
        raise ValueError("name is required when ingesting turns rather than a file")
    name = validate_name(name or Path(history).stem)
    if store is not None:  # a batch worker's driver checks its own store
        store.check_writable()
    if not replace and name in {c.name for c in store.conversations()}:
        raise UserError(f"conversation '{name}' exists; use --replace")
    turns = load_history(history) if from_file else list(history)
    lines = format_turns(turns)
    layout = ChatLayout.from_tokenizer(lm.tokenizer, config.system_prompt)
    prefix_ids = lm.encode(layout.before_conversation)
    context_ids = lm.encode("\n".join(lines))
    cache_cfg = config.cache
    full = method(cache_cfg.method).scorer is None
    total = prefix_ids.shape[-1] + context_ids.shape[-1]
    protected = prefix_ids.shape[-1]
    if not full and cache_cfg.budget <= protected:  # every layer's floor lies above the prompt when M does
        raise UserError(
            f"--budget {cache_cfg.budget} must exceed the system prompt's {protected} tokens, which every "
            "layer keeps; raise --budget"
        )
    notes: list[str] = []
    dirs = [store.home / "profiles"] if profile_dirs is None else list(profile_dirs)
    trained = find_indexmem(lm, dirs) if method(cache_cfg.method).trained else None
    memory = cache_cfg.memory and trained is not None
    if memory and trained.memory is None:
        notes.append(f"{trained.path} holds no memory weights (trained with --stage indexer): no latent memory")
        memory = False
    strategy, budgets, alpha = ("full", None, None) if full else resolve_layer_budgets(
        cache_cfg, lm, dirs, protected, notes
    )
    budgets = offload_budgets(cache_cfg, budgets, total)
    heads = HeadBudgets(cache_cfg.head_budgets)
    shape = preflight.ModelShape.of(lm.model)
    available = max_memory if max_memory is not None else preflight.available_bytes(lm.device)

    def estimate(select_from_full: bool) -> int:
        return estimate_bytes(config, lm, layout, total, budgets, heads, protected, select_from_full=select_from_full)

    episodes = _episodes(lines, config, lm, encoder, episodic=method(cache_cfg.method).episodic)
    episode_ids = _routed_ids(turns, episodes, config, lm) if method(cache_cfg.method).routed else []
    if episode_ids:  # each cache holds its episode's turns only: its window and prefill are the longest episode's
        total = prefix_ids.shape[-1] + max(int(ids.shape[-1]) for ids in episode_ids)
    prefill = _prefill_mode(cache_cfg, strategy, total, lm.context_window, estimate(True), shape, available)
    peak_bytes = estimate(prefill == "full")
    if not force:
        preflight.check_fits(peak_bytes, resident=shape.weight_bytes, available=available, device=lm.device)
    families.check_context(lm.model.config, total + ANSWER_ROOM, lm.spec,
                           what=f"the history ({total} tokens with the system prompt) and {ANSWER_ROOM} for an answer")
    positions = _positions_mode(cache_cfg.positions, total, lm.context_window)
    families.check_positions(lm.model.config, positions, lm.spec)
    if cache_cfg.offload.enabled and positions == "compact":
        raise UserError(
            f"--offload {cache_cfg.offload.mode} keeps evicted entries at their original positions, so the history "
            f"({total} tokens with the system prompt) must fit the model's window ({lm.context_window}) with "
            "--positions original"
        )
    resolved = dataclasses.replace(
        config,
        cache=dataclasses.replace(
            cache_cfg, positions=positions, layer_budgets=cache_cfg.layer_budgets if full else strategy, alpha=alpha,
            prefill=prefill, memory=memory,
        ),
    )
    return IngestPlan(
        name=name,
        config=resolved,
        source=str(Path(history).resolve()) if from_file else source,
        turns=len(turns),
        layout=layout,
        prefix_ids=prefix_ids,
        context_ids=context_ids,
        history_tokens=int(context_ids.shape[-1]),
        budgets=budgets,
        heads=heads,
        prefill=prefill,
        episodes=episodes,
        episode_segments=[len(e.segments) for e in episodes],
        estimated_peak_bytes=peak_bytes,
        notes=notes,
        trained=trained,
        appended=tuple(appended),
        episode_ids=episode_ids,
    )


def prefill_history(
    plan: IngestPlan, lm: LoadedModel, *, on_block: Callable[[int, int], None] | None = None
) -> EpisodeCache:
    """The whole history's KV, fed block by block and kept whole: what `--prefill full` selects from."""
    return block_prefill(
        lm.model, plan.prefix_ids, plan.context_ids, block_size=plan.config.cache.block_size, budgets=None,
        scorer=None, on_block=on_block,
    ).cache


def build_episode(
    plan: IngestPlan,
    episode: Episode,
    lm: LoadedModel,
    *,
    on_block: Callable[[int, int], None] | None = None,
    full: EpisodeCache | None = None,
    spill: SpillWriter | None = None,
) -> BuiltEpisode:
    """`episode`'s cache: block prefill of the history, or with `plan.prefill == "full"` a selection from
    `full` (`prefill_history`), scored once by the episode's patched prompt. With `spill` (`--offload`,
    see `spill_writer`), every entry an eviction drops goes to disk; with `--method full`, everything
    between the system prompt and the last `offload.window` history tokens is dropped there."""
    cache_cfg = plan.config.cache
    scorer = episode_scorer(plan.config, episode, lm, plan.layout, plan.trained)
    compact = cache_cfg.positions == "compact"
    if plan.prefill == "full":
        if full is None:
            raise ValueError("a plan with prefill 'full' builds episodes from prefill_history(plan, lm)")
        last_block = plan.context_ids.split(cache_cfg.block_size, dim=-1)[-1]
        cache = select_from(lm.model, full, last_block, budgets=plan.budgets, scorer=scorer, heads=plan.heads,
                            compact=compact, on_evict=spill, recent=resident_window(cache_cfg))  # fmt: skip
        if on_block is not None:
            on_block(1, 1)
        cache = finish_cache(cache, cache_cfg)
        return BuiltEpisode(episode, cache, cache.peak_layer_entries, cache.peak_total_entries, spill)
    memory = None
    if cache_cfg.memory and plan.trained is not None:  # IndexMem: what is evicted is written, read when answering
        from kvchat.kv.latent import LatentMemory

        memory = LatentMemory(plan.trained.memory, plan.trained.config)
    writer = None if memory is None else memory.writer(lm.model.model.rotary_emb)
    result = block_prefill(
        lm.model,
        plan.prefix_ids,
        plan.episode_ids[episode.index] if plan.episode_ids else plan.context_ids,
        block_size=cache_cfg.block_size,
        budgets=plan.budgets,
        scorer=scorer,
        compact=compact,
        on_block=on_block,
        heads=plan.heads,
        on_evict=_every(spill, writer),
        recent=resident_window(cache_cfg) if scorer is not None else 0,
    )
    if spill is not None and scorer is None:  # full KV evicted nothing: page everything but sink and window
        offload = cache_cfg.offload
        keep_sink_and_window(result.cache, offload.window, offload.first_paged_layer)
    result.cache.on_evict = None
    result.cache.memory = memory
    finish_cache(result.cache, cache_cfg)
    return BuiltEpisode(episode, result.cache, result.peak_layer_entries, result.peak_total_entries, spill)


def offload_budgets(
    cache: CacheConfig, budgets: list[int] | CakeBudgets | None, entries: int
) -> list[int] | CakeBudgets | None:
    """`budgets` (M per layer) as an offloading cache keeps them: the resident window W beside each layer's M
    (`resident_window`), and the layers below `offload.first_paged_layer` keeping all their `entries`
    (nothing evicted or paged there, as IceCache keeps layers 0-1)."""
    if budgets is None or not cache.offload.enabled:
        return budgets
    first, window = cache.offload.first_paged_layer, resident_window(cache)
    if isinstance(budgets, CakeBudgets):
        if first:
            raise UserError("a first paged layer above 0 needs fixed layer budgets, not --layer-budgets cake")
        return dataclasses.replace(budgets, budget=budgets.budget + window)
    return [max(entries, b) if i < first else b + window for i, b in enumerate(budgets)]


def resident_window(cache: CacheConfig) -> int:
    """History tokens at the end that stay resident whatever the scorer says: IceCache's window (beside the
    budget) with `--offload`, none without."""
    return cache.offload.window if cache.offload.enabled else 0


def _every(*observers):
    """One eviction observer calling each of `observers` that is set (IceCache's spill, IndexMem's memory)."""
    chosen = [o for o in observers if o is not None]
    if len(chosen) <= 1:
        return chosen[0] if chosen else None
    return lambda layer, heads: [observe(layer, heads) for observe in chosen]


def spill_writer(plan: IngestPlan, lm: LoadedModel, pending: PendingConversation, index: int) -> SpillWriter | None:
    """Where episode `index`'s evicted entries go with `--offload` (None without): files in the pending
    conversation's private scratch dir for that episode."""
    offload = plan.config.cache.offload
    if not offload.enabled:
        return None
    shape = preflight.ModelShape.of(lm.model)
    return SpillWriter(
        pending.scratch_dir(index), num_layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        dtype=PAGE_DTYPES[offload.dtype],
    )


@dataclass(frozen=True)
class EncodedEpisode:
    """One built episode as its file's tensors and metadata plus its index row: what a batch worker sends
    its driver, which writes it into the pending conversation."""

    index: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    centroid: list[float]
    medoid_text: str
    budgets: list[int]
    n_tokens: int

    def write(self, pending: PendingConversation, pages: PagesRecord | None = None) -> EpisodeRecord:
        """Write and fsync the file in `pending` (not visible until commit); `pages`, its pages file's
        record when the episode offloads (written first: the episode's record refers to it)."""
        return pending.write_episode(
            self.index, self.tensors, self.metadata, centroid=self.centroid, medoid_text=self.medoid_text,
            budgets=self.budgets, n_tokens=self.n_tokens, pages=pages,
        )


def encode_episode(plan: IngestPlan, built: BuiltEpisode, lm: LoadedModel) -> EncodedEpisode:
    """Encode one episode's cache (kvchat.kv.codec) with its routing data."""
    cache = built.cache
    meta = codec.meta_of(
        cache, fingerprint=lm.fingerprint, method=plan.config.cache.method, positions=plan.config.cache.positions
    )
    tensors, metadata = codec.encode(cache, meta)
    return EncodedEpisode(
        built.episode.index, tensors, metadata, centroid=built.episode.centroid.tolist(),
        medoid_text=built.episode.medoid_text, budgets=list(meta.budgets), n_tokens=cache.entries,
    )


def write_episode(
    pending: PendingConversation, plan: IngestPlan, built: BuiltEpisode, lm: LoadedModel
) -> EpisodeRecord:
    """Encode one episode's cache into its file in the pending conversation (not visible until commit), its
    pages file first when it offloads (IceCache)."""
    pages = None
    if built.spill is not None:
        spill, paging = built.spill, plan.config.cache.offload.paging
        pages = pending.write_pages(
            built.episode.index, lambda path: spill.write_pages(path, paging, {"fingerprint": lm.fingerprint})
        )
    return encode_episode(plan, built, lm).write(pending, pages)


def commit_ingest(
    pending: PendingConversation,
    plan: IngestPlan,
    built: Sequence[EpisodeStats],
    records: Sequence[EpisodeRecord],
    lm: LoadedModel | ModelIdentity,
    seconds: float,
) -> IngestReport:
    """Make the conversation visible with its resolved settings; returns what the ingest did. `lm` is the
    model that built the caches, or its identity where it was loaded elsewhere (a batch worker)."""
    cache_cfg = plan.config.cache
    settings = to_settings(plan.config, source=plan.source, appended=plan.appended)
    head_entries = [n for b in built for n in b.head_entries]
    identity = lm.identity if isinstance(lm, LoadedModel) else lm
    report = IngestReport(
        name=plan.name,
        method=cache_cfg.method,
        positions=cache_cfg.positions,
        turns=plan.turns,
        history_tokens=plan.history_tokens,
        episodes=len(built),
        budgets=list(built[-1].budgets),
        layer_budgets=settings["layer_budgets"],
        peak_layer_entries=max(b.peak_layer_entries for b in built),
        peak_total_entries=max(b.peak_total_entries for b in built),
        estimated_peak_bytes=plan.estimated_peak_bytes,
        cache_bytes=sum(r.bytes for r in records),
        seconds=round(seconds, 2),
        head_budgets=cache_cfg.head_budgets,
        head_entries=[min(head_entries), max(head_entries)] if head_entries else [],
        prefill=plan.prefill,
        episode_segments=list(plan.episode_segments),
        notes=plan.notes,
        offload=cache_cfg.offload.mode,
        offloaded_entries=sum(b.offloaded_entries for b in built),
        pages_bytes=sum(r.pages.bytes for r in records if r.pages is not None),
        cache_precision=cache_cfg.precision,
        device=identity.device,
        dtype=identity.dtype,
        attention_backend=identity.attention_backend,
    )
    pending.commit(
        model=lm.spec,
        fingerprint=lm.fingerprint,
        settings=settings,
        stats=report.to_dict(),
    )
    return report


def ingest(
    history: str | os.PathLike | Sequence[Turn],
    *,
    store: Store,
    lm: LoadedModel,
    progress: IngestProgress | None = None,
    **plan_options: Any,
) -> IngestReport:
    """Build and store the episode caches of one history (a file, or turns already loaded from one).
    Nothing is visible in the store until all is written.

    `plan_options` are `plan_ingest`'s: `name` (required for turns; default: the file's stem), `config`,
    `encoder`, `replace` an existing conversation, `source` (the history's path to record when turns are
    passed), `force` past the memory estimate (an ingest whose estimate exceeds the available memory is
    refused by default), `profile_dirs` where layer profiles are looked up (default: the store's
    `profiles/`) before the shipped ones."""
    started = time.perf_counter()
    progress = progress or IngestProgress()
    plan = plan_ingest(history, store=store, lm=lm, **plan_options)
    stats: list[EpisodeStats] = []
    records: list[EpisodeRecord] = []
    full = prefill_history(plan, lm, on_block=progress.history) if plan.prefill == "full" else None
    with store.begin(plan.name, replace=plan_options.get("replace", False)) as pending:
        for episode in plan.episodes:
            progress.episode(episode.index, len(plan.episodes))
            with pending.disk_full_guard():  # spilled entries are written during the prefill
                spill = spill_writer(plan, lm, pending, episode.index)
                built = build_episode(plan, episode, lm, on_block=progress.block, full=full, spill=spill)
            records.append(write_episode(pending, plan, built, lm))
            stats.append(built.stats())  # the cache itself is released before the next episode is built
        return commit_ingest(pending, plan, stats, records, lm, time.perf_counter() - started)


def resolve_layer_budgets(
    cache: CacheConfig, lm: LoadedModel, profile_dirs: list[Path], protected: int, notes: list[str]
) -> tuple[str, list[int] | CakeBudgets, float | None]:
    """The strategy actually used, its per-layer budgets (each above the `protected` system prompt) and,
    for sensitivity, the alpha used. `auto` = sensitivity when a profile of these weights exists (shipped,
    or made by `kvchat profile-layers`), else uniform. `cake` budgets are computed during prefill, from
    each block's attention."""
    strategy = cache.layer_budgets
    if strategy == "cake":
        cake = cache.cake
        return strategy, CakeBudgets(
            cache.budget, cake.window, cake.tau1, cake.tau2, cake.floor_fraction, cake.cascade
        ), None
    profile = find_profile(lm, profile_dirs) if strategy in ("auto", "sensitivity") else None
    if strategy == "auto":
        strategy = "sensitivity" if profile else "uniform"
        if profile is None:
            notes.append(f"no layer profile for {lm.spec}: uniform budgets (run `kvchat profile-layers` to make one)")
    elif strategy == "sensitivity" and profile is None:
        raise UserError(f"--layer-budgets sensitivity needs a profile of {lm.spec}: run `kvchat profile-layers` first")
    alpha = cache.alpha if cache.alpha is not None else (profile.alpha if profile else 1.0)
    budgets = layer_budgets(
        strategy, lm.num_layers, cache.budget, sensitivity=profile.sensitivity if profile else None, alpha=alpha,
        protected=protected,
    )
    return strategy, budgets, alpha if strategy == "sensitivity" else None


def _longest_head(
    budgets: list[int] | CakeBudgets, heads: HeadBudgets, shape: preflight.ModelShape, protected: int
) -> int:
    """The most entries one KV head of one layer may keep: the largest layer budget (cake: every other
    layer at its floor), and with adaptive heads that layer's whole share less the other heads' floors."""
    if isinstance(budgets, CakeBudgets):
        largest = shape.layers * budgets.budget - (shape.layers - 1) * budgets.floor(protected)
    else:
        largest = max(budgets)
    if heads.mode == "uniform":
        return largest
    return largest * shape.kv_heads - (shape.kv_heads - 1) * head_floor(largest, protected, heads.floor_fraction)


def estimate_bytes(
    config: IngestConfig,
    lm: LoadedModel,
    layout: ChatLayout,
    context_tokens: int,
    budgets: list[int] | CakeBudgets | None,
    heads: HeadBudgets,
    protected: int,
    *,
    select_from_full: bool = False,
) -> int:
    """The pre-flight estimate (kvchat.preflight) of building `config`'s caches over `context_tokens`."""
    shape = preflight.ModelShape.of(lm.model)
    return preflight.estimate_ingest_bytes(
        shape,
        budget=config.cache.budget,
        block_size=config.cache.block_size,
        prompt_tokens=config.episodes.prompt_tokens + lm.encode(layout.question("")).shape[-1],
        context_tokens=context_tokens,
        full=budgets is None,
        longest_head=None if budgets is None else _longest_head(budgets, heads, shape, protected),
        select_from_full=select_from_full,
    )


def _prefill_mode(
    cache: CacheConfig,
    strategy: str,
    history_tokens: int,
    window: int,
    full_bytes: int,
    shape: preflight.ModelShape,
    available: int | None,
) -> str:
    """`block` or `full` (see `CacheConfig.prefill`). `auto` picks `full` when it can run (a method that
    scores after the block, fixed layer budgets, a history inside the model's window) and the estimate of
    holding the whole history fits `available`; an explicit `full` that cannot run is refused."""
    entry = method(cache.method)
    if entry.scorer is None or cache.prefill == "block":
        return "block"  # full KV evicts nothing: both ways build the same cache
    if entry.in_forward:
        why_not = f"--method {entry.name} scores inside each block's forward"
    elif entry.routed:
        why_not = f"--method {entry.name} prefills each episode's own turns, not the whole history"
    elif strategy == "cake":
        why_not = "cake layer budgets come from each block's attention"
    elif window and history_tokens + ANSWER_ROOM > window:
        why_not = f"the history ({history_tokens} tokens with the system prompt) exceeds the model's window ({window})"
    else:
        why_not = None
    if cache.prefill == "full":
        if why_not:
            raise UserError(f"--prefill full cannot run: {why_not}; use --prefill block or auto")
        return "full"
    fits = available is None or full_bytes - shape.weight_bytes <= available
    return "full" if why_not is None and fits else "block"


def _positions_mode(requested: str, history_tokens: int, window: int) -> str:
    """`auto` re-rotates to compact positions only when the history would not fit the model's window."""
    if requested != "auto":
        return requested
    return "compact" if window and history_tokens + ANSWER_ROOM > window else "original"


def _episodes(
    lines: list[str], config: IngestConfig, lm: LoadedModel, encoder: SentenceEncoder, *, episodic: bool
) -> list[Episode]:
    """Episodes of the history. Only EpiCache is episodic: full KV and the query-agnostic baselines
    build a single cache, as in the EpiCache paper's comparisons."""
    eps = config.episodes
    segments = segment(lines, eps.window)
    if eps.episodes > len(segments) and episodic:
        raise UserError(
            f"--episodes {eps.episodes} is more than the history's {len(segments)} segments of "
            f"{eps.window} turns; use at most {len(segments)}"
        )
    return build_episodes(
        segments,
        encoder.embed(segments),
        k=eps.episodes if episodic else 1,
        seed=eps.seed,
        token_cap=_medoid_cap(config, lm),
        count_tokens=lambda text: lm.encode(text).shape[-1],
    )


def _routed_ids(turns: Sequence[Turn], episodes: list[Episode], config: IngestConfig, lm: LoadedModel) -> list:
    """Token ids of each episode's own turns (`--method routed`): the turns of its segments in history order,
    rendered as the history is, so a session's date opens the first of its turns that the episode holds."""
    w = config.episodes.window
    return [lm.encode("\n".join(format_turns([t for s in sorted(e.segments) for t in turns[s * w : (s + 1) * w]])))
            for e in episodes]  # fmt: skip


def episode_scorer(
    config: IngestConfig, episode: Episode, lm: LoadedModel, layout: ChatLayout, trained: object | None = None
) -> Scorer | None:
    """The eviction scorer of `config.cache.method` for this episode (None for full KV)."""
    entry = method(config.cache.method)
    if entry.scorer is None:
        return None
    prompt = _patched_prompt(config, episode, lm) if entry.episodic else ""
    return entry.scorer(ScorerInputs(lm.encode, layout, config.cache, prompt, model=lm.model, trained=trained))


def _medoid_cap(config: IngestConfig, lm: LoadedModel) -> int:
    """Tokens left for medoid segments once the instruction is in the patched prompt."""
    return max(config.episodes.prompt_tokens - lm.encode(config.instruction).shape[-1], 16)


def _patched_prompt(config: IngestConfig, episode: Episode, lm: LoadedModel) -> str:
    """Instruction + medoid segments, the medoid cut so the whole stays within the token cap (a single
    medoid segment longer than the cap is cut here)."""
    medoid = lm.encode(episode.medoid_text)[0, : _medoid_cap(config, lm)].tolist()
    return f"{config.instruction}\n\n{lm.decode(medoid)}"
