"""The store's commands: `list`, `use`, `show`, `rm`, `path`, `logs`, `doctor`."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kvchat import documents
from kvchat.cli.options import JsonOpt, NameArg, complete_conversation, open_store
from kvchat.cli.render import beside_table, counted, emit_json, err, head_budgets_text, out, say, table
from kvchat.cli.terminal import clean
from kvchat.cli.words import spell
from kvchat.config import default_home
from kvchat.errors import UserError
from kvchat.history.loading import cut_at_word


def list_conversations(as_json: JsonOpt = False) -> None:
    """List stored conversations, newest first, with their size on disk (every file of each); the default one (what
    `ask` answers from) is marked *."""
    store = open_store()
    records = store.conversations()
    default = store.default_name()
    if as_json:
        emit_json(documents.conversations(records, default))
        return
    if not records:
        say("kvchat: no conversations yet; `kvchat ingest HISTORY` stores one (docs/formats.md: the files it reads)",
            console=err)
        if out.is_terminal:
            return
    rows = []
    for r in records:
        s = documents.conversation(r)
        rows.append((r.name, r.created_at[:19], r.model, s["method"], s["episode_count"], s["turns"],
                     f"{s['disk_bytes'] / 2**20:.1f}", "*" if r.name == default else ""))
    table(("name", "created", "model", "method", "episodes", "turns", "MiB", "default"), rows,
          right=("episodes", "turns", "MiB"))


def use(name: Annotated[str | None, typer.Argument(
        metavar="[NAME]", help="The conversation `ask` answers from when --conversation is not given.",
        autocompletion=complete_conversation)] = None, as_json: JsonOpt = False) -> None:
    """Choose the default conversation; without NAME, show it (the latest ingested until one is chosen)."""
    store = open_store()
    record = store.use(name) if name is not None else store.default()
    chosen = name is not None or store.chosen() is not None
    if as_json:
        emit_json(documents.document(conversation=record.name, chosen=chosen))
        return
    sys.stdout.write(clean(record.name, one_line=True) + "\n")
    if not chosen:
        say("kvchat: note: the latest ingested; `kvchat use NAME` chooses the default", console=err)


def show(name: NameArg, verbose: Annotated[bool, typer.Option(
        "--verbose", help="Every setting, and each episode's budget per layer.")] = False,
        as_json: JsonOpt = False) -> None:
    """Show a conversation: its size, method and budget, then its episodes' topics, sizes and excerpts.

    Piped, stdout holds the episodes' table alone (tab-separated); the lines above it go to stderr."""
    store = open_store()
    record = store.get(name)
    if as_json:
        emit_json(documents.show(record))
        return
    shown = documents.show(record)
    above = beside_table()
    default = " (the default conversation)" if store.default_name() == record.name else ""
    say((record.name, "bold"), default, console=above)
    for line in _summary(shown, verbose):
        say(f"  {line}", console=above)
    headers = ["episode", "topic", "segments", "entries", "MiB", "medoid excerpt"]
    rows = []
    for e in shown["episodes"]:
        text = _excerpt(e["medoid_text"]) if out.is_terminal else e["medoid_text"]  # piped: whole
        row = [e["index"], e["topic"] or "-", "" if e["segments"] is None else e["segments"], e["entries"],
               f"{e['cache_bytes'] / 2**20:.1f}", text]
        rows.append([*row[:5], _compress_budgets(e["budgets"]), row[5]] if verbose else row)
    if verbose:
        headers.insert(5, "budgets per layer")
    table(headers, rows, right=("episode", "segments", "entries", "MiB"))


def _excerpt(text: str, limit: int = 90) -> str:
    """The start of a medoid text as shown, on one line, cut at a word boundary (its length is what shows)."""
    return cut_at_word(clean(" ".join(text.split()), one_line=True), limit)


def _recalled_text(shown: dict) -> str:
    """--method recall: how the budget is shared between the caches and each question's recalled chunks (stores
    ingested before kvchat reported it say nothing)."""
    recalled = shown.get("recalled_entries")
    if not recalled:
        return ""
    return f" ({shown['settings']['budget'] - recalled} cached + {recalled} recalled per question)"


def _summary(shown: dict, verbose: bool) -> list[str]:
    """The lines above `show`'s table: sizes, then method and budget (and with `verbose` every setting)."""
    s = shown["settings"]
    tokens = f", {shown['history_tokens']:,} tokens" if shown.get("history_tokens") is not None else ""
    entries = sum(e["entries"] for e in shown["episodes"])
    beside = "".join(f" + {shown[key] / 2**20:.1f} MiB of {what}" for key, what in
                     (("pages_bytes", "pages"), ("recall_entries_bytes", "recall entries")) if shown[key])  # fmt: skip
    lines = [
        f"{shown['turns']} turns{tokens} in {counted(shown['episode_count'], 'episode')} "
        f"(segments of {s.get('segment_turns')} turns): "
        f"{entries:,} entries kept, {shown['cache_bytes'] / 2**20:.1f} MiB{beside}",
        f"{s['method']}, budget {s['budget']} per layer and KV head{_recalled_text(shown)}, "
        f"{s.get('cache_precision', 'full')} precision"
        f"{', offload ' + s['offload'] if s.get('offload', 'none') != 'none' else ''}; model {shown['model']}, "
        f"ingested {shown['created_at'][:19]}",
    ]
    if verbose:
        strategy = s.get("layer_budgets", "uniform")
        if strategy == "cake":
            strategy += f" tau1={s.get('tau1')} tau2={s.get('tau2')}"
        heads = head_budgets_text(s.get("head_budgets", "uniform"), shown.get("head_entries") or [])
        lines.append(f"block {s['block_size']}, {strategy} layer budgets, {heads}, "
                     f"{s['positions']} positions, {s.get('prefill', 'block')} prefill")
        if shown.get("timings_ms"):
            lines.append(f"ingested in {shown['timings_ms']['total'] / 1000:.1f} s on {shown.get('device', '?')} "
                         f"({shown.get('dtype', '?')}), peak {shown.get('peak_layer_entries', '?')} entries per layer")
    return lines


def rm(names: Annotated[list[str], typer.Argument(metavar="NAME...", help="Conversation names.",
                                                   autocompletion=complete_conversation)],
       as_json: JsonOpt = False) -> None:
    """Remove conversations and their caches, in the order given (an unknown name stops there, exit 2)."""
    store = open_store(frees_space=True)
    for name in dict.fromkeys(names):
        store.remove(name)
        if as_json:
            emit_json(documents.document(removed=name))
        else:
            say(f"removed {name}")


def path(as_json: JsonOpt = False) -> None:
    """Show where kvchat keeps its store ($KVCHAT_HOME) and converted models."""
    store = open_store()
    places = {"home": str(store.home), "models": str(store.models_dir)}
    if as_json:
        emit_json(documents.document(**places))
    else:
        sys.stdout.write("".join(f"{what}\t{clean(where, one_line=True)}\n" for what, where in places.items()))


def logs(
    count: Annotated[int, typer.Option("-n", "--count", help="How many, newest first.")] = 20,
    conversation: Annotated[str | None, typer.Option(
        help="Only this conversation's.", autocompletion=complete_conversation)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show recorded questions and answers (`kvchat ask --no-log` records nothing)."""
    if count < 1:
        raise UserError(f"-n must be >= 1 (got {count})")
    store = open_store()
    if conversation is not None:
        store.get(conversation)  # an unknown name is a mistake, not an empty log
    rows = store.asks(limit=count, conversation=conversation)
    if as_json:
        emit_json(documents.asks(rows))
        return
    if not rows:
        say(f"kvchat: {_no_questions(store, conversation)}", console=err)
        if out.is_terminal:
            return
    table(("time", "conversation", "episode", "question", "answer"),
          [(r["created_at"][:19], r["conversation"], r["episode"], r["question"], r["answer"]) for r in rows],
          right=("episode",))


def _no_questions(store, conversation: str | None) -> str:
    """What an empty log says: which command fills it."""
    if conversation is not None:
        return (f"no questions asked of {conversation} yet (or all with --no-log); "
                f"`kvchat ask --conversation {conversation} QUESTION` asks one")
    if not store.conversations():
        return ("no questions asked yet, and no conversations: `kvchat ingest HISTORY` stores one, then "
                "`kvchat ask QUESTION`")
    return "no questions asked yet (or all with --no-log); `kvchat ask QUESTION` asks one"


def doctor(
    fix: Annotated[bool, typer.Option("--fix", help=(
        "Rebuild a damaged database (moved aside, kept), remove damaged conversations, delete leftovers."))] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check the store: a damaged database, missing or damaged cache files, leftovers of crashed ingests
    and model conversions. Reads only (no lock) unless --fix.

    Exit status: 0 when the store is healthy (with --fix: once repaired), 1 when problems remain.
    """
    from kvchat.model.encoder import embedding_dimension
    from kvchat.serve.announcement import ANNOUNCEMENT, remove_stale_announcement, stale_announcement
    from kvchat.store import Problem, diagnose, repair

    home, dimension = default_home(), embedding_dimension()  # from the encoder's config: no model, no torch

    def problems() -> list[Problem]:
        stale = stale_announcement(home)  # a `kvchat serve` killed before it could remove its serve.json
        return diagnose(home, embedding_dimension=dimension) + ([] if stale is None else [Problem(
            "stale-announcement", None, None, home / ANNOUNCEMENT,
            f"{home / ANNOUNCEMENT} {stale}: `kvchat ask` would try it first; --fix removes it")])

    found = problems()
    fixed = repair(home, found, embedding_dimension=dimension) if fix and found else []
    if fix and any(p.kind == "stale-announcement" for p in found) and remove_stale_announcement(home):
        fixed.append(f"removed {home / ANNOUNCEMENT} (no server runs)")
    remaining = problems() if fix and found else found
    if as_json:
        emit_json(documents.document(healthy=not remaining, problems=[p.to_dict() for p in found], fixed=fixed))
    else:
        for problem in found:
            say(f"problem: {spell(problem.message)}")
        for line in fixed:
            say(f"fixed: {spell(line)}")
        if not remaining:
            say("healthy" if not found else "healthy now")
        elif not fix:
            say(f"{len(remaining)} problem(s); `kvchat doctor --fix` repairs them")
        else:
            say(f"{len(remaining)} problem(s) remain")
    if remaining:
        raise typer.Exit(1)


def _compress_budgets(budgets: list[int]) -> str:
    """'1024 x30' when uniform, else the list."""
    if len(set(budgets)) == 1:
        return f"{budgets[0]} x{len(budgets)}"
    return " ".join(map(str, budgets))
