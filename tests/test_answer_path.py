"""The one answer path (kvchat.answer.decoding): the question's prompt, sampling, the end of an answer where the model
writes the history on, and follow-ups routed with the exchange they continue; on the tiny model and fake scores."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.answer.session import Session
from kvchat.answer.stops import TextGate
from kvchat.config import AskConfig, CacheConfig, EpisodeConfig, IngestConfig, Sampling
from kvchat.errors import UserError
from kvchat.history.synthetic import planted_conversation
from kvchat.ingest.pipeline import ingest
from kvchat.model.llm import ChatLayout
from kvchat.model.sampling import Sampler
from kvchat.store import Store

SPEAKERS = ("Dana", "Sam", "Dana Lee")
SMALL = IngestConfig(cache=CacheConfig(budget=64, block_size=32, prefill="block"),
                     episodes=EpisodeConfig(episodes=3, patched_prompt_tokens=32))


# --------------------------------------------------------------------------- where an answer ends


@pytest.mark.parametrize(("text", "shown", "cut"), [
    ("Dana: 12:30\nDana: 12:30\nDana: 12:30", "12:30", True),   # a speaker's label at the start is dropped
    ("  The gate is B17.\nSam: ok, thanks", "The gate is B17.", True),
    ("[08/05/2023, 13:40]\nDana: The violin.\n[08/05/2023, 13:41]\nSam: yes", "The violin.", True),
    ("The violin.\n[2023-05-08 13:41] Sam: yes", "The violin.", True),
    ("Dana Lee: the blue one\nDana: no", "the blue one", True),  # the longest label
    ("Dana said it was blue.\nSamples are fine.", "Dana said it was blue.\nSamples are fine.", False),
    ("It is [blue].\n[a list]\n- one", "It is [blue].\n[a list]\n- one", False),
    ("Sam planted 23.\n\n  ", "Sam planted 23.", False),
])
def test_an_answer_ends_where_the_model_writes_the_history_on(text, shown, cut):
    gate = TextGate((), SPEAKERS)
    assert gate.feed(text) + gate.finish() == shown == gate.text
    assert gate.transcript_cut == cut == gate.stopped


def test_without_speakers_no_line_is_cut():
    gate = TextGate()
    assert gate.feed("Dana: hi\nSam: yo\n[08/05]") + gate.finish() == "Dana: hi\nSam: yo\n[08/05]"


_PIECES = st.sampled_from(["Dana", "Dana:", " Lee:", "Sam", ":", "\n", " ", "[08/05]", "[", "]", "END", "EN", "D",
                           "The", " gate", " is", " B17.", "x", "\n\n"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=14), st.integers(1, 5))
def test_a_streamed_answer_is_the_text_a_whole_one_gives(pieces, size):
    text = "".join(pieces)
    whole = TextGate(["END"], SPEAKERS)
    expected = whole.feed(text) + whole.finish()
    streamed = TextGate(["END"], SPEAKERS)
    released = [streamed.feed(text[i:i + size]) for i in range(0, len(text), size)]
    assert "".join(released) + streamed.finish() == expected == streamed.text
    assert (streamed.stopped, streamed.transcript_cut) == (whole.stopped, whole.transcript_cut)
    assert expected == expected.strip() and "END" not in expected
    lines = expected.split("\n")
    assert not any(line.lstrip().startswith(label) for line in lines[1:] for label in ("Dana:", "Sam:"))


# --------------------------------------------------------------------------- choosing tokens


def test_sampling_settings_out_of_range_are_refused_in_one_line():
    for given_ in ({"temperature": 2.5}, {"top_p": 0.0}, {"repetition_penalty": 0.9}, {"seed": -1},
                   {"frequency_penalty": 3.0}, {"temperature": float("nan")}):
        with pytest.raises(UserError) as raised:
            Sampling(**given_)
        assert "\n" not in str(raised.value) and "must be within" in str(raised.value)


def test_greedy_takes_the_best_and_the_penalty_demotes_what_the_answer_holds():
    scores = torch.tensor([0.0, 3.0, 2.8, -1.0])
    off = Sampling(repetition_penalty=1.0)
    assert Sampler(off).choose(scores, [1]) == 1  # no penalty: the argmax, repeated or not
    assert Sampler().choose(scores, [1]) == 2  # the default penalty (1.1): 3.0 / 1.1 < 2.8
    assert Sampler(Sampling(repetition_penalty=1.2)).choose(scores, []) == 1
    assert Sampler(Sampling(repetition_penalty=1.2)).choose(scores, [1]) == 2  # 3.0 / 1.2 < 2.8
    assert Sampler(Sampling(repetition_penalty=1.0, frequency_penalty=0.5)).choose(scores, [1]) == 2
    assert Sampler(Sampling(repetition_penalty=1.0, presence_penalty=0.1)).choose(scores, [1]) == 1


def test_a_seed_repeats_a_draw_and_top_p_keeps_to_the_likeliest():
    scores = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    def draws(sampling):
        sampler = Sampler(sampling)
        return [sampler.choose(scores, []) for _ in range(40)]

    assert draws(Sampling(temperature=1.0, seed=7)) == draws(Sampling(temperature=1.0, seed=7))
    assert draws(Sampling(temperature=1.0, seed=7)) != draws(Sampling(temperature=1.0, seed=8))
    assert set(draws(Sampling(temperature=1.0, seed=7, top_p=0.7))) == {0, 1}  # 0.5 + 0.3 hold 0.7
    assert set(draws(Sampling(temperature=1.0, seed=7))) == {0, 1, 2, 3}
    assert Sampler(Sampling(temperature=1.0)).seed is not None  # drawn afresh, and known


# --------------------------------------------------------------------------- the prompt


def test_instructions_are_a_system_turn_after_the_conversation(tiny_lm):
    layout = ChatLayout.from_tokenizer(tiny_lm.tokenizer, "You are a helpful assistant .")
    text = layout.question("Q ?", [("q1", "a1")], system="Answer briefly .")
    assert text.startswith("<|im_end|>\n<|im_start|>system\nAnswer briefly .<|im_end|>\n<|im_start|>user\nq1")
    assert text.endswith("<|im_start|>user\nQ ?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_a_second_system_turn_puts_instructions_in_the_users(tiny_lm):
    tokenizer = tiny_lm.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                               "{{ raise_exception('system first only') }}{% endif %}<|im_start|>{{ m['role'] }}\n"
                               "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                               "<|im_start|>assistant\n{% endif %}")
    try:
        layout = ChatLayout.from_tokenizer(tokenizer, "S")
    finally:
        tokenizer.chat_template = saved
    assert layout.before_system is None
    assert layout.question("Q ?", system="Be brief .") == "<|im_end|>\n<|im_start|>user\nBe brief .\n\nQ ?" \
        "<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- through a session


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tiny_lm, encoder):
    home = tmp_path_factory.mktemp("answer-path")
    messages, facts = planted_conversation(seed=2, topics=3, turns_per_topic=12)
    path = home / "chat.json"
    path.write_text(json.dumps(messages))
    store = Store(home)
    ingest(path, name="chat", config=SMALL, store=store, lm=tiny_lm, encoder=encoder)
    yield store, facts
    store.close()


class _Prompts:
    """The model, recording every text it is asked to encode."""

    def __init__(self, lm) -> None:
        self._lm, self.texts = lm, []

    def encode(self, text):
        self.texts.append(text)
        return self._lm.encode(text)

    def __getattr__(self, name):
        return getattr(self._lm, name)


def test_the_same_seed_gives_the_same_answer_and_another_seed_another(planted, tiny_lm, encoder):
    store, facts = planted
    question = facts[0].question

    def answer(seed: int | None, temperature: float = 1.0) -> str:
        config = AskConfig(max_new_tokens=12, sampling=Sampling(temperature=temperature, seed=seed))
        return Session(store, store.get("chat"), tiny_lm, encoder, config).ask(question, log=False).text

    assert answer(3) == answer(3)
    assert len({answer(3), answer(4), answer(5)}) > 1
    assert answer(None, temperature=0.0) == answer(None, temperature=0.0)


def test_instructions_reach_the_prompt_before_the_question(planted, tiny_lm, encoder):
    store, facts = planted
    recording = _Prompts(tiny_lm)
    config = AskConfig(max_new_tokens=4, system="Answer in one word .")
    plain = Session(store, store.get("chat"), tiny_lm, encoder, AskConfig(max_new_tokens=4)).ask(facts[0].question,
                                                                                                  log=False)
    told = Session(store, store.get("chat"), recording, encoder, config).ask(facts[0].question, log=False)
    prompt = next(t for t in recording.texts if facts[0].question in t and t != facts[0].question)
    assert prompt.index("Answer in one word .") < prompt.index(facts[0].question)
    assert told.prompt_tokens > plain.prompt_tokens


def test_a_follow_up_is_routed_with_the_exchange_it_continues(planted, tiny_lm, encoder):
    store, facts = planted
    session = Session(store, store.get("chat"), tiny_lm, encoder)
    follow_up = "And what colour was it?"
    moved = [(f, session.route(f.question)[0]) for f in facts if session.route(follow_up)[0] != session.route(
        f.question)[0]]  # fmt: skip
    assert moved, "every fact's episode is where the follow-up alone goes: the test shows nothing"
    for fact, episode in moved:
        earlier = ((fact.question, fact.answer),)
        assert session.route(follow_up, earlier)[0] == episode
        answer = session.ask(follow_up, earlier=earlier, log=False)
        assert answer.episode == episode and not answer.off_topic
