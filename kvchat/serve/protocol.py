"""The OpenAI chat completions API as kvchat speaks it: request bodies, the response and chunk documents, errors.

A model id names a stored conversation (`NAME`) or one of its episodes (`NAME/EPISODE`, skipping routing;
conversation names never contain '/'). The last message is the question and must be the user's; earlier
user/assistant pairs are the exchange it follows up, decoded on top of the episode cache before it (and rolled
back after). System messages are ignored: the conversation's own system prompt sits in its cache. Decoding is
greedy, so sampling settings (`temperature`, `top_p`, `seed`, ...) are accepted and have no effect.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvchat.serve.engine import ChatRequest, Completion
from kvchat.serve.spelling import spell

FINISH_REASONS = {"stop": "stop", "length": "length", "stopped": "stop", "cancelled": "stop", "refused": "stop"}


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise ApiError(400, "only text content is supported", param="messages")
        return "".join(part.text or "" for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class KvchatOptions(BaseModel):
    """kvchat's own request options (the body's `kvchat` object; OpenAI clients send it as extra body)."""

    model_config = ConfigDict(extra="forbid")
    sources: bool = False  # the answer's sources in the response's `kvchat` (kvchat.answer.sources)
    refuse_off_topic: bool = False  # no answer (`finish_reason` "refused" in `kvchat`) when no episode matches well


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    kvchat: KvchatOptions = KvchatOptions()

    def to_chat(self, default_tokens: int, limit: int) -> ChatRequest:
        """The engine's request: conversation and episode from the model id, question and follow-up context
        from the messages."""
        if self.n != 1:
            raise ApiError(400, "n must be 1 (answers are greedy: every choice would be the same)", param="n")
        conversation, episode = parse_model(self.model)
        turns = [m for m in self.messages if m.role not in ("system", "developer")]
        if not turns or turns[-1].role != "user":
            raise ApiError(400, "the last message must be the user's question", param="messages")
        earlier = turns[:-1]
        roles = [m.role for m in earlier]
        if roles != ["user", "assistant"] * (len(roles) // 2):
            raise ApiError(400, "messages before the question must alternate user, assistant", param="messages")
        question = turns[-1].text().strip()
        if not question:
            raise ApiError(400, "the question (the last user message) is empty", param="messages")
        pairs = tuple((earlier[i].text(), earlier[i + 1].text()) for i in range(0, len(earlier), 2))
        tokens = self.max_completion_tokens or self.max_tokens or default_tokens
        if tokens > limit:
            raise ApiError(400, f"max_tokens is {tokens}; this server allows at most {limit}", param="max_tokens")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stop) > 4:
            raise ApiError(400, "at most 4 stop sequences", param="stop")
        return ChatRequest(conversation, question, episode, pairs, tokens, stop, sources=self.kvchat.sources,
                           refuse_off_topic=self.kvchat.refuse_off_topic)


def parse_model(model: str) -> tuple[str, int | None]:
    """`NAME` or `NAME/EPISODE` -> (conversation, episode or None)."""
    name, _, episode = model.partition("/")
    if not episode:
        return name, None
    if not episode.isdigit():
        raise ApiError(404, f"unknown model {model!r}: expected a conversation name, or NAME/EPISODE",
                       param="model", code="model_not_found")
    return name, int(episode)


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def kvchat_fields(completion: Completion) -> dict[str, Any]:
    """What the OpenAI API cannot say: which episode answered, how similar the question was to it (`off_topic`
    below the server's threshold), why the answer ended in kvchat's words (`finish_reason`: `refused` too),
    timings, the turns recall recalled, and when the request asked for them the answer's `sources`."""
    answer = completion.answer
    fields = {"conversation": answer.conversation, "episode": answer.episode, "similarity": answer.similarity,
              "off_topic": answer.off_topic, "finish_reason": completion.finish_reason,
              "reused_cache": answer.reused_cache, "timings_ms": answer.timings_ms, "recalled": answer.recalled}
    if completion.replica is not None:
        fields["replica"] = completion.replica
    if answer.sources is not None or answer.sources_note is not None:
        fields["sources"] = None if answer.sources is None else [s.to_dict() for s in answer.sources]
        fields["sources_note"] = None if answer.sources_note is None else spell(answer.sources_note)
    return fields


def usage(completion: Completion) -> dict[str, int]:
    """Tokens decoded for this request: the prompt is the question and its follow-up context (the episode
    cache it sits on is not counted), the completion every answer token decoded."""
    prompt, answer = completion.answer.prompt_tokens, completion.answer.answer_tokens
    return {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": prompt + answer}


def response(request_id: str, model: str, completion: Completion) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                     "finish_reason": FINISH_REASONS[completion.finish_reason], "logprobs": None}],
        "usage": usage(completion),
        "kvchat": kvchat_fields(completion),
    }


def chunk(request_id: str, model: str, delta: dict[str, Any], finish_reason: str | None = None,
          **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}


def model_entry(record) -> dict[str, Any]:
    """A conversation in GET /v1/models."""
    from datetime import datetime

    try:
        created = int(datetime.fromisoformat(record.created_at).timestamp())
    except ValueError:
        created = 0
    return {"id": record.name, "object": "model", "created": created, "owned_by": "kvchat",
            "episode_count": len(record.episodes)}
