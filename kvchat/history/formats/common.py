"""What every history importer shares: the `Turn` they produce, the sanity limits, and one-line refusals.

Every refusal of a file's content names the accepted formats and where their examples are, so a user holding
the wrong file learns what kvchat reads without opening the docs first.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvchat.errors import UserError
from kvchat.messages import option

# Sanity limits, not model limits (the caller handles token budgets): they keep a wrong file
# (a disk image, a log dump) from eating all memory before we can say what is wrong.
MAX_TURNS = 1_000_000
MAX_FILE_BYTES = 512 * 1024 * 1024
MAX_TURN_CHARS = 1 << 18  # one turn (its speaker, text, time, title): about 65K tokens, 8x the embedded model's window
MAX_NESTING = 64  # lists/objects inside each other; the deepest export kvchat reads nests about 8

FORMATS = (
    'an OpenAI messages list or {"messages": [...]}, JSONL of messages, OpenAI fine-tune JSONL, '
    'a ChatGPT or Claude export (conversations.json), a Telegram (result.json), Slack or Discord export, '
    'a "Name: text" transcript or WhatsApp chat, a markdown chat log, a LoCoMo conversation or a LongMemEval instance'
)
EXAMPLES = 'examples: README, "History formats"'
MESSAGE_SHAPE = 'expected {"role", "content"} objects'

_LINE_BREAKS = re.compile(r"[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")

Pick = int | str | None
"""Which conversation of a file holding several: None (the file must hold one), a 1-based index, a title, or
"all" (every conversation in time order)."""


@dataclass(frozen=True)
class Turn:
    """One utterance; `time`, `turn_id` and `conversation_title` carry what the source format knows, so answers can
    cite them."""

    role: str  # "user"/"assistant"/"system"/... or a speaker name (LoCoMo, transcripts)
    text: str
    time: str | None = None  # session or message date/time when the format gives one
    turn_id: str | None = None  # the format's own: LoCoMo's dia_id "D1:3", or "Trip to Japan, turn 3" in a file of
    #                             several conversations taken together (`in_conversation`); None otherwise
    conversation_title: str | None = None  # which conversation it came from, in files that hold several


def one_line(source: str, what: str) -> UserError:
    """A UserError on one line: file names and quoted values may hold line breaks, which would split it."""
    message = f"{source}: {what}"
    return UserError(_LINE_BREAKS.sub(lambda m: ascii(m.group())[1:-1], message))


def refuse(source: str, what: str) -> UserError:
    """A refusal of the file's content: `what` is wrong, then which formats kvchat reads and where to look."""
    return one_line(source, f"{what}; kvchat reads {FORMATS} ({EXAMPLES})")


def load_json(text: str) -> object:
    """`json.loads`, raising RecursionError also for a value that nests lists and objects more than MAX_NESTING
    deep: whether json itself gives up depends on the Python version (3.12 parses 5,000 levels)."""
    value = json.loads(text)
    level = [value]
    for _ in range(MAX_NESTING + 1):  # breadth first, without recursion
        level = [child for item in level if isinstance(item, list | dict)
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return value
    raise RecursionError(f"nested more than {MAX_NESTING} deep")


def type_name(value: object) -> str:
    """JSON's names for Python values, since the user wrote JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def quote(value: str, limit: int = 40) -> str:
    """A short JSON-quoted excerpt of a user string for error messages."""
    text = json.dumps(value[:limit], ensure_ascii=True)
    return text if len(value) <= limit else text[:-1] + '..."'


def check_count(count: int, what: str, source: str) -> None:
    if count > MAX_TURNS:
        raise refuse(source, f"has {count:,} {what}, over the limit of {MAX_TURNS:,} turns")


def choose(titles: Sequence[str | None], pick: Pick, source: str, kind: str) -> list[int]:
    """The indices `pick` selects among a file's conversations (`titles`, in file order)."""
    count = len(titles)
    if count == 0:
        raise refuse(source, f"holds no {kind} conversations")
    if pick is None:
        if count == 1:
            return [0]
        if not any(titles):
            raise one_line(source, f"holds {count} {kind} conversations; choose one by number "
                           f"(ingest {option('pick', 2)}) or {option('pick', 'all')}")
        shown = "; ".join(f"{i + 1} {quote(t, 30) if t else '(untitled)'}" for i, t in enumerate(titles[:3]))
        example = quote(next(t for t in titles if t), 30)
        raise one_line(source, f"holds {count} {kind} conversations ({shown}{', ...' if count > 3 else ''}); "
                       f"choose one by number or title (ingest {option('pick', 2)}, {option('pick', example)}) or "
                       f"{option('pick', 'all')}")
    if isinstance(pick, bool) or not isinstance(pick, int | str):
        raise one_line(source, f"pick is {type_name(pick)} (expected a number, a title or \"all\")")
    if isinstance(pick, str) and pick.strip().lower() == "all":
        return list(range(count))
    if isinstance(pick, int) or pick.strip().isdigit():
        n = int(pick)
        if not 1 <= n <= count:
            raise one_line(source, f"has no conversation {n}: it holds {count} (number 1 to {count})")
        return [n - 1]
    wanted = pick.strip().casefold()
    exact = [i for i, t in enumerate(titles) if t is not None and t.strip().casefold() == wanted]
    if len(exact) == 1:
        return exact
    if len(exact) > 1:
        numbers = ", ".join(str(i + 1) for i in exact[:5])
        raise one_line(source, f"has {len(exact)} conversations titled {quote(pick)} (numbers {numbers}); "
                       "choose one by number")
    if not any(titles):
        raise one_line(source, f"{kind} conversations have no titles; choose one by number (1 to {count})")
    near = [i for i, t in enumerate(titles) if t is not None and wanted in t.casefold()]
    shown = ", ".join(f"{i + 1} {quote(titles[i] or '', 30)}" for i in near[:3])
    hint = f" (titles containing it: {shown})" if near else ""
    raise one_line(source, f"has no conversation titled {quote(pick)}{hint}")


@dataclass(frozen=True)
class ExportShape:
    """How a chat app's export names its parts: the app, the key only its conversations have, their title."""

    app: str  # "ChatGPT"
    marker: str  # "mapping"
    title_key: str  # "title"
    keys: str  # the conversation's main keys, for refusals


def read_export(data: list | dict, source: str, pick: Pick, shape: ExportShape,
                created: Callable[[dict], float | str | None],
                read: Callable[[dict, str, str, str], list[Turn]]) -> list[Turn]:
    """The turns of an export's picked conversations (a list: the export; an object: one conversation), oldest
    first by `created` (file order among equals); `read(conversation, its name in errors, title, source)`."""
    conversations = data if isinstance(data, list) else [data]
    for k, conv in enumerate(conversations):
        if not isinstance(conv, dict) or shape.marker not in conv:
            what = f'has no "{shape.marker}"' if isinstance(conv, dict) else f"is {type_name(conv)}"
            raise refuse(source, f"conversation {k + 1} {what} (expected a {shape.app} conversation: {shape.keys})")
    titles = [_title(conv.get(shape.title_key)) for conv in conversations]

    def oldest_first(k: int) -> tuple[bool, float | str, int]:
        time = created(conversations[k])
        return (time is None, "" if time is None else time, k)

    turns: list[Turn] = []
    chosen = choose(titles, pick, source, shape.app)
    for k in sorted(chosen, key=oldest_first):
        title = titles[k] or f"#{k + 1}"
        read_turns = read(conversations[k], f"conversation {k + 1}", title, source)
        turns.extend(in_conversation(read_turns, title) if len(chosen) > 1 else read_turns)
        check_count(len(turns), "messages", source)
    return turns


def in_conversation(turns: Sequence[Turn], title: str) -> list[Turn]:
    """The turns of one of several conversations taken from one file, each named for receipts (`turn_id`) by its
    conversation's title and its number in it: "Trip to Japan, turn 3"."""
    shown = title if len(title) <= 60 else title[:59] + "…"
    return [dataclasses.replace(t, turn_id=f"{shown}, turn {n}", conversation_title=title)
            for n, t in enumerate(turns, start=1)]


def _title(value: object) -> str | None:
    return " ".join(value.split()) or None if isinstance(value, str) else None
