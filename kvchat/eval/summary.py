"""An eval's records summarized: one row per variant compared with full KV, over all sets or per conversation,
as `kvchat eval` prints them and `--json` carries them (kvchat.documents.eval_rows); answers scored against gold
answers are kvchat.eval.gold's."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from kvchat.eval import memory_metrics
from kvchat.eval.evaluate import REFERENCE
from kvchat.eval.qa import CATEGORIES


def summarize(records: Sequence[dict]) -> list[dict]:
    """One row per variant over all sets: mean F1 (overall and per category), recall, agreement, KL,
    F1 relative to full KV on the same questions, peak cache entries, ingest seconds, answer tok/s."""
    answers: dict[str, list[dict]] = defaultdict(list)
    ingests: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["kind"] != "skipped" and r.get("against") != "gold":  # answers against gold: kvchat.eval.gold
            (answers if r["kind"] == "answer" else ingests)[r["variant"]].append(r)
    full_f1 = {(r["set"], r["qid"]): r["f1"] for r in answers.get(REFERENCE, [])}
    rows = []
    for key, rs in answers.items():
        paired = [r for r in rs if (r["set"], r["qid"]) in full_f1]
        reference = _mean(full_f1[(r["set"], r["qid"])] for r in paired)
        paired_f1 = _mean(r["f1"] for r in paired)
        decode_s = sum(r["timings_ms"]["decode"] for r in rs) / 1000
        row = {
            "variant": key,
            "method": rs[0]["method"],
            "budget": rs[0]["budget"],
            "questions": len(rs),
            "f1": _mean(r["f1"] for r in rs),
            "recall": _mean(float(r["recall"]) for r in rs),
            "agreement": _mean(r["agreement"] for r in rs),
            "kl": _mean(r["kl"] for r in rs),
            "evidence_kept": _mean(r["evidence_kept"] for r in rs if r.get("evidence_kept") is not None),
            "evidence_kept_best": _mean(
                r["evidence_kept_best"] for r in rs if r.get("evidence_kept_best") is not None
            ),
            "evidence_recalled": _mean(  # results files written before it have no such key
                r["evidence_recalled"] for r in rs if r.get("evidence_recalled") is not None
            ),
            "evidence_attention_recalled": _mean(
                r["evidence_attention_recalled"] for r in rs if r.get("evidence_attention_recalled") is not None
            ),
            "relative_f1": paired_f1 / reference if paired_f1 is not None and reference else None,
            "f1_by_category": {
                CATEGORIES.get(c, str(c)): _mean(r["f1"] for r in rs if r["category"] == c)
                for c in sorted({r["category"] for r in rs})
            },
            "peak_layer_entries": max(
                (peak for i in ingests.get(key, [])
                 if (peak := i.get("peak_layer_entries", i.get("peak_cache_tokens"))) is not None), default=None
            ),  # results files written before 0.2 call it peak_cache_tokens
            "ingest_seconds": _mean(i["seconds"] for i in ingests.get(key, [])),
            "answer_tokens_per_s": sum(r["answer_tokens"] for r in rs) / decode_s if decode_s else None,
            **memory_metrics.memory_summary(rs),
        }
        rows.append(row)
    return sorted(rows, key=lambda r: (r["method"] != REFERENCE, r["method"], r["budget"] or 0, r["variant"]))


def summarize_per_conversation(records: Sequence[dict]) -> list[dict]:
    """`summarize` for each QA set (conversation) on its own; each row names its `conversation`."""
    sets = sorted({r["set"] for r in records})
    return [{"conversation": s, **row} for s in sets for row in summarize([r for r in records if r["set"] == s])]


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None
