"""The server's words for the references in kvchat's messages (kvchat.messages): a setting or option by the
request field that gives it (`"budget": 64`), a command by the endpoint that does it (`GET /kvchat/conversations`).
What no request can give or do is written plainly (`block_size=32`, `doctor fix=true`): an HTTP client reads what
the server's own settings were, never a command-line flag. Every error and message field a reply carries goes
through `spell`."""

from __future__ import annotations

import json
from typing import Any

from kvchat.messages import NOTHING, PLAIN, Command, Spelling
from kvchat.messages import spell as spell_with

# neutral key -> the request body's field that gives it (tests/test_messages.py checks each is one)
# (no "model": an ingest's model is the server operator's, never a request's, so it is written as a setting's key)
FIELDS: dict[str, str] = {
    "budget": "budget", "episodes": "episodes", "method": "method", "name": "name", "pick": "pick",
    "format": "format", "replace": "replace", "append": "append", "episode": "episode",
    "max_new_tokens": "max_tokens", "sources": "sources", "refuse_off_topic": "refuse_off_topic",
}
# command -> its endpoint (`{}`: the command's first argument, a conversation's name)
ENDPOINTS: dict[str, str] = {
    "list": "GET /kvchat/conversations", "show": "GET /kvchat/conversations/{}",
    "rm": "DELETE /kvchat/conversations/{}", "ingest": "POST /kvchat/ingest", "ask": "POST /kvchat/ask",
}


class HttpSpelling(Spelling):
    """kvchat serve's words (see the module docstring)."""

    def setting(self, key: str, value: Any) -> str:
        field = FIELDS.get(key)
        if field is None:
            return super().setting(key, value)
        return json.dumps(field) if value is NOTHING else f"{json.dumps(field)}: {json.dumps(value)}"

    def command(self, command: Command) -> str:
        endpoint = ENDPOINTS.get(command.name)
        if endpoint is None or any(key not in FIELDS for key in command.options):
            return PLAIN.command(command)
        if "{}" in endpoint:
            endpoint = endpoint.format(command.args[0] if command.args else "NAME")
        body = {FIELDS[key]: value for key, value in command.options.items()}
        return f"{endpoint} {json.dumps(body)}" if body else endpoint


HTTP = HttpSpelling()


def spell(text: str) -> str:
    """`text`, written by the library, in the server's words."""
    return spell_with(text, HTTP)
