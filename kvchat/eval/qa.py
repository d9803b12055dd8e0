"""Question-answering sets for evaluation: LoCoMo conversations (cut to whole sessions, questions kept only
when all their evidence is inside the cut) and planted-fact conversations, plus LoCoMo's answer scoring.

Scoring follows LoCoMo's `task_eval/evaluation.py`: lowercase, drop commas, punctuation and the words
a/an/the/and, Porter-stem, token F1. Per category: multi-hop (1) golds are comma-separated lists scored
as the mean over gold items of the best-matching predicted item; open-domain (3) golds keep the part
before the first ';'; adversarial (5) scores 1 when the answer says the fact is not mentioned.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from nltk.stem import PorterStemmer

from kvchat.errors import UserError
from kvchat.history.loading import Turn, format_turns, parse_history
from kvchat.history.synthetic import planted_conversation
from kvchat.messages import option

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial", 0: "planted"}
ADVERSARIAL = 5
_EVIDENCE = re.compile(r"D(\d+):(\d+)")
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_STEMMER = PorterStemmer()


@dataclass(frozen=True)
class Question:
    qid: str          # stable within its set: the question's index in the source file
    text: str
    gold: str
    category: int     # LoCoMo category (CATEGORIES); 0 for planted facts
    evidence: tuple[str, ...] = ()   # dia_ids of the turns that hold the answer


@dataclass(frozen=True)
class QASet:
    """One conversation and the questions asked about it."""

    name: str
    turns: list[Turn]
    questions: list[Question]
    sessions_kept: int = 0
    sessions_total: int = 0

    def describe(self, limit: int | None) -> str:
        """One report line: how much of the conversation was kept and how many of its questions asked."""
        sessions = f"first {self.sessions_kept} of {self.sessions_total} sessions, " if self.sessions_total else ""
        asked = len(sample_questions(self.questions, limit))
        return f"{self.name}: {sessions}{len(self.turns)} turns, {asked} of its {len(self.questions)} questions"


# --- scoring ---------------------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """LoCoMo's normalisation: lowercase, no commas/punctuation/articles/'and', single spaces."""
    text = text.replace(",", "").lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _tokens(text: str) -> list[str]:
    return [_STEMMER.stem(word) for word in normalize_answer(text).split()]


def token_f1(prediction: str, gold: str) -> float:
    """Token F1 of the normalised, stemmed words."""
    pred, ref = _tokens(prediction), _tokens(gold)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _multi_answer_f1(prediction: str, gold: str) -> float:
    predictions = [p.strip() for p in prediction.split(",")]
    golds = [g.strip() for g in gold.split(",")]
    return sum(max(token_f1(p, g) for p in predictions) for g in golds) / len(golds)


def score_answer(prediction: str, question: Question) -> float:
    """LoCoMo's per-category score of `prediction` (0..1)."""
    if question.category == ADVERSARIAL:
        said = prediction.lower()
        return float("no information available" in said or "not mentioned" in said)
    if question.category == 1:
        return _multi_answer_f1(prediction, question.gold)
    gold = question.gold.split(";")[0].strip() if question.category == 3 else question.gold
    return token_f1(prediction, gold)


def repeats_itself(prediction: str, words: int = 4) -> bool:
    """The answer loops: some sequence of `words` words occurs in it twice ("a big dog with a big dog with ...")."""
    found = re.findall(r"\w+", prediction.lower())
    grams = [tuple(found[i : i + words]) for i in range(len(found) - words + 1)]
    return len(grams) != len(set(grams))


def contains_gold(prediction: str, question: Question) -> bool:
    """Recall as the planted-fact set measures it: the normalised gold appears in the normalised answer."""
    gold = normalize_answer(question.gold)
    return bool(gold) and gold in normalize_answer(prediction)


# --- LoCoMo ------------------------------------------------------------------------------------------
def session_of(turn: Turn) -> int | None:
    """LoCoMo session number from a dia_id like "D3:12"."""
    match = _EVIDENCE.fullmatch(turn.turn_id or "")
    return int(match.group(1)) if match else None


def load_locomo(
    path: Path,
    *,
    count_tokens: Callable[[str], int] | None = None,
    max_context: int | None = None,
    categories: Iterable[int] = (1, 2, 3, 4),
) -> QASet:
    """A LoCoMo file as a QASet: whole sessions from the start while the formatted history fits
    `max_context` tokens, and only the questions (of `categories`) whose evidence turns are all kept.
    Questions without evidence cannot be placed and are left out."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UserError(f"{path}: cannot read a LoCoMo file ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("qa"), list):
        raise UserError(f"{path}: not a LoCoMo file with questions (expected an object with a \"qa\" list)")
    turns = parse_history(data, source=str(path))
    sessions = _sessions(turns, path)
    kept = _fitting_sessions(sessions, count_tokens, max_context)
    if not kept:
        raise UserError(f"{path}: {option('max_context', max_context)} is smaller than the first session")
    kept_turns = [turn for session in kept for turn in session]
    kept_ids = {turn.turn_id for turn in kept_turns}
    wanted = set(categories)
    questions = []
    for index, item in enumerate(data["qa"]):
        question = _question(index, item)
        if question is None or question.category not in wanted or not question.evidence:
            continue
        if all(e in kept_ids for e in question.evidence):
            questions.append(question)
    return QASet(Path(path).stem, kept_turns, questions, len(kept), len(sessions))


def _sessions(turns: list[Turn], path: Path) -> list[list[Turn]]:
    sessions: list[list[Turn]] = []
    current = None
    for turn in turns:
        number = session_of(turn)
        if number is None:
            raise UserError(f"{path}: turn without a LoCoMo dia_id (expected \"D<session>:<turn>\")")
        if number != current:
            sessions.append([])
            current = number
        sessions[-1].append(turn)
    return sessions


def _fitting_sessions(
    sessions: list[list[Turn]], count_tokens: Callable[[str], int] | None, max_context: int | None
) -> list[list[Turn]]:
    """The longest prefix of whole sessions whose formatted text has at most `max_context` tokens."""
    if max_context is None or count_tokens is None:
        return sessions
    kept: list[list[Turn]] = []
    for session in sessions:
        candidate = [turn for s in (*kept, session) for turn in s]
        if count_tokens("\n".join(format_turns(candidate))) > max_context:
            break
        kept.append(session)
    return kept


def _question(index: int, item: object) -> Question | None:
    if not isinstance(item, dict) or not isinstance(item.get("question"), str):
        return None
    category = item.get("category")
    gold = item.get("answer", "Not mentioned in the conversation" if category == ADVERSARIAL else None)
    if not isinstance(category, int) or gold is None:
        return None
    evidence = tuple(
        f"D{int(s)}:{int(t)}" for e in item.get("evidence") or () if isinstance(e, str) for s, t in _EVIDENCE.findall(e)
    )
    return Question(str(index), item["question"], str(gold), category, evidence)


# --- planted facts -------------------------------------------------------------------------------------
def planted_sets(count: int, *, topics: int = 6, turns_per_topic: int = 48) -> list[QASet]:
    """`count` deterministic planted-fact conversations (seeds 0..count-1), one question per fact."""
    sets = []
    for seed in range(count):
        messages, facts = planted_conversation(seed, topics=topics, turns_per_topic=turns_per_topic)
        turns = [
            dataclasses.replace(turn, turn_id=f"T{i}")
            for i, turn in enumerate(parse_history(messages, source=f"planted-{seed}"))
        ]
        questions = [Question(str(i), f.question, f.answer, 0, (f"T{f.turn}",)) for i, f in enumerate(facts)]
        sets.append(QASet(f"planted-{seed}", turns, questions))
    return sets


def sample_questions(questions: list[Question], limit: int | None) -> list[Question]:
    """At most `limit` questions spread evenly over the list (deterministic), so a small sample still
    covers the whole conversation and every category the file interleaves."""
    if limit is None or limit >= len(questions):
        return questions
    step = len(questions) / limit
    return [questions[int(i * step)] for i in range(limit)]
