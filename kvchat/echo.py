"""Question echo: a small model that cannot find the answer often repeats the question back, as its answer or
quoted inside one ('The answer to the question is: "When did ...?"').

Such an answer says nothing, so kvchat does not give it: an answer's tokens are held back while they could be the
start of the question's first words, verbatim, and once they are those words, decoding goes back to the token
where they began and takes the next best token there (`kvchat.llm.generate`). Answers that never spell out the
question's opening are untouched, token for token; only the tokens that might begin it are shown a little later.
Words are compared as casefolded text, since the question in the prompt and the answer tokenize differently (the
question follows a space, the answer opens a line).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvchat.config import ECHO_RETRIES, ECHO_WORDS

_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Echo:
    """Where the question's opening begins, or may begin, in an answer's text (a character offset)."""

    start: int
    complete: bool  # all of the opening's words are there; else the text so far ends with a part of them


@dataclass(frozen=True)
class EchoGuard:
    """Finds the question's first `words` words (all of them in a shorter question) in an answer's text; decoding
    goes back at most `retries` times per answer, after which the answer is left as it comes."""

    question: str
    decode: Callable[[list[int]], str]
    words: int = ECHO_WORDS
    retries: int = ECHO_RETRIES

    def find(self, tokens: Sequence[int]) -> Echo | None:
        """The opening in the answer `tokens` decode to, complete, or begun at the text's end; None if neither."""
        opening = _WORD.findall(self.question.casefold())[: self.words]
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


def _begins(tail: list[str], opening: list[str], open_end: bool) -> bool:
    """Whether `tail` is how `opening` starts; its last word may be cut short when the text ends inside it."""
    if not tail or len(tail) > len(opening) or tail[:-1] != opening[: len(tail) - 1]:
        return False
    want = opening[len(tail) - 1]
    return tail[-1] == want or (open_end and want.startswith(tail[-1]))
