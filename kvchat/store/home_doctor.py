"""`kvchat doctor` on a whole home: what is wrong (`diagnose`) and the repairs (`repair`), whether its kvchat.db
opens (the store's own checks, kvchat.store.doctor) or is too damaged to (a rebuild from the manifests,
kvchat.store.recovery)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvchat.errors import UserError
from kvchat.store import Store, recovery
from kvchat.store.errors import DamagedDatabase
from kvchat.store.layout import read_only_reason
from kvchat.store.leftovers import Problem


def diagnose(home: Path, *, embedding_dimension: int | None = None) -> list[Problem]:
    """Everything wrong in `home`, changing nothing (`kvchat doctor`). A damaged kvchat.db is one
    "database" problem saying what a rebuild would restore, plus one "lost" problem per conversation it
    could not (with the command that builds it again); else the store's `check` (`embedding_dimension`: the
    encoder's, which every centroid must have; kvchat.model.encoder.embedding_dimension)."""
    home = Path(home).expanduser().absolute()
    store, damage = _open_for_doctor(home)
    if store is None:
        return recovery.damage_problems(home, damage)
    try:
        return store.check(embedding_dimension=embedding_dimension)
    finally:
        store.close()


def repair(home: Path, problems: Iterable[Problem], *, embedding_dimension: int | None = None) -> list[str]:
    """Repair what `diagnose` found (`kvchat doctor --fix`); one line per action taken.

    A damaged kvchat.db is moved aside, kept, and rebuilt from what survives (`recovery`); then, or
    else, the store fixes its files and leftovers (`Store.fix`). A conversation listed again from its
    manifest (the rebuild, an unlisted one) is checked as every other (`embedding_dimension`, as `diagnose`'s)
    before it counts as restored: a manifest re-signed with centroids of another length is removed, not listed.
    """
    home = Path(home).expanduser().absolute()
    problems = list(problems)
    done = _rebuild(home) if any(p.kind == "database" for p in problems) else []
    store = Store(home, clean_stale=False, frees_space=True)
    try:
        done += store.fix(store.check(embedding_dimension=embedding_dimension) if done else problems)
        if any(p.kind == "unlisted" for p in problems):  # listed again from their manifests: their files (and
            # centroids) checked now, so one run leaves the store healthy
            done += store.fix([p for p in store.check(embedding_dimension=embedding_dimension)
                               if p.conversation is not None])  # fmt: skip
        return done
    finally:
        store.close()


def _open_for_doctor(home: Path) -> tuple[Store | None, str]:
    """The store, or None and how its kvchat.db is damaged."""
    try:
        store = Store(home, clean_stale=False, frees_space=True)
    except DamagedDatabase as e:
        return None, e.what
    damage = store.database_damage()
    if damage is None:
        return store, ""
    store.close()
    return None, damage


def _rebuild(home: Path) -> list[str]:
    """Build a new kvchat.db from what survives, then put it in the damaged one's place (`recovery`)."""
    reason = read_only_reason(home)
    if reason is not None:
        raise UserError(f"{home} is read-only ({reason}): its damaged database cannot be rebuilt there")
    with recovery.one_rebuild_at_a_time(home):  # a second `doctor --fix` waits, then finds it rebuilt
        store, damage = _open_for_doctor(home)
        if store is not None:  # repaired since it was diagnosed
            store.close()
            return []
        return recovery.rebuild(home, damage)
