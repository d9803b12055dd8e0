"""The store's commands: `list`, `show`, `rm`, `logs`, `doctor`."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kvchat import documents
from kvchat.cli.options import JsonOpt, NameArg, complete_conversation, open_store
from kvchat.cli.render import emit_json, head_budgets_text, out, say, table
from kvchat.config import default_home
from kvchat.errors import UserError
from kvchat.terminal import clean


def list_conversations(as_json: JsonOpt = False) -> None:
    """List stored conversations."""
    records = open_store().conversations()
    if as_json:
        emit_json(documents.conversations(records))
        return
    rows = []
    for r in records:
        s = documents.conversation(r)
        rows.append((r.name, r.created_at[:19], r.model, s["method"], s["episode_count"], s["turns"],
                     f"{s['cache_bytes'] / 2**20:.1f}"))
    table(("name", "created", "model", "method", "episodes", "turns", "MiB"), rows,
          right=("episodes", "turns", "MiB"))


def show(name: NameArg, as_json: JsonOpt = False) -> None:
    """Show a conversation's episodes: sizes, budgets and medoid excerpts."""
    record = open_store().get(name)
    if as_json:
        emit_json(documents.show(record))
        return
    s = record.settings
    strategy = s.get("layer_budgets", "uniform")
    if strategy == "cake":
        strategy += f" tau1={s.get('tau1')} tau2={s.get('tau2')}"
    heads = head_budgets_text(s.get("head_budgets", "uniform"), record.stats.get("head_entries", []))
    say(
        (record.name, "bold"),
        f" ({record.model}, {s['method']}, budget {s['budget']}, block {s['block_size']}, "
        f"{strategy} layer budgets, {heads}, {s['positions']} positions, {s.get('cache_precision', 'full')} "
        f"precision) ingested {record.created_at[:19]}",
    )
    rows = [(e.index, f"{e.bytes / 2**20:.1f}", _compress_budgets(e.budgets),
             " ".join(e.medoid_text.split())[:90] if out.is_terminal else e.medoid_text)
            for e in record.episodes]
    table(("episode", "MiB", "budgets per layer", "medoid excerpt"), rows, right=("episode", "MiB"))


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
    table(("time", "conversation", "episode", "question", "answer"),
          [(r["created_at"][:19], r["conversation"], r["episode"], r["question"], r["answer"]) for r in rows],
          right=("episode",))


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
        emit_json(documents.document(healthy=not remaining, problems=[p.to_dict() for p in found], fixed=fixed))
    else:
        for problem in found:
            say(f"problem: {problem.message}")
        for line in fixed:
            say(f"fixed: {line}")
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
