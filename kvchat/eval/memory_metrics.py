"""Reader-light metrics: what a system's memory holds for a question, measured apart from how well the reader reads it.

With the embedded 135M reader every memory system scores LoCoMo F1 0.07-0.11, so F1 cannot choose between memory
designs. Each answer record (kvchat.eval.gold, kvchat.eval.evaluate) also carries, from one teacher-forced forward
after the answer is decoded (kvchat.answer.probe):
- evidence recall: of the question's gold evidence turns (LoCoMo's `evidence` dia ids), what the first answer token
  can attend to (resident, read back from pages, placed or prefilled), per layer and KV head and then averaged over
  them: `evidence_any` counts a turn present in a head when any of its tokens is, `evidence_half` when at least half
  of them are, `evidence_tokens` is the mean share of its tokens;
- `nll`: the gold answer's mean per-token negative log-likelihood (nats), teacher forced after the system's context
  and question, in the prompt the answer was decoded from;
- the two references a question's systems share: `nll_none`, the same with no history at all (the system prompt and
  the question), and `nll_evidence`, with the evidence turns alone prefilled (rendered as the history renders them,
  in history order).
Per system (`memory_summary`): means with bootstrap intervals over the questions, and oracle-gain recovery,
(mean nll_none - mean nll) / (mean nll_none - mean nll_evidence): 1.0 holds as much as handing the reader the
evidence, 0 no more than no history. It is a ratio of means, its interval from resampling the questions together (a
ratio per question explodes where the evidence barely helps). `nll_verdict` ranks systems by NLL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvchat.answer.probe import Probe, continuation_nll, prompt_held
from kvchat.answer.rag import Chunk
from kvchat.answer.recall import recalled_spans
from kvchat.eval.qa import QASet, Question
from kvchat.eval.stats import bootstrap_interval, paired_difference, statistic_interval
from kvchat.history.loading import format_turns
from kvchat.history.tokens import turn_spans
from kvchat.kv.cache import EpisodeCache
from kvchat.kv.forward import forward
from kvchat.model.llm import ChatLayout, LoadedModel

EVIDENCE = ("evidence_any", "evidence_half", "evidence_tokens")  # the evidence recall fields of a record
RECORD_FIELDS = ("nll", "nll_none", "nll_evidence", *EVIDENCE)  # every field `Measured.fields` writes
RAG = "rag"  # the `method` of a retrieval baseline's records (kvchat.eval.gold): dense, lexical or hybrid


def gold_text(question: Question) -> str:
    """The gold answer as scored: an open-domain (3) gold's part before its first ';' (as kvchat.eval.qa scores it)."""
    return question.gold.split(";")[0].strip() if question.category == 3 else question.gold.strip()


def probe_for(lm: LoadedModel, question: Question) -> Probe:
    """A probe scoring `question`'s gold answer after an answer's prompt."""
    return Probe(lm.encode(gold_text(question))[0].tolist())


@dataclass
class References:
    """A QA set's shared references, computed once per question by the answering model: the gold answer's NLL with
    no history and with the evidence turns alone, in the prompt layout every system answers in; and each turn's
    tokens in the history as ingest tokenizes it (the denominators of evidence recall)."""

    lm: LoadedModel
    qa_set: QASet
    system_prompt: str
    question_template: str
    _nlls: dict[str, tuple[float, float]] = field(default_factory=dict)
    _tokens: list[int] | None = None

    def nlls(self, question: Question) -> tuple[float, float]:
        """(nll_none, nll_evidence) of `question`'s gold answer."""
        if question.qid not in self._nlls:
            turns = self.qa_set.turns
            evidence = [turns[i] for i in self.evidence(question)]
            text = "\n".join(format_turns(evidence))
            self._nlls[question.qid] = (self._nll("", question), self._nll(text, question))
        return self._nlls[question.qid]

    def evidence(self, question: Question) -> list[int]:
        """The history indices of `question`'s evidence turns found in the history, in history order."""
        wanted = set(question.evidence)
        return [i for i, turn in enumerate(self.qa_set.turns) if turn.turn_id in wanted]

    @property
    def tokens(self) -> list[int]:
        """Each turn's tokens in the history."""
        if self._tokens is None:
            self._tokens = [s.end - s.start for s in turn_spans(self.lm.tokenizer, self.qa_set.turns, 0)]
        return self._tokens

    def _nll(self, history: str, question: Question) -> float:
        layout = ChatLayout.from_tokenizer(self.lm.tokenizer, self.system_prompt)
        parts = [layout.before_conversation, history, layout.question(self.question_template.format(
            question=question.text))]  # fmt: skip
        ids = torch.cat([self.lm.encode(p) for p in parts], dim=-1)
        cache = EpisodeCache(self.lm.num_layers)
        forward(self.lm.model, cache, ids)
        n = int(ids.shape[-1])
        return continuation_nll(self.lm.model, cache, prompt_held(cache, n), ids[:, -1:], probe_for(self.lm, question)
                                .continuation)  # fmt: skip


def chunk_presence(lm: LoadedModel, chunks: Sequence[Chunk]) -> dict[int, torch.Tensor]:
    """What prefilling `chunks` as text puts in front of the first answer token: every token of their turns, in every
    layer and KV head (history turn index -> `[layers * kv_heads]` counts, as `TurnPresence.present`)."""
    heads = lm.num_layers * lm.config.num_key_value_heads
    present: dict[int, torch.Tensor] = {}
    for span in recalled_spans(lm.tokenizer, chunks, lead=""):
        present[span.index] = torch.full((heads,), span.end - span.start, dtype=torch.long)
    return present


def merged(*presences: Mapping[int, torch.Tensor] | None) -> dict[int, torch.Tensor] | None:
    """Presences summed turn by turn (a cache's and text prefilled on top of it); None when any is unknown."""
    out: dict[int, torch.Tensor] = {}
    for presence in presences:
        if presence is None:
            return None
        for turn, counts in presence.items():
            out[turn] = out[turn] + counts if turn in out else counts.clone()
    return out


def evidence_recall(present: Mapping[int, torch.Tensor] | None, evidence: Sequence[int],
                    tokens: Sequence[int]) -> dict[str, float | None]:  # fmt: skip
    """`evidence_any`, `evidence_half`, `evidence_tokens` of the `evidence` turns (history indices) given what the
    first answer token can attend to (`present`, as `TurnPresence.present`) and each turn's tokens in the history;
    None where unknown (no presence, no evidence)."""
    if present is None or not evidence:
        return dict.fromkeys(EVIDENCE)
    heads = next((len(c) for c in present.values()), 1)
    shares = []
    for turn in evidence:
        counts = present.get(turn, torch.zeros(heads)).double()
        shares.append((counts / max(tokens[turn], 1)).clamp(max=1.0))
    table = torch.stack(shares)  # [evidence turns, heads]
    return {"evidence_any": round(float((table > 0).double().mean()), 4),
            "evidence_half": round(float((table >= 0.5).double().mean()), 4),
            "evidence_tokens": round(float(table.mean()), 4)}  # fmt: skip


def fields(probe: Probe, references: References, question: Question,
           present: Mapping[int, torch.Tensor] | None = None) -> dict[str, float | None]:  # fmt: skip
    """An answer record's reader-light fields (RECORD_FIELDS) from its filled `probe` (`present`: what the caller
    knows the prompt holds in its place, as a RAG answer's chunks)."""
    none, evidence = references.nlls(question)
    found = probe.present if present is None else present
    return {"nll": None if probe.nll is None else round(probe.nll, 4), "nll_none": round(none, 4),
            "nll_evidence": round(evidence, 4),
            **evidence_recall(found, references.evidence(question), references.tokens)}  # fmt: skip


# --- per system -------------------------------------------------------------------------------------
def _recovery(none: np.ndarray, nll: np.ndarray, evidence: np.ndarray) -> np.ndarray:
    return (none - nll) / (none - evidence)


def memory_summary(answers: Sequence[dict]) -> dict[str, float | None]:
    """One system's answers (records carrying RECORD_FIELDS) summarized: NLL, recovery and evidence recall with 95%
    intervals (`KEY`, `KEY_low`, `KEY_high`); None where no answer carries them."""
    out: dict[str, float | None] = {}
    scored = [r for r in answers if r.get("nll") is not None and r.get("nll_none") is not None]
    for key, values in (("nll", [r["nll"] for r in scored]),
                        *((k, [r[k] for r in answers if r.get(k) is not None]) for k in EVIDENCE)):  # fmt: skip
        low, high = bootstrap_interval(values) if values else (None, None)
        out |= {key: float(np.mean(values)) if values else None, f"{key}_low": low, f"{key}_high": high}
    if scored:
        columns = [[r["nll_none"] for r in scored], [r["nll"] for r in scored], [r["nll_evidence"] for r in scored]]
        point, low, high = statistic_interval(columns, _recovery)
        out |= {"recovery": point, "recovery_low": low, "recovery_high": high}
    else:
        out |= {"recovery": None, "recovery_low": None, "recovery_high": None}
    return out


def has_nll(records: Iterable[dict]) -> bool:
    """Whether every answer among `records` carries a gold-answer NLL (results written before it do not)."""
    answers = [r for r in records if r.get("kind") == "answer"]
    return bool(answers) and all(r.get("nll") is not None for r in answers)


def recovery_ratio(a: Sequence[dict], b: Sequence[dict]) -> tuple[float, float, float]:
    """Recovery of answers `a` over that of answers `b` (the same questions, paired by (set, qid)), with its
    interval: the gain over no history of one system relative to another's."""
    ours = {(r["set"], r["qid"]): r for r in a}
    theirs = {(r["set"], r["qid"]): r for r in b}
    shared = sorted(set(ours) & set(theirs))
    columns = [[ours[q]["nll_none"] for q in shared], [ours[q]["nll"] for q in shared],
               [theirs[q]["nll"] for q in shared]]  # fmt: skip
    return statistic_interval(columns, lambda none, mine, other: (none - mine) / (none - other))


def _by_question(answers: Sequence[dict]):
    """`key` -> {(set, qid): the answer's value of `key`}."""
    return lambda key: {(r["set"], r["qid"]): r[key] for r in answers}


def nll_verdict(records: Sequence[dict], rows: Sequence[dict]) -> list[str]:
    """Per entry budget with both kvchat and a retrieval baseline measured on the most questions there, one line: the
    kvchat system with the lowest gold-answer NLL against RAG, the best of the retrieval baselines by NLL (dense,
    lexical, hybrid), with their paired NLL difference and its 95% interval (a win only when it excludes zero), the
    ratio of their recoveries, and their paired F1 difference. `rows`: kvchat.eval.gold.summarize_gold's."""
    answers: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") == "answer":
            answers[r["variant"]].append(r)
    lines = []
    for budget in sorted({r["entries_budget"] for r in rows}):
        at = [r for r in rows if r["entries_budget"] == budget and r.get("nll") is not None]
        most = max((r["questions"] for r in at), default=0)
        ours = [r for r in at if not r["baseline"] and r["questions"] == most]
        theirs = [r for r in at if r["baseline"] and r["method"] == RAG and r["questions"] == most]
        if not ours or not theirs:
            continue
        a, b = min(ours, key=lambda r: r["nll"]), min(theirs, key=lambda r: r["nll"])
        ours_by, theirs_by = (_by_question(answers[r["variant"]]) for r in (a, b))
        diff, low, high, n = paired_difference(ours_by("nll"), theirs_by("nll"))
        ratio, r_low, r_high = recovery_ratio(answers[a["variant"]], answers[b["variant"]])
        f1, f1_low, f1_high, _ = paired_difference(ours_by("f1"), theirs_by("f1"))
        rag = f"RAG ({b['variant']}, the best of {len(theirs)} retrieval baseline{'s' if len(theirs) > 1 else ''})"
        gap = (f"NLL {a['nll']:.3f} against {b['nll']:.3f}, paired {diff:+.3f} (95% interval [{low:+.3f}, "
               f"{high:+.3f}], {n} questions)")  # fmt: skip
        if low > 0 or high < 0:
            better = a["variant"] if diff < 0 else rag
            worse = rag if diff < 0 else a["variant"]
            head = f"{budget} entries: {better} beat {worse} by gold-answer NLL: "
        else:
            head = (f"{budget} entries: no winner between {a['variant']} and {rag} by gold-answer NLL, inside the "
                    "noise: ")
        tail = (f"; recovery {a['recovery']:.2f} against {b['recovery']:.2f} ({ratio:.2f}x [{r_low:.2f}, "
                f"{r_high:.2f}]); F1 {f1:+.3f} [{f1_low:+.3f}, {f1_high:+.3f}]")  # fmt: skip
        lines.append(head + gap + tail)
    return lines


# --- reports ------------------------------------------------------------------------------------------
HEADERS = ("evidence any [95%]", "evidence >= half [95%]", "gold NLL [95%]", "recovery [95%]")
ALIGN = tuple((h, "---") for h in HEADERS)  # markdown column alignment of HEADERS
LEGEND = (  # what each of HEADERS means, as a report states it
    ("evidence any / >= half", "evidence recall: the share of the question's gold evidence turns the first answer "
     "token can attend to (resident, read back, placed or prefilled), per layer and KV head, averaged over them; a "
     "turn counts when any of its tokens is there / when at least half of them are"),
    ("gold NLL", "the gold answer's mean per-token negative log-likelihood in nats, teacher forced after the system's "
     "context and question (lower is better; F1 cannot separate memory systems with this reader, NLL can)"),
    ("recovery", "oracle-gain recovery: (NLL with no history - the system's NLL) / (NLL with no history - NLL with "
     "the evidence turns alone prefilled), of the means over the questions; 1.0 holds as much as the evidence alone"),
)


def cells(row: Mapping) -> list[str]:
    """A summary row's HEADERS cells (blank where its records carry no such metric)."""

    def interval(key: str, fmt: str) -> str:
        if row.get(key) is None:
            return ""
        low, high = row.get(f"{key}_low"), row.get(f"{key}_high")
        spread = "" if low is None or np.isnan(low) else f" [{fmt.format(low)}, {fmt.format(high)}]"
        return fmt.format(row[key]) + spread

    return [interval("evidence_any", "{:.2f}"), interval("evidence_half", "{:.2f}"), interval("nll", "{:.3f}"),
            interval("recovery", "{:.2f}")]
