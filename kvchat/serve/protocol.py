"""The OpenAI chat completions API as kvchat speaks it: request bodies, the response and chunk documents, errors.

A model id names a stored conversation (`NAME`) or one of its episodes (`NAME/EPISODE`, skipping routing;
conversation names never contain '/'). The last message is the question and must be the user's; earlier
user/assistant pairs are the exchange it follows up, decoded on top of the episode cache before it (and rolled
back after), and routed with the question. System (and developer) messages are the client's instructions: one
system turn after the conversation's own system prompt (which sits in the cache), before the exchange. Sampling is
OpenAI's (`temperature`, `top_p`, `seed`, `frequency_penalty`, `presence_penalty`) and vLLM's `repetition_penalty`
(kvchat.model.sampling; greedy with kvchat's repetition penalty when none is given). What kvchat cannot do (tools,
structured output, log probabilities, several choices) is refused with 400 and a one-line reason, never ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvchat import documents
from kvchat.config import Sampling
from kvchat.errors import UserError
from kvchat.serve.engine import ChatRequest, Completion
from kvchat.serve.spelling import spell
from kvchat.untrusted_text import valid_text

FINISH_REASONS = {"stop": "stop", "length": "length", "stopped": "stop", "cancelled": "stop", "refused": "stop"}
# What a plain OpenAI client shows for a question refused as off-topic (`kvchat.refuse_off_topic`): the message's
# content and OpenAI's `refusal` field say it, so no client takes an empty answer for one.
REFUSAL = "Not answered: no part of this conversation matches the question well enough."


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
            return valid_text(self.content or "")
        if any(part.type != "text" for part in self.content):
            raise ApiError(400, "only text content is supported", param="messages")
        return valid_text("".join(part.text or "" for part in self.content))


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
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra field (CTRL's penalty, 1: off)
    kvchat: KvchatOptions = KvchatOptions()

    def to_chat(self, default_tokens: int, limit: int) -> ChatRequest:
        """The engine's request: conversation and episode from the model id, question, instructions and follow-up
        context from the messages, sampling from the request's fields."""
        self._refuse_unsupported()
        conversation, episode = parse_model(self.model)
        if any(m.role in ("tool", "function") for m in self.messages):
            raise ApiError(400, "tool and function messages are not supported: kvchat calls no tools",
                           param="messages")
        system = "\n\n".join(t for m in self.messages if m.role in ("system", "developer") for t in [m.text().strip()]
                             if t) or None  # fmt: skip
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
                           refuse_off_topic=self.kvchat.refuse_off_topic, sampling=self._sampling(), system=system)

    def _sampling(self) -> Sampling:
        """The request's sampling, kvchat's defaults where it names none (a temperature of 0: greedy)."""
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "seed", "frequency_penalty",
                                                        "presence_penalty", "repetition_penalty")}  # fmt: skip
        given = {name: value for name, value in given.items() if value is not None}
        for name, value in given.items():  # each alone first, so the error names its field
            try:
                Sampling(**{name: value})
            except UserError as exc:
                raise ApiError(400, str(exc), param=name) from None
        return Sampling(**given)

    def _refuse_unsupported(self) -> None:
        """A 400 naming the first field asked for that kvchat cannot honour (a default value passes: clients send
        some of them always)."""
        extra = self.model_extra or {}
        for name, asked, why in (
            ("n", self.n != 1, "n must be 1: kvchat gives one answer per request"),
            ("tools", bool(extra.get("tools")), "tools are not supported: kvchat answers in text and calls no tools"),
            ("functions", bool(extra.get("functions")), "functions are not supported: kvchat calls no tools"),
            ("tool_choice", extra.get("tool_choice") not in (None, "none"), "tool_choice is not supported: kvchat "
             "calls no tools"),
            ("function_call", extra.get("function_call") not in (None, "none"), "function_call is not supported: "
             "kvchat calls no tools"),
            ("response_format", (extra.get("response_format") or {"type": "text"}) != {"type": "text"},
             "response_format is not supported: answers are plain text (no JSON mode or schema)"),
            ("logprobs", bool(extra.get("logprobs")), "logprobs are not supported"),
            ("top_logprobs", bool(extra.get("top_logprobs")), "top_logprobs are not supported"),
            ("logit_bias", bool(extra.get("logit_bias")), "logit_bias is not supported"),
            ("modalities", extra.get("modalities") not in (None, ["text"]), "only text output is supported"),
            ("audio", extra.get("audio") is not None, "audio output is not supported"),
            ("prediction", extra.get("prediction") is not None, "predicted outputs are not supported"),
            ("web_search_options", extra.get("web_search_options") is not None, "web search is not supported"),
        ):
            if asked:
                raise ApiError(400, why, param=name)


def parse_model(model: str) -> tuple[str, int | None]:
    """`NAME` or `NAME/EPISODE` -> (conversation, episode or None)."""
    name, _, episode = model.partition("/")
    if not episode:
        return name, None
    if not (episode.isascii() and episode.isdigit()) or len(episode) > 9:  # int() takes "²" and "١" too
        raise ApiError(404, f"unknown model {model!r}: expected a conversation name, or NAME/EPISODE",
                       param="model", code="model_not_found")
    return name, int(episode)


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def kvchat_fields(completion: Completion) -> dict[str, Any]:
    """What the OpenAI API cannot say: the `kvchat ask --json` document's fields but the question and the answer's
    text (which episode answered, how similar the question was to it, `off_topic` below the server's threshold,
    why the answer ended in kvchat's words (`finish_reason`: `refused` too), token counts, timings, the turns
    recall recalled, whether the answer was cut where the model went on writing the history, and when the
    request asked for them the answer's `sources`), so a streamed answer
    carries the whole document (kvchat.serve.client builds it)."""
    answer = completion.answer
    fields = {key: value for key, value in documents.answer("", answer).items()
              if key not in ("schema", "question", "answer")}
    fields["finish_reason"] = completion.finish_reason
    if answer.sources is None and answer.sources_note is None:  # not asked for
        fields.pop("sources", None)
        fields.pop("sources_note", None)
    if completion.replica is not None:
        fields["replica"] = completion.replica
    if fields.get("sources_note") is not None:
        fields["sources_note"] = spell(fields["sources_note"])
    return fields


def usage(completion: Completion) -> dict[str, int]:
    """Tokens decoded for this request: the prompt is the question and its follow-up context (the episode
    cache it sits on is not counted), the completion every answer token decoded."""
    prompt, answer = completion.answer.prompt_tokens, completion.answer.answer_tokens
    return {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": prompt + answer}


def refusal(completion: Completion) -> str | None:
    """The sentence a refused answer is shown as (OpenAI's `refusal`), or None when the question was answered."""
    return REFUSAL if completion.finish_reason == "refused" else None


def response(request_id: str, model: str, completion: Completion) -> dict[str, Any]:
    refused = refusal(completion)
    message = {"role": "assistant", "content": refused or completion.text, "refusal": refused}
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message,
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
