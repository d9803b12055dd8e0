"""Long generated histories with planted facts: years of dated chat sessions between two recurring speakers about
everyday topics, with personal facts about the people they know planted at known depths, some updated later, and
a question for each whose evidence is the turn that states its latest value.

Deterministic for a seed and a token counter (the embedded model's tokenizer in benchmarks/long_history.py), so a
history of 10^5 or 10^6 tokens is made here rather than downloaded. `LongHistory.to_locomo()` is a LoCoMo document
(sessions dated by `session_N_date_time`, turns with `dia_id`s, a `qa` list with evidence ids), which `kvchat
ingest` reads and kvchat.eval.qa.load_locomo loads with its questions. The words come from
kvchat.history.everyday_talk.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvchat.history.everyday_talk import (
    ACKS,
    CLOSINGS,
    ENDINGS,
    FACT_KINDS,
    GREETING_REPLIES,
    GREETINGS,
    NAMES,
    OPENINGS,
    SWITCHES,
    TOPICS,
    WEEKDAYS,
    WHEN,
    FactKind,
    Topic,
)
from kvchat.history.loading import Turn, format_turns

FACTS = 100            # facts planted by default, whatever the history's length
UPDATE_EVERY = 5       # every 5th planted turn updates a fact stated earlier (when one is left to update)
UPDATE_AFTER = 20      # ... the fact planted this many planted turns before it
START = dt.datetime(2019, 3, 4, 9, 30)


@dataclass(frozen=True)
class PlantedFact:
    """One planted fact and its question: `answer` is its latest value, stated in turn `evidence` (a dia_id) at
    `depth` (the share of the history's tokens before that turn); an updated fact's first value and turn are
    `first_answer` and `first_evidence`."""

    subject: str
    kind: str
    question: str
    answer: str
    evidence: str
    depth: float
    first_answer: str | None = None
    first_evidence: str | None = None
    first_depth: float | None = None

    @property
    def updated(self) -> bool:
        return self.first_evidence is not None


@dataclass(frozen=True)
class Session:
    date: str  # LoCoMo's style: "9:30 am on 4 March, 2019"
    turns: tuple[tuple[str, str], ...]  # (speaker, text)


@dataclass(frozen=True)
class LongHistory:
    speakers: tuple[str, str]
    sessions: list[Session]
    facts: list[PlantedFact]
    tokens: int  # as counted while generating: each rendered line's tokens and its newline

    def turns(self) -> list[Turn]:
        """The history as kvchat reads it (`kvchat ingest` of `to_locomo()`'s file gives the same turns)."""
        return [Turn(speaker, text, time=s.date, turn_id=f"D{n}:{j}")
                for n, s in enumerate(self.sessions, 1) for j, (speaker, text) in enumerate(s.turns, 1)]  # fmt: skip

    def to_locomo(self) -> dict:
        """A LoCoMo conversation with its questions (category 4, single-hop; `kind` says "stated" or "updated",
        `depth` where the evidence lies)."""
        conversation: dict[str, object] = {"speaker_a": self.speakers[0], "speaker_b": self.speakers[1]}
        for n, s in enumerate(self.sessions, 1):
            conversation[f"session_{n}_date_time"] = s.date
            conversation[f"session_{n}"] = [{"speaker": speaker, "dia_id": f"D{n}:{j}", "text": text}
                                            for j, (speaker, text) in enumerate(s.turns, 1)]  # fmt: skip
        qa = [{"question": f.question, "answer": f.answer, "evidence": [f.evidence], "category": 4,
               "kind": "updated" if f.updated else "stated", "depth": round(f.depth, 4),
               **({"first_answer": f.first_answer, "first_evidence": f.first_evidence} if f.updated else {})}
              for f in self.facts]  # fmt: skip
        return {"sample_id": f"long-{self.tokens}", "conversation": conversation, "qa": qa}


def _estimate(text: str) -> int:
    """About a token per four characters: what English text costs a BPE tokenizer."""
    return max(1, len(text) // 4)


def long_history(tokens: int, *, seed: int = 0, facts: int = FACTS,
                 count_tokens: Callable[[str], int] | None = None) -> LongHistory:  # fmt: skip
    """A history of at least `tokens` tokens (by `count_tokens` of each rendered line, kvchat's rendering; default:
    an estimate of four characters a token) with `facts` planted facts, their planted turns (stated and updated)
    evenly spread over the depth. The same arguments give the same history."""
    if tokens < 1000:
        raise ValueError(f"a long history has at least 1000 tokens (got {tokens})")
    if not 1 <= facts <= _capacity():
        raise ValueError(f"facts must be in 1..{_capacity()} (got {facts})")
    return _Writer(random.Random(seed), tokens, facts, count_tokens or _estimate).write()


def _capacity() -> int:
    """The most facts a history can plant: each kind about each person at most once, no value used twice."""
    return sum(min(len(NAMES) - 2, len(k.values)) for k in FACT_KINDS)


@dataclass(frozen=True)
class _Planted:
    """A planting event: state fact `fact` (its first value), or update it."""

    fact: int
    update: bool


def _events(facts: int) -> list[_Planted]:
    """The planted turns in history order: each fact stated once; every UPDATE_EVERY-th turn instead updates the
    latest fact stated at least UPDATE_AFTER turns before it and not updated yet."""
    events: list[_Planted] = []
    updated: set[int] = set()
    stated = 0
    while stated < facts:
        slot = len(events)
        if slot % UPDATE_EVERY == UPDATE_EVERY - 1:
            earlier = next((e.fact for e in reversed(events[: max(0, slot - UPDATE_AFTER + 1)])
                            if not e.update and e.fact not in updated), None)  # fmt: skip
            if earlier is not None:
                updated.add(earlier)
                events.append(_Planted(earlier, True))
                continue
        events.append(_Planted(stated, False))
        stated += 1
    return events


@dataclass
class _Fact:
    """A fact being planted: its values (a first one and, when updated, a later one) and where each was said."""

    kind: FactKind
    person: str
    values: list[str]
    turns: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # tokens before each of its turns


@dataclass
class _Writer:
    rng: random.Random
    target: int
    facts: int
    count: Callable[[str], int]
    sessions: list[Session] = field(default_factory=list)
    tokens: int = 0
    speakers: tuple[str, str] = ("", "")
    people: list[str] = field(default_factory=list)

    def write(self) -> LongHistory:
        rng = self.rng
        first, second = rng.sample(NAMES, 2)
        self.speakers = (first, second)
        self.people = [n for n in NAMES if n not in self.speakers]
        events = _events(self.facts)
        facts = self._choose({e.fact for e in events if e.update})
        due = [(int((k + 0.5) / len(events) * self.target), e) for k, e in enumerate(events)]
        when = START
        while self.tokens < self.target or due:
            when += dt.timedelta(days=rng.choice((1, 1, 2, 2, 3, 4, 7)), minutes=rng.randrange(-180, 180))
            self._session(when, due, facts)
        return LongHistory(self.speakers, self.sessions, [self._planted_fact(f) for f in facts], self.tokens)

    def _choose(self, updated: set[int]) -> list[_Fact]:
        """`facts` distinct (kind, person) pairs spread over the kinds, an updatable kind for each fact in
        `updated`, with values no other fact of the kind uses."""
        pairs = [(kind, person) for kind in FACT_KINDS for person in self.people]
        self.rng.shuffle(pairs)
        free = {kind.name: list(kind.values) for kind in FACT_KINDS}
        chosen: list[_Fact] = []
        for i in range(self.facts):
            need = 2 if i in updated else 1
            found = next(((k, p) for k, p in pairs if len(free[k.name]) >= need and (k.updates or need == 1)), None)
            if found is None:
                raise ValueError(f"{self.facts} facts do not fit in one history's people and values")
            kind, person = found
            pairs.remove(found)
            values = self.rng.sample(free[kind.name], need)
            free[kind.name] = [v for v in free[kind.name] if v not in values]
            chosen.append(_Fact(kind, person, values))
        return chosen

    def _session(self, when: dt.datetime, due: list[tuple[int, _Planted]], facts: list[_Fact]) -> None:
        """One dated session: a greeting, talk about one to three topics, a goodbye, and any planted turn that falls
        due on the way (each followed by an acknowledgement)."""
        rng = self.rng
        a, b = self.speakers if rng.random() < 0.5 else self.speakers[::-1]
        lines = [rng.choice(GREETINGS).format(other=b), rng.choice(GREETING_REPLIES).format(other=a)]
        for n, topic in enumerate(rng.sample(TOPICS, rng.choice((1, 2, 2, 3)))):
            lines += self._talk(topic, first=n == 0)
        lines.append(rng.choice(CLOSINGS).format(other=a if len(lines) % 2 else b))
        turns: list[tuple[str, str]] = []
        date = _date(when)
        for text in lines:
            if due and self.tokens >= due[0][0] and len(turns) >= 2:
                event = due.pop(0)[1]
                fact = facts[event.fact]
                self._add(turns, date, self._said(fact, event.update), fact, (a, b))
                self._add(turns, date, rng.choice(ACKS).format(friend=fact.person), None, (a, b))
            self._add(turns, date, text, None, (a, b))
        self.sessions.append(Session(date, tuple(turns)))

    def _add(self, turns: list, date: str, text: str, fact: _Fact | None, speakers: tuple[str, str]) -> None:
        speaker = speakers[len(turns) % 2]
        if fact is not None:
            fact.turns.append(f"D{len(self.sessions) + 1}:{len(turns) + 1}")
            fact.offsets.append(self.tokens)
        shown = format_turns([Turn(speaker, text, time=date)])[0] if not turns else f"{speaker}: {text}"
        self.tokens += self.count(shown) + 1
        turns.append((speaker, text))

    def _said(self, fact: _Fact, update: bool) -> str:
        """The planted turn's text: the fact's first value, or its later one."""
        templates = fact.kind.updates if update else fact.kind.says
        text = self.rng.choice(templates).format(who=fact.person, value=fact.values[-1 if update else 0])
        if self.rng.random() < 0.5:
            return f"{self.rng.choice(SWITCHES)} {text}"
        return text[0].upper() + text[1:]

    def _talk(self, topic: Topic, *, first: bool) -> list[str]:
        """A stretch of talk about `topic`: statements and replies in turn."""
        rng = self.rng
        out = []
        for i in range(rng.randrange(6, 15)):
            pool = topic.lines if i % 2 == 0 or rng.random() < 0.3 else topic.replies
            text = self._fill(rng.choice(pool), topic)
            if i == 0 and not first and rng.random() < 0.5:
                text = f"{rng.choice(SWITCHES)} {text[0].lower()}{text[1:]}"
            out.append(text)
        return out

    def _fill(self, template: str, topic: Topic) -> str:
        """`template` with its slots filled, sometimes opened or ended by a phrase of its own."""
        rng = self.rng
        slots = {"thing": rng.choice(topic.thing), "place": rng.choice(topic.place), "act": rng.choice(topic.act),
                 "adj": rng.choice(topic.adj), "friend": rng.choice(self.people), "day": rng.choice(WEEKDAYS),
                 "when": rng.choice(WHEN), "num": str(rng.randrange(2, 13))}  # fmt: skip
        text = template.format(**slots)
        if rng.random() < 0.3:
            text = f"{rng.choice(OPENINGS)} {text[0].lower()}{text[1:]}"
        if rng.random() < 0.35:
            text = f"{text} {rng.choice(ENDINGS).format(**slots)}"
        return text[0].upper() + text[1:]

    def _planted_fact(self, fact: _Fact) -> PlantedFact:
        question = fact.kind.question.format(who=fact.person)
        depths = [offset / self.tokens for offset in fact.offsets]
        if len(fact.turns) > 1:
            return PlantedFact(fact.person, fact.kind.name, question, fact.values[-1], fact.turns[-1], depths[-1],
                               fact.values[0], fact.turns[0], depths[0])
        return PlantedFact(fact.person, fact.kind.name, question, fact.values[0], fact.turns[0], depths[0])


def _date(when: dt.datetime) -> str:
    hour = when.hour % 12 or 12
    return f"{hour}:{when.minute:02d} {'am' if when.hour < 12 else 'pm'} on {when.day} {when:%B}, {when.year}"
