"""The two kinds of failure kvchat distinguishes: the user's mistake (exit 2) and ours (exit 1)."""


class KvchatError(Exception):
    """An internal failure: a bug or an environment problem the user did not cause."""


class UserError(KvchatError):
    """A mistake the user can fix (bad file, unknown name, bad option). Exit 2, one line, no traceback."""


class CacheIntegrityError(UserError):
    """A stored cache is damaged or was built by another model; the message says how to rebuild it."""


def first_line(exc: BaseException) -> str:
    """An exception's message as one line of a UserError: its first line, else its type's name."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
