"""Grounded answers: is what an answer says found in the turns it drew on?

A small model answers fluently whether or not the conversation holds the answer ("The door code is 483." where the
turn says 4821). After decoding, `check` looks for the answer's terms (its numbers, names, dates and content words,
case and simple stems normalised; stop words and the question's own words left out) in the turns it drew on: its
sources, the turns recalled for it and the turns of its episode that match the question best (`drawn_on`). A term
found nowhere there is unsupported; an answer with an unsupported number, name or date, or mostly unsupported words,
is flagged, and so is one that only repeats a question asking for something ("Tom's project is 'The Project'.");
where a top turn holds a span of the same kind (a number where the answer has another one, a name), that span is
quoted as the better answer.

`off_topic` is the off-topic signal read off what retrieval found: a question is off-topic when no turn it could draw
on holds its words and no episode matches it either, and never when it follows up an earlier exchange. `quote_span`
gives a receipt's quote: the part of the turn that matches the answer rather than its first characters.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from kvchat.config import GroundingConfig

SUPPORTED, UNSUPPORTED, UNCHECKED = "supported", "unsupported", "unchecked"

# Words that carry no claim: function words, the filler small models answer with, and chat's generic verbs.
_STOP = frozenset("""
a about above after again against all also am an and any are aren't as at be because been before being below between
both but by can can't cannot could couldn't did didn't do does doesn't doing don't down during each either else even
ever every few for from further get gets got had hadn't has hasn't have haven't having he he'd he'll he's her here
here's hers herself him himself his how how's however i i'd i'll i'm i've if in into is isn't it it's its itself just
let's like made make many may me might mine more most much must mustn't my myself no nor not now of off on once one
only or other ought our ours ourselves out over own really said same say says she she'd she'll she's should shouldn't
so some such than that that's the their theirs them themselves then there there's these they they'd they'll they're
they've this those though through to too under until up upon us very was wasn't we we'd we'll we're we've were weren't
what what's when when's where where's whether which while who who's whom whose why why's will with won't would
wouldn't yes yet you you'd you'll you're you've your yours yourself yourselves answer called named name conversation
mentioned mention tell told think know sure sorry based according yeah okay ok oh well thing things something anything
""".split())

_NUMBER_WORDS = {w: str(n) for n, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty".split())}  # fmt: skip
_MONTHS = {m[:3]: str(n) for n, m in enumerate(
    "january february march april may june july august september october november december".split(), start=1)}
_ORDINAL = re.compile(r"^(\d+)(?:st|nd|rd|th)$")
# A word: letters, digits, and the marks inside numbers, codes and dates (4,821; 3.5; B-17; 2023-05-01; 10:30).
_TERM = re.compile(r"[^\W_](?:[\w'’]|[.,:/-](?=[^\W_]))*")
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)")
_ASKING = re.compile(r"\b(?:what|which|who|whom|whose|when|where|how)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Quote:
    """A span of a turn: what the conversation says where the answer says something else."""

    turn: int
    speaker: str
    quote: str
    time: str | None = None


@dataclass(frozen=True)
class Grounding:
    """How far an answer is found in the turns it drew on (`status`: supported, unsupported, or unchecked where
    there was nothing to check: no claim in the answer, or no turn it drew on)."""

    status: str
    unsupported: list[str] = field(default_factory=list)  # the answer's terms found in none of the turns (none: it
                                                           # only repeats a question that asks for something)
    checked: int = 0                                       # the answer's terms looked for
    better: Quote | None = None                            # a top turn's span of the same kind, where there is one

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Turn:
    """A turn an answer may draw on: its index in the history, speaker, time and text."""

    index: int
    speaker: str
    text: str
    time: str | None = None


@dataclass(frozen=True)
class _Term:
    shown: str  # as the answer spells it
    key: str    # normalised: case, number words, thousands marks, stems
    kind: str   # number | name | word


def check(answer: str, question: str, turns: Sequence[Turn], config: GroundingConfig = GroundingConfig()
          ) -> Grounding:  # fmt: skip
    """`answer` checked against `turns` (the turns it drew on, the most relevant first: `drawn_on`)."""
    asked = {t.key for t in _terms(question)}
    claims = _unique(t for t in _terms(answer) if t.key not in asked)
    if not turns:
        return Grounding(UNCHECKED, checked=len(claims))
    if not claims:  # it only repeats the question: no answer to a question asking for something, else nothing to check
        if not _asks_for_something(question):
            return Grounding(UNCHECKED)
        return Grounding(UNSUPPORTED, better=_better([], asked, set(), turns[: config.quote_turns], config.quote_chars))
    found = set().union(*(_keys(t.text) for t in turns))
    missing = [t for t in claims if t.key not in found]
    strict = [t for t in missing if t.kind != "word"]
    words = [t for t in claims if t.kind == "word"]
    loose = [t for t in missing if t.kind == "word"]
    flagged = bool(strict) or (bool(words) and len(loose) / len(words) > config.max_unsupported_words)
    if not flagged:
        return Grounding(SUPPORTED, checked=len(claims))
    return Grounding(UNSUPPORTED, [t.shown for t in missing], len(claims),
                     _better(missing, asked, {t.key for t in claims}, turns[: config.quote_turns], config.quote_chars))


def _asks_for_something(question: str) -> bool:
    """A question asking for a thing (what, which, who, when, where, how many...), not for a yes or a no."""
    return bool(_ASKING.search(question))


def drawn_on(question: str, candidates: Sequence[Turn], first: Sequence[Turn], count: int) -> list[Turn]:
    """The turns an answer drew on: `first` (its sources, most attended first, and the turns recalled for it), then the
    `count` turns of `candidates` (its episode's) sharing the most of the question's terms."""
    chosen = list(first)
    seen = {t.index for t in chosen}
    asked = {t.key for t in _terms(question)}
    scored = sorted(((len(asked & _keys(t.text)), -i, t) for i, t in enumerate(candidates) if t.index not in seen),
                    key=lambda s: s[:2], reverse=True)  # fmt: skip
    chosen += [t for score, _, t in scored[:count] if score > 0]
    return chosen


def coverage(question: str, turns: Iterable[Turn]) -> float:
    """The largest share of the question's terms that one of `turns` holds (0 when the question has none)."""
    asked = {t.key for t in _terms(question)}
    if not asked:
        return 0.0
    return max((len(asked & _keys(t.text)) / len(asked) for t in turns), default=0.0)


def off_topic(similarity: float, covered: float, follow_up: bool, config: GroundingConfig = GroundingConfig(),
              similarity_floor: float = 0.3) -> bool:  # fmt: skip
    """The off-topic signal: no episode matches the question (routing similarity under `similarity_floor`) and no turn
    it could draw on holds its words (`covered`, `coverage`'s share, under the config's); never for a follow-up,
    whose words are the exchange before it."""
    return not follow_up and similarity < similarity_floor and covered < config.off_topic_coverage


def quote_span(text: str, answer: str, question: str, limit: int) -> str:
    """What a receipt quotes of a turn's `text`: the sentence holding most of the answer's terms (else the question's),
    cut to `limit` characters around its first match; the turn's start where neither is found."""
    flat = " ".join(text.split())
    for wanted in ({t.key for t in _terms(answer)}, {t.key for t in _terms(question)}):
        best = _best_sentence(flat, wanted)
        if best is not None:
            return _around(*best, limit)
    return _around(flat, 0, limit)


def _better(missing: Sequence[_Term], asked: set[str], said: set[str], turns: Sequence[Turn], limit: int
            ) -> Quote | None:  # fmt: skip
    """The span of the first of `turns` holding a term of the same kind as one of `missing` that neither the question
    nor the answer says (a number for a number, a name for a name) in a sentence sharing the question's words; else
    the sentence sharing most of them."""
    kinds = {t.kind for t in missing if t.kind != "word"}
    fallback: tuple[int, Quote] | None = None
    for turn in turns:
        flat = " ".join(turn.text.split())
        for match in _SENTENCE.finditer(flat):
            sentence = match.group().strip()
            terms = _terms(sentence)
            overlap = len(asked & {t.key for t in terms})
            if not overlap:
                continue
            fresh = [t for t in terms if t.kind in kinds and t.key not in asked and t.key not in said]
            if fresh:
                at = sentence.find(fresh[0].shown)
                return Quote(turn.index, turn.speaker, _around(sentence, max(at, 0), limit), turn.time)
            if fallback is None or overlap > fallback[0]:
                fallback = (overlap, Quote(turn.index, turn.speaker, _around(sentence, 0, limit), turn.time))
    return None if fallback is None else fallback[1]


def _best_sentence(flat: str, wanted: set[str]) -> tuple[str, int] | None:
    """The sentence of `flat` sharing most of `wanted` (the first of equals) and where in it the first match is."""
    best: tuple[int, str, int] | None = None
    for match in _SENTENCE.finditer(flat):
        sentence = match.group().strip()
        hits = [(m.start(), _key(m.group())) for m in _TERM.finditer(sentence)]
        found = {key for _, key in hits if key in wanted}
        if found and (best is None or len(found) > best[0]):
            best = (len(found), sentence, min(at for at, key in hits if key in wanted))
    return None if best is None else (best[1], best[2])


def _around(sentence: str, at: int, limit: int) -> str:
    """`sentence` cut to `limit` characters at word boundaries, keeping the character `at` (an ellipsis marks a cut)."""
    if len(sentence) <= limit:
        return sentence
    start = max(0, min(at - limit // 3, len(sentence) - limit))
    if start:
        space = sentence.find(" ", start)
        start = space + 1 if 0 <= space < at else start
    end = start + limit - (1 if start else 0) - 1
    if end < len(sentence):
        space = sentence.rfind(" ", start, end)
        end = space if space > at else end
    return ("…" if start else "") + sentence[start:end].rstrip(" ,;:") + ("…" if end < len(sentence) else "")


def _terms(text: str) -> list[_Term]:
    terms = []
    for match in _TERM.finditer(text):
        shown = match.group().strip(".,:/-'’")
        low = shown.lower().replace("’", "'")
        if low in _STOP or (len(low) < 3 and not any(c.isdigit() for c in low)):
            continue
        key = _key(shown)
        if any(c.isdigit() for c in key) or low in _NUMBER_WORDS:
            kind = "number"
        elif low[:3] in _MONTHS and low in _month_names():
            kind = "number"  # a date's month: compared as a number
        elif shown[:1].isupper() and match.start() > 0 and text[: match.start()].rstrip()[-1:] not in ".!?\n":
            kind = "name"
        else:
            kind = "word"
        terms.append(_Term(shown, key, kind))
    return terms


def _keys(text: str) -> set[str]:
    return {t.key for t in _terms(text)}


@functools.lru_cache(maxsize=1 << 16)  # a pure function of the word: an episode's turns are checked per question
def _key(word: str) -> str:
    """A word as it is compared: lower case, a number's digits alone (4,821 = 4821; "four" = 4; 3rd = 3), a month's
    number, else its simple stem without a possessive."""
    low = word.lower().replace("’", "'").strip(".,:/-'")
    low = low[:-2] if low.endswith("'s") else low
    if low in _NUMBER_WORDS:
        return _NUMBER_WORDS[low]
    if low in _month_names():
        return "month" + _MONTHS[low[:3]]
    ordinal = _ORDINAL.match(low)
    if ordinal:
        return ordinal.group(1)
    if re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", low):
        return low.replace(",", "")
    if any(c.isdigit() for c in low):
        return low
    return _stem(low)


def _unique(terms: Iterable[_Term]) -> list[_Term]:
    seen: dict[str, _Term] = {}
    for term in terms:
        seen.setdefault(term.key, term)
    return list(seen.values())


@functools.cache
def _month_names() -> frozenset[str]:
    names = "january february march april june july august september october november december".split()
    return frozenset(names + [n[:3] for n in names if n != "may"] + ["sept"])


_SUFFIXES = (("ies", "y"), ("ied", "y"), ("ing", ""), ("ed", ""), ("es", ""), ("ly", ""), ("s", ""))


def _stem(word: str) -> str:
    """A simple stem: one inflection off (plural, past, -ing, -ly), then a final e (lake = lakes, leave = leaves).
    Not nltk's Porter stemmer: importing nltk imports scikit-learn, which a question must not pay for."""
    for suffix, replacement in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not (suffix == "s" and word.endswith("ss")):
            word = word[: -len(suffix)] + replacement
            break
    return word[:-1] if word.endswith("e") and len(word) > 3 else word
