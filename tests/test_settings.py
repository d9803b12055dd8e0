"""The settings table (kvchat.settings_table) and what is derived from it: `--setting` takes every saved key, the
rebuild command gives every setting back through the command line's own parser, older stores' settings still load,
and `kvchat ingest --help` shows the options users need while the rest are documented as settings."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import typer.main
from cli_helpers import run_main
from conftest import raises_said

from kvchat.cli import app
from kvchat.cli.setting_options import PARAMETERS, config_from
from kvchat.cli.words import spell
from kvchat.config import (
    CacheConfig,
    CakeConfig,
    EpisodeConfig,
    IngestConfig,
    OffloadConfig,
    PagingConfig,
    RecallConfig,
)
from kvchat.errors import UserError
from kvchat.settings import differing_options, from_settings, rebuild_command, to_settings, upgraded, with_settings
from kvchat.settings_table import SETTINGS, Setting, markdown

DOCS = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
# Configs under which every row is saved somewhere: CAKE's budgets and scorer with IceCache; IndexMem with
# sensitivity budgets and 8 bits; recall with 4 bits.
BASES = [
    IngestConfig(cache=CacheConfig(method="cake", layer_budgets="cake", offload=OffloadConfig(mode="icecache"))),
    IngestConfig(cache=CacheConfig(method="indexmem", layer_budgets="sensitivity", alpha=1.3, precision="int8")),
    IngestConfig(cache=CacheConfig(method="recall", precision="int4")),
    IngestConfig(cache=CacheConfig(method="recall", recall=RecallConfig(entries="stored"))),
]


def _other_value(row: Setting):
    """A value of `row` other than its default (and than what it saves when unused)."""
    default = row.default
    if row.choices:
        return next(c for c in row.choices if c not in (default, row.unused, "auto"))
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2
    if isinstance(default, str):
        return default + " Be brief."
    return 1.5 if row.key == "alpha" else 3  # alpha's and episodes' None: the profile's, as many as fit


def _saving(row: Setting, value) -> IngestConfig:
    """A config with `row` at `value` under which it is saved."""
    for base in BASES:
        config = row.set(base, value)
        if to_settings(config, source=None).get(row.key) == value:
            return config
    raise AssertionError(f"no base config saves {row.key}")


def _parsed(command: str) -> IngestConfig:
    """The IngestConfig `kvchat ingest` builds from the command line `command`, through its own parser."""
    words = shlex.split(command)
    assert words[:2] == ["kvchat", "ingest"]
    ingest = typer.main.get_command(app).commands["ingest"]
    context = ingest.make_context("ingest", words[2:])
    return config_from(**{p.name: context.params[p.name] for p in PARAMETERS})


@pytest.mark.parametrize("row", SETTINGS, ids=lambda row: row.key)
def test_setting_takes_every_saved_key(row):
    value = _other_value(row)
    assert row.get(with_settings(IngestConfig(), [f"{row.key}={json.dumps(value)}"])) == value
    for old in row.old_keys:  # an older version's key too
        assert row.get(with_settings(IngestConfig(), [f"{old}={json.dumps(value)}"])) == value
    if isinstance(value, str):  # a string may go bare
        assert row.get(with_settings(IngestConfig(), [f"{row.key}={value}"])) == value


@pytest.mark.parametrize("row", SETTINGS, ids=lambda row: row.key)
def test_the_rebuild_command_gives_every_setting_back_through_the_parser(row):
    value = _other_value(row)
    config = _saving(row, value)
    settings = to_settings(config, source="/h/chat.json")
    expected = from_settings(settings)
    assert row.get(expected) == value
    parsed = _parsed(spell(rebuild_command("chat", "default", settings)))
    assert parsed == expected
    assert to_settings(parsed, source="/h/chat.json") == settings


def test_a_setting_of_the_wrong_kind_or_name_is_refused_by_name():
    for pair, says in [("no_such_key=1", "--setting 'no_such_key=1': expected KEY=VALUE"),
                       ("budget", "expected KEY=VALUE"), ("source=x", "expected KEY=VALUE"),
                       ('budget="many"', "--setting budget: expected int"),
                       ("budget=true", "--setting budget: expected int"),
                       ("alpha=high", "--setting alpha: expected float")]:  # fmt: skip
        with raises_said(UserError, says):
            with_settings(IngestConfig(), [pair])
    assert with_settings(IngestConfig(), ["alpha=2", "alpha=null"]).cache.alpha is None
    assert with_settings(IngestConfig(), ["tau1=2"]).cache.cake.tau1 == 2.0


# Settings as kvchat wrote them before recall_retrieval, before the indexer's blend and before --prefill, and as
# it wrote them before keys were renamed (issue 42); all before cache_storage (their files: the model's dtype).
OLDER = {
    "recall, before recall_retrieval": (
        {"method": "recall", "budget": 512, "block_size": 256, "positions": "compact", "pool_kernel": 7,
         "layer_budgets": "sensitivity", "head_budgets": "uniform", "prefill": "block", "episodes": None, "window": 4,
         "prompt_tokens": 256, "seed": 0, "system_prompt": "S", "instruction": "I", "source": "/h.json",
         "alpha": 1.2, "recall_share": 0.75, "recall_chunk_tokens": 128, "offload": "none",
         "cache_precision": "full"},
        IngestConfig(episodes=EpisodeConfig(segment_turns=4), system_prompt="S", instruction="I", cache=CacheConfig(
            method="recall", budget=512, block_size=256, positions="compact", layer_budgets="sensitivity", alpha=1.2,
            prefill="block", recall=RecallConfig(share=0.75, chunk_tokens=128, retrieval="dense"), storage="model")),
    ),
    "indexmem, before the blend and --prefill": (
        {"method": "indexmem", "budget": 256, "block_size": 128, "positions": "original", "pool_kernel": 5,
         "layer_budgets": "uniform", "head_budgets": "uniform", "episodes": 2, "window": 3, "prompt_tokens": 128,
         "seed": 1, "system_prompt": "S", "instruction": "I", "source": None, "memory": False,
         "recent_window": 32},
        IngestConfig(episodes=EpisodeConfig(episodes=2, segment_turns=3, patched_prompt_tokens=128, seed=1),
                     system_prompt="S", instruction="I", cache=CacheConfig(
                         method="indexmem", budget=256, block_size=128, positions="original", pool_kernel=5,
                         layer_budgets="uniform", prefill="block", latent_memory=False, indexer_recent=32,
                         attention_mix=0.0, indexer_pool_kernel=5, storage="model")),
    ),
    "full KV offloaded, cake scorer keys": (
        {"method": "full", "budget": 1024, "block_size": 512, "positions": "original", "pool_kernel": 7,
         "layer_budgets": "full", "head_budgets": "uniform", "prefill": "block", "episodes": None, "window": 4,
         "prompt_tokens": 256, "seed": 0, "system_prompt": "S", "instruction": "I", "source": "/h.json",
         "offload": "icecache", "cache_precision": "full", "retrieve": 64, "page_scorer": "two-stage",
         "offload_window": 8, "page_size": 4},
        IngestConfig(system_prompt="S", instruction="I", cache=CacheConfig(
            method="full", positions="original", prefill="block", storage="model",
            offload=OffloadConfig(mode="icecache", retrieve=64, scorer="two-stage", recent=8,
                                  paging=PagingConfig(page_size=4)))),
    ),
    "cake": (
        {"method": "cake", "budget": 300, "block_size": 512, "positions": "compact", "pool_kernel": 7,
         "layer_budgets": "cake", "head_budgets": "uniform", "prefill": "block", "episodes": None, "window": 4,
         "prompt_tokens": 256, "seed": 0, "system_prompt": "S", "instruction": "I", "source": None,
         "cake_window": 16, "tau1": 0.5, "tau2": 2.0, "cake_floor_fraction": 0.25, "cake_cascade": True,
         "cake_gamma": 50.0, "cake_pool_kernel": 5, "offload": "none", "cache_precision": "full"},
        IngestConfig(system_prompt="S", instruction="I", cache=CacheConfig(
            method="cake", budget=300, positions="compact", layer_budgets="cake", prefill="block",
            cake=CakeConfig(tau1=0.5, tau2=2.0, gamma=50.0, queries=16), storage="model")),
    ),
}


@pytest.mark.parametrize("older", OLDER, ids=str)
def test_settings_an_older_kvchat_saved_load_to_the_config_that_built_them(older):
    saved, built = OLDER[older]
    assert from_settings(saved) == built
    again = to_settings(built, source=saved["source"])  # what kvchat saves for it now: every older key, as it was
    assert {key: again[key] for key in upgraded(saved)} == upgraded(saved)
    assert from_settings(again) == built


def test_an_append_names_a_setting_without_an_option_by_its_key():
    stored = to_settings(IngestConfig(cache=CacheConfig(method="recall")), source="h.json")
    given = with_settings(IngestConfig(), ["recall_share=0.75", "block_size=256"])
    assert [spell(d) for d in differing_options(given, stored, "default")] == [
        "--setting block_size=256 (built with 512)", "--setting recall_share=0.75 (built with 0.5)"]
    same = to_settings(IngestConfig(cache=CacheConfig(method="recall", recall=RecallConfig(share=0.75))), source=None)
    assert differing_options(with_settings(IngestConfig(), ["recall_share=0.75"]), same, "default") == []


def _ingest_help_options(monkeypatch) -> set[str]:
    monkeypatch.setenv("COLUMNS", "80")
    shown = run_main(Path("/nonexistent"), "ingest", "--help")
    assert shown.returncode == 0, shown.stderr
    declared = [line.strip().split("  ")[0] for line in shown.stdout.splitlines() if line.startswith("  -")]
    return {word.rstrip(",") for names in declared for word in names.split() if word.startswith("--")}


USER_OPTIONS = {
    "--name", "--format", "--pick", "--append", "--reingest", "--replace", "--model", "--budget", "--method",
    "--episodes", "--offload", "--retrieve", "--cache-precision", "--recall-entries", "--max-memory", "--threads",
    "--weights", "--device", "--dtype", "--force", "--trust-remote-code", "--json", "--setting", "--help",
    "--resume", "--ray", "--workers", "--address",
}
BENCHMARK_KNOBS = {
    "--tau1": "tau1", "--tau2": "tau2", "--alpha": "alpha", "--page-size": "page_size", "--block-size": "block_size",
    "--window": "segment_turns", "--positions": "positions", "--layer-budgets": "layer_budgets",
    "--head-budgets": "head_budgets", "--prefill": "prefill", "--offload-window": "offload_recent",
    "--memory": "latent_memory",
}


def test_ingest_help_lists_the_user_options_and_the_docs_every_other_setting(monkeypatch):
    shown = _ingest_help_options(monkeypatch)
    assert {o for o in shown if not o.startswith("--no-")} == USER_OPTIONS
    docs = DOCS.read_text()
    assert markdown() in docs, "docs/commands.md's settings table: paste kvchat.settings_table.markdown() there"
    for option, key in BENCHMARK_KNOBS.items():
        assert option not in shown
        assert f"| `{key}` |" in docs


def test_ingest_help_offers_the_user_methods_and_the_parser_takes_the_baselines(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    shown = run_main(Path("/nonexistent"), "ingest", "--help").stdout
    assert "--method auto|epicache|recall|full" in shown and "snapkv|" not in shown
    ingest = typer.main.get_command(app).commands["ingest"]
    assert ingest.make_context("ingest", ["h.json", "--method", "snapkv"]).params["method"] == "snapkv"
