"""OpenAI fine-tune JSONL: one conversation per line, each {"messages": [...]} as in a chat fine-tuning file.

Its user and assistant messages are the history: a system prompt (usually the same on every line), tool output and
tool calls are instructions to the model being tuned, not what was said, and are left out. Which lines become the
history is the caller's pick; several taken together are told apart in receipts by their number ("#2, turn 3").
"""

from __future__ import annotations

from kvchat.history.formats.common import Pick, Turn, check_count, choose, in_conversation, refuse, type_name
from kvchat.history.formats.jsonl import read_lines
from kvchat.history.formats.openai import Label, parse_messages

EXPECTS = 'one {"messages": [...]} conversation per line'
_INSTRUCTIONS = ("system", "developer", "tool", "function")


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
        said = [(i, m) for i, m in enumerate(conversations[k]) if not _instruction(m)]
        read = parse_messages([m for _, m in said], source, _message_label(numbers[k], [i for i, _ in said]))
        turns.extend(in_conversation(read, f"#{k + 1}") if len(chosen) > 1 else read)
    return turns


def _instruction(message: object) -> bool:
    """What a fine-tune example tells the model rather than says in the conversation: a system (or developer)
    prompt, a tool's output, an assistant's tool call without text."""
    if not isinstance(message, dict):
        return False  # parse_messages says what is wrong with it
    role = message.get("role")
    return role in _INSTRUCTIONS or (role == "assistant" and message.get("content") is None
                                     and ("tool_calls" in message or "function_call" in message))


def _message_label(line: int, places: list[int]) -> Label:
    """Message i of those kept is message places[i] + 1 of its line."""
    return lambda i: f"line {line} message {places[i] + 1}"
