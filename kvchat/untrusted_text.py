"""Text from outside kvchat (a history, a question, a request) made safe for everything downstream.

Python strings may hold lone surrogates (`"\\ud800"` in a JSON history, bytes that are not UTF-8 in a command's
argument, which Python keeps as `"\\udcff"`): no tokenizer, SQLite or terminal takes them, so they would fail
deep inside with an internal error. They become U+FFFD, as a decoder would have made them.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def valid_text(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD (a high and a low one side by side become the character
    they encode); `text` itself when it has none, the common case, checked at C speed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text
