"""Every saved ingest setting, written once: one `Setting` row per setting in `SETTINGS`.

A row says where the setting lives in `IngestConfig`, its key in a conversation's saved settings (stable across
versions; `old_keys` are the names older versions saved it under), its `kvchat ingest` option if users need one
(every other setting is given as `--setting KEY=VALUE`), the values it accepts, when it is saved, and what a store
written before it existed was built with. The command-line options, their validation, the saved settings dict,
`--setting`, the rebuild command and docs/commands.md's settings table are all derived from these rows
(kvchat.settings, kvchat.cli.setting_options); ARCHITECTURE.md shows adding one.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvchat import messages
from kvchat.config import (
    CACHE_PRECISIONS,
    CACHE_STORAGES,
    DEFAULT_EPISODES,
    EPISODE_SPAN_TOKENS,
    HEAD_BUDGETS,
    LAYER_BUDGETS,
    OFFLOAD_MODES,
    OFFLOAD_SCORERS,
    PAGE_DTYPE_NAMES,
    POSITION_MODES,
    PREFILL_MODES,
    RECALL_ENTRIES,
    RETRIEVALS,
    IngestConfig,
)
from kvchat.errors import UserError
from kvchat.kv.methods import METHOD_CHOICES, USER_METHODS


class _Nothing:
    """No value given (a row without an `unused` or `legacy` value)."""

    def __repr__(self) -> str:
        return "NOTHING"


NOTHING: Any = _Nothing()


@dataclass(frozen=True)
class Setting:
    """One saved setting (see the module docstring)."""

    key: str                          # its key in saved settings and in `--setting KEY=VALUE`
    field: str                        # its IngestConfig field, dotted ("cache.offload.paging.page_size")
    help: str                         # what it is: --help's text (plain help: its first sentence), the docs' too
    option: str | None = None         # its `kvchat ingest` option, if users need one; else `--setting` only
    choices: tuple[Any, ...] = ()     # the values it accepts (none: any value of its type)
    shown_choices: tuple[Any, ...] = ()  # the choices --help lists, when not all of them (the rest still accepted)
    min: float | None = None          # the least value it accepts (None passes: "not given")
    max: float | None = None          # the most
    features: tuple[str, ...] = ()    # saved only while one of these cache features is on (kvchat.features)
    used: Callable[[IngestConfig], bool] | None = None  # saved only when it changes what is built
    unused: Any = NOTHING             # saved in its place when not used (and read back as the default)
    legacy: Any = NOTHING             # what a store written before the key existed was built with, when that is
    # not the default (a value, or a function of the config its other keys give)
    old_keys: tuple[str, ...] = ()    # keys older versions saved it under, still read
    old_options: tuple[str, ...] = ()  # options older versions set it with (a usage error names `--setting KEY`)

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.field.split("."))

    def get(self, config: IngestConfig) -> Any:
        value: Any = config
        for name in self.path:
            value = getattr(value, name)
        return value

    def set(self, config: IngestConfig, value: Any) -> IngestConfig:
        return _replaced(config, self.path, value)

    @property
    def default(self) -> Any:
        return self.get(IngestConfig())

    @property
    def annotation(self) -> Any:
        """The field's type (`int`, `float | None`, ...), read from its dataclass."""
        owner: Any = IngestConfig
        for name in self.path[:-1]:
            owner = typing.get_type_hints(owner)[name]
        return typing.get_type_hints(owner)[self.path[-1]]

    @property
    def named(self) -> str:
        """A message's reference to it (kvchat.messages; the CLI writes its option, or `--setting KEY`)."""
        return messages.setting(self.key)

    def given(self, value: Any) -> str:
        """A message's reference to it given `value` (the CLI: `--budget 64`, `--setting block_size=32`)."""
        return messages.setting(self.key, value)

    def parse(self, raw: str) -> Any:
        """`raw` (JSON, or else a plain string) as a value of this setting's type; UserError otherwise."""
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        kinds = typing.get_args(self.annotation) if isinstance(self.annotation, types.UnionType) else (
            self.annotation,)  # fmt: skip
        if value is None and type(None) in kinds:
            return None
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not any(isinstance(value, kind) and (kind is bool) == isinstance(value, bool)
                   for kind in kinds if isinstance(kind, type)):  # fmt: skip
            names = " or ".join(k.__name__ for k in kinds if k is not type(None))
            raise UserError(f"{messages.option('setting')} {self.key}: expected {names}, got {raw!r}")
        return value

    def check(self, value: Any) -> None:
        """The values it accepts (UserError naming how it was given)."""
        if self.choices and value not in self.choices:
            raise UserError(f"unknown {self.named} {value!r} (choose from {', '.join(map(str, self.choices))})")
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if self.min is not None and not value >= self.min:
            raise UserError(f"{self.named} must be >= {self.min:g} (got {value})")
        if self.max is not None and not value <= self.max:
            raise UserError(f"{self.named} must be <= {self.max:g} (got {value})")


def _replaced(config: Any, path: tuple[str, ...], value: Any) -> Any:
    if len(path) == 1:
        return dataclasses.replace(config, **{path[0]: value})
    return dataclasses.replace(config, **{path[0]: _replaced(getattr(config, path[0]), path[1:], value)})


def _sensitivity(config: IngestConfig) -> bool:
    cache = config.cache
    return _layer_budgets_used(config) and cache.layer_budgets == "sensitivity" and cache.alpha is not None


def _layer_budgets_used(config: IngestConfig) -> bool:
    return config.cache.method != "full"  # full KV keeps everything: no budgets


def _cake_budgets(config: IngestConfig) -> bool:
    return _layer_budgets_used(config) and config.cache.layer_budgets == "cake"


def _cake_scorer(config: IngestConfig) -> bool:
    return config.cache.method == "cake"


def _stored_entries(config: IngestConfig) -> bool:
    return config.cache.recall.entries == "stored"


_METHOD_HELP = (
    "How entries are scored for eviction (the baselines kvchat eval compares are accepted too: docs/commands.md). "
    "auto: epicache within the model's window, recall beyond it; epicache: each episode's patched prompt scores its "
    "cache; recall: routed episode caches keep part of the budget and the question's top chunks of raw turns fill "
    "the rest; full: keep everything. Baselines: routed, streaming, snapkv, infinipot, kvzip, keydiff, cake, "
    "indexmem."
)

SETTINGS: tuple[Setting, ...] = (
    # --- what every conversation saves
    Setting("method", "cache.method", _METHOD_HELP, option="--method", choices=METHOD_CHOICES,
            shown_choices=USER_METHODS),
    Setting("budget", "cache.budget", "Kept KV entries per layer and KV head (M), system prompt included.",
            option="--budget", min=1),
    Setting("block_size", "cache.block_size", "Tokens fed per prefill block (B) before evicting back to M; peak "
            "memory grows with it.", min=16, old_options=("--block-size",)),
    Setting("positions", "cache.positions", "original, compact (kept keys re-rotated to 0..n-1) or auto (compact "
            "only when the history exceeds the model's window).", choices=POSITION_MODES,
            old_options=("--positions",)),
    Setting("pool_kernel", "cache.pool_kernel", "Max-pool of scores over neighbouring entries (SnapKV practice), "
            "an odd number; 1 = off."),
    Setting("layer_budgets", "cache.layer_budgets", "How M is shared among layers: auto (sensitivity when the "
            "model has a profile, else uniform), uniform, sensitivity (kvchat profile-layers), pyramid (PyramidKV) or "
            "cake (from each block's attention).", choices=LAYER_BUDGETS, used=_layer_budgets_used, unused="full",
            old_options=("--layer-budgets",)),
    Setting("head_budgets", "cache.head_budgets", "How a layer's budget is shared among KV heads: uniform or "
            "adaptive (AdaKV: the layer's top entries across heads, each head at least a fifth).",
            choices=HEAD_BUDGETS, old_options=("--head-budgets",)),
    Setting("prefill", "cache.prefill", "block (evict after every block: peak memory flat in the history's length), "
            "full (one prefill of the whole history, then each episode keeps its top entries) or auto (full when "
            "the history fits the model's window and memory).", choices=PREFILL_MODES,
            legacy="block", old_options=("--prefill",)),  # stores written before it were built block by block
    Setting("episodes", "episodes.episodes", f"Number of topical episodes (E). Default: {DEFAULT_EPISODES} (routed "
            f"methods, recall among them: one per {EPISODE_SPAN_TOKENS} history tokens, if more), or fewer when the "
            "history has fewer segments.",
            option="--episodes", min=1),
    Setting("segment_turns", "episodes.segment_turns", "Turns per segment clustered into episodes (w).", min=1,
            old_keys=("window",), old_options=("--window",)),
    Setting("patched_prompt_tokens", "episodes.patched_prompt_tokens", "Tokens of an episode's patched prompt at "
            "most (instruction and medoid segments).", old_keys=("prompt_tokens",)),
    Setting("seed", "episodes.seed", "Seed of the episodes' K-Means clustering."),
    Setting("system_prompt", "system_prompt", "The system prompt the conversation sits in."),
    Setting("instruction", "instruction", "The instruction opening each episode's patched prompt."),
    # --- sensitivity and CAKE layer budgets, CAKE's scorer
    Setting("alpha", "cache.alpha", "Sharpness of sensitivity layer budgets (default: the profile's), in (0, 10].",
            used=_sensitivity, old_options=("--alpha",)),
    Setting("cake_queries", "cache.cake.queries", "CAKE: the block's last queries that measure layer preferences "
            "and score entries (S_w).", min=1, old_keys=("cake_window",),
            used=lambda c: _cake_budgets(c) or _cake_scorer(c)),
    Setting("tau1", "cache.cake.tau1", "cake layer budgets: temperature of attention dispersion (smaller weighs it "
            "more), in (0, 10].", used=_cake_budgets, old_options=("--tau1",)),
    Setting("tau2", "cache.cake.tau2", "cake layer budgets: temperature of attention shift (smaller weighs it more), "
            "in (0, 10].", used=_cake_budgets, old_options=("--tau2",)),
    Setting("cake_floor_fraction", "cache.cake.floor_fraction", "cake layer budgets: the least share of M a layer "
            "keeps.", min=0, max=1, used=_cake_budgets),
    Setting("cake_cascade", "cache.cake.cascade", "cake layer budgets: evict layer by layer during the block's "
            "forward (false: once at its end).", used=_cake_budgets),
    Setting("cake_gamma", "cache.cake.gamma", "--method cake: weight of the attention's variance in the eviction "
            "indicator.", min=0, used=_cake_scorer),
    Setting("cake_pool_kernel", "cache.cake.pool_kernel", "--method cake: average pool of the indicator over "
            "neighbouring entries, an odd number.", used=_cake_scorer),
    # --- recall (kvchat.features.recall)
    Setting("recall_share", "cache.recall.share", "Of M, the share recalled chunks take at each question (whole "
            "chunks, at least one), between 0 and 1.", features=("recall",)),
    Setting("recall_chunk_tokens", "cache.recall.chunk_tokens", "Tokens of consecutive turns per recalled chunk "
            "at most.", min=1, features=("recall",)),
    Setting("recall_retrieval", "cache.recall.retrieval", "How a question's chunks are ranked: lexical (their "
            "words, the encoder breaking ties), dense (the sentence encoder alone), hybrid (reciprocal-rank fusion of "
            "both) or interleaved (the best by their words, then the one holding the turn the encoder finds nearest, "
            "in turn; every turn's embedding kept in each episode file).", choices=RETRIEVALS,
            features=("recall",), legacy="dense"),  # recall stores written before it ranked by the encoder
    Setting("recall_dated", "cache.recall.dated", "Each recalled chunk opens with its first turn's date.",
            features=("recall",)),
    Setting("recall_entries", "cache.recall.entries", "Recalled chunks: prefilled at each question, or stored "
            "(computed once at ingest, in 4 bits, and placed at each question).", option="--recall-entries",
            choices=RECALL_ENTRIES, features=("recall",)),
    Setting("recall_repair", "cache.recall.repair", "Stored recall entries: each placed chunk's first tokens, not "
            "stored but computed again at each question with what precedes them in view (EPIC).", min=0,
            features=("recall",), used=_stored_entries),
    Setting("recall_kept", "cache.recall.kept", "Stored recall entries: the share of each chunk's entries kept at "
            "ingest (the attention of its last tokens chooses them), so a budget places about 1 / kept as many chunks; "
            "above 0, at most 1.", min=0, max=1, features=("recall",), used=_stored_entries),
    # --- cache features (kvchat.features)
    Setting("offload", "cache.offload.mode", "Page evicted entries to disk and read the best back while answering "
            "(icecache), or drop them (none).", option="--offload", choices=OFFLOAD_MODES),
    Setting("cache_precision", "cache.precision", "Caches held (and stored) quantized: int8 or int4 (KIVI), or "
            "full. Not with --offload.", option="--cache-precision", choices=CACHE_PRECISIONS),
    Setting("cache_storage", "cache.storage", "How episode files hold keys and values: int8 (KIVI codes read back "
            "in full precision), float16, bfloat16, or model (the dtype the model built them in: float32 on a CPU). "
            "Measured in benchmarks/results/storage_precision.md.", choices=CACHE_STORAGES,
            legacy="model"),  # stores written before it kept the model's dtype
    Setting("retrieve", "cache.offload.retrieve", "With --offload icecache: entries per layer and KV head read from "
            "the pages while answering (R).", option="--retrieve", min=0, features=("icecache",)),
    Setting("page_scorer", "cache.offload.scorer", "icecache: how pages are chosen for a question: entries (the "
            "default, measured best), two-stage, top-keys or centroid (benchmarks/results/icecache_pages*.md).",
            choices=OFFLOAD_SCORERS, features=("icecache",)),
    Setting("refresh", "cache.offload.refresh", "icecache: decoded tokens between re-choosing the pages beyond the "
            "question's pinned ones.", min=0, features=("icecache",)),
    Setting("pinned_share", "cache.offload.pinned_share", "icecache: of R, the question's best pages that stay for "
            "the whole answer.", min=0, max=1, features=("icecache",)),
    Setting("page_candidates", "cache.offload.candidates", "icecache, entries and two-stage scorers: page "
            "centroids choose pages of up to this many times R entries, whose keys are scored exactly.", min=1,
            features=("icecache",)),
    Setting("offload_recent", "cache.offload.recent", "icecache: every head's last entries kept resident beside M "
            "(W).", min=0, features=("icecache",), old_keys=("offload_window",), old_options=("--offload-window",)),
    Setting("first_paged_layer", "cache.offload.first_paged_layer", "icecache: layers below it keep every entry.",
            min=0, features=("icecache",)),
    Setting("pages_dtype", "cache.offload.dtype", "icecache: the pages' dtype on disk.", choices=PAGE_DTYPE_NAMES,
            features=("icecache",)),
    Setting("page_size", "cache.offload.paging.page_size", "icecache: entries per page at most.", min=1,
            features=("icecache",), old_options=("--page-size",)),
    Setting("cluster_size", "cache.offload.paging.cluster_size", "icecache: target entries per k-means cluster of "
            "keys (a larger one is cut into pages).", min=1, features=("icecache",)),
    Setting("kmeans_iterations", "cache.offload.paging.iterations", "icecache: Lloyd iterations of the pages' "
            "k-means.", min=1, features=("icecache",)),
    Setting("paging_seed", "cache.offload.paging.seed", "icecache: seed of the pages' k-means.",
            features=("icecache",)),
    Setting("latent_memory", "cache.latent_memory", "--method indexmem: fold evicted entries into a latent memory "
            "stored with each episode and read while answering.", features=("indexmem",), old_keys=("memory",),
            old_options=("--memory", "--no-memory")),
    Setting("indexer_recent", "cache.indexer_recent", "--method indexmem: each block's last entries, always kept.",
            min=0, features=("indexmem",), old_keys=("recent_window",)),
    Setting("attention_mix", "cache.attention_mix", "--method indexmem: share of the attention of the block's last "
            "queries blended into the indexer's scores (0: the indexer alone).", min=0, max=1,
            features=("indexmem",), legacy=0.0),  # stores written before the blend: the indexer alone
    Setting("indexer_pool_kernel", "cache.indexer_pool_kernel", "--method indexmem: max-pool of its scores, an odd "
            "number; 1 = off.", features=("indexmem",),
            legacy=lambda config: config.cache.pool_kernel),  # before it, the indexer pooled with pool_kernel
    Setting("quant_group", "cache.quant_group", "int8: tokens per key group and channels per value group.", min=1,
            features=("int8",)),
    Setting("quant_group_4bit", "cache.quant_group_4bit", "int4: tokens per key group and channels per value group.",
            min=1, features=("int4",)),
    Setting("quant_residual", "cache.quant_residual", "int8, int4: each head's last entries kept in full precision.",
            min=0, features=("int8", "int4")),
)

BY_KEY: types.MappingProxyType[str, Setting] = types.MappingProxyType(
    {key: s for s in SETTINGS for key in (s.key, *s.old_keys)})  # fmt: skip


def former_option(option: str) -> Setting | None:
    """The setting an older version's option `option` (say `--block-size`) set, if one did."""
    return next((row for row in SETTINGS if option in row.old_options), None)


def setting(key: str) -> Setting:
    """The row of saved key `key` (a current or an older one); KeyError when there is none."""
    return BY_KEY[key]


def named(key: str) -> str:
    """A message's reference to setting `key` (the CLI: `--budget`, `--setting block_size`); KeyError for no key."""
    return BY_KEY[key].named


def given(key: str, value: Any) -> str:
    """A message's reference to setting `key` given `value` (the CLI: `--budget 64`, `--setting block_size=32`)."""
    return BY_KEY[key].given(value)


def check(config: IngestConfig) -> None:
    """Every setting's value against its row's choices and bounds (UserError), whether it is used or not."""
    for row in SETTINGS:
        row.check(row.get(config))


def markdown() -> str:
    """docs/commands.md's table of the settings without an option of their own (tests/test_settings.py keeps the
    page equal to it)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for row in SETTINGS:
        if row.option is None:
            default = row.default
            shown = "kvchat's own" if isinstance(default, str) and len(default) > 40 else f"`{json.dumps(default)}`"
            former = [f"`{option}`" for option in row.old_options] + [f"key `{key}`" for key in row.old_keys]
            before = f" Formerly {', '.join(former)}." if former else ""
            lines.append(f"| `{row.key}` | {shown} | {row.help}{before} |")
    return "\n".join(lines) + "\n"


def _unique() -> None:
    keys = [key for s in SETTINGS for key in (s.key, *s.old_keys)]
    fields = [s.field for s in SETTINGS]
    if len(set(keys)) != len(keys) or len(set(fields)) != len(fields):
        raise ValueError("a settings key or field is written in two rows")


_unique()
