"""A conversation's saved ingest settings, both ways: the `IngestConfig` that built it <-> the flat dict
the store keeps with it, and the command line that builds it again (every setting: those without an option
of their own as `--setting KEY=VALUE`).

The store keeps the *resolved* settings (what ran: `auto` positions and layer budgets replaced by the
choice made, the alpha used), so the same settings rebuild the same caches. Keys are stable across
versions; a key an older kvchat did not write takes its default here.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from typing import Any

from kvchat import features
from kvchat.config import CacheConfig, CakeConfig, EpisodeConfig, IngestConfig, RecallConfig
from kvchat.errors import UserError
from kvchat.kv.config import saved_keys
from kvchat.kv.methods import may_recall

# Settings keys of CAKE's knobs (its fields' metadata): with `cake` layer budgets, and with the `cake` method's
# scorer; its window with either.
_CAKE_KEYS = saved_keys(CakeConfig)
_CAKE_SCORER_KEYS = {key: _CAKE_KEYS[key] for key in ("cake_gamma", "cake_pool_kernel")}
_CAKE_BUDGET_KEYS = {key: name for key, name in _CAKE_KEYS.items() if key not in (*_CAKE_SCORER_KEYS, "cake_window")}
_FULL = "full"  # what `layer_budgets` records for full KV, which has none
_NOT_SETTINGS = ("source", "appended", "reads", "layer_budgets")  # kept apart, or (layer_budgets) an option's own


def setting_paths(config_class: type = IngestConfig, path: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """Every saved settings key -> the path of the `IngestConfig` field it holds (e.g. "page_size" ->
    ("cache", "offload", "paging", "page_size")), from the config dataclasses' field metadata."""
    found = {key: (*path, name) for key, name in saved_keys(config_class).items()}
    for f in dataclasses.fields(config_class):
        if dataclasses.is_dataclass(f.default):
            nested = setting_paths(type(f.default), (*path, f.name))
            if found.keys() & nested.keys():
                raise ValueError(f"settings keys {sorted(found.keys() & nested.keys())} name two fields each")
            found |= nested
    return found


def _get(config: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def _set(config: Any, path: tuple[str, ...], value: Any) -> Any:
    if len(path) == 1:
        return dataclasses.replace(config, **{path[0]: value})
    return dataclasses.replace(config, **{path[0]: _set(getattr(config, path[0]), path[1:], value)})


def with_settings(config: IngestConfig, pairs: Sequence[str]) -> IngestConfig:
    """`config` with saved settings given as `KEY=VALUE` (`kvchat ingest --setting`, which rebuild commands use
    for settings without an option of their own): VALUE is JSON, or else a plain string. Unknown keys and
    values of the wrong type are user errors; `ingest.validate` checks the values."""
    paths = setting_paths()
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in paths or key in _NOT_SETTINGS:
            raise UserError(f"--setting {pair!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(paths))}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        current = _get(config, paths[key])
        if current is not None and not isinstance(value, type(current)) and not (
            isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool)
        ):
            raise UserError(f"--setting {key}: expected a {type(current).__name__}, got {raw!r}")
        config = _set(config, paths[key], float(value) if isinstance(current, float) else value)
    return config


def to_settings(config: IngestConfig, *, source: str | None, appended: Sequence[str] = (),
                reads: dict[str, dict[str, str]] | None = None) -> dict:
    """The dict stored with a conversation. `config` is the resolved one (see the module docstring);
    `appended`, the histories `kvchat ingest --append` added after `source`, in order; `reads`, how those of them
    read with `--format` or `--pick` were read (`read_options`)."""
    cache, episodes = config.cache, config.episodes
    strategy = _FULL if cache.method == "full" else cache.layer_budgets
    settings: dict = {
        "method": cache.method,
        "budget": cache.budget,
        "block_size": cache.block_size,
        "positions": cache.positions,
        "pool_kernel": cache.pool_kernel,
        "layer_budgets": strategy,
        "head_budgets": cache.head_budgets,
        "prefill": cache.prefill,
        "episodes": episodes.episodes,
        "window": episodes.window,
        "prompt_tokens": episodes.prompt_tokens,
        "seed": episodes.seed,
        "system_prompt": config.system_prompt,
        "instruction": config.instruction,
        "source": source,
    }
    if appended:
        settings["appended"] = list(appended)
    if reads:
        settings["reads"] = {path: dict(options) for path, options in reads.items()}
    if strategy == "sensitivity" and cache.alpha is not None:
        settings["alpha"] = cache.alpha
    cake = dataclasses.asdict(cache.cake)
    if strategy == "cake" or cache.method == "cake":
        settings["cake_window"] = cache.cake.window
    if strategy == "cake":
        settings |= {key: cake[field] for key, field in _CAKE_BUDGET_KEYS.items()}
    if cache.method == "cake":
        settings |= {key: cake[field] for key, field in _CAKE_SCORER_KEYS.items()}
    if may_recall(cache.method):
        settings |= {"recall_share": cache.recall.share, "recall_chunk_tokens": cache.recall.chunk_tokens,
                     "recall_retrieval": cache.recall.retrieval, "recall_dated": cache.recall.dated,
                     "recall_entries": cache.recall.entries}
    settings["offload"] = cache.offload.mode
    settings["cache_precision"] = cache.precision
    return settings | features.settings(cache)  # the settings of the features it turns on (kvchat.features)


def read_options(format: str | None = None, pick: str | None = None) -> dict[str, str]:
    """How a history file was read (`--format`, `--pick`), as a conversation's `reads` keeps it: the options given."""
    return {key: value for key, value in (("format", format), ("pick", pick)) if value is not None}


def stored_read(settings: dict, path: str | None) -> dict[str, str]:
    """`load_history`'s `format` and `pick` for `path`, one of the histories a conversation was built from."""
    return dict((settings.get("reads") or {}).get(path) or {})


def from_settings(settings: dict, model: str = "default") -> IngestConfig:
    """The `IngestConfig` stored `settings` describe (defaults for keys they lack)."""
    defaults = IngestConfig()
    cache_d, episodes_d, cake_d = defaults.cache, defaults.episodes, defaults.cache.cake

    def get(key: str, default):
        return settings.get(key, default)

    cake = CakeConfig(
        window=get("cake_window", cake_d.window),
        **{field: get(key, getattr(cake_d, field)) for key, field in (_CAKE_BUDGET_KEYS | _CAKE_SCORER_KEYS).items()},
    )
    strategy = get("layer_budgets", cache_d.layer_budgets)
    cache = CacheConfig(
        method=get("method", cache_d.method),
        budget=get("budget", cache_d.budget),
        block_size=get("block_size", cache_d.block_size),
        positions=get("positions", cache_d.positions),
        pool_kernel=get("pool_kernel", cache_d.pool_kernel),
        layer_budgets=cache_d.layer_budgets if strategy == _FULL else strategy,
        alpha=get("alpha", cache_d.alpha),
        cake=cake,
        head_budgets=get("head_budgets", cache_d.head_budgets),
        prefill=get("prefill", "block"),  # stores written before --prefill existed were built block by block
        precision=get("cache_precision", cache_d.precision),  # stores written before it were full precision
        recall=RecallConfig(share=get("recall_share", cache_d.recall.share),
                            chunk_tokens=get("recall_chunk_tokens", cache_d.recall.chunk_tokens),
                            # recall stores written before recall_retrieval ranked by the encoder
                            retrieval=get("recall_retrieval", "dense" if "recall_share" in settings
                                          else cache_d.recall.retrieval),
                            dated=get("recall_dated", cache_d.recall.dated),
                            entries=get("recall_entries", cache_d.recall.entries)),
    )
    cache = dataclasses.replace(cache, **features.from_settings(settings, cache))
    episodes = EpisodeConfig(
        episodes=get("episodes", episodes_d.episodes),
        window=get("window", episodes_d.window),
        prompt_tokens=get("prompt_tokens", episodes_d.prompt_tokens),
        seed=get("seed", episodes_d.seed),
    )
    return IngestConfig(
        model=model, episodes=episodes, cache=cache,
        system_prompt=get("system_prompt", defaults.system_prompt),
        instruction=get("instruction", defaults.instruction),
    )


def rebuild_command(name: str, model: str, settings: dict, *, replace: bool = False) -> str:
    """`kvchat ingest SOURCE --name NAME ...` with every setting a command-line option can carry (the rest
    are library-only and, when changed, must be passed through `IngestConfig`)."""
    config = from_settings(settings, model)
    cache, episodes = config.cache, config.episodes
    words = ["kvchat", "ingest", settings.get("source") or "HISTORY", "--name", name]
    words += _read_words(settings, settings.get("source"))
    if model != "default":
        words += ["--model", model]
    options: dict[str, object] = {
        "method": cache.method, "budget": cache.budget, "block-size": cache.block_size,
        "episodes": episodes.episodes, "window": episodes.window, "positions": cache.positions,
    }  # fmt: skip
    if episodes.episodes is None:  # as many as the history holds: counted again from the history
        del options["episodes"]
    if cache.method != "full":
        options["layer-budgets"] = cache.layer_budgets
    if cache.alpha is not None:
        options["alpha"] = cache.alpha
    if cache.layer_budgets == "cake" and cache.method != "full":
        options |= {"tau1": cache.cake.tau1, "tau2": cache.cake.tau2}
    options["head-budgets"] = cache.head_budgets
    options["prefill"] = cache.prefill
    if cache.recall.entries != RecallConfig.entries:
        options["recall-entries"] = cache.recall.entries
    options |= features.options(cache)  # the options of the features it turns on (kvchat.features)
    flags = {option: value for option, value in options.items() if isinstance(value, bool)}
    for option, value in options.items():  # valued options first, then on/off flags
        if option not in flags:
            words += [f"--{option}", str(value)]
    words += [f"--{option}" if on else f"--no-{option}" for option, on in flags.items()]
    words += [f"--setting={pair}" for pair in _library_only(config, {o.replace("-", "_") for o in options})]
    if replace:
        words.append("--replace")
    appends = [shlex.join(["kvchat", "ingest", p, "--name", name, "--append", *_read_words(settings, p)])
               for p in settings.get("appended", [])]
    return " && ".join([shlex.join(words), *appends])


def _read_words(settings: dict, path: str | None) -> list[str]:
    """`--format F --pick P` as history `path` was read."""
    return [word for key, value in stored_read(settings, path).items() for word in (f"--{key}", str(value))]


def _library_only(config: IngestConfig, expressed: set[str]) -> list[str]:
    """`KEY=VALUE` for each saved setting of `config` that no option in `expressed` carries and whose value
    differs from what the command would take without it (its default)."""
    saved, paths, default = to_settings(config, source=None), setting_paths(), IngestConfig()
    return [f"{key}={json.dumps(value)}" for key, value in saved.items()
            if key in paths and key not in expressed and key not in _NOT_SETTINGS
            and value != _get(default, paths[key])]  # fmt: skip


def differing_options(given: IngestConfig, settings: dict, model: str) -> list[str]:
    """The options an `--append` gave (those not at their defaults) whose values differ from the conversation's
    stored `settings`, as `--key VALUE (built with STORED)`: an option equal to the stored one is no conflict."""
    default, stored = IngestConfig(model=given.model), from_settings(settings, model)
    differing = []
    for key, path in setting_paths().items():
        mine, theirs = _get(given, path), _get(stored, path)
        if mine != _get(default, path) and mine != theirs:
            built = "without it" if theirs is None else f"with {theirs}"
            differing.append(f"--{key.replace('_', '-')} {mine} (built {built})")
    return differing
