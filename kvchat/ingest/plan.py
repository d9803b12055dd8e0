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
from typing import TYPE_CHECKING

import torch

from kvchat import features
from kvchat.answer import recall
from kvchat.answer.rag import RagIndex, TurnEmbeddings
from kvchat.config import (
    ANSWER_ROOM,
    DEFAULT_EPISODES,
    EPISODE_SPAN_TOKENS,
    CacheConfig,
    IngestConfig,
    RecallConfig,
)
from kvchat.errors import UserError
from kvchat.history.episodes import Episode, build_episodes, scaled_count, segment
from kvchat.history.loading import Turn, format_turns, load_history
from kvchat.history.spans import TurnSpan
from kvchat.history.tokens import TokenizedTurns, tokenize_turns
from kvchat.ingest import preflight
from kvchat.ingest.cache_budgets import estimate_bytes, prefill_mode, resolve_layer_budgets
from kvchat.ingest.layer_profiles import find_indexmem
from kvchat.ingest.validation import validate as validate
from kvchat.kv import families
from kvchat.kv.cascade import CakeBudgets
from kvchat.kv.heads import HeadBudgets
from kvchat.kv.methods import (
    AUTO_METHOD,
    AUTO_METHODS,
    ScorerInputs,
    method,
)
from kvchat.kv.scoring import Scorer
from kvchat.messages import option
from kvchat.model.encoder import SentenceEncoder
from kvchat.model.llm import ChatLayout, LoadedModel
from kvchat.settings_table import given, named
from kvchat.store import Store, name_from_file, validate_name

if TYPE_CHECKING:
    from kvchat.kv.trained import TrainedIndexMem


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
    trained: TrainedIndexMem | None = None            # a trained method's weights (kvchat.kv.trained.TrainedIndexMem)
    # each turn's token range (kvchat.answer.sources), stored with every episode; an append's: its new turns only;
    # routed: one tuple per episode, of its own turns
    turn_spans: tuple[TurnSpan, ...] | tuple[tuple[TurnSpan, ...], ...] = ()
    episode_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # routed: each episode's own turns
    recall: RagIndex | None = None  # --method recall: the chunks questions recall turns from (an append's: new ones)
    # every layer's budget holds the whole history, so no episode evicts anything and their caches would be equal:
    # one is built and every episode's record names its file (kvchat.ingest.pipeline)
    one_cache: bool = False


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
    same_caches: bool = False  # every stored episode's cache is the same (one file, or files of one checksum)


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
    history shows progress before the first block.

    The steps, each its own function: the history read and tokenized (`_read`); the method resolved (`_method`);
    the episodes, fresh or joined by an append's turns, each cache fed the whole history or, routed, its own turns
    (`_fresh_episodes`, `_appended_episodes`); the layer budgets (`_budgets`); block or full prefill and the memory
    check (`_prefill`); the positions (`_positions`)."""
    if store is None and (not replace or profile_dirs is None):
        raise ValueError("plan_ingest without a store needs replace=True and profile_dirs")
    validate(config)
    name = _new_name(history, name, store, replace)
    if profile_dirs is None:
        profile_dirs = [store.home / "profiles"] if store is not None else []
    dirs = list(profile_dirs)
    planner = _Planner(lm, encoder, continuing, dirs, max_memory, force, on_step or _quiet)
    text = _read(history, config, planner)
    config = dataclasses.replace(config, cache=_method(config.cache, text, planner))
    fed = (_appended_episodes(text, config, continuing, planner) if continuing is not None
           else _fresh_episodes(text, config, planner))
    chosen = _budgets(config.cache, fed.total, text.protected, planner)
    prefill, peak_bytes = _prefill(config, chosen, fed, text, planner)
    resolved = dataclasses.replace(config, cache=dataclasses.replace(
        chosen.cache, positions=_positions(chosen.cache, fed.total, planner), alpha=chosen.alpha,
        layer_budgets=chosen.cache.layer_budgets if chosen.strategy == "full" else chosen.strategy,
        prefill=chosen.cache.prefill if continuing else prefill,
    ))  # fmt: skip
    spans = _turn_spans(text, fed)
    text = dataclasses.replace(text, tokenized=None)  # its offsets go before the recall index is built
    return IngestPlan(
        name=name,
        config=resolved,
        source=continuing.source if continuing else _source(history, source),
        turns=text.first + len(text.turns),
        layout=text.layout,
        prefix_ids=text.prefix_ids,
        context_ids=text.context_ids,
        history_tokens=text.history_tokens,
        budgets=chosen.budgets,
        heads=chosen.heads,
        prefill=prefill,
        episodes=fed.episodes,
        episode_segments=fed.members,
        estimated_peak_bytes=peak_bytes,
        notes=planner.notes,
        trained=chosen.trained,
        appended=tuple(appended),
        reads={path: dict(options) for path, options in (reads or {}).items() if options},
        turn_spans=spans,
        episode_ids=fed.episode_ids,
        recall=_recall_index(text, resolved.cache, planner),
        one_cache=_one_cache(chosen, fed, planner),
    )


def _quiet(step: str, done: int, total: int) -> None:
    """No progress to hear of."""


@dataclass
class _Planner:
    """What every step of a plan reads besides the history and the settings: the model and encoder, the stored
    conversation an append continues (None: a fresh ingest), where profiles are found, the memory there is (None:
    measured) and whether to go ahead past the estimate, progress, and the notes gathered so far."""

    lm: LoadedModel
    encoder: SentenceEncoder
    continuing: Continuation | None
    profile_dirs: list[Path]
    max_memory: int | None
    force: bool
    step: Callable[[str, int, int], None]
    notes: list[str] = dataclasses.field(default_factory=list)


def _new_name(history: str | os.PathLike | Sequence[Turn], name: str | None, store: Store | None,
              replace: bool) -> str:  # fmt: skip
    """The conversation's name (made from the file's name when not given), checked, and free in `store` unless
    replacing."""
    if name:
        name = validate_name(name)
    elif isinstance(history, (str, os.PathLike)):
        name = name_from_file(history)
    else:
        raise ValueError("name is required when ingesting turns rather than a file")
    if store is not None:  # a batch worker's driver checks its own store
        store.check_writable()
        if not replace and name in {c.name for c in store.conversations()}:
            raise UserError(f"conversation '{name}' exists; use {option('replace')}")
    return name


def _source(history: str | os.PathLike | Sequence[Turn], source: str | None) -> str | None:
    """The history's path as recorded for rebuild commands: a file's, else the one given."""
    return str(Path(history).resolve()) if isinstance(history, (str, os.PathLike)) else source


@dataclass(frozen=True)
class _History:
    """The history (an append: its new turns) read and tokenized after the system prompt."""

    turns: list[Turn]
    lines: list[str]               # each turn as the history renders it
    layout: ChatLayout
    prefix_ids: torch.Tensor       # the system prompt up to the conversation: never evicted
    tokenized: TokenizedTurns | None
    context_ids: torch.Tensor      # the turns' tokens, on the model's device
    earlier: int                   # history tokens the stored caches already hold (an append's; else 0)
    first: int                     # the history index of `turns[0]` (an append's: the stored turns' count)

    @property
    def protected(self) -> int:
        return self.prefix_ids.shape[-1]

    @property
    def history_tokens(self) -> int:
        """Tokens of the whole history the caches hold."""
        return self.earlier + int(self.context_ids.shape[-1])

    @property
    def total(self) -> int:
        """With the system prompt."""
        return self.protected + self.history_tokens


def _read(history: str | os.PathLike | Sequence[Turn], config: IngestConfig, planner: _Planner) -> _History:
    """The turns (from the file, or as given), rendered and tokenized in one chunked pass with their spans."""
    lm, step, continuing = planner.lm, planner.step, planner.continuing
    if isinstance(history, (str, os.PathLike)):
        step("reading the history", 0, 1)
        turns = load_history(history, min_turns=1 if continuing else 2)
    else:
        turns = list(history)
    tokenizing = f"tokenizing {len(turns):,} turns"
    step(tokenizing, 0, 1)
    lines = format_turns(turns)
    layout = ChatLayout.from_tokenizer(lm.tokenizer, config.system_prompt)
    # an append's first new line follows the stored history's last one, which ends without a newline
    tokenized = tokenize_turns(lm.tokenizer, turns, lead="\n" if continuing else "", lines=lines,
                               on_progress=lambda done, total: step(tokenizing, done, total))  # fmt: skip
    return _History(turns, lines, layout, lm.encode(layout.before_conversation), tokenized,
                    tokenized.ids.to(lm.device), continuing.history_tokens if continuing else 0,
                    continuing.turns if continuing else 0)  # fmt: skip


def _method(cache: CacheConfig, text: _History, planner: _Planner) -> CacheConfig:
    """`cache` with `--method auto` resolved, refused where each episode cache's budget M would not exceed the
    system prompt, which every layer keeps."""
    cache = _resolve_method(cache, text.total, planner.lm.context_window, planner.notes)
    kept = features.episode_budget(cache)  # M of each episode cache
    if method(cache.method).scorer is not None and kept <= text.protected:  # every layer's floor lies above it
        raise UserError(
            f"{given('budget', cache.budget)} must exceed the system prompt's {text.protected} tokens, which every "
            f"layer keeps; raise {named('budget')}" if kept == cache.budget else
            f"{given('budget', cache.budget)} leaves {given('method', 'recall')}'s episode caches {kept} entries, no "
            f"more than the system prompt's {text.protected} tokens, which every layer keeps; raise {named('budget')}"
        )
    return cache


@dataclass(frozen=True)
class _Episodes:
    """The episodes and what their caches are fed: every cache the history (an append: its new turns), or routed,
    each episode its own turns."""

    episodes: list[Episode]
    members: list[int]             # history segments per episode
    total: int                     # the longest cache's tokens with the system prompt (stored ones included)
    fed: int                       # the tokens the longest cache is fed now (an append: the new turns only)
    held_turns: list[list[int]] = dataclasses.field(default_factory=list)  # routed: indices into the turns
    routed: list[TokenizedTurns] = dataclasses.field(default_factory=list)  # routed: each episode's own turns
    episode_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # their tokens, on the device
    starts: list[int] = dataclasses.field(default_factory=list)  # routed: where each one's new turns start


def _fresh_episodes(text: _History, config: IngestConfig, planner: _Planner) -> _Episodes:
    """A new conversation's episodes (embedded segments, clustered); routed, each one's own turns: the longest
    sets the window. The config keeps the count asked for: without one, a re-ingest counts again."""
    entry = method(config.cache.method)
    episodes = _episodes(text.lines, config, planner.lm, planner.encoder, episodic=entry.episodic,
                         routed=entry.routed, history_tokens=text.total, notes=planner.notes,
                         step=planner.step)  # fmt: skip
    whole = _Episodes(episodes, [len(e.segments) for e in episodes], text.total, text.total)
    if not entry.routed:
        return whole
    w, n = config.episodes.segment_turns, len(text.turns)
    return _routed(whole, text, [_segment_turns(e.segments, w, n) for e in episodes], (0,) * len(episodes), planner)


def _appended_episodes(text: _History, config: IngestConfig, continuing: Continuation, planner: _Planner
                       ) -> _Episodes:  # fmt: skip
    """An append's new segments joined to the stored episodes (before anything else is noted); routed, each
    stored cache continues with the new turns of the segments that joined its episode."""
    w = config.episodes.segment_turns
    episodes, members, joined = continuing.place(segment(text.lines, w), planner.notes)
    whole = _Episodes(episodes, members, text.total, text.total - text.earlier)
    if not method(config.cache.method).routed:
        return whole
    held = [_segment_turns([s for s, e in enumerate(joined) if e == episode.index], w, len(text.turns))
            for episode in episodes]  # fmt: skip
    stored = continuing.episode_tokens or (text.earlier,) * len(episodes)
    return _routed(whole, text, held, stored, planner)


def _routed(whole: _Episodes, text: _History, held: list[list[int]], stored: Sequence[int], planner: _Planner
            ) -> _Episodes:  # fmt: skip
    """`whole`'s episodes, each fed its `held` turns on top of the `stored` history tokens its cache holds."""
    routed = _routed_tokens(text.turns, held, planner.lm, lead="\n" if planner.continuing else "")
    episode_ids = [t.ids.to(planner.lm.device) for t in routed]
    protected = text.protected
    total, fed = max((protected + h + int(ids.shape[-1]), int(ids.shape[-1]) + protected)
                     for h, ids in zip(stored, episode_ids, strict=True))  # fmt: skip
    return dataclasses.replace(whole, total=total, fed=fed, held_turns=held, routed=routed, episode_ids=episode_ids,
                               starts=[protected + h for h in stored])


@dataclass(frozen=True)
class _Budgets:
    """The caches' budgets as resolved: layer budgets (None: full KV) and how each layer shares them among heads."""

    cache: CacheConfig                       # as the cache features resolved it
    strategy: str                            # the layer budgets' strategy that runs ("full": none)
    budgets: list[int] | CakeBudgets | None
    alpha: float | None                      # sensitivity's alpha
    heads: HeadBudgets
    trained: TrainedIndexMem | None                   # a trained method's weights (kvchat.kv.trained.TrainedIndexMem)


def _budgets(cache: CacheConfig, total: int, protected: int, planner: _Planner) -> _Budgets:
    """Layer budgets of M (the recalled chunks' share taken out), each above the `protected` system prompt, with
    the cache features' say (resident windows beside M); a trained method's weights found by fingerprint."""
    lm = planner.lm
    trained = find_indexmem(lm, planner.profile_dirs) if method(cache.method).trained else None
    cache = features.resolve(cache, trained, planner.notes)
    if method(cache.method).scorer is None:
        strategy, budgets, alpha = "full", None, None
    else:
        kept = dataclasses.replace(cache, budget=features.episode_budget(cache))
        strategy, budgets, alpha = resolve_layer_budgets(kept, lm, planner.profile_dirs, protected, planner.notes)
    return _Budgets(cache, strategy, features.budgets(cache, budgets, total), alpha, HeadBudgets(cache.head_budgets),
                    trained)


def _prefill(config: IngestConfig, chosen: _Budgets, fed: _Episodes, text: _History, planner: _Planner
             ) -> tuple[str, int]:  # fmt: skip
    """`block` or `full` (an append continues block by block) and the estimated peak bytes, checked against the
    memory there is unless forced."""
    lm = planner.lm
    shape = preflight.ModelShape.of(lm.model)
    available = planner.max_memory if planner.max_memory is not None else preflight.available_bytes(lm.device)
    # A cache under budget holds what an ingest of the new turns alone would; full KV holds the stored ones too.
    held = fed.total if chosen.budgets is None else fed.fed

    def estimate(select_from_full: bool) -> int:
        return estimate_bytes(config, lm, text.layout, held, chosen.budgets, chosen.heads, text.protected,
                              select_from_full=select_from_full)  # fmt: skip

    prefill = "block" if planner.continuing else prefill_mode(chosen.cache, chosen.strategy, fed.total,
                                                               lm.context_window, estimate(True), shape, available)
    peak_bytes = estimate(prefill == "full")
    if not planner.force:
        preflight.check_fits(peak_bytes, resident=shape.weight_bytes, available=available, device=lm.device)
    return prefill, peak_bytes


def _positions(cache: CacheConfig, total: int, planner: _Planner) -> str:
    """The positions the caches keep: a fresh ingest's as asked (`auto`: compact beyond the model's window), checked
    against the model; an append keeps the stored caches' until the history outgrows the window, as `auto` would."""
    lm = planner.lm
    positions = cache.positions
    if planner.continuing is None:
        families.check_context(lm.config, total + ANSWER_ROOM, lm.spec, what=f"the history ({total} tokens with "
                               f"the system prompt) and {ANSWER_ROOM} for an answer")  # fmt: skip
        positions = _positions_mode(cache.positions, total, lm.context_window)
        families.check_positions(lm.config, positions, lm.spec)
    elif positions == "original" and _positions_mode("auto", total, lm.context_window) == "compact":
        families.check_positions(lm.config, "compact", lm.spec)
        positions = "compact"
        planner.notes.append(f"the history ({total} tokens with the system prompt) now exceeds the model's window "
                             f"({lm.context_window}): the caches continue at compact positions")  # fmt: skip
    if method(cache.method).scorer is None and positions == "compact" and not cache.offload.enabled:
        raise UserError(f"{given('method', 'full')} keeps every entry at its own position, and the history ({total} "
                        f"tokens with the system prompt) exceeds the model's window ({lm.context_window}); use a "
                        f"method with a budget (the default does), or {given('offload', 'icecache')}")  # fmt: skip
    return positions


def _one_cache(chosen: _Budgets, fed: _Episodes, planner: _Planner) -> bool:
    """Whether the episodes' caches would all be the same: each is fed the whole history (not routed), every layer's
    budget holds all of it with the system prompt, so nothing is evicted whatever an episode's patched prompt scores
    (an append: and the stored caches are the same too)."""
    budgets = chosen.budgets
    if len(fed.episodes) < 2 or fed.episode_ids or not isinstance(budgets, list) or not budgets:
        return False
    continuing = planner.continuing
    if continuing is not None and not continuing.same_caches:
        return False
    if min(budgets) < fed.total:
        return False
    planner.notes.append(f"every layer's budget holds the whole history ({fed.total} tokens with the system prompt): "
                         f"the {len(fed.episodes)} episodes' caches are the same, stored once")
    return True


def _turn_spans(text: _History, fed: _Episodes) -> tuple:
    """Each turn's token range (kvchat.answer.sources), from after the system prompt and the stored turns; routed:
    one tuple per episode, of its own turns."""
    if fed.episode_ids:
        return tuple(_routed_spans(text.turns, fed.held_turns, fed.routed, fed.starts, first=text.first))
    indices = range(text.first, text.first + len(text.turns))
    if text.tokenized is None:
        raise RuntimeError("the turns' token offsets were released before their spans were taken")
    return tuple(text.tokenized.spans(text.turns, text.protected + text.earlier, indices=indices))


def _recall_index(text: _History, cache: CacheConfig, planner: _Planner) -> RagIndex | None:
    """--method recall: the chunks each question's turns are recalled from (an append's: its new turns only), and
    for the interleaved ranking each turn's embedding."""
    split = recall.split_for(cache)
    if split is None:
        return None
    turns = None
    if cache.recall.retrieval == "interleaved":
        turns = TurnEmbeddings.build(text.lines, planner.encoder,
                                     on_progress=lambda done, total: planner.step("embedding turns", done, total))
    index = RagIndex.build(text.turns, planner.lm, planner.encoder, split.chunk_tokens, cache.recall.dated, turns)
    return recall.offset(index, planner.continuing.turns) if planner.continuing else index


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
            notes.append(f"{given('recall_entries', cache.recall.entries)} is unused: the history fits the model's "
                         f"window, so {given('method', 'auto')} is {within}, which recalls nothing")
        return dataclasses.replace(cache, method=within)
    return dataclasses.replace(cache, method=beyond)  # an ingest's progress hears of it (IngestHooks.method)


def _positions_mode(requested: str, history_tokens: int, window: int) -> str:
    """`auto` re-rotates to compact positions only when the history would not fit the model's window."""
    if requested != "auto":
        return requested
    return "compact" if window and history_tokens + ANSWER_ROOM > window else "original"


def _episodes(
    lines: list[str], config: IngestConfig, lm: LoadedModel, encoder: SentenceEncoder, *, episodic: bool,
    routed: bool, history_tokens: int, notes: list[str], step: Callable[[str, int, int], None],
) -> list[Episode]:
    """Episodes of the history. Only EpiCache is episodic: full KV
    and the query-agnostic baselines build a single cache, as in the EpiCache paper's comparisons. Without a
    given count, as many as `DEFAULT_EPISODES` (routed: one per `EPISODE_SPAN_TOKENS` of the history, if more) the
    history's segments can hold; a given count it cannot hold is refused."""
    eps = config.episodes
    segments = segment(lines, eps.segment_turns)
    count = eps.episodes
    if count is None:
        wanted = scaled_count(history_tokens, least=DEFAULT_EPISODES, span=EPISODE_SPAN_TOKENS) if routed else \
            DEFAULT_EPISODES
        count = min(wanted, len(segments))
        if count < wanted and episodic:
            notes.append(f"{count} episode{'s' * (count != 1)}, not {wanted}: the history has "
                         f"{len(segments)} segment{'s' * (len(segments) != 1)} of {eps.segment_turns} turns")
        elif count > DEFAULT_EPISODES:
            notes.append(f"{count} episodes, one per {EPISODE_SPAN_TOKENS} tokens of the history ({history_tokens} "
                         "tokens with the system prompt)")
    elif count > len(segments) and episodic:
        raise UserError(
            f"{given('episodes', count)} is more than the history's {len(segments)} segments of "
            f"{eps.segment_turns} turns; use at most {len(segments)} (or leave {named('episodes')} out)"
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
    config: IngestConfig, episode: Episode, lm: LoadedModel, layout: ChatLayout, trained: TrainedIndexMem | None = None
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
