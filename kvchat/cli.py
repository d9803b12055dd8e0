"""kvchat's command line: parses options, calls the library, renders with rich. No logic lives here."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvchat.config import (
    AskConfig,
    CacheConfig,
    CakeConfig,
    EpisodeConfig,
    EvalConfig,
    IngestConfig,
    ProfileSettings,
    default_home,
)
from kvchat.errors import UserError
from kvchat.kv.methods import REGISTRY
from kvchat.report import COLUMNS as EVAL_COLUMNS
from kvchat.report import cell as eval_cell

app = typer.Typer(
    help="Answer questions about chat histories far longer than your KV-cache budget.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (for scripts).")]
ThreadsOpt = Annotated[int | None, typer.Option(
    help="Torch threads (default: $OMP_NUM_THREADS, else the cores this process may use). Running several "
    "kvchat processes? Give each cores / processes.")]
_METHOD_HELP = "; ".join(f"{m.name}: {m.summary}" for m in REGISTRY.values()) + "."


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of internal errors.")] = False,
) -> None:
    """kvchat keeps one compressed KV cache per topical episode of a conversation, on disk
    ($KVCHAT_HOME, default: the platform's user data dir), and answers from the nearest one."""


def _store():
    from kvchat.store import Store

    return Store(default_home())


def _model(spec: str, store, trust_remote_code: bool = False, threads: int | None = None):
    from kvchat.llm import load_model, use_threads

    use_threads(threads)
    return load_model(spec, store.home / "models", trust_remote_code=trust_remote_code)


def _encoder():
    from kvchat.encoder import SentenceEncoder

    return SentenceEncoder()


def _emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


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


@app.command()
def ingest(
    history: Annotated[Path, typer.Argument(help="Chat history: OpenAI messages JSON/JSONL, LoCoMo or LongMemEval.")],
    name: Annotated[str | None, typer.Option(help="Conversation name (default: the file's stem).")] = None,
    model: Annotated[str, typer.Option(help="'default' (embedded SmolLM2-135M), a model dir or a .gguf file.")] = (
        IngestConfig.model
    ),
    budget: Annotated[int, typer.Option(help="Kept KV entries per layer and head (M).")] = CacheConfig.budget,
    block_size: Annotated[int, typer.Option(help="Tokens per prefill block (B).")] = CacheConfig.block_size,
    episodes: Annotated[int, typer.Option(help="Number of topical episodes (E).")] = EpisodeConfig.episodes,
    window: Annotated[int, typer.Option(help="Turns per segment for clustering (w).")] = EpisodeConfig.window,
    method: Annotated[str, typer.Option(help="Eviction method: " + _METHOD_HELP)] = CacheConfig.method,
    positions: Annotated[str, typer.Option(help="original, compact (re-rotate kept keys) or auto.")] = (
        CacheConfig.positions
    ),
    layer_budgets: Annotated[str, typer.Option(
        help="Per-layer budgets: auto (sensitivity if the model has a profile, else uniform), uniform, "
        "sensitivity (kvchat profile-layers), pyramid (PyramidKV) or cake (CAKE: from each block's "
        "attention; with --method cake, layers are evicted one by one in the forward).")] = CacheConfig.layer_budgets,
    alpha: Annotated[float | None, typer.Option(
        help="Sharpness of sensitivity budgets (default: the profile's, 1.2).")] = CacheConfig.alpha,
    tau1: Annotated[float, typer.Option(
        help="cake budgets: temperature of attention dispersion (smaller = weighs it more).")] = CakeConfig.tau1,
    tau2: Annotated[float, typer.Option(
        help="cake budgets: temperature of attention shift (smaller = weighs it more).")] = CakeConfig.tau2,
    head_budgets: Annotated[str, typer.Option(
        help="Per-head budgets within a layer: uniform (every KV head keeps M_l entries) or adaptive (AdaKV: "
        "the layer's top M_l x KV-heads entries across heads, each head keeping at least a fifth of M_l; "
        "files and memory hold only kept entries). adaptive needs epicache, snapkv, infinipot or kvzip.")] = (
        CacheConfig.head_budgets
    ),
    prefill: Annotated[str, typer.Option(
        help="block (evict after every block: peak memory flat in the history's length), full (keep the whole "
        "history once, then each episode keeps its top entries: one prefill instead of one per episode) or auto "
        "(full when the history fits the model's window and its full KV fits memory).")] = CacheConfig.prefill,
    max_memory: Annotated[int | None, typer.Option(
        help="MiB this ingest may use (default: what the system has available); decides auto prefill and the "
        "pre-flight check.")] = None,
    replace: Annotated[bool, typer.Option(help="Replace a conversation of the same name.")] = False,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow a model dir's own Python code.")] = False,
    force: Annotated[bool, typer.Option(help="Run even when the memory estimate exceeds the available memory.")] = (
        False
    ),
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Split a history into episodes and store one compressed KV cache per episode."""
    from kvchat.history import load_history
    from kvchat.ingest import ingest as run_ingest
    from kvchat.ingest import validate
    from kvchat.store import validate_name

    config = IngestConfig(
        model=model,
        episodes=EpisodeConfig(episodes=episodes, window=window),
        cache=CacheConfig(method=method, budget=budget, block_size=block_size, positions=positions,
                          layer_budgets=layer_budgets, alpha=alpha, cake=CakeConfig(tau1=tau1, tau2=tau2),
                          head_budgets=head_budgets, prefill=prefill),
    )
    if max_memory is not None and max_memory < 1:
        raise UserError(f"--max-memory must be >= 1 MiB (got {max_memory})")
    validate(config)
    name = validate_name(name or history.stem)
    turns = load_history(history)  # a bad file fails here, before any model is loaded
    store = _store()
    lm = _model(model, store, trust_remote_code, threads)
    encoder = _encoder()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True, disable=not err.is_terminal or as_json,
    ) as bars:
        report = run_ingest(
            turns, name=name, config=config, store=store, lm=lm, encoder=encoder,
            replace=replace, progress=_RichIngestProgress(bars), source=str(history.resolve()), force=force,
            max_memory=None if max_memory is None else max_memory * 2**20,
        )
    for note in report.notes:
        err.print(f"kvchat: note: {note}", markup=False, soft_wrap=True)
    if as_json:
        _emit_json(report.to_dict())
    else:
        out.print(
            f"ingested [bold]{report.name}[/]: {report.turns} turns, {report.history_tokens} tokens -> "
            f"{report.episodes} episodes x budget {budget} ({report.method}, {report.prefill} prefill, "
            f"{report.layer_budgets} layer budgets, "
            f"{_head_budgets_text(report.head_budgets, report.head_entries)}, {report.positions} positions), "
            f"peak {report.peak_layer_entries} entries/layer ({report.peak_total_entries} in all layers), "
            f"{report.cache_bytes / 2**20:.1f} MiB, "
            f"{report.seconds:.1f}s"
        )


@app.command()
def ask(
    question: Annotated[str | None, typer.Argument(help="The question. Omit it to read stdin or start a REPL.")] = None,
    conversation: Annotated[str | None, typer.Option(help="Conversation name (default: the latest).")] = None,
    episode: Annotated[int | None, typer.Option(help="Use this episode's cache instead of routing.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Longest answer in tokens.")] = AskConfig.max_new_tokens,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Answer a question from the nearest episode's cache (one-shot, stdin lines, or a REPL)."""
    from kvchat.ask import Session

    if question is not None and not question.strip():
        raise UserError("the question is empty")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    store = _store()
    record = store.get(conversation) if conversation else store.latest()
    lm = _model(record.model, store, threads=threads)
    session = Session(store, record, lm, _encoder(), AskConfig(max_new_tokens))

    def answer(q: str, show_episode: bool = False) -> None:
        if as_json:
            _emit_json(session.ask(q, episode=episode).to_dict())
            return
        if show_episode:
            result = session.ask(q, episode=episode, on_text=lambda t: None)
            reuse = ", resident" if result.reused_cache else ""
            err.print(f"[dim]episode {result.episode} (similarity {result.similarity:.2f}{reuse})[/]")
            out.print(result.text)
            return
        session.ask(q, episode=episode, on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        sys.stdout.write("\n")

    if question is not None:
        answer(question)
    elif not sys.stdin.isatty():
        for line in sys.stdin:
            if line.strip():
                answer(line)
    else:
        err.print(f"[bold]{record.name}[/]: {len(record.episodes)} episodes. Ask away; exit, quit or Ctrl-D ends.")
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if line.strip() in {"exit", "quit"}:
                break
            if line.strip():
                answer(line, show_episode=True)


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
    as_json: JsonOpt = False,
) -> None:
    """Measure how much block prefill disturbs each layer; ingest then budgets layers by it."""
    from kvchat.profile import calibration_text, profile_layers, save_plot

    if text is not None and not text.is_file():
        raise UserError(f"{text}: no such file")
    calibration = text.read_text(errors="replace") if text else calibration_text()
    store = _store()
    lm = _model(model, store, trust_remote_code, threads)
    settings = ProfileSettings(budget=budget, block_size=block_size, sink=sink)
    profile = profile_layers(lm, calibration, settings, source=str(text) if text else "kvchat/data/calibration.txt")
    target = out_file or store.home / "profiles" / f"{profile.weights}.json"
    profile.save(target)
    if plot is not None:
        save_plot(profile, plot)
    if as_json:
        _emit_json({"path": str(target), **dataclasses.asdict(profile)})
        return
    table = Table("layer", "key similarity", "sensitivity")
    for i, (sim, sens) in enumerate(zip(profile.similarity, profile.sensitivity, strict=True)):
        table.add_row(str(i), f"{sim:.5f}", f"{sens:.5f}")
    out.print(table)
    out.print(f"wrote {target}" + (f" and {plot}" if plot else ""))


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
    data: Annotated[list[Path] | None, typer.Argument(help="LoCoMo-format conversation files with QA.")] = None,
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
    prefill: Annotated[str, typer.Option(help="block, full or auto, as for ingest (recorded per variant).")] = (
        CacheConfig.prefill
    ),
    out_path: Annotated[Path | None, typer.Option("--out", help="Append per-question records here (JSON lines); "
                                                  "a re-run skips what the file already has.")] = None,
    report: Annotated[Path | None, typer.Option(help="Write a markdown report (and a PNG plot beside it).")] = None,
    threads: ThreadsOpt = None,
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
    variant_list = evaluate.variants(config.methods, config.budgets, base.cache)
    for v in variant_list:
        validate(dataclasses.replace(base, cache=v.cache))
    for path in data or []:
        load_locomo(path)  # a bad file fails here, before any model is loaded
    results = evaluate.ResultsFile(out_path)
    store = _store()
    lm = _model(model, store, threads=threads)
    sets = evaluate.qa_sets(data or [], synthetic, lm, config)
    for s in sets:
        if s.sessions_total:
            err.print(f"kvchat: {s.name}: {s.sessions_kept}/{s.sessions_total} sessions, "
                      f"{len(s.questions)} questions with all evidence inside", markup=False)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
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
        err.print(f"kvchat: {line}", markup=False)
    if report is not None:
        from kvchat import report as eval_report

        report.parent.mkdir(parents=True, exist_ok=True)
        png = report.with_suffix(".png")
        eval_report.plot(rows, png)
        notes = [s.describe(config.questions) for s in sets] + skips
        report.write_text(eval_report.markdown(rows, title=f"kvchat eval ({lm.spec})", notes=notes, plot=png.name))
    if as_json:
        _emit_json(rows)
        return
    table = Table(title=f"kvchat eval: {', '.join(sorted(names))}")
    for _, header, _ in EVAL_COLUMNS:
        table.add_column(header, justify="left" if header == "variant" else "right")
    for row in rows:
        table.add_row(*(eval_cell(row, key, fmt) for key, _, fmt in EVAL_COLUMNS))
    out.print(table)


@app.command("list")
def list_conversations(as_json: JsonOpt = False) -> None:
    """List stored conversations."""
    records = _store().conversations()
    if as_json:
        _emit_json([_summary(r) for r in records])
        return
    table = Table("name", "created", "model", "method", "episodes", "turns", "MiB")
    for r in records:
        s = _summary(r)
        table.add_row(r.name, r.created_at[:19], r.model, s["method"], str(s["episodes"]),
                      str(s["turns"]), f"{s['bytes'] / 2**20:.1f}")
    out.print(table)


@app.command()
def show(name: str, as_json: JsonOpt = False) -> None:
    """Show a conversation's episodes: sizes, budgets and medoid excerpts."""
    record = _store().get(name)
    if as_json:
        _emit_json(
            _summary(record)
            | {"settings": record.settings, "stats": record.stats,
               "episodes": [
                   {"index": e.index, "budgets": e.budgets, "bytes": e.bytes, "entries": e.n_tokens,
                    "medoid_text": e.medoid_text}
                   for e in record.episodes
               ]}
        )
        return
    s = record.settings
    strategy = s.get("layer_budgets", "uniform")
    if strategy == "cake":
        strategy += f" tau1={s.get('tau1')} tau2={s.get('tau2')}"
    heads = _head_budgets_text(s.get("head_budgets", "uniform"), record.stats.get("head_entries", []))
    out.print(
        f"[bold]{record.name}[/] ({record.model}, {s['method']}, budget {s['budget']}, block {s['block_size']}, "
        f"{strategy} layer budgets, {heads}, {s['positions']} positions) ingested {record.created_at[:19]}"
    )
    table = Table("episode", "MiB", "budgets per layer", "medoid excerpt")
    for e in record.episodes:
        budgets = _compress_budgets(e.budgets)
        excerpt = " ".join(e.medoid_text.split())[:90]
        table.add_row(str(e.index), f"{e.bytes / 2**20:.1f}", budgets, excerpt)
    out.print(table)


@app.command()
def rm(name: str, as_json: JsonOpt = False) -> None:
    """Remove a conversation and its caches."""
    _store().remove(name)
    if as_json:
        _emit_json({"removed": name})
    else:
        out.print(f"removed {name}")


@app.command()
def doctor(
    fix: Annotated[bool, typer.Option("--fix", help="Remove damaged conversations and delete leftovers.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check the store: missing or damaged cache files, leftovers of crashed ingests.

    Exit status: 0 when the store is healthy (with --fix: once repaired), 1 when problems remain.
    """
    from kvchat.store import Store

    store = Store(default_home(), clean_stale=False)  # leave crash leftovers in place to report them
    found = store.check()
    fixed = store.fix(found) if fix and found else []
    remaining = store.check() if fix and found else found
    if as_json:
        _emit_json({"healthy": not remaining, "problems": [p.to_dict() for p in found], "fixed": fixed})
    else:
        for problem in found:
            out.print(f"problem: {problem.message}", markup=False, soft_wrap=True)
        for line in fixed:
            out.print(f"fixed: {line}", markup=False, soft_wrap=True)
        if not remaining:
            out.print("healthy" if not found else "healthy now")
        elif not fix:
            out.print(f"{len(remaining)} problem(s); `kvchat doctor --fix` repairs them", markup=False)
        else:
            out.print(f"{len(remaining)} problem(s) remain", markup=False)
    if remaining:
        raise typer.Exit(1)


def _summary(record) -> dict:
    return {
        "name": record.name,
        "created_at": record.created_at,
        "model": record.model,
        "method": record.settings.get("method"),
        "episodes": len(record.episodes),
        "turns": record.stats.get("turns"),
        "bytes": sum(e.bytes for e in record.episodes),
    }


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
    """Entry point: user mistakes exit 2 with one line; internal failures exit 1 and point to --debug."""
    debug = "--debug" in sys.argv[1:]
    _quiet_libraries()
    try:
        status = app(standalone_mode=False)  # without standalone mode, click returns typer.Exit's code
        if isinstance(status, int) and status:
            sys.exit(status)
    except UserError as exc:
        err.print(f"kvchat: error: {exc}", markup=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err.print("kvchat: interrupted")
        sys.exit(130)
    except Exception as exc:  # an internal failure: say so, traceback only on request
        if debug:
            raise
        err.print(f"kvchat: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
                  markup=False, soft_wrap=True)
        sys.exit(1)


def _quiet_libraries() -> None:
    """transformers' load-time progress bars and advice belong in logs, not in a CLI's output."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws its own bar
