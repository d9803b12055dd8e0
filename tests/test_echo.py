"""The question echo guard (kvchat.model.echo): an answer that opens by repeating the question is decoded again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvchat.model.echo import Echo, EchoGuard
from kvchat.model.llm import generate

WORDS = ["<eos>", "When", "did", "Tom", "plant", "tomatoes?", "In", "May", "when", "The", "answer:", '"When', "Tommy"]
ID = {w: i for i, w in enumerate(WORDS)}
QUESTION = "When did Tom plant tomatoes?"
NEXT = {"When": "did", "did": "Tom", "Tom": "plant", "plant": "tomatoes?", "tomatoes?": "<eos>", "In": "May",
        "May": "<eos>", "when": "<eos>", "The": "answer:", "answer:": ('"When', "May"), '"When': "did",
        "Tommy": "<eos>"}  # fmt: skip


def decode(tokens: list[int]) -> str:
    return " ".join(WORDS[t] for t in tokens)


def logits(best: str, second: str | None = None) -> torch.Tensor:
    row = torch.zeros(len(WORDS))
    row[ID[best]] = 2.0
    if second is not None:
        row[ID[second]] = 1.0
    return row


class ScriptedCache:
    """What generate asks of a cache: room, a checkpoint, a rollback; `fed` is every token in it."""

    def __init__(self) -> None:
        self.fed: list[int] = []

    def reserve(self, n: int) -> None:
        pass

    def checkpoint(self) -> int:
        return len(self.fed)

    def rollback(self, mark: int) -> None:
        del self.fed[mark:]


def scripted_model(first: torch.Tensor) -> SimpleNamespace:
    """A model whose next token follows NEXT from the last one fed, and `first` after the prompt."""

    def forward(cache, ids, recorder=None):
        cache.fed += ids[0].tolist()
        if ids.shape[-1] > 1:  # the prompt
            return first.view(1, 1, -1)
        following = NEXT[WORDS[cache.fed[-1]]]
        return logits(*following if isinstance(following, tuple) else (following,)).view(1, 1, -1)

    return SimpleNamespace(forward=forward, decode_step=None, stop_ids={ID["<eos>"]},
                           config=SimpleNamespace(max_position_embeddings=64))  # fmt: skip


def answer(first: torch.Tensor, guard: bool) -> tuple[str, ScriptedCache]:
    cache = ScriptedCache()
    prompt = torch.tensor([[ID["tomatoes?"], ID["<eos>"]]])  # two tokens: the forward returns `first`
    echo = EchoGuard(QUESTION, decode) if guard else None
    tokens = list(generate(scripted_model(first), cache, prompt, 16, echo=echo))
    return decode(tokens), cache


def test_an_answer_repeating_the_question_is_decoded_again_without_its_first_token():
    assert answer(logits("When", "In"), guard=False)[0] == QUESTION
    text, cache = answer(logits("When", "In"), guard=True)
    assert text == "In May"
    assert decode(cache.fed[2:]) == "In May"  # the echo's tokens left the cache


def test_an_answer_that_leaves_the_questions_words_is_untouched():
    assert answer(logits("In", "When"), guard=True)[0] == answer(logits("In", "When"), guard=False)[0] == "In May"
    assert answer(logits("when"), guard=True)[0] == "when"  # the question's first word alone, then the end


def test_an_echo_quoted_inside_the_answer_is_decoded_again_from_where_it_began():
    assert answer(logits("The"), guard=False)[0] == 'The answer: "When did Tom plant tomatoes?'
    assert answer(logits("The"), guard=True)[0] == "The answer: May"


def test_decoding_goes_back_at_most_retries_times():
    guard = EchoGuard(QUESTION, decode, retries=0)
    tokens = generate(scripted_model(logits("When", "In")), ScriptedCache(), torch.tensor([[1, 0]]), 16, echo=guard)
    assert decode(list(tokens)) == QUESTION


@pytest.mark.parametrize(
    ("tokens", "found"),
    [
        (["When"], Echo(0, complete=False)),  # may go on as the question
        (["When", "did", "Tom"], Echo(0, complete=False)),  # "Tom" may still become "Tommy"
        (["When", "did", "Tom", "plant"], Echo(0, complete=True)),
        (["when", "did", "Tom", "plant"], Echo(0, complete=True)),  # casefolded
        (["The", "answer:", '"When', "did", "Tom", "plant"], Echo(len('the answer: "'), complete=True)),
        (["In", "When", "did"], Echo(len("in "), complete=False)),
        (["When", "did", "Tommy"], None),
        (["In"], None),
        (["When", "May"], None),
    ],
)
def test_the_opening_is_found_as_words_of_the_text(tokens, found):
    assert EchoGuard(QUESTION, decode).find([ID[t] for t in tokens]) == found


def test_a_question_shorter_than_the_opening_has_no_echo():
    assert EchoGuard("When did?", decode).find([ID["When"], ID["did"], ID["Tom"]]) is None
