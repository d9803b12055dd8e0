"""ChatGPT's data export (conversations.json): a list of conversations, each a `mapping` tree of message nodes.

Editing a prompt or regenerating an answer forks the tree; the branch the user last saw runs from
`current_node` up its parent chain, and that branch alone is the history. Of its messages only what the user
saw counts: user and assistant text, not system prompts, tool calls and their output, custom instructions,
hidden messages or reasoning summaries. Times are the messages' create_time, in UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TypeGuard

from kvchat.history.formats.common import (
    ExportShape,
    Pick,
    Turn,
    quote,
    read_export,
    refuse,
    type_name,
)

_SHOWN_CONTENT = ("text", "multimodal_text")  # code, execution_output, thoughts, ... are not the chat
_SHOWN_ROLES = ("user", "assistant")
_SHAPE = ExportShape("ChatGPT", "mapping", "title", '{"title", "mapping", "current_node", ...}')


def looks_chatgpt(obj: object) -> bool:
    return isinstance(obj, dict) and _SHAPE.marker in obj


def parse_chatgpt(data: list | dict, source: str, pick: Pick = None) -> list[Turn]:
    """The picked conversations (a list: an export; an object: one conversation), oldest first."""
    return read_export(data, source, pick, _SHAPE, _created, _conversation)


def _created(conv: dict) -> float | None:
    t = conv.get("create_time")
    return float(t) if _is_number(t) else None


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e11  # NaN fails too


def _conversation(conv: dict, where: str, title: str, source: str) -> list[Turn]:
    mapping = conv["mapping"]
    if not isinstance(mapping, dict):
        raise refuse(source, f'{where} has a "mapping" that is {type_name(mapping)} (expected an object of '
                     "message nodes)")
    turns = []
    for node_id in _visible_branch(mapping, conv.get("current_node"), where, source):
        turn = _turn(mapping[node_id], f"{where} node {quote(node_id, 40)}", title, source)
        if turn is not None:
            turns.append(turn)
    return turns


def _visible_branch(mapping: dict, current: object, where: str, source: str) -> list[str]:
    """Node ids from the root down to `current_node` (or, without one, the latest leaf)."""
    if current is None:
        current = _latest_leaf(mapping)
        if current is None:
            return []
    if not isinstance(current, str) or current not in mapping:
        raise refuse(source, f'{where} has a "current_node" that is not in its "mapping" ({quote(str(current))})')
    branch: list[str] = []
    seen: set[str] = set()
    node_id: object = current
    while node_id is not None:
        if not isinstance(node_id, str) or node_id not in mapping:
            raise refuse(source, f"{where} node {quote(branch[-1])} has a parent that is not in its "
                         f'"mapping" ({quote(str(node_id))})')
        if node_id in seen:
            raise refuse(source, f"{where} node {quote(node_id)} is its own ancestor (the mapping is not a tree)")
        seen.add(node_id)
        branch.append(node_id)
        node = mapping[node_id]
        if not isinstance(node, dict):
            raise refuse(source, f"{where} node {quote(node_id)} is {type_name(node)} (expected "
                         '{"message", "parent", "children"})')
        node_id = node.get("parent")
    return branch[::-1]


def _latest_leaf(mapping: dict) -> str | None:
    leaves = [(_message_time(node.get("message")) or 0.0, node_id) for node_id, node in mapping.items()
              if isinstance(node_id, str) and isinstance(node, dict) and not node.get("children")]
    return max(leaves)[1] if leaves else None


def _message_time(message: object) -> float | None:
    t = message.get("create_time") if isinstance(message, dict) else None
    return float(t) if _is_number(t) else None


def _turn(node: dict, where: str, title: str, source: str) -> Turn | None:
    """The node's message as a turn, or None for what the user did not see as chat."""
    message = node.get("message")
    if message is None:
        return None  # the root, and placeholder nodes
    if not isinstance(message, dict):
        raise refuse(source, f'{where} has a "message" that is {type_name(message)} (expected an object)')
    author = message.get("author")
    role = author.get("role") if isinstance(author, dict) else None
    if not isinstance(role, str):
        raise refuse(source, f'{where} has no "author"."role" (expected "user", "assistant", "system" or "tool")')
    metadata = message.get("metadata")
    if not isinstance(metadata, dict):
        metadata = {}
    hidden = metadata.get("is_visually_hidden_from_conversation") or metadata.get("is_user_system_message")
    if role not in _SHOWN_ROLES or hidden or message.get("recipient", "all") != "all":
        return None
    content = message.get("content")
    if not isinstance(content, dict) or content.get("content_type") not in _SHOWN_CONTENT:
        return None
    parts = content.get("parts")
    if not isinstance(parts, list):
        raise refuse(source, f'{where} has "content"."parts" that is {type_name(parts)} (expected a list)')
    text = "\n".join(p.strip() for p in parts if isinstance(p, str) and p.strip())  # images etc. are objects
    if not text:
        return None
    seconds = _message_time(message)
    time = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M UTC") if seconds is not None else None
    return Turn(role, text, time, conversation_title=title)
