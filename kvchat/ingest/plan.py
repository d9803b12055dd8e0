"""Planning an ingest: everything decided before the first episode cache is built, and nothing written.

`plan_ingest` validates the settings, loads and tokenizes the history, resolves layer budgets, positions and
the prefill mode, lets each cache feature adjust them (kvchat.features), checks memory before anything runs
and cuts the history into episodes. An append (kvchat.ingest.append) plans through the same function, continuing
the stored conversation (`Continuation`): its new turns are tokenized and budgeted the same way and join
the stored episodes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat import features, settings_table
from kvchat.answer import recall
from kvchat.answer.rag import RagIndex
from kvchat.config import (
    ANSWER_ROOM,
    DEFAULT_EPISODES,
    CacheConfig,
    IngestConfig,
    RecallConfig,
)
from kvchat.errors import UserError
from kvchat.history.episodes import Episode, build_episodes, segment
from kvchat.history.loading import Turn, format_turns, load_history
from kvchat.history.spans import TurnSpan
from kvchat.history.tokens import TokenizedTurns, tokenize_turns
from kvchat.ingest import preflight
from kvchat.ingest.layer_profiles import find_indexmem, find_profile
from kvchat.kv import families
from kvchat.kv.budgets import layer_budgets
from kvchat.kv.cascade import CakeBudgets
from kvchat.kv.heads import HeadBudgets, head_floor
from kvchat.kv.methods import (
    AUTO_METHOD,
    AUTO_METHODS,
    ScorerInputs,
    across_heads_methods,
    candidates,
    method,
)
from kvchat.kv.scoring import Scorer
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, LoadedModel
from kvchat.settings_table import given, named
from kvchat.store import Store, validate_name


def validate(config: IngestConfig) -> None:
    """Reject setting values that cannot work, before anything is loaded or written: each against its row in
    kvchat.settings_table (choices, bounds), then the combinations and ranges a row does not say."""
    cache = config.cache
    settings_table.check(config)
    if cache.block_size > cache.budget * 8 and cache.method != "full":
        raise UserError(
            f"{given('block_size', cache.block_size)} is more than 8x --budget {cache.budget}: "
            "peak memory would be dominated by the block"
        )
    if cache.head_budgets == "adaptive" and not all(e.across_heads for e in candidates(cache.method)):
        raise UserError(
            f"{given('head_budgets', 'adaptive')} needs attention scores to compare across heads; --method "
            f"{cache.method} has none (use it with {', '.join(across_heads_methods())})"
        )
    if cache.alpha is not None and not 0 < cache.alpha <= 10:
        raise UserError(f"{named('alpha')} must be in (0, 10] (got {cache.alpha})")
    for key in ("pool_kernel", "indexer_pool_kernel", "cake_pool_kernel"):
        kernel = settings_table.setting(key).get(config)
        if kernel < 1 or kernel % 2 == 0:
            raise UserError(f"{named(key)} must be an odd number >= 1 (got {kernel})")
    cake = cache.cake
    for key, tau in (("tau1", cake.tau1), ("tau2", cake.tau2)):
        if not 0 < tau <= 10:  # also refuses nan and inf
            raise UserError(f"{named(key)} must be in (0, 10] (got {tau})")
    if not cake.gamma < float("inf"):
        raise UserError(f"{named('cake_gamma')} must be finite (got {cake.gamma})")
    features.validate(cache)


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
    appended: tuple[str, ...] = ()           # histories appended after `source` (kvchat.ingest.append)
    reads: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)  # how `source` and `appended` were
    # read where --format or --pick was given (kvchat.settings.read_options)
    trained: object | None = None            # a trained method's weights (kvchat.kv.trained.TrainedIndexMem)
    # each turn's token range (kvchat.answer.sources), stored with every episode; an append's: its new turns only;
    # routed: one tuple per episode, of its own turns
    turn_spans: tuple[TurnSpan, ...] | tuple[tuple[TurnSpan, ...], ...] = ()
    episode_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # routed: each episode's own turns
    recall: RagIndex | None = None  # --method recall: the chunks questions recall turns from (an append's: new ones)


@dataclass(frozen=True)
class Continuation:
    """The stored conversation an append continues (kvchat.ingest.append): what its caches already hold."""

    turns: int                 # turns stored
    history_tokens: int        # history tokens the stored caches hold
    source: str | None         # the stored history's path, kept for rebuild commands
    # the new segments (and the notes list) -> the stored episodes they join, each one's segment count, and the
    # episode each new segment joined
    place: Callable[[list[str], list[str]], tuple[list[Episode], list[int], list[int]]]
    # per stored episode, the history tokens its cache holds (routed: its own turns'); () when all hold the history
    episode_tokens: tuple[int, ...] = ()


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
    continuing: Continuation | None = None,
    on_step: Callable[[str, int, int], None] | None = None,
    reads: Mapping[str, Mapping[str, str]] | None = None,
) -> IngestPlan:
    """Decide everything about an ingest without building a cache or writing anything (`kvchat.ingest.pipeline.ingest`
    describes the arguments). `store` may be None with `replace` and `profile_dirs` given: a batch worker
    plans without the store, which only its driver opens (kvchat.ingest.batch). With `continuing`, `history` holds
    the new turns of a stored conversation whose resolved settings `config` is (an append). `on_step(step, done,
    total)` hears of its steps as they go (reading, tokenizing, embedding segments, clustering), so that a long
    history shows progress before the first block."""
    step = on_step or (lambda what, done, total: None)
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
    if from_file:
        step("reading the history", 0, 1)
    turns = load_history(history, min_turns=1 if continuing else 2) if from_file else list(history)
    tokenizing = f"tokenizing {len(turns):,} turns"
    step(tokenizing, 0, 1)
    lines = format_turns(turns)
    layout = ChatLayout.from_tokenizer(lm.tokenizer, config.system_prompt)
    prefix_ids = lm.encode(layout.before_conversation)
    # an append's first new line follows the stored history's last one, which ends without a newline
    lead = "\n" if continuing else ""
    tokenized = tokenize_turns(lm.tokenizer, turns, lead=lead, lines=lines,
                               on_progress=lambda done, total: step(tokenizing, done, total))  # fmt: skip
    context_ids = tokenized.ids.to(lm.device)
    earlier = continuing.history_tokens if continuing else 0
    history_tokens = earlier + int(context_ids.shape[-1])
    protected = prefix_ids.shape[-1]
    total = protected + history_tokens
    notes: list[str] = []
    cache_cfg = _resolve_method(config.cache, total, lm.context_window, notes)
    config = dataclasses.replace(config, cache=cache_cfg)
    full = method(cache_cfg.method).scorer is None
    split = recall.split_for(cache_cfg)
    kept = features.episode_budget(cache_cfg)  # M of each episode cache
    if not full and kept <= protected:  # every layer's floor lies above the prompt when M does
        raise UserError(
            f"--budget {cache_cfg.budget} must exceed the system prompt's {protected} tokens, which every "
            "layer keeps; raise --budget" if kept == cache_cfg.budget else
            f"--budget {cache_cfg.budget} leaves --method recall's episode caches {kept} entries, no more than "
            f"the system prompt's {protected} tokens, which every layer keeps; raise --budget"
        )
    episode_ids: list[torch.Tensor] = []
    held_turns: list[list[int]] = []  # routed: the turns each episode's cache is fed now (indices into `turns`)
    fed = total - earlier  # the tokens the longest cache is fed now (an append: the new turns only)
    w = config.episodes.segment_turns
    if continuing:  # the new turns join the stored episodes (before anything else is noted)
        episodes, members, joined = continuing.place(segment(lines, w), notes)
        if method(cache_cfg.method).routed:  # each new segment continues the cache of the episode it joined
            held_turns = [_segment_turns([s for s, e in enumerate(joined) if e == episode.index], w, len(turns))
                          for episode in episodes]  # fmt: skip
            routed = _routed_tokens(turns, held_turns, lm, lead="\n")
            episode_ids = [t.ids.to(lm.device) for t in routed]
            stored = continuing.episode_tokens or (earlier,) * len(episodes)
            total, fed = max((protected + h + int(ids.shape[-1]), int(ids.shape[-1]) + protected)
                             for h, ids in zip(stored, episode_ids, strict=True))  # fmt: skip
    else:
        episodes = _episodes(lines, config, lm, encoder, episodic=method(cache_cfg.method).episodic, notes=notes,
                             step=step)  # the config keeps the count asked for: without one, a re-ingest counts again
        members = [len(e.segments) for e in episodes]
        if method(cache_cfg.method).routed:  # each cache holds its episode's turns: the longest sets the window
            held_turns = [_segment_turns(e.segments, w, len(turns)) for e in episodes]
            routed = _routed_tokens(turns, held_turns, lm)
            episode_ids = [t.ids.to(lm.device) for t in routed]
            total = protected + max(int(ids.shape[-1]) for ids in episode_ids)
            fed = total
    dirs = [store.home / "profiles"] if profile_dirs is None else list(profile_dirs)
    trained = find_indexmem(lm, dirs) if method(cache_cfg.method).trained else None
    cache_cfg = features.resolve(cache_cfg, trained, notes)
    strategy, budgets, alpha = ("full", None, None) if full else resolve_layer_budgets(
        dataclasses.replace(cache_cfg, budget=kept), lm, dirs, protected, notes
    )
    budgets = features.budgets(cache_cfg, budgets, total)
    heads = HeadBudgets(cache_cfg.head_budgets)
    shape = preflight.ModelShape.of(lm.model)
    available = max_memory if max_memory is not None else preflight.available_bytes(lm.device)
    # A cache under budget holds what an ingest of the new turns alone would; full KV holds the stored ones too.
    held = total if budgets is None else fed

    def estimate(select_from_full: bool) -> int:
        return estimate_bytes(config, lm, layout, held, budgets, heads, protected, select_from_full=select_from_full)

    if continuing:  # a stored cache continues block by block
        prefill = "block"
    else:
        prefill = _prefill_mode(cache_cfg, strategy, total, lm.context_window, estimate(True), shape, available)
    peak_bytes = estimate(prefill == "full")
    if not force:
        preflight.check_fits(peak_bytes, resident=shape.weight_bytes, available=available, device=lm.device)
    positions = cache_cfg.positions
    if not continuing:
        families.check_context(lm.model.config, total + ANSWER_ROOM, lm.spec, what=f"the history ({total} tokens with "
                               f"the system prompt) and {ANSWER_ROOM} for an answer")  # fmt: skip
        positions = _positions_mode(cache_cfg.positions, total, lm.context_window)
        families.check_positions(lm.model.config, positions, lm.spec)
    elif positions == "original" and _positions_mode("auto", total, lm.context_window) == "compact":
        # an append keeps the stored caches' positions until the history outgrows the window, as `auto` would
        families.check_positions(lm.model.config, "compact", lm.spec)
        positions = "compact"
        notes.append(f"the history ({total} tokens with the system prompt) now exceeds the model's window "
                     f"({lm.context_window}): the caches continue at compact positions")
    if full and positions == "compact" and not cache_cfg.offload.enabled:  # nothing evicted: nothing compacts
        raise UserError(f"--method full keeps every entry at its own position, and the history ({total} tokens with "
                        f"the system prompt) exceeds the model's window ({lm.context_window}); use a method with a "
                        "budget (the default does), or --offload icecache")  # fmt: skip
    resolved = dataclasses.replace(
        config,
        cache=dataclasses.replace(
            cache_cfg, positions=positions, layer_budgets=cache_cfg.layer_budgets if full else strategy, alpha=alpha,
            prefill=cache_cfg.prefill if continuing else prefill,
        ),
    )
    if episode_ids:  # routed: each episode's own turns, from the system prompt on (an append: after its stored ones)
        first = continuing.turns if continuing else 0
        starts = [protected + h for h in continuing.episode_tokens] if continuing and continuing.episode_tokens else (
            [protected + earlier] * len(episodes))  # fmt: skip
        spans = _routed_spans(turns, held_turns, routed, starts, first=first)
    else:
        first = continuing.turns if continuing else 0  # an append's turns follow the stored ones
        spans = tokenized.spans(turns, protected + earlier, indices=range(first, first + len(turns)))
    del tokenized
    recall_index = None
    if split:  # the chunks each question's turns are recalled from: an append's new turns only
        index = RagIndex.build(turns, lm, encoder, split.chunk_tokens, resolved.cache.recall.dated)
        recall_index = recall.offset(index, continuing.turns) if continuing else index
    return IngestPlan(
        name=name,
        config=resolved,
        source=continuing.source if continuing else str(Path(history).resolve()) if from_file else source,
        turns=(continuing.turns if continuing else 0) + len(turns),
        layout=layout,
        prefix_ids=prefix_ids,
        context_ids=context_ids,
        history_tokens=history_tokens,
        budgets=budgets,
        heads=heads,
        prefill=prefill,
        episodes=episodes,
        episode_segments=members,
        estimated_peak_bytes=peak_bytes,
        notes=notes,
        trained=trained,
        appended=tuple(appended),
        reads={path: dict(options) for path, options in (reads or {}).items() if options},
        turn_spans=tuple(spans),
        episode_ids=episode_ids,
        recall=recall_index,
    )


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
            cache.budget, cake.queries, cake.tau1, cake.tau2, cake.floor_fraction, cake.cascade
        ), None
    profile = find_profile(lm, profile_dirs) if strategy in ("auto", "sensitivity") else None
    if strategy == "auto":
        strategy = "sensitivity" if profile else "uniform"
        if profile is None:
            notes.append(f"no layer profile for {lm.spec}: uniform budgets (run `kvchat profile-layers` to make one)")
    elif strategy == "sensitivity" and profile is None:
        raise UserError(f"{given('layer_budgets', 'sensitivity')} needs a profile of {lm.spec}: run `kvchat "
                        "profile-layers` first")
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
    """The pre-flight estimate (kvchat.ingest.preflight) of building `config`'s caches over `context_tokens`."""
    shape = preflight.ModelShape.of(lm.model)
    return preflight.estimate_ingest_bytes(
        shape,
        budget=config.cache.budget,
        block_size=config.cache.block_size,
        prompt_tokens=config.episodes.patched_prompt_tokens + lm.encode(layout.question("")).shape[-1],
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
            raise UserError(f"{given('prefill', 'full')} cannot run: {why_not}; use {given('prefill', 'block')} or "
                            "auto")
        return "full"
    fits = available is None or full_bytes - shape.weight_bytes <= available
    return "full" if why_not is None and fits else "block"


def _segment_turns(segments: Sequence[int], w: int, turns: int) -> list[int]:
    """The turns (indices, in history order) of `segments` of `w` turns each, of a history of `turns` turns."""
    return [i for s in sorted(segments) for i in range(s * w, min((s + 1) * w, turns))]


def _routed_tokens(
    turns: Sequence[Turn], held: list[list[int]], lm: LoadedModel, lead: str = ""
) -> list[TokenizedTurns]:
    """Each episode's own turns tokenized (`--method routed`; `held`: their indices in history order), rendered
    as the history is, so a session's date opens the first of its turns that the episode holds. An append's start
    with a newline (`lead`) after the stored ones; an episode that gets none is fed nothing."""
    empty = TokenizedTurns(torch.zeros(1, 0, dtype=torch.long), None)
    return [tokenize_turns(lm.tokenizer, [turns[i] for i in ids], lead=lead) if ids else empty for ids in held]


def _routed_spans(turns: Sequence[Turn], held: list[list[int]], routed: list[TokenizedTurns], starts: Sequence[int],
                  *, first: int = 0) -> list[tuple[TurnSpan, ...]]:
    """Each routed episode's turn spans from `starts` on (none when the tokenizer gives no offsets); `first`, the
    history index of `turns[0]`."""
    out = []
    for ids, start, tokenized in zip(held, starts, routed, strict=True):
        spans = tokenized.spans([turns[i] for i in ids], start, [first + i for i in ids]) if ids else []
        if ids and not spans:
            return []
        out.append(tuple(spans))
    return out


def _resolve_method(cache: CacheConfig, history_tokens: int, window: int, notes: list[str]) -> CacheConfig:
    """`--method auto`: `recall` for a history longer than the model's window (its caches alone would keep a
    fraction of it, chosen before any question), else `epicache` (kvchat.kv.methods.AUTO_METHODS)."""
    if cache.method != AUTO_METHOD:
        return cache
    within, beyond = AUTO_METHODS
    if not window or history_tokens + ANSWER_ROOM <= window:
        if cache.recall.entries != RecallConfig.entries:
            notes.append(f"--recall-entries {cache.recall.entries} is unused: the history fits the model's window, "
                         f"so --method auto is {within}, which recalls nothing")
        return dataclasses.replace(cache, method=within)
    notes.append(f"the history ({history_tokens} tokens with the system prompt) exceeds the model's window ({window}): "
                 f"--method {beyond}")
    return dataclasses.replace(cache, method=beyond)


def _positions_mode(requested: str, history_tokens: int, window: int) -> str:
    """`auto` re-rotates to compact positions only when the history would not fit the model's window."""
    if requested != "auto":
        return requested
    return "compact" if window and history_tokens + ANSWER_ROOM > window else "original"


def _episodes(
    lines: list[str], config: IngestConfig, lm: LoadedModel, encoder: SentenceEncoder, *, episodic: bool,
    notes: list[str], step: Callable[[str, int, int], None],
) -> list[Episode]:
    """Episodes of the history. Only EpiCache is episodic: full KV
    and the query-agnostic baselines build a single cache, as in the EpiCache paper's comparisons. Without a
    given count, as many as `DEFAULT_EPISODES` the history's segments can hold; a given count it cannot hold
    is refused."""
    eps = config.episodes
    segments = segment(lines, eps.segment_turns)
    count = eps.episodes
    if count is None:
        count = min(DEFAULT_EPISODES, len(segments))
        if count < DEFAULT_EPISODES and episodic:
            notes.append(f"{count} episode{'s' * (count != 1)}, not {DEFAULT_EPISODES}: the history has "
                         f"{len(segments)} segment{'s' * (len(segments) != 1)} of {eps.segment_turns} turns")
    elif count > len(segments) and episodic:
        raise UserError(
            f"--episodes {count} is more than the history's {len(segments)} segments of "
            f"{eps.segment_turns} turns; use at most {len(segments)} (or leave --episodes out)"
        )
    embedded = encoder.embed(segments, lambda done, total: step("embedding segments", done, total))
    step("clustering episodes", 0, 1)
    built = build_episodes(
        segments,
        embedded,
        k=count if episodic else 1,
        seed=eps.seed,
        token_cap=_medoid_cap(config, lm),
        count_tokens=lambda text: lm.encode(text).shape[-1],
    )
    return built


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
    return max(config.episodes.patched_prompt_tokens - lm.encode(config.instruction).shape[-1], 16)


def _patched_prompt(config: IngestConfig, episode: Episode, lm: LoadedModel) -> str:
    """Instruction + medoid segments, the medoid cut so the whole stays within the token cap (a single
    medoid segment longer than the cap is cut here)."""
    medoid = lm.encode(episode.medoid_text)[0, : _medoid_cap(config, lm)].tolist()
    return f"{config.instruction}\n\n{lm.decode(medoid)}"
