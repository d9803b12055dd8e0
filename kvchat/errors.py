"""The two kinds of failure kvchat distinguishes: the user's mistake (exit 2) and ours (exit 1).

A message names settings, options and commands by kvchat.messages' references: `str()` shows them plainly, and a
front end spells `message(exc)` in its own words."""

from kvchat.messages import plain


class KvchatError(Exception):
    """An internal failure: a bug or an environment problem the user did not cause."""

    def __str__(self) -> str:
        return plain(super().__str__())


class UserError(KvchatError):
    """A mistake the user can fix (bad file, unknown name, bad option). Exit 2, one line, no traceback."""


class CacheIntegrityError(UserError):
    """A stored cache is damaged or was built by another model; the message says how to rebuild it."""


def message(exc: BaseException) -> str:
    """`exc`'s message with its references (kvchat.messages) unspelt: what a front end spells, and what a message
    that wraps `exc` embeds so its references stay references."""
    return Exception.__str__(exc) if isinstance(exc, KvchatError) else str(exc)


def first_line(exc: BaseException) -> str:
    """An exception's message as one line of a UserError: its first line, else its type's name."""
    return (message(exc).strip().splitlines() or [type(exc).__name__])[0]
