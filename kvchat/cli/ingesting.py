"""`kvchat ingest` and `kvchat ingest-batch`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import typer

from kvchat import documents
from kvchat.cli.options import (
    BuildWeightsOpt,
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    ThreadsOpt,
    TrustOpt,
    load_encoder,
    load_model,
    open_store,
)
from kvchat.cli.progress import (
    STORED,
    LineBatchProgress,
    LineIngestProgress,
    RichBatchProgress,
    RichIngestProgress,
    progress_bars,
)
from kvchat.cli.render import beside_table, counted, emit_json, err, head_budgets_text, said_notes, say, table
from kvchat.cli.setting_options import OFFLOAD_PANEL, with_setting_options
from kvchat.cli.words import spell
from kvchat.config import WEIGHTS, BatchConfig, DeviceConfig, IngestConfig
from kvchat.errors import UserError
from kvchat.history.loading import FORMAT_NAMES

HistoryFormat = Literal[tuple(FORMAT_NAMES)]  # type: ignore[valid-type]
_INPUT, _STORE, _RAY = "History", "Storing", "Ray workers"
INGEST_EXAMPLES = """Examples:
  kvchat ingest chat.json                       # stored as "chat"
  kvchat ingest conversations.json --pick "Trip to Japan" --name japan
  kvchat ingest more.json --append --name chat  # continue a stored conversation
  kvchat ingest year.json --ray --workers 8     # its episodes on 8 Ray workers"""


@with_setting_options
def ingest(
    history: Annotated[Path, typer.Argument(
        metavar="HISTORY", help='A chat history file (docs/formats.md): OpenAI messages JSON/JSONL, a '
        'ChatGPT, Claude, Telegram or Discord export, a Slack channel\'s folder, fine-tune JSONL, a "Name: text" '
        'transcript or WhatsApp chat, a markdown chat log, LoCoMo or LongMemEval.')],
    name: Annotated[str | None, typer.Option(help="Conversation name (default: made from the file's name).",
                                             rich_help_panel=_INPUT)] = None,
    history_format: Annotated[HistoryFormat | None, typer.Option(
        "--format", help="Force the history's format (default: detected).",
        rich_help_panel=_INPUT)] = None,
    pick: Annotated[str | None, typer.Option(rich_help_panel=_INPUT,
        help='The conversation to take: its number, title or "all". From a ChatGPT, Claude or Telegram export or '
        'fine-tune JSONL holding several; number 1 is the first in the file, "all" takes them oldest first.')] = None,
    config: IngestConfig = IngestConfig(),
    max_memory: Annotated[int | None, typer.Option(rich_help_panel=OFFLOAD_PANEL,
        help="MiB this ingest may use (default: what the system has available). It decides auto prefill and the "
        "pre-flight check.")] = None,
    replace: Annotated[bool, typer.Option(help="Replace a conversation of the same name.",
                                          rich_help_panel=_STORE)] = False,
    append: Annotated[bool, typer.Option(rich_help_panel=_STORE,
        help="Add the history's turns to conversation --name. Every episode cache continues from where it "
        "stopped, with the settings it was built with (cache options are not taken); the past is not ingested "
        "again, and a newer export of the same chat adds only the turns after those stored.")] = False,
    reingest: Annotated[bool, typer.Option(rich_help_panel=_STORE,
        help="With --append: ingest the stored histories and this one again from the start. Episodes are "
        "clustered anew.")] = False,
    resume: Annotated[bool | None, typer.Option("--resume/--no-resume", rich_help_panel=_STORE,
        help="Continue an ingest of this name stopped before it finished, from its last finished part: where it has "
        "the same history and settings (the default), always (exit 2 without one), or never (start over).")] = None,
    ray: Annotated[bool, typer.Option("--ray", rich_help_panel=_RAY,
        help="Build the episodes (and stored recall entries) on Ray workers; this process writes the store "
        "(docs/batch.md).")] = False,
    workers: Annotated[int | None, typer.Option(rich_help_panel=_RAY,
        help="With --ray: workers (default: the CPUs Ray has / --threads).")] = BatchConfig.workers,
    address: Annotated[str | None, typer.Option(rich_help_panel=_RAY,
        help="With --ray: join this Ray cluster ('auto', or ray://HOST:10001) instead of starting a local "
        "Ray.")] = BatchConfig.address,
    trust_remote_code: TrustOpt = False,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    weights: BuildWeightsOpt = WEIGHTS,
    as_json: JsonOpt = False,
) -> None:
    """Split a history into episodes and store one compressed KV cache per episode."""
    started = time.monotonic()  # the summary's time is the whole command's: reading, model loading, ingest
    # Every mistake in the options, the name or the file is refused before torch is imported (a fraction of a second)
    from kvchat.history.loading import load_history
    from kvchat.ingest.validation import validate
    from kvchat.settings import read_options
    from kvchat.store.resumable import unfinished

    model = config.model
    if max_memory is not None and max_memory < 1:
        raise UserError(f"--max-memory must be >= 1 MiB (got {max_memory})")
    validate(config)
    _check_spread(append, resume, ray, workers, address)
    if append and name is None:
        raise UserError("--append needs --name, the conversation to continue")
    name = _conversation_name(name, history)
    turns = load_history(history, format=history_format, pick=pick,  # fails before a model loads
                         min_turns=1 if append else 2)
    read = read_options(history_format, pick)  # kept, so that `--append --reingest` reads it the same way
    store = open_store()
    if append or reingest:
        _check_append(append, reingest, replace, config, model, store.get(name) if append else None)
    elif not replace and name in {c.name for c in store.conversations()}:
        raise UserError(f"conversation '{name}' exists; use --replace (or --append to add to it)")
    store.check_writable()
    if resume and not unfinished(store.caches_dir, name):
        raise UserError(f"--resume: no unfinished ingest of {name!r} to continue")
    if ray:
        from kvchat.ingest.batch_units import ingest_spread

        with said_notes(), progress_bars() as bars:
            asked = config.cache.method
            progress = RichIngestProgress(bars, asked) if err.is_terminal else LineIngestProgress(asked)
            report = ingest_spread(
                turns, name=name, store=store, config=config, source=str(history.resolve()), reads=read or None,
                batch=BatchConfig(workers=workers, threads=threads or 1, address=address,
                                  device=DeviceConfig(device, dtype), weights=weights),
                replace=replace, force=force, max_memory=None if max_memory is None else max_memory * 2**20,
                trust_remote_code=trust_remote_code, progress=progress, resumable=True, resume=resume,
            )  # fmt: skip
        return _say_ingested(report, append, reingest, as_json, started, None)
    spec = store.get(name).model if append else model
    from kvchat.ingest.pipeline import ingest as run_ingest

    lm = load_model(spec, store, trust_remote_code, threads, DeviceConfig(device, dtype), weights)
    encoder = load_encoder()
    loading = time.monotonic() - started
    with said_notes(), progress_bars() as bars:
        asked = STORED if append else config.cache.method  # --reingest too: the conversation's settings
        progress = RichIngestProgress(bars, asked) if err.is_terminal else LineIngestProgress(asked)
        if append:
            from kvchat.ingest import append as appending

            run = appending.reingest if reingest else appending.append
            extra = {} if reingest else {"source": str(history.resolve())}
            try:
                report = run(history if reingest else turns, name=name, store=store, lm=lm, encoder=encoder,
                             progress=progress, force=force, read=read, **extra)  # fmt: skip
            except appending.NothingNew as exc:  # a re-export with nothing new: done, nothing written
                say(f"kvchat: {exc}", console=err)
                if as_json:
                    emit_json(documents.document(name=name, appended_turns=0, skipped_turns=exc.turns))
                return
        else:
            report = run_ingest(
                turns, name=name, config=config, store=store, lm=lm, encoder=encoder, replace=replace,
                progress=progress, source=str(history.resolve()), force=force,
                max_memory=None if max_memory is None else max_memory * 2**20,
                reads={str(history.resolve()): read} if read else None, resumable=True, resume=resume,
            )
    _say_ingested(report, append, reingest, as_json, started, loading)


def _say_ingested(report, append: bool, reingest: bool, as_json: bool, started: float, loading: float | None) -> None:
    """The ingest's notes, then its summary line or its JSON document. `loading`: the seconds reading the history
    and loading the model took (None: on Ray workers)."""
    for note in report.notes:
        say(f"kvchat: note: {spell(note)}", console=err)
    if as_json:
        emit_json(documents.ingest(report))
    else:
        say(
            "appended to " if append and not reingest else "ingested ", (report.name, "bold"),
            f": {report.turns} turns, {report.history_tokens} tokens -> "
            f"{counted(report.episodes, 'episode')}, {_budget_text(report)} "
            f"({report.method}, {report.prefill} prefill, "
            f"{report.layer_budgets} layer budgets, "
            f"{head_budgets_text(report.head_budgets, report.head_entries)}, {report.positions} positions, "
            f"{report.weights} weights), "
            f"peak {report.peak_layer_entries} entries/layer ({report.peak_total_entries} in all layers), "
            f"{report.cache_bytes / 2**20:.1f} MiB{_offload_text(report)}{_recall_entries_text(report)}, "
            f"{time.monotonic() - started:.1f}s"
            + (f" ({loading:.1f}s reading and loading the model)" if loading is not None else " (on Ray workers)"),
        )


def _check_spread(append: bool, resume: bool | None, ray: bool, workers: int | None, address: str | None) -> None:
    """How --resume and --ray combine with the other options (before anything is read)."""
    if append and resume is not None:
        raise UserError("--resume and --no-resume go with a plain ingest: an --append is not resumable")
    if append and ray:
        raise UserError("--ray spreads a plain ingest: an --append runs in this process")
    if not ray and (workers is not None or address is not None):
        raise UserError(f"{'--workers' if workers is not None else '--address'} goes with --ray")


def _conversation_name(name: str | None, history: Path) -> str:
    """The name given, checked; else one made from the file's name ("WhatsApp Chat with Dana.txt":
    "WhatsApp-Chat-with-Dana")."""
    from kvchat.store import name_from_file, validate_name

    return validate_name(name) if name is not None else name_from_file(history)


def _budget_text(report) -> str:
    """The budget M asked for, the entries per layer and KV head an episode's cache keeps on average over layers
    (fewer than M for a short history, or with --method recall the rest of M), and the recalled chunks' entries."""
    kept = round(sum(report.budgets) / len(report.budgets))
    asked = f"budget {report.budget} asked" if report.budget else "budget"
    recalled = f" + {report.recalled_entries} recalled per question" if report.recalled_entries else ""
    return f"{asked}, {kept} kept on average per layer and KV head{recalled}"


def _recall_entries_text(report) -> str:
    """What `--recall-entries stored` added on disk."""
    if not report.recall_entries_bytes:
        return ""
    return f" + {report.recall_entries_bytes / 2**20:.1f} MiB of recall entries"


def _offload_text(report) -> str:
    """What `--offload` added: entries paged and their disk use, per history token too."""
    if report.offload == "none":
        return ""
    per_token = report.pages_bytes / max(report.history_tokens, 1)
    return (f" + {report.pages_bytes / 2**20:.1f} MiB of pages ({report.offloaded_entries} offloaded entries, "
            f"{per_token / 1024:.1f} KiB per history token)")


def _check_append(append: bool, reingest: bool, replace: bool, config: IngestConfig, model: str, record) -> None:
    """--append takes the conversation's own settings: options equal to them are fine, others would be silently
    ignored, so they are refused by name."""
    from kvchat.settings import differing_options

    if reingest and not append:
        raise UserError("--reingest goes with --append (a plain ingest always starts from the start)")
    if replace:
        raise UserError("--append continues a conversation and --replace starts it over: give one of them")
    differing = differing_options(config, record.settings, record.model)
    if differing:
        raise UserError(f"--append continues with the settings the conversation was built with, and "
                        f"{'; '.join(differing)}: drop the cache options that differ (to change them, ingest the "
                        "whole history again with --replace)")
    if model not in (IngestConfig.model, record.model):
        raise UserError(f"--append uses the model the conversation was built with ({record.model}); drop --model")


@with_setting_options
def ingest_batch(
    files: Annotated[list[Path] | None, typer.Argument(
        metavar="HISTORY", help="History files; each becomes the conversation named after its stem.")] = None,
    manifest: Annotated[list[Path] | None, typer.Option(
        help="A file of NAME PATH lines (a relative PATH is relative to the manifest; # comments). Repeatable."
    )] = None,
    workers: Annotated[int | None, typer.Option(
        help="Ray workers, each ingesting one history at a time (default: the CPUs Ray has / --threads; a local "
        "Ray has this machine's usable cores).")] = BatchConfig.workers,
    threads: Annotated[int, typer.Option(
        help="Torch threads per worker; workers x threads may not exceed the CPUs.")] = BatchConfig.threads,
    address: Annotated[str | None, typer.Option(
        help="Join this Ray cluster ('auto', or ray://HOST:10001) instead of starting a local Ray (what a "
        "cluster needs: docs/batch.md).")] = BatchConfig.address,
    history_format: Annotated[HistoryFormat | None, typer.Option(
        "--format", help="Force every history's format (default: detected).", rich_help_panel=_INPUT)] = None,
    pick: Annotated[str | None, typer.Option(rich_help_panel=_INPUT,
        help='The conversation to take of each file holding several: its number, title or "all".')] = None,
    config: IngestConfig = IngestConfig(),
    max_memory: Annotated[int | None, typer.Option(
        help="MiB each worker's ingest may use (default: the memory available on its node, shared among the "
        "workers there); decides auto prefill and the pre-flight check.")] = None,
    replace: Annotated[bool, typer.Option(
        help="Replace conversations stored with other settings (without it such a history fails; one stored "
        "with the same settings is skipped either way).")] = False,
    trust_remote_code: TrustOpt = False,
    force: ForceOpt = False,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    weights: BuildWeightsOpt = WEIGHTS,
    as_json: JsonOpt = False,
) -> None:
    """Ingest many histories on Ray workers (the optional extra 'batch'); a re-run skips what is already stored.

    Exit status 2 when any history failed (each is reported; the others go on).
    """
    from kvchat.ingest.batch_sources import histories
    from kvchat.ingest.validation import validate

    validate(config)  # mistakes in the options and the files' names: before Ray and torch load
    sources = histories(files or [], manifest or [], format=history_format, pick=pick)
    store = open_store()
    from kvchat.ingest import batch as batching

    with progress_bars(markup=False) as bars:
        progress = RichBatchProgress(bars) if err.is_terminal else LineBatchProgress()
        report = batching.ingest_batch(
            sources, store=store, config=config,
            batch=BatchConfig(workers=workers, threads=threads, address=address, device=DeviceConfig(device, dtype),
                              weights=weights),
            replace=replace, force=force, max_memory=None if max_memory is None else max_memory * 2**20,
            trust_remote_code=trust_remote_code, progress=progress,
        )
    notes = dict.fromkeys(n for h in report.histories if h.report is not None for n in h.report.notes)
    for note in notes:
        say(f"kvchat: note: {spell(note)}", console=err)
    if as_json:
        emit_json(documents.batch(report))
    else:
        table(("conversation", "status", "episodes", "MiB", "seconds", "tries", "error"),
              [(h.name, h.status, h.report.episodes if h.report else "",
                f"{h.report.cache_bytes / 2**20:.1f}" if h.report else "", f"{h.seconds:.1f}", h.attempts,
                spell(h.error or "")) for h in report.histories],
              right=("episodes", "MiB", "seconds", "tries"))  # fmt: skip
        say(f"{report.count('committed')} committed, {report.count('skipped')} skipped, {report.count('failed')} "
            f"failed in {report.seconds:.1f} s on {report.workers} worker{'s' * (report.workers != 1)} x "
            f"{report.threads} thread{'s' * (report.threads != 1)} "
            f"({report.histories_per_hour:.0f} histories/hour)", console=beside_table())  # fmt: skip
    failed = report.count("failed")
    if failed:
        raise UserError(f"{failed} of {len(report.histories)} histories failed")
