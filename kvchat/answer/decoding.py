"""One answer path: the question's prompt and the answer decoded on top of a cache, for every caller alike.

`kvchat ask` (one-shot, stdin, the REPL), `kvchat serve`, `kvchat eval` and the benchmarks answer through `Session.ask`
or `RagSession.ask`, and both build the question's turns with `question_prompt` and decode with `decode_answer`, from
one `AskConfig`: what the README measures is what a user gets. The prompt is the chat layout's question turn (the
user's own instructions as a system turn first, then the earlier exchange a follow-up continues, then the question
in `AskConfig.question_template`); decoding chooses each token as `AskConfig.sampling` says (kvchat.model.sampling),
goes back before an echo of the question (kvchat.model.echo), and ends at the model's end of turn, `max_new_tokens`, a
caller's stop strings, or a line where the model goes on writing the history (kvchat.answer.stops).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvchat.answer.stops import TextGate
from kvchat.config import AskConfig
from kvchat.kv.attention import Recorder
from kvchat.kv.cache import EpisodeCache
from kvchat.model.echo import guard_for
from kvchat.model.llm import ChatLayout, LoadedModel, generate
from kvchat.model.sampling import Sampler


def question_prompt(layout: ChatLayout, config: AskConfig, question: str,
                    earlier: Sequence[tuple[str, str]] = ()) -> str:  # fmt: skip
    """The text after the conversation for `question`: `config.system` as a system turn, the `earlier` (question,
    answer) pairs it follows up, and the question in `config.question_template`, up to the answer's first token."""
    return layout.question(config.question_template.format(question=question), earlier, config.system)


@dataclass(frozen=True)
class Decoded:
    text: str             # what the reader sees: up to a stop, without surrounding whitespace
    tokens: list[int]     # every token decoded (the text may end before the last of them)
    finish_reason: str    # "stop": the model ended it, or a stop string or a history line did; "length": cut at
                          # max_new_tokens; "stopped": the caller's `stop` asked
    transcript_cut: bool  # it ended where the model went on writing the history as a transcript
    closed: bool          # the model chose to end it after the last token (its end of turn); else decoding was cut


def decode_answer(
    lm: LoadedModel,
    cache: EpisodeCache,
    prompt_ids: torch.Tensor,
    config: AskConfig,
    *,
    question: str,
    speakers: Iterable[str] = (),
    stops: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    stop: Callable[[], bool] | None = None,
    on_first_logits: Callable[[torch.Tensor], None] | None = None,
    first_recorder: Recorder | None = None,
) -> Decoded:
    """Decode the answer to `question` whose prompt `prompt_ids` follows `cache` (extended; the caller rolls it
    back). `speakers`: the history's speaker names (an answer ends where a line starts with one's label); `stops`:
    strings that end it; `on_text` gets the text as a reader sees it, as it comes; `stop`, asked before each token,
    ends it early; `on_first_logits` and `first_recorder` see the first answer token's logits and forward
    (kvchat.model.llm.generate)."""
    gate = TextGate(stops, speakers)
    stream = Detokenizer(lm.decode)
    finish, decoded = "stop", ""

    def show(text: str) -> None:
        if text and on_text is not None:
            on_text(text)

    steps = generate(lm, cache, prompt_ids, config.max_new_tokens, on_first_logits, first_recorder=first_recorder,
                     echo=guard_for(config, question, lm.decode), sampler=Sampler(config.sampling))  # fmt: skip
    for token in steps:
        if stop is not None and stop():
            finish = "stopped"
            break
        delta = stream.push(token)
        decoded += delta
        show(gate.feed(delta))
        if gate.stopped:
            break
    steps.close()
    tokens = stream.tokens
    closed = finish == "stop" and not gate.stopped and len(tokens) < config.max_new_tokens
    if finish == "stop" and not gate.stopped and not closed:
        finish = "length"
    whole = lm.decode(tokens)
    if not gate.stopped and whole.startswith(decoded) and len(whole) > len(decoded):  # what streaming left partial
        show(gate.feed(whole[len(decoded):]))
    show(gate.finish())
    return Decoded(gate.text, tokens, finish, gate.transcript_cut, closed)


class Detokenizer:
    """The text of a growing list of tokens, decoding a few tokens per step rather than all of them
    (linear in the answer's length, where decoding everything at each step is quadratic).

    Each step decodes the tokens since the last-but-one emitted chunk and emits what that adds beyond
    the previous chunk, so tokenizers that drop a leading space or join bytes into characters (a
    multi-byte character across tokens decodes to U+FFFD until it is complete) stream right."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self._prefix = 0  # start of the window decoded each step
        self._read = 0  # tokens already emitted

    def push(self, token: int) -> str:
        """Add `token`; return the text it completes ("" while a character is still partial)."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self._prefix:self._read])
        after = self.decode(self.tokens[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.tokens)
            return after[len(before):]
        return ""
