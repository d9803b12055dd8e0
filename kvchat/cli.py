"""kvchat's command line: parses options, calls the library, renders with rich. No logic lives here."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from kvchat import documents
from kvchat.config import (
    CACHE_PRECISIONS,
    DEVICES,
    DTYPES,
    HEAD_BUDGETS,
    LAYER_BUDGETS,
    MEMORY_READOUTS,
    OFFLOAD_MODES,
    POSITION_MODES,
    PREFILL_MODES,
    TRAIN_STAGES,
    WEIGHT_MODES,
    AskConfig,
    BatchConfig,
    CacheConfig,
    CakeConfig,
    DeviceConfig,
    EpisodeConfig,
    EvalConfig,
    IndexMemConfig,
    IngestConfig,
    OffloadConfig,
    PagingConfig,
    ProfileSettings,
    TrainConfig,
    default_home,
)
from kvchat.errors import UserError
from kvchat.kv.methods import METHODS, REGISTRY
from kvchat.report import COLUMNS as EVAL_COLUMNS
from kvchat.report import cell as eval_cell
from kvchat.terminal import StreamCleaner, cell, clean

app = typer.Typer(
    help="Answer questions about chat histories far longer than your KV-cache budget.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout (for scripts; see the README).")]
DeviceOpt = Annotated[Literal[DEVICES], typer.Option(  # type: ignore[valid-type]
    help="Where the model runs: auto (CUDA when torch sees a GPU, else the CPU), cpu or cuda.")]
DtypeOpt = Annotated[Literal[DTYPES], typer.Option(  # type: ignore[valid-type]
    help="The model's dtype, and its caches': auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16, or "
    "float16 (CUDA only). A cache answers in any dtype, converted on load.")]
ThreadsOpt = Annotated[int | None, typer.Option(
    help="Torch threads (default: $OMP_NUM_THREADS, else the cores this process may use). Running several "
    "kvchat processes? Give each cores / processes.")]
# Choices are real choices: listed in --help, completed by the shell, refused by the parser (exit 2).
Positions = Literal[POSITION_MODES]  # type: ignore[valid-type]
Prefill = Literal[PREFILL_MODES]  # type: ignore[valid-type]
Method = Literal[METHODS]  # type: ignore[valid-type]
LayerBudgets = Literal[LAYER_BUDGETS]  # type: ignore[valid-type]
HeadBudgets = Literal[HEAD_BUDGETS]  # type: ignore[valid-type]
Offload = Literal[OFFLOAD_MODES]  # type: ignore[valid-type]
CachePrecision = Literal[CACHE_PRECISIONS]  # type: ignore[valid-type]
TrainStage = Literal[TRAIN_STAGES]  # type: ignore[valid-type]
MemoryReadoutMode = Literal[MEMORY_READOUTS]  # type: ignore[valid-type]
Weights = Literal[WEIGHT_MODES]  # type: ignore[valid-type]


def _complete_conversation(incomplete: str) -> list[str]:
    """Stored conversation names, for shell completion."""
    try:
        return [r.name for r in _store().conversations() if r.name.startswith(incomplete)]
    except Exception:  # completion must never print a traceback into the shell
        return []


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("kvchat")
        except PackageNotFoundError:
            number = "unknown"
        sys.stdout.write(f"kvchat {number}\n")
        raise typer.Exit()
_METHOD_HELP = "; ".join(f"{m.name}: {m.summary}" for m in REGISTRY.values()) + "."


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of internal errors, and what kvchat's "
                                        "library logs (where the model runs, its decode attention backend).")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print kvchat's version and exit.")] = False,
) -> None:
    """kvchat keeps one compressed KV cache per topical episode of a conversation, on disk
    ($KVCHAT_HOME, default: the platform's user data dir), and answers from the nearest one."""


def _store():
    from kvchat.store import Store

    return Store(default_home())


def _model(spec: str, store, trust_remote_code: bool = False, threads: int | None = None,
           device: DeviceConfig = DeviceConfig(), weights: str = "float"):
    from kvchat.device import resolve
    from kvchat.llm import load_model, use_threads

    placement = resolve(device)  # a device this machine lacks is refused before anything loads
    use_threads(threads)
    return load_model(spec, store.models_dir, trust_remote_code=trust_remote_code, placement=placement,
                      weights=weights)


def _encoder():
    from kvchat.encoder import SentenceEncoder

    return SentenceEncoder()


def _emit_json(document: dict) -> None:
    """One JSON document on one line (JSON Lines when a command prints several)."""
    sys.stdout.write(json.dumps(document, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _say(*parts: str | tuple[str, str], console: Console | None = None) -> None:
    """One line to a console: user data shown as its characters (no markup, no escape sequences), never
    hard-wrapped; a part given as (text, style) is styled."""
    text = Text()
    for part in parts:
        value, style = part if isinstance(part, tuple) else (part, "")
        text.append(clean(value), style=style)
    (console or out).print(text, soft_wrap=True)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, title: str | None = None,
           right: Sequence[str] = ()) -> None:
    """A table: with rich's rules on a terminal (folded, never cut), tab-separated values otherwise
    (a header line, then one line per row: plain for cut, awk and sort)."""
    if not out.is_terminal:
        for line in [headers, *rows]:
            sys.stdout.write("\t".join(cell(v) for v in line) + "\n")
        sys.stdout.flush()
        return
    table = Table(title=clean(title) if title else None)
    for header in headers:
        table.add_column(header, justify="right" if header in right else "left", overflow="fold")
    for row in rows:
        table.add_row(*(Text(cell(v)) for v in row))
    out.print(table)


class _LineIngestProgress:
    """Where stderr is not a terminal: one line per episode, so a log shows the ingest is alive."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def history(self, done: int, total: int) -> None:
        if done == total:
            err.print(f"kvchat: history prefilled once ({total} blocks, {self._elapsed()}); selecting episodes",
                      markup=False, soft_wrap=True)  # fmt: skip

    def episode(self, index: int, total: int) -> None:
        err.print(f"kvchat: episode {index + 1}/{total} ({self._elapsed()})", markup=False, soft_wrap=True)

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.1f} s elapsed"

    def block(self, done: int, total: int) -> None:
        pass


class _RichIngestProgress:
    """Per-episode and per-block bars on a TTY."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.episodes = progress.add_task("episodes", total=None)
        self.blocks = progress.add_task("blocks", total=None)

    def history(self, done: int, total: int) -> None:
        self.progress.update(self.blocks, completed=done, total=total, description="history (full prefill)")

    def episode(self, index: int, total: int) -> None:
        self.progress.update(self.episodes, completed=index, total=total, description=f"episode {index + 1}")
        self.progress.update(self.blocks, description="blocks")

    def block(self, done: int, total: int) -> None:
        self.progress.update(self.blocks, completed=done, total=total)
        if done == total:
            self.progress.advance(self.episodes)


def _option(name: str, annotation: object, default: object) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, default=default)


# The cache options of `ingest` and `ingest-batch`, which `_cache_options` gives a command.
_CACHE_OPTIONS = [
    _option("model", Annotated[str, typer.Option(
        help="'default' (embedded SmolLM2-135M), a model dir or a .gguf file.")], IngestConfig.model),
    _option("budget", Annotated[int, typer.Option(help="Kept KV entries per layer and head (M).")], CacheConfig.budget),
    _option("block_size", Annotated[int, typer.Option(help="Tokens per prefill block (B).")], CacheConfig.block_size),
    _option("episodes", Annotated[int, typer.Option(help="Number of topical episodes (E).")], EpisodeConfig.episodes),
    _option("window", Annotated[int, typer.Option(help="Turns per segment for clustering (w).")], EpisodeConfig.window),
    _option("method", Annotated[Method, typer.Option(help="Eviction method: " + _METHOD_HELP)], CacheConfig.method),
    _option("positions", Annotated[Positions, typer.Option(
        help="original, compact (re-rotate kept keys) or auto.")], CacheConfig.positions),
    _option("layer_budgets", Annotated[LayerBudgets, typer.Option(
        help="Per-layer budgets: auto (sensitivity if the model has a profile, else uniform), uniform, "
        "sensitivity (kvchat profile-layers), pyramid (PyramidKV) or cake (CAKE: from each block's "
        "attention; with --method cake, layers are evicted one by one in the forward).")], CacheConfig.layer_budgets),
    _option("alpha", Annotated[float | None, typer.Option(
        help="Sharpness of sensitivity budgets (default: the profile's, 1.2).")], CacheConfig.alpha),
    _option("tau1", Annotated[float, typer.Option(
        help="cake budgets: temperature of attention dispersion (smaller = weighs it more).")], CakeConfig.tau1),
    _option("tau2", Annotated[float, typer.Option(
        help="cake budgets: temperature of attention shift (smaller = weighs it more).")], CakeConfig.tau2),
    _option("head_budgets", Annotated[HeadBudgets, typer.Option(
        help="Per-head budgets within a layer: uniform (every KV head keeps M_l entries) or adaptive (AdaKV: "
        "the layer's top M_l x KV-heads entries across heads, each head keeping at least a fifth of M_l; "
        "files and memory hold only kept entries). adaptive needs epicache, snapkv, infinipot or kvzip.")],
        CacheConfig.head_budgets),
    _option("prefill", Annotated[Prefill, typer.Option(
        help="block (evict after every block: peak memory flat in the history's length), full (keep the whole "
        "history once, then each episode keeps its top entries: one prefill instead of one per episode) or auto "
        "(full when the history fits the model's window and its full KV fits memory).")], CacheConfig.prefill),
    _option("cache_precision", Annotated[CachePrecision, typer.Option(
        help="full (the model's dtype), int8 or int4 (KIVI: keys per channel, values per token, in 8 bits with "
        "a float32 scale and zero point per group of 32, or in 4 bits, two per byte, with float16 ones per group "
        "of 16; each head's last entries and the answer stay in full precision): stored and resident caches take "
        "about a third (int8) or a fifth (int4) of float32's bytes, 64% or 38% of bfloat16's, dequantized while "
        "answering. Not with --offload.")], CacheConfig.precision),
]
TrustOpt = Annotated[bool, typer.Option(help="Allow a model dir's own Python code.")]
ForceOpt = Annotated[bool, typer.Option(help="Run even when the memory estimate exceeds the available memory.")]


def _cache_options(command):
    """Give `command`, in place of its parameter `config: IngestConfig`, the cache options (`_CACHE_OPTIONS`),
    and call it with the IngestConfig they describe: one list of options for every command that ingests."""
    signature = inspect.signature(command, eval_str=True)
    params = list(signature.parameters.values())
    at = [p.name for p in params].index("config")

    @functools.wraps(command)
    def with_config(**options):
        o = {p.name: options.pop(p.name) for p in _CACHE_OPTIONS}
        config = IngestConfig(
            model=o["model"],
            episodes=EpisodeConfig(episodes=o["episodes"], window=o["window"]),
            cache=CacheConfig(method=o["method"], budget=o["budget"], block_size=o["block_size"],
                              positions=o["positions"], layer_budgets=o["layer_budgets"], alpha=o["alpha"],
                              cake=CakeConfig(tau1=o["tau1"], tau2=o["tau2"]), head_budgets=o["head_budgets"],
                              prefill=o["prefill"], precision=o["cache_precision"]),
        )  # fmt: skip
        return command(config=config, **options)

    with_config.__signature__ = signature.replace(parameters=[*params[:at], *_CACHE_OPTIONS, *params[at + 1 :]])
    return with_config


@app.command()
@_cache_options
def ingest(
    history: Annotated[Path, typer.Argument(
        metavar="HISTORY", help="Chat history: OpenAI messages JSON/JSONL, LoCoMo or LongMemEval.")],
    name: Annotated[str | None, typer.Option(help="Conversation name (default: the file's stem).")] = None,
    config: IngestConfig = IngestConfig(),
    memory: Annotated[bool, typer.Option(
        "--memory/--no-memory", help="indexmem: fold evicted entries into a latent memory stored with each episode "
        "and read while answering (IndexMem).")] = CacheConfig.memory,
    max_memory: Annotated[int | None, typer.Option(
        help="MiB this ingest may use (default: what the system has available); decides auto prefill and the "
        "pre-flight check.")] = None,
    offload: Annotated[Offload, typer.Option(
        help="icecache: keep what eviction drops on disk, in pages of similar keys, and answer with the pages "
        "that match the question beside the kept cache (IceCache); with --method full, everything but the "
        "system prompt and the last tokens is paged. none: drop it.")] = OffloadConfig.mode,
    retrieve: Annotated[int, typer.Option(
        help="--offload icecache: entries per layer and KV head read from the pages while answering (R).")] = (
        OffloadConfig.retrieve
    ),
    page_size: Annotated[int, typer.Option(help="--offload icecache: entries per page at most.")] = (
        PagingConfig.page_size
    ),
    offload_window: Annotated[int, typer.Option(
        help="--offload icecache: the last W history tokens stay resident in every layer and KV head whatever "
        "the method scores them, beside --budget (IceCache's window pages).")] = OffloadConfig.window,
    setting: Annotated[list[str] | None, typer.Option(metavar="KEY=VALUE", help="A saved setting without an "
        "option of its own, VALUE in JSON (rebuild commands carry them; keys as `kvchat list --json` shows).")] = None,
    replace: Annotated[bool, typer.Option(help="Replace a conversation of the same name.")] = False,
    append: Annotated[bool, typer.Option(
        help="Add the history's turns to conversation --name: every episode cache continues from where it "
        "stopped, with the settings it was built with (cache options are not taken); the past is not ingested "
        "again.")] = False,
    reingest: Annotated[bool, typer.Option(
        help="With --append: ingest the stored histories and this one again from the start, episodes clustered "
        "anew.")] = False,
    trust_remote_code: TrustOpt = False,
    force: ForceOpt = False,
    threads: ThreadsOpt = None,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    as_json: JsonOpt = False,
) -> None:
    """Split a history into episodes and store one compressed KV cache per episode."""
    from kvchat.history import load_history
    from kvchat.ingest import ingest as run_ingest
    from kvchat.ingest import validate
    from kvchat.settings import with_settings
    from kvchat.store import validate_name

    model = config.model
    offloading = OffloadConfig(mode=offload, retrieve=retrieve, window=offload_window,
                               paging=PagingConfig(page_size=page_size))
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, offload=offloading, memory=memory))
    config = with_settings(config, setting or [])
    if max_memory is not None and max_memory < 1:
        raise UserError(f"--max-memory must be >= 1 MiB (got {max_memory})")
    validate(config)
    if append and name is None:
        raise UserError("--append needs --name, the conversation to continue")
    if name is None:
        try:
            name = validate_name(history.stem)
        except UserError as exc:
            raise UserError(f"{exc}; name it with --name") from None
    else:
        name = validate_name(name)
    turns = load_history(history)  # a bad file fails here, before any model is loaded
    if append or reingest:
        _check_append(append, reingest, replace, config, model)
    store = _store()
    store.check_writable()
    spec = store.get(name).model if append else model
    lm = _model(spec, store, trust_remote_code, threads, DeviceConfig(device, dtype))
    encoder = _encoder()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        console=err, transient=True, disable=not err.is_terminal,
    ) as bars:
        progress = _RichIngestProgress(bars) if err.is_terminal else _LineIngestProgress()
        if append:
            from kvchat import append as appending

            run = appending.reingest if reingest else appending.append
            extra = {} if reingest else {"source": str(history.resolve())}
            report = run(history if reingest else turns, name=name, store=store, lm=lm, encoder=encoder,
                         progress=progress, force=force, **extra)  # fmt: skip
        else:
            report = run_ingest(
                turns, name=name, config=config, store=store, lm=lm, encoder=encoder, replace=replace,
                progress=progress, source=str(history.resolve()), force=force,
                max_memory=None if max_memory is None else max_memory * 2**20,
            )
    for note in report.notes:
        _say(f"kvchat: note: {note}", console=err)
    if as_json:
        _emit_json(documents.ingest(report))
    else:
        _say(
            "appended to " if append and not reingest else "ingested ", (report.name, "bold"),
            f": {report.turns} turns, {report.history_tokens} tokens -> "
            f"{report.episodes} episodes x budget {round(sum(report.budgets) / len(report.budgets))} "
            f"({report.method}, {report.prefill} prefill, "
            f"{report.layer_budgets} layer budgets, "
            f"{_head_budgets_text(report.head_budgets, report.head_entries)}, {report.positions} positions), "
            f"peak {report.peak_layer_entries} entries/layer ({report.peak_total_entries} in all layers), "
            f"{report.cache_bytes / 2**20:.1f} MiB{_offload_text(report)}, {report.seconds:.1f}s",
        )


def _offload_text(report) -> str:
    """What `--offload` added: entries paged and their disk use, per history token too."""
    if report.offload == "none":
        return ""
    per_token = report.pages_bytes / max(report.history_tokens, 1)
    return (f" + {report.pages_bytes / 2**20:.1f} MiB of pages ({report.offloaded_entries} offloaded entries, "
            f"{per_token / 1024:.1f} KiB per history token)")


def _check_append(append: bool, reingest: bool, replace: bool, config: IngestConfig, model: str) -> None:
    """--append takes the conversation's own settings: refuse options that would be silently ignored."""
    if reingest and not append:
        raise UserError("--reingest goes with --append (a plain ingest always starts from the start)")
    if replace:
        raise UserError("--append continues a conversation and --replace starts it over: give one of them")
    if config != IngestConfig(model=model):
        raise UserError("--append continues with the settings the conversation was built with; drop the cache "
                        "options (to change them, ingest the whole history again with --replace)")
    if model != IngestConfig.model:
        raise UserError("--append uses the model the conversation was built with; drop --model")


class _LineBatchProgress:
    """Where stderr is not a terminal: a line per history done (with the tally and an ETA) or retried."""

    def __init__(self) -> None:
        self.started: float | None = None  # when the first history went to a worker: the ETA leaves out loading
        self.total = 0
        self.done = 0

    def start(self, total: int, workers: int) -> None:
        self.total = total
        _say(f"kvchat: {total} histories on {workers} worker{'s' * (workers != 1)} (each loads the model once)",
             console=err)  # fmt: skip

    def running(self, name: str, attempt: int, worker) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def episode(self, name: str, done: int, total: int) -> None:
        pass

    def retrying(self, name: str, why: str) -> None:
        _say(f"kvchat: retrying {name} on another worker: {why}", console=err)

    def finished(self, result) -> None:
        self.done += 1
        elapsed = time.monotonic() - (self.started or time.monotonic())
        eta = elapsed / self.done * (self.total - self.done)
        _say(f"kvchat: [{self.done}/{self.total}] {result.status} {result.name}: {_batch_outcome(result)} "
             f"({elapsed:.0f} s elapsed, ETA {eta:.0f} s)", console=err)  # fmt: skip


class _RichBatchProgress:
    """On a TTY: a bar over all histories (done, failed, running, ETA) and one per running history."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.overall = progress.add_task("histories", total=None)
        self.running_tasks: dict[str, TaskID] = {}
        self.tally = {"committed": 0, "skipped": 0, "failed": 0}

    def start(self, total: int, workers: int) -> None:
        self.progress.update(self.overall, total=total, description=f"starting {workers} workers")

    def running(self, name: str, attempt: int, worker) -> None:
        label = f"  {clean(name)}" + (f" (try {attempt})" if attempt > 1 else "")
        self.running_tasks[name] = self.progress.add_task(label, total=None)
        self._describe()

    def episode(self, name: str, done: int, total: int) -> None:
        if name in self.running_tasks:
            self.progress.update(self.running_tasks[name], completed=done, total=total)

    def retrying(self, name: str, why: str) -> None:
        self._stop(name)
        _say(f"kvchat: retrying {name} on another worker: {why}", console=self.progress.console)

    def finished(self, result) -> None:
        self._stop(result.name)
        self.tally[result.status] += 1
        self.progress.advance(self.overall)
        self._describe()
        if result.status == "failed":
            _say(f"kvchat: failed {result.name}: {result.error}", console=self.progress.console)

    def _stop(self, name: str) -> None:
        task = self.running_tasks.pop(name, None)
        if task is not None:
            self.progress.remove_task(task)

    def _describe(self) -> None:
        t = self.tally
        done = f"{t['committed']} done" + (f", {t['skipped']} skipped" if t["skipped"] else "")
        self.progress.update(self.overall, description=f"{done}, {t['failed']} failed, "
                                                       f"{len(self.running_tasks)} running")  # fmt: skip


def _batch_outcome(result) -> str:
    """What became of one history, in a few words."""
    if result.status == "committed":
        report = result.report
        return f"{report.episodes} episodes, {report.cache_bytes / 2**20:.1f} MiB, {result.seconds:.1f} s"
    if result.status == "skipped":
        return "stored with the same settings"
    return result.error or "failed"


@app.command("ingest-batch")
@_cache_options
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
        "cluster needs: see the README).")] = BatchConfig.address,
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
    as_json: JsonOpt = False,
) -> None:
    """Ingest many histories on Ray workers (the optional extra 'batch'); a re-run skips what is already stored.

    Exit status 2 when any history failed (each is reported; the others go on).
    """
    from kvchat import batch as batching

    sources = batching.histories(files or [], manifest or [])
    store = _store()
    with Progress(
        TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal,
    ) as bars:
        progress = _RichBatchProgress(bars) if err.is_terminal else _LineBatchProgress()
        report = batching.ingest_batch(
            sources, store=store, config=config,
            batch=BatchConfig(workers=workers, threads=threads, address=address, device=DeviceConfig(device, dtype)),
            replace=replace, force=force, max_memory=None if max_memory is None else max_memory * 2**20,
            trust_remote_code=trust_remote_code, progress=progress,
        )
    notes = dict.fromkeys(n for h in report.histories if h.report is not None for n in h.report.notes)
    for note in notes:
        _say(f"kvchat: note: {note}", console=err)
    if as_json:
        _emit_json(documents.batch(report))
    else:
        _table(("conversation", "status", "episodes", "MiB", "seconds", "tries", "error"),
               [(h.name, h.status, h.report.episodes if h.report else "",
                 f"{h.report.cache_bytes / 2**20:.1f}" if h.report else "", f"{h.seconds:.1f}", h.attempts,
                 h.error or "") for h in report.histories],
               right=("episodes", "MiB", "seconds", "tries"))  # fmt: skip
        _say(f"{report.count('committed')} committed, {report.count('skipped')} skipped, {report.count('failed')} "
             f"failed in {report.seconds:.1f} s on {report.workers} worker{'s' * (report.workers != 1)} x "
             f"{report.threads} thread{'s' * (report.threads != 1)} "
             f"({report.histories_per_hour:.0f} histories/hour)")  # fmt: skip
    failed = report.count("failed")
    if failed:
        raise UserError(f"{failed} of {len(report.histories)} histories failed")


@app.command()
def ask(
    question: Annotated[str | None, typer.Argument(
        metavar="QUESTION",
        help="The question. Omit it to read one question per line from stdin, or on a terminal for a REPL.")] = None,
    conversation: Annotated[str | None, typer.Option(
        help="Conversation name (default: the latest).", autocompletion=_complete_conversation)] = None,
    episode: Annotated[int | None, typer.Option(help="Use this episode's cache instead of routing.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Longest answer in tokens.")] = AskConfig.max_new_tokens,
    retrieve: Annotated[int | None, typer.Option(
        help="Conversations ingested with --offload: entries per layer and KV head read from the pages (R; "
        "default: the conversation's).")] = None,
    threads: ThreadsOpt = None,
    weights: Annotated[Weights, typer.Option(
        help="float: the model's weights as loaded; int8: its Linear weights as int8 (per channel), ~1.3x faster "
        "answers on a CPU, first-token KL ~0.006 vs float (README, Decode speed).")] = AskConfig.weights,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    no_log: Annotated[bool, typer.Option("--no-log", help="Do not record this question in `kvchat logs`.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per question (JSON Lines).")] = False,
) -> None:
    """Answer a question from the nearest episode's cache (one-shot, stdin lines, or a REPL).

    Every question and answer is recorded in the store (`kvchat logs` shows them) unless --no-log."""
    if question is not None and not question.strip():
        raise UserError("the question is empty")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if question is None and (sys.stdin is None or sys.stdin.closed):
        raise UserError("no question: give one as an argument, or one per line on stdin")
    if retrieve is not None and retrieve < 0:
        raise UserError(f"--retrieve must be >= 0 (got {retrieve})")
    store = _store()
    if store.read_only and not no_log:
        _say(f"kvchat: note: {store.home} is read-only ({store.read_only_reason}); questions are not logged",
             console=err)
    asker = _Asker(store, conversation, AskConfig(max_new_tokens, retrieve=retrieve, weights=weights),
                   log=not no_log and not store.read_only, threads=threads, device=DeviceConfig(device, dtype))
    if question is not None:
        asker.answer(question, episode, as_json=as_json)
    elif sys.stdin.isatty() and out.is_terminal and not as_json:
        from kvchat.repl import Repl, prompt_reader

        if episode is not None:
            asker.check_episode(episode)
        name = asker.session.conversation.name
        _say((name, "bold"), f": {asker.episode_count()} episodes. /help for help; exit, quit or Ctrl-D ends.",
             console=err)
        history_file = None if store.read_only else store.home / "repl-history"
        repl = Repl(prompt_reader(history_file), asker, lambda m: _say(m, console=err))
        repl.episode = episode
        repl.run()
    else:
        for line in sys.stdin:
            if line.strip():
                asker.answer(line, episode, as_json=as_json)


class _Asker:
    """The session `ask` answers from, and how an answer reaches the terminal (the REPL's Actions)."""

    def __init__(self, store, conversation: str | None, config: AskConfig, *, log: bool, threads: int | None,
                 device: DeviceConfig = DeviceConfig()) -> None:
        from kvchat.ask import Session

        self.store, self.config, self.log = store, config, log
        record = store.get(conversation) if conversation else store.latest()
        self.threads, self.device = threads, device
        lm = _model(record.model, store, threads=threads, device=device, weights=config.weights)
        self.session = Session(store, record, lm, _encoder(), config)

    def episode_count(self) -> int:
        return len(self.session.conversation.episodes)

    def check_episode(self, episode: int) -> None:
        if not 0 <= episode < self.episode_count():
            raise UserError(f"--episode {episode} does not exist (conversation "
                            f"'{self.session.conversation.name}' has episodes 0..{self.episode_count() - 1})")

    def switch(self, name: str) -> int:
        from kvchat.ask import Session

        record = self.store.get(name)
        same = record.model == self.session.lm.spec
        lm = self.session.lm if same else _model(record.model, self.store, threads=self.threads, device=self.device,
                                                 weights=self.config.weights)
        self.session = Session(self.store, record, lm, self.session.encoder, self.config)
        return self.episode_count()

    def answer(self, question: str, episode: int | None, *, as_json: bool = False) -> None:
        """Stream the answer to stdout (cleaned of escape sequences); on a terminal, Ctrl-C stops it."""
        question = question.strip()
        if as_json:
            result = self.session.ask(question, episode=episode, log=self.log)
            _emit_json(documents.answer(question, result))
            return
        cleaner = StreamCleaner()

        def write(text: str) -> None:
            sys.stdout.write(cleaner.feed(text))
            sys.stdout.flush()

        with _ctrl_c_stops() as stopping:
            result = self.session.ask(question, episode=episode, on_text=write, log=self.log, stop=stopping)
        sys.stdout.write(cleaner.flush() + "\n")
        sys.stdout.flush()
        if result.finish_reason == "length":
            _say(f"[answer cut at --max-new-tokens {self.config.max_new_tokens}]", console=err)
        elif result.finish_reason == "stopped":
            _say("[stopped]", console=err)
        if sys.stdin is not None and sys.stdin.isatty() and err.is_terminal:
            reuse = ", resident" if result.reused_cache else ""
            err.print(Text(f"episode {result.episode} (similarity {result.similarity:.2f}{reuse})", style="dim"))


class _ctrl_c_stops:
    """While an answer streams on a terminal, a first Ctrl-C asks it to stop (the answer ends after the
    current token and the session stays); a second one interrupts at once."""

    def __enter__(self):
        self.requested = False
        self.previous = None
        if sys.stdin is not None and sys.stdin.isatty() and _main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return lambda: self.requested

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@app.command("profile-layers")
def profile_layers_command(
    model: Annotated[str, typer.Option(help="'default', a model dir or a .gguf file.")] = IngestConfig.model,
    text: Annotated[Path | None, typer.Option(help="Calibration text file (default: the shipped one).")] = None,
    budget: Annotated[int, typer.Option(help="Simulated cache budget M.")] = ProfileSettings.budget,
    block_size: Annotated[int, typer.Option(help="Simulated prefill block B.")] = ProfileSettings.block_size,
    sink: Annotated[int, typer.Option(help="Sink tokens always visible.")] = ProfileSettings.sink,
    out_file: Annotated[Path | None, typer.Option("--out", help="Profile JSON (default: in $KVCHAT_HOME).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Also draw sensitivity and budgets per layer to this PNG.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a model dir's own Python code.")] = False,
    threads: ThreadsOpt = None,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    as_json: JsonOpt = False,
) -> None:
    """Measure how much block prefill disturbs each layer; ingest then budgets layers by it."""
    from kvchat.profile import calibration_text, profile_layers, save_plot, shipped_profiles

    if text is not None and not text.is_file():
        raise UserError(f"{text}: no such file")
    calibration = text.read_text(errors="replace") if text else calibration_text()
    store = _store()
    lm = _model(model, store, trust_remote_code, threads, DeviceConfig(device, dtype))
    settings = ProfileSettings(budget=budget, block_size=block_size, sink=sink)
    profile = profile_layers(lm, calibration, settings, source=str(text) if text else "kvchat/data/calibration.txt")
    target = out_file or store.home / "profiles" / f"{profile.weights}.json"
    profile.save(target)
    if plot is not None:
        save_plot(profile, plot)
    overridden = [str(p) for p in shipped_profiles() if json.loads(p.read_text()).get("weights") == profile.weights
                  ] if target.parent == store.home / "profiles" else []
    if overridden:
        _say(f"kvchat: note: ingest now uses {target} for these weights instead of the shipped {overridden[0]}; "
             "delete it to go back", console=err)
    if as_json:
        _emit_json(documents.document(path=str(target), overrides=overridden[0] if overridden else None,
                                      **dataclasses.asdict(profile)))
        return
    _table(("layer", "key similarity", "sensitivity"),
           [(i, f"{sim:.5f}", f"{sens:.5f}")
            for i, (sim, sens) in enumerate(zip(profile.similarity, profile.sensitivity, strict=True))],
           right=("layer", "key similarity", "sensitivity"))
    _say(f"wrote {target}" + (f" and {plot}" if plot else ""), console=err)


class _RichTrainProgress:
    """Bars for `train-indexer`: the frozen model's pass over the chunks, then each stage's steps."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, int] = {}

    def prepare(self, done: int, total: int) -> None:
        self._update("chunks through the model", done, total)

    def step(self, stage: str, done: int, total: int, loss: float) -> None:
        self._update(f"{stage} (loss {loss:.4f})", done, total, key=stage)

    def _update(self, description: str, done: int, total: int, key: str | None = None) -> None:
        key = key or description
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(description, total=total)
        self.progress.update(self.tasks[key], completed=done, total=total, description=description)


class _LineTrainProgress:
    """Where stderr is not a terminal: a line when the data is ready and every 25 steps, so a log shows it is alive."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def prepare(self, done: int, total: int) -> None:
        if done == total:
            self._say(f"{total} chunks through the model")

    def step(self, stage: str, done: int, total: int, loss: float) -> None:
        if done % 25 == 0 or done == total:
            self._say(f"{stage} step {done}/{total}, loss {loss:.4f}")

    def _say(self, text: str) -> None:
        err.print(f"kvchat: {text} ({time.monotonic() - self.started:.1f} s elapsed)", markup=False, soft_wrap=True)


@app.command("train-indexer")
def train_indexer_command(
    model: Annotated[str, typer.Option(help="'default', a model dir or a .gguf file.")] = IngestConfig.model,
    data: Annotated[list[Path] | None, typer.Option(
        "--data", help="Training text: chat histories (any format ingest reads) or .txt files; repeat for more "
        "(default: chitchat-dataset, kvchat's synthetic conversations and the calibration text).")] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps per stage (one chunk each).")] = TrainConfig.steps,
    stage: Annotated[TrainStage, typer.Option(
        help="indexer, memory (on the indexer already at --out) or both.")] = TrainConfig.stage,
    chunks: Annotated[int, typer.Option(help="Training chunks.")] = TrainConfig.train_chunks,
    chunk_tokens: Annotated[int, typer.Option(help="Tokens per chunk.")] = TrainConfig.chunk_tokens,
    seed: Annotated[int, typer.Option(help="Data order, initial weights and held-out split.")] = TrainConfig.seed,
    memory_budgets: Annotated[str, typer.Option(
        help="Memory stage: the budgets its simulated block prefill evicts to, cycled over the chunks; each must "
        "exceed the system prompt's tokens.")] = ",".join(map(str, TrainConfig.memory_budgets)),
    memory_readout: Annotated[MemoryReadoutMode, typer.Option(
        help="Memory stage: how answering reads the memory: mass (its entries join attention's softmax as extra "
        "mass, weighed against the resident entries') or additive (the paper's o + g m(q)).")] = IndexMemConfig.readout,
    out_file: Annotated[Path | None, typer.Option(
        "--out", help="Weights file (default: in $KVCHAT_HOME/profiles/, used by ingest before the shipped ones).",
    )] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a model dir's own Python code.")] = False,
    threads: ThreadsOpt = None,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    as_json: JsonOpt = False,
) -> None:
    """Train IndexMem's indexer (and latent memory) for a model, by distillation from its own attention.

    Resumable: rerun the same command after an interruption. Deterministic for a seed."""
    from kvchat.training import default_out, train

    for path in data or []:
        if not path.is_file():
            raise UserError(f"{path}: no such file")
    config = TrainConfig(stage=stage, steps=steps, train_chunks=chunks, chunk_tokens=chunk_tokens, seed=seed,
                         memory_budgets=_int_list(memory_budgets, "--memory-budgets"))
    store = _store()
    lm = _model(model, store, trust_remote_code, threads, DeviceConfig(device, dtype))
    target = out_file or default_out(store.home, lm)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        console=err, transient=True, disable=not err.is_terminal or as_json,
    ) as bars:
        progress = _RichTrainProgress(bars) if err.is_terminal else _LineTrainProgress()
        report = train(lm, target, config, files=data or [], indexmem=IndexMemConfig(readout=memory_readout),
                       progress=progress)
    for note in report.notes:
        _say(f"kvchat: note: {note}", console=err)
    if as_json:
        fields = report.to_dict()
        seconds = fields.pop("seconds")
        _emit_json(documents.document(**fields, timings_ms={"total": round(seconds * 1000, 1)}))
        return
    indexer = report.metrics.get("indexer", {})
    memory = report.metrics.get("memory", {})
    _say(f"wrote {report.out} ({report.file_bytes / 2**10:.0f} KiB; {', '.join(report.stages)}; "
         f"{report.seconds:.0f} s)")
    if indexer:
        _say(f"held-out top-{indexer['fraction']:.0%} overlap with the model's attention: {indexer['top_overlap']:.3f} "
             f"(SnapKV-like {indexer['snapkv_like_top_overlap']:.3f}, random {indexer['random_top_overlap']:.3f})")
    if memory:
        parts = ", ".join(f"{v:.3f} at {k}" for k, v in memory["residual_removed"].items() if v is not None)
        _say(f"held-out share of the eviction residual the memory removes: {parts}")


class _RichEvalProgress:
    """A bar per conversation x variant, with the ingest's blocks and the questions under it."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.variants = progress.add_task("variants", total=None)
        self.questions = progress.add_task("questions", total=None)
        self.ingest = _RichIngestProgress(progress)

    def variant(self, qa_set: str, key: str, index: int, total: int) -> None:
        self.progress.update(self.variants, completed=index, total=total, description=f"{qa_set} {key}")
        self.progress.reset(self.questions)

    def question(self, done: int, total: int) -> None:
        self.progress.update(self.questions, completed=done, total=total)


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers (got {text!r})") from None
    if not values:
        raise UserError(f"{option} is empty")
    return values


@app.command("eval")
def eval_command(
    data: Annotated[list[Path] | None, typer.Argument(
        metavar="DATA", help="LoCoMo-format conversation files with QA.")] = None,
    methods: Annotated[str, typer.Option(help="Comma-separated methods; full KV always runs as the reference.")] = (
        ",".join(EvalConfig.methods)
    ),
    budgets: Annotated[str, typer.Option(help="Comma-separated budgets M.")] = ",".join(map(str, EvalConfig.budgets)),
    max_context: Annotated[int | None, typer.Option(
        help="Keep whole sessions from the start up to this many tokens (default: the model's window minus "
        "room for the answer) and only questions whose evidence is all inside.")] = EvalConfig.max_context,
    questions: Annotated[int | None, typer.Option(
        help="At most N questions per conversation, spread evenly over the file.")] = EvalConfig.questions,
    categories: Annotated[str, typer.Option(
        help="LoCoMo categories: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial.")] = (
        ",".join(map(str, EvalConfig.categories))
    ),
    synthetic: Annotated[int, typer.Option(help="Also run N planted-fact conversations (deterministic).")] = 0,
    model: Annotated[str, typer.Option(help="'default' (embedded SmolLM2-135M), a model dir or a .gguf file.")] = (
        IngestConfig.model
    ),
    block_size: Annotated[int, typer.Option(help="Tokens per prefill block (B).")] = CacheConfig.block_size,
    offload: Annotated[str, typer.Option(
        help="Comma-separated offload modes, each run with every method and budget: none, icecache (with "
        "icecache, full KV runs once more, paged past the system prompt and the last tokens).")] = "none",
    retrieve: Annotated[int, typer.Option(help="--offload icecache: entries per layer and KV head read (R).")] = (
        OffloadConfig.retrieve
    ),
    prefill: Annotated[Prefill, typer.Option(help="block, full or auto, as for ingest (recorded per variant).")] = (
        CacheConfig.prefill
    ),
    cache_precision: Annotated[str, typer.Option(
        help="Comma-separated cache precisions, each run with every method and budget: full, int8, int4 (as for "
        "ingest; quantized variants are named .../precision=int8 or .../precision=int4).")] = CacheConfig.precision,
    out_path: Annotated[Path | None, typer.Option("--out", help="Append per-question records here (JSON lines); "
                                                  "a re-run skips what the file already has.")] = None,
    report: Annotated[Path | None, typer.Option(help="Write a markdown report (and a PNG plot beside it).")] = None,
    per_conversation: Annotated[bool, typer.Option(
        help="One row per conversation and variant in the table and --json (the report stays pooled).")] = False,
    threads: ThreadsOpt = None,
    device: DeviceOpt = DeviceConfig.device,
    dtype: DtypeOpt = DeviceConfig.dtype,
    as_json: JsonOpt = False,
) -> None:
    """Measure answer quality of methods x budgets against full KV on LoCoMo files (F1, agreement, KL)."""
    from kvchat import evaluate
    from kvchat.config import METHODS
    from kvchat.ingest import validate
    from kvchat.qa import load_locomo

    if not data and synthetic < 1:
        raise UserError("give LoCoMo files to evaluate, or --synthetic N")
    method_list = tuple(m.strip() for m in methods.split(",") if m.strip())
    for m in method_list:
        if m not in METHODS:
            raise UserError(f"unknown method {m!r} in --methods (choose from {', '.join(METHODS)})")
    config = EvalConfig(
        methods=method_list, budgets=_int_list(budgets, "--budgets"), max_context=max_context,
        questions=questions, categories=_int_list(categories, "--categories"),
    )
    if questions is not None and questions < 1:
        raise UserError(f"--questions must be >= 1 (got {questions})")
    if max_context is not None and max_context < 64:
        raise UserError(f"--max-context must be >= 64 tokens (got {max_context})")
    base = IngestConfig(model=model, cache=CacheConfig(block_size=block_size, prefill=prefill))
    modes = tuple(m.strip() for m in offload.split(",") if m.strip())
    for mode in modes:
        if mode not in OFFLOAD_MODES:
            raise UserError(f"unknown mode {mode!r} in --offload (choose from {', '.join(OFFLOAD_MODES)})")
    precisions = tuple(p.strip() for p in cache_precision.split(",") if p.strip())
    for precision in precisions:
        if precision not in CACHE_PRECISIONS:
            raise UserError(f"unknown precision {precision!r} in --cache-precision (choose from "
                            f"{', '.join(CACHE_PRECISIONS)})")  # fmt: skip
    variant_list = [
        v for mode in modes or ("none",) for precision in precisions or ("full",)
        for v in evaluate.variants(config.methods, config.budgets, dataclasses.replace(
            base.cache, offload=OffloadConfig(mode=mode, retrieve=retrieve), precision=precision))
    ]  # fmt: skip
    for v in variant_list:
        validate(dataclasses.replace(base, cache=v.cache))
    for path in data or []:
        load_locomo(path)  # a bad file fails here, before any model is loaded
    results = evaluate.ResultsFile(out_path)
    store = _store()
    lm = _model(model, store, threads=threads, device=DeviceConfig(device, dtype))
    sets = evaluate.qa_sets(data or [], synthetic, lm, config)
    for s in sets:
        if s.sessions_total:
            _say(f"kvchat: {s.name}: {s.sessions_kept}/{s.sessions_total} sessions, "
                 f"{len(s.questions)} questions with all evidence inside", console=err)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        console=err, transient=True, disable=not err.is_terminal or as_json,
    ) as bars:
        records = evaluate.evaluate(
            sets, variant_list, lm=lm, encoder=_encoder(), config=config, base=base, results=results,
            profile_dirs=[store.home / "profiles"], progress=_RichEvalProgress(bars),
        )
    names = {s.name for s in sets}
    rows = evaluate.summarize([r for r in records if r["set"] in names])
    skips = [f"{key} on {name} skipped: {reason}" for (name, key), reason in evaluate.skipped(records).items()
             if name in names]
    for line in skips:
        _say(f"kvchat: {line}", console=err)
    if report is not None:
        from kvchat import report as eval_report

        report.parent.mkdir(parents=True, exist_ok=True)
        png = report.with_suffix(".png")
        eval_report.plot(rows, png, title=f"kvchat eval ({lm.spec}): {', '.join(sorted(names))}",
                         synthetic=not data)
        notes = [s.describe(config.questions) for s in sets] + skips
        report.write_text(eval_report.markdown(rows, title=f"kvchat eval ({lm.spec})", notes=notes, plot=png.name))
    columns = EVAL_COLUMNS
    if per_conversation:
        rows = evaluate.summarize_per_conversation([r for r in records if r["set"] in names])
        columns = [("conversation", "conversation", "{}"), *EVAL_COLUMNS]
    if as_json:
        _emit_json(documents.eval_rows(rows))
        return
    headers = [header for _, header, _ in columns]
    _table(headers, [[eval_cell(row, key, fmt) for key, _, fmt in columns] for row in rows],
           title=f"kvchat eval: {', '.join(sorted(names))}", right=headers[2 if per_conversation else 1:])


@app.command("list")
def list_conversations(as_json: JsonOpt = False) -> None:
    """List stored conversations."""
    records = _store().conversations()
    if as_json:
        _emit_json(documents.conversations(records))
        return
    rows = []
    for r in records:
        s = documents.conversation(r)
        rows.append((r.name, r.created_at[:19], r.model, s["method"], s["episode_count"], s["turns"],
                     f"{s['cache_bytes'] / 2**20:.1f}"))
    _table(("name", "created", "model", "method", "episodes", "turns", "MiB"), rows,
           right=("episodes", "turns", "MiB"))


NameArg = Annotated[str, typer.Argument(help="Conversation name.", autocompletion=_complete_conversation)]


@app.command()
def show(name: NameArg, as_json: JsonOpt = False) -> None:
    """Show a conversation's episodes: sizes, budgets and medoid excerpts."""
    record = _store().get(name)
    if as_json:
        _emit_json(documents.show(record))
        return
    s = record.settings
    strategy = s.get("layer_budgets", "uniform")
    if strategy == "cake":
        strategy += f" tau1={s.get('tau1')} tau2={s.get('tau2')}"
    heads = _head_budgets_text(s.get("head_budgets", "uniform"), record.stats.get("head_entries", []))
    _say(
        (record.name, "bold"),
        f" ({record.model}, {s['method']}, budget {s['budget']}, block {s['block_size']}, "
        f"{strategy} layer budgets, {heads}, {s['positions']} positions, {s.get('cache_precision', 'full')} "
        f"precision) ingested {record.created_at[:19]}",
    )
    rows = [(e.index, f"{e.bytes / 2**20:.1f}", _compress_budgets(e.budgets),
             " ".join(e.medoid_text.split())[:90] if out.is_terminal else e.medoid_text)
            for e in record.episodes]
    _table(("episode", "MiB", "budgets per layer", "medoid excerpt"), rows, right=("episode", "MiB"))


@app.command()
def rm(name: NameArg, as_json: JsonOpt = False) -> None:
    """Remove a conversation and its caches."""
    _store().remove(name)
    if as_json:
        _emit_json(documents.document(removed=name))
    else:
        _say(f"removed {name}")


@app.command()
def logs(
    count: Annotated[int, typer.Option("-n", "--count", help="How many, newest first.")] = 20,
    conversation: Annotated[str | None, typer.Option(
        help="Only this conversation's.", autocompletion=_complete_conversation)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show recorded questions and answers (`kvchat ask --no-log` records nothing)."""
    if count < 1:
        raise UserError(f"-n must be >= 1 (got {count})")
    store = _store()
    if conversation is not None:
        store.get(conversation)  # an unknown name is a mistake, not an empty log
    rows = store.asks(limit=count, conversation=conversation)
    if as_json:
        _emit_json(documents.asks(rows))
        return
    _table(("time", "conversation", "episode", "question", "answer"),
           [(r["created_at"][:19], r["conversation"], r["episode"], r["question"], r["answer"]) for r in rows],
           right=("episode",))


@app.command()
def doctor(
    fix: Annotated[bool, typer.Option("--fix", help=(
        "Rebuild a damaged database (moved aside, kept), remove damaged conversations, delete leftovers."))] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check the store: a damaged database, missing or damaged cache files, leftovers of crashed ingests
    and model conversions. Reads only (no lock) unless --fix.

    Exit status: 0 when the store is healthy (with --fix: once repaired), 1 when problems remain.
    """
    from kvchat.store import diagnose, repair

    home = default_home()
    found = diagnose(home)
    fixed = repair(home, found) if fix and found else []
    remaining = diagnose(home) if fix and found else found
    if as_json:
        _emit_json(documents.document(healthy=not remaining, problems=[p.to_dict() for p in found], fixed=fixed))
    else:
        for problem in found:
            _say(f"problem: {problem.message}")
        for line in fixed:
            _say(f"fixed: {line}")
        if not remaining:
            _say("healthy" if not found else "healthy now")
        elif not fix:
            _say(f"{len(remaining)} problem(s); `kvchat doctor --fix` repairs them")
        else:
            _say(f"{len(remaining)} problem(s) remain")
    if remaining:
        raise typer.Exit(1)


def _head_budgets_text(mode: str, entries: list[int]) -> str:
    """'uniform head budgets', or 'adaptive head budgets (12-301 entries per head)'."""
    if mode == "adaptive" and len(entries) == 2:
        return f"{mode} head budgets ({entries[0]}-{entries[1]} entries per head)"
    return f"{mode} head budgets"


def _compress_budgets(budgets: list[int]) -> str:
    """'1024 x30' when uniform, else the list."""
    if len(set(budgets)) == 1:
        return f"{budgets[0]} x{len(budgets)}"
    return " ".join(map(str, budgets))


def main() -> None:
    """Entry point: usage errors and user mistakes exit 2 with one line (usage errors with click's usage
    line); internal failures exit 1 and point to --debug; a closed pipe ends quietly, as in git."""
    if hasattr(signal, "SIGPIPE"):  # `kvchat ask ... | head -c1`: die of SIGPIPE like any Unix filter
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for name in ("SIGTERM", "SIGHUP"):  # unwind, so an ingest or a model conversion removes its temp dir
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _terminate)
    run()


class _Terminated(SystemExit):
    """SIGTERM or SIGHUP: leave through every `finally` and context manager, then exit 128 + signal."""


def _terminate(signum: int, frame) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise _Terminated(128 + signum)


def run(argv: Sequence[str] | None = None) -> None:
    """main() without the process-wide signal setup (tests call this in-process)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    _quiet_libraries()
    with _debug_log(debug):
        _run(args, debug)


@contextlib.contextmanager
def _debug_log(enabled: bool):
    """With --debug, the `kvchat` loggers' debug records go to stderr as `kvchat: debug: ...` lines."""
    if not enabled:
        yield
        return
    logger = logging.getLogger("kvchat")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kvchat: debug: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args: list[str], debug: bool) -> None:
    try:
        status = app(args=args, prog_name="kvchat", standalone_mode=False)  # returns typer.Exit's code
    except _Terminated as exc:
        err.print("kvchat: terminated", markup=False)
        sys.exit(exc.code)
    except UserError as exc:
        _say(f"kvchat: error: {exc}", console=err)
        sys.exit(2)
    except typer.TyperException as exc:  # click's (vendored in typer) usage errors: exit 2, usage line
        if getattr(exc, "ctx", False) is None:  # raised by the parser before it had a context
            exc.ctx = _usage_context(args)
        exc.show()
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        status = 130
    except Exception as exc:  # an internal failure: say so, traceback only on request
        if debug:
            raise
        _say(f"kvchat: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
             console=err)
        sys.exit(1)
    if status == 130:  # typer turns Ctrl-C into Exit(130)
        err.print("kvchat: interrupted", markup=False)
    if isinstance(status, int) and status:
        sys.exit(status)


def _usage_context(args: Sequence[str]):
    """A context for the command `args` name (or the root), so a usage error shows that command's usage."""
    root = typer.main.get_command(app)
    context = root.make_context("kvchat", [], resilient_parsing=True)
    name = next((a for a in args if not a.startswith("-")), None)
    command = root.get_command(context, name) if name else None
    if command is None:
        return context
    return command.make_context(name, [], parent=context, resilient_parsing=True)


def _quiet_libraries() -> None:
    """transformers' load-time progress bars and advice belong in logs, not in a CLI's output."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws its own bar
