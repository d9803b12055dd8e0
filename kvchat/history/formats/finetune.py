"""OpenAI fine-tune JSONL: one conversation per line, each {"messages": [...]} as in a chat fine-tuning file.

A line reads exactly as a one-conversation {"messages": [...]} file would (system messages included); which
lines become the history is the caller's pick.
"""

from __future__ import annotations

from kvchat.history.formats.common import Pick, Turn, check_count, choose, refuse, type_name
from kvchat.history.formats.jsonl import read_lines
from kvchat.history.formats.openai import Label, parse_messages

EXPECTS = 'one {"messages": [...]} conversation per line'


def parse_finetune(text: str, source: str, pick: Pick = None) -> list[Turn]:
    numbers, items = read_lines(text, source, EXPECTS, "conversations")
    conversations: list[list[object]] = []  # each line's "messages", once checked
    for n, item in zip(numbers, items, strict=True):
        if not isinstance(item, dict):
            raise refuse(source, f"line {n} is {type_name(item)} (fine-tune JSONL expects {EXPECTS})")
        if "messages" not in item:
            raise refuse(source, f'line {n} has no "messages" (fine-tune JSONL expects {EXPECTS})')
        if not isinstance(item["messages"], list):
            raise refuse(source, f'line {n} "messages" is {type_name(item["messages"])} (expected a list of '
                         '{"role", "content"} objects)')
        conversations.append(item["messages"])
    chosen = choose([None] * len(items), pick, source, "fine-tune JSONL")
    check_count(sum(len(conversations[k]) for k in chosen), "messages", source)
    turns: list[Turn] = []
    for k in chosen:
        title = f"#{k + 1}" if len(chosen) > 1 else None
        turns.extend(parse_messages(conversations[k], source, _message_label(numbers[k]), conversation_title=title))
    return turns


def _message_label(line: int) -> Label:
    return lambda i: f"line {line} message {i + 1}"
