"""Question echo: a small model that cannot find the answer often repeats the question back, as its answer or
quoted inside one ('The answer to the question is: "When did ...?"').

Such an answer says nothing, so kvchat does not give it: an answer's tokens are held back while they could be the
start of the question's first words, verbatim, and once they are those words, decoding goes back to the token
where they began and takes the next best token there (`kvchat.model.llm.generate`). Answers that never spell out the
question's opening are untouched, token for token; only the tokens that might begin it are shown a little later.
Words are compared as casefolded text, since the question in the prompt and the answer tokenize differently (the
question follows a space, the answer opens a line).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from kvchat.config import ECHO_RETRIES, ECHO_WORDS, AskConfig

_WORD = re.compile(r"\w+")


class Rewindable(Protocol):
    """What decoding goes back in: the cache."""

    def checkpoint(self) -> object: ...

    def rollback(self, mark: object) -> None: ...


@dataclass(frozen=True)
class Echo:
    """Where the question's opening begins, or may begin, in an answer's text (a character offset)."""

    start: int
    complete: bool  # all of the opening's words are there; else the text so far ends with a part of them


@dataclass(frozen=True)
class EchoGuard:
    """Finds the question's first `words` words in an answer's text (a question of fewer words has no echo to
    find: repeating "Paris?" is an answer); decoding goes back at most `retries` times per answer, after which the
    answer is left as it comes."""

    question: str
    decode: Callable[[list[int]], str]
    words: int = ECHO_WORDS
    retries: int = ECHO_RETRIES

    @cached_property
    def opening(self) -> list[str]:
        """The question's first `words` words, casefolded; none for a shorter question."""
        words = _WORD.findall(self.question.casefold())[: self.words]
        return words if len(words) == self.words else []

    def find(self, tokens: Sequence[int]) -> Echo | None:
        """The opening in the answer `tokens` decode to, complete, or begun at the text's end; None if neither."""
        opening = self.opening
        if not opening:
            return None
        text = self.decode(list(tokens)).casefold()
        found = list(_WORD.finditer(text))
        open_end = bool(found) and found[-1].end() == len(text)  # the last word may go on in the next token
        for i, word in enumerate(found):
            tail = [w.group() for w in found[i : i + len(opening)]]
            at_end = i + len(tail) == len(found)
            if tail == opening and not (at_end and open_end):
                return Echo(word.start(), True)
            if at_end and _begins(tail, opening, open_end):
                return Echo(word.start(), False)
        return None


def guard_for(config: AskConfig, question: str, decode: Callable[[list[int]], str]) -> EchoGuard | None:
    """The guard `config` asks for on `question`'s answer (`AskConfig.echo_guard`), or None."""
    return EchoGuard(question, decode) if config.echo_guard else None


def _begins(tail: list[str], opening: list[str], open_end: bool) -> bool:
    """Whether `tail` is how `opening` starts; its last word may be cut short when the text ends inside it."""
    if not tail or len(tail) > len(opening) or tail[:-1] != opening[: len(tail) - 1]:
        return False
    want = opening[len(tail) - 1]
    return tail[-1] == want or (open_end and want.startswith(tail[-1]))


@dataclass(frozen=True)
class _Choice:
    """Where decoding stood when a token held back was chosen: its scores, and the cache's mark before it."""

    scores: torch.Tensor
    mark: object


@dataclass
class HeldAnswer:
    """One answer as it is decoded: `push` each chosen token before it is fed to the model; it says which tokens
    can be given out, or, when under `guard` they spelled out the question's opening, rolls `cache` back to where
    the opening began and returns the scores to choose from there, that token ruled out. Without a guard every
    token is given out at once."""

    guard: EchoGuard | None
    cache: Rewindable
    tokens: list[int] = field(default_factory=list)  # every token chosen: tokens[:given] given out, the rest held
    given: int = 0
    _held: list[_Choice] = field(default_factory=list)  # per token held back
    _bans: dict[int, set[int]] = field(default_factory=dict)  # per position, tokens an echo began with there
    _retries: int = field(init=False)

    def __post_init__(self) -> None:
        self._retries = self.guard.retries if self.guard is not None else 0

    def push(self, token: int, scores: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """`token`, chosen from `scores`: the tokens to give out now, and None, or the scores to choose again from
        (the answer went back; feed nothing)."""
        self.tokens.append(token)
        if not self._retries or self.guard is None:
            return self.flush(), None
        found = self.guard.find(self.tokens)
        back = self._token_at(self.guard, found.start) if found is not None else None
        if found is None or back is None:  # no echo, or one that began in text already given: too late to change
            return self.flush(), None
        self._held.append(_Choice(scores.clone(), self.cache.checkpoint()))  # held: this token
        if not found.complete:  # it may become one: hold back from where it began
            give = self.tokens[self.given : back]
            del self._held[: back - self.given]
            self.given = back
            return give, None
        choice = self._held[back - self.given]
        self.cache.rollback(choice.mark)
        self._bans = {p: b for p, b in self._bans.items() if p <= back}
        self._bans.setdefault(back, set()).add(self.tokens[back])
        del self.tokens[back:], self._held[back - self.given :]
        self._retries -= 1
        again = choice.scores.clone()
        again[list(self._bans[back])] = float("-inf")
        return [], again

    def flush(self) -> list[int]:
        """Every token held back, given out (the answer ends, or can no longer be an echo)."""
        give = self.tokens[self.given :]
        self.given = len(self.tokens)
        self._held.clear()
        return give

    def _token_at(self, guard: EchoGuard, offset: int) -> int | None:
        """The first token held back, or the last one chosen, whose text reaches past character `offset`; None
        when that character lies in the text already given."""
        if len(guard.decode(self.tokens[: self.given])) > offset:
            return None
        for i in range(self.given, len(self.tokens)):
            if len(guard.decode(self.tokens[: i + 1])) > offset:
                return i
        return None
