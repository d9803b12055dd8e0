"""`kvchat eval --report`: the summary rows as markdown tables and a PNG of F1 and agreement vs budget."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path

from kvchat.errors import UserError

COLUMNS = (
    ("variant", "variant", "{}"),
    ("questions", "questions", "{}"),
    ("f1", "F1", "{:.3f}"),
    ("relative_f1", "F1 / full", "{:.2f}"),
    ("agreement", "agreement", "{:.3f}"),
    ("kl", "KL 1st token", "{:.3f}"),
    ("recall", "contains gold", "{:.2f}"),
    ("evidence_kept", "evidence kept", "{:.2f}"),
    ("evidence_kept_best", "in best episode", "{:.2f}"),
    ("evidence_recalled", "evidence kept + retrieved", "{:.2f}"),
    ("evidence_attention_recalled", "evidence attention recalled", "{:.2f}"),
    ("evidence_any", "evidence any", "{:.2f}"),
    ("evidence_half", "evidence half", "{:.2f}"),
    ("nll", "gold NLL", "{:.3f}"),
    ("recovery", "recovery", "{:.2f}"),
    ("peak_layer_entries", "peak entries/layer", "{}"),
    ("ingest_seconds", "ingest s", "{:.0f}"),
    ("answer_tokens_per_s", "answer tok/s", "{:.1f}"),
)


# What each column of COLUMNS says, as the report explains it.
MEANINGS = {
    "variant": "method@budget (and any setting that differs: /block_size=..., /precision=..., /offload=...); "
               "`full` is full KV, the reference",
    "questions": "n: the questions this row averages over",
    "f1": "mean token F1 of the answer against the gold answer (LoCoMo's scoring: lowercase, no punctuation or "
          "articles, Porter stems; multi-hop golds item by item)",
    "relative_f1": "the row's F1 over full KV's F1 on the same questions",
    "agreement": "mean F1 between the row's answer and full KV's answer to the same question (1: the same answer)",
    "kl": "KL(full || row) of the first answer token's distribution, in nats (0: the same distribution)",
    "recall": "share of answers that contain the gold answer",
    "evidence_kept": "share of the evidence turns' (layer, KV head, token) entries the answering episode's cache "
                     "holds",
    "evidence_kept_best": "the same, in whichever episode holds most of them (what perfect routing would get)",
    "evidence_recalled": "evidence entries held or read back from the pages (icecache offload) by the question",
    "evidence_attention_recalled": "share of the attention full KV's last question token pays the evidence that "
                                   "lands on entries held or read back (full KV: 1)",
    "evidence_any": "share of the evidence turns the first answer token can attend to (resident, read back, placed or "
                    "prefilled), per layer and KV head, a turn counting when any of its tokens is there",
    "evidence_half": "the same, a turn counting when at least half of its tokens are there",
    "nll": "the gold answer's mean per-token negative log-likelihood (nats), teacher forced after the row's context "
           "and question; its interval and the others' in the JSON records (kvchat.eval.memory_metrics)",
    "recovery": "oracle-gain recovery: (NLL with no history - the row's NLL) / (NLL with no history - NLL with the "
                "evidence turns alone prefilled); 1.0 holds as much as the evidence alone",
    "peak_layer_entries": "most KV entries one layer held at once while ingesting",
    "ingest_seconds": "seconds to ingest the conversation (mean over conversations)",
    "answer_tokens_per_s": "answer tokens decoded per second",
}


def settings(config, base, *, model: str, offloads: Sequence[str] = ("none",), precisions: Sequence[str] = ("full",),
             retrieve: int | None = None, weights: str = "float") -> dict[str, str]:
    """The settings an eval ran with (an `EvalConfig` and the base `IngestConfig` its variants start from), as the
    report states them."""
    from kvchat.config import ANSWER_ROOM, DEFAULT_EPISODES, EPISODE_SPAN_TOKENS

    episodes = base.episodes
    found = {
        "model": model,
        "methods": ", ".join(config.methods) + " (full KV always runs, as the reference)",
        "budgets": ", ".join(map(str, config.budgets)) + " (KV entries kept per layer and KV head)",
        "block size": str(base.cache.block_size),
        "prefill": base.cache.prefill,
        "episodes": (str(episodes.episodes) if episodes.episodes is not None
                     else f"{DEFAULT_EPISODES} (routed methods: one per {EPISODE_SPAN_TOKENS} history tokens, if "
                          "more), or fewer when a history has fewer segments")
                    + f", from segments of {episodes.segment_turns} turns",
        "cache precision": ", ".join(precisions),
        "offload": ", ".join(offloads) + (f" (retrieve {retrieve})" if retrieve is not None and
                                          any(o != "none" for o in offloads) else ""),
        "history kept": f"whole sessions up to {config.max_context} tokens" if config.max_context is not None
                        else f"whole sessions up to the model's window minus {ANSWER_ROOM} tokens for the answer",
        "questions": ("all" if config.questions is None else f"at most {config.questions}") + " per conversation, "
                     f"LoCoMo categories {', '.join(map(str, config.categories))}, only those whose evidence is kept",
        "answers": f"as every question is answered (answer.decoding): at most {config.max_new_tokens} tokens, the "
                   f"question as {config.question_template!r}, {_sampling(config.answering().sampling)}"
                   + (", no answer repeating the question's first words (model.echo)" if config.echo_guard else "")
                   + f"; {weights} weights (the caches built and the answers decoded with them, as an ingest and a "
                   "question hold them)",
    }
    return found


def cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "–" if value is None else fmt.format(value)


def write(path: Path, rows: Sequence[dict], *, title: str, sets: Collection[str], notes: Sequence[str] = (),
          synthetic: bool = False, settings: dict[str, str] | None = None) -> None:
    """The markdown report at `path` and its plot beside it (the same name, .png), titled `title` (the front end's
    words: the command and the model), on `sets`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    png = path.with_suffix(".png")
    plot(rows, png, title=f"{title}: {', '.join(sorted(sets))}", synthetic=synthetic)
    path.write_text(markdown(rows, title=title, notes=notes, plot=png.name, settings=settings or {}))


def markdown(rows: Sequence[dict], *, title: str, notes: Sequence[str] = (), plot: str | None = None,
             settings: dict[str, str] | None = None) -> str:
    """The settings, n, the summary table, F1 per question category, what each column means, then `notes` (what
    was run, on what)."""
    lines = [f"# {title}", ""]
    if settings:
        lines += ["Settings:", ""] + [f"- {name}: {value}" for name, value in settings.items()] + [""]
    lines += [_n_line(rows)]
    lines += [""] + [f"- {note}" for note in notes] if notes else []
    lines += ["", "| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r, k, f) for k, _, f in COLUMNS) + " |" for r in rows]
    categories = sorted({c for r in rows for c in r["f1_by_category"]})
    if categories:
        lines += ["", "F1 per question category:", ""]
        lines += ["| variant | " + " | ".join(categories) + " |", "|" + "---|" * (len(categories) + 1)]
        lines += [
            f"| {r['variant']} | " + " | ".join(cell(r["f1_by_category"], c, "{:.3f}") for c in categories) + " |"
            for r in rows
        ]
    lines += ["", "Columns:", ""] + [f"- **{header}**: {MEANINGS[key]}" for key, header, _ in COLUMNS]
    lines += ["", "– marks a value the row cannot have (no full-KV pair, no evidence labels, no pages)."]
    if plot:
        lines += ["", f"![F1 and agreement vs budget]({plot})"]
    return "\n".join(lines) + "\n"


def _n_line(rows: Sequence[dict]) -> str:
    """How many questions each row averages over: a mean of few answers is a rough figure."""
    n = _n(rows)
    if n is None:
        return "No rows: no question was scored."
    few = " (few: a difference between rows may be chance)" if min(r["questions"] for r in rows) < 30 else ""
    return f"n = {n} questions per row{few}."


def _n(rows: Sequence[dict]) -> str | None:
    """The questions per row: one number, or the range, or None when the rows do not say."""
    counts = sorted({r["questions"] for r in rows if r.get("questions") is not None})
    if not counts:
        return None
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def plot(rows: Sequence[dict], path: Path, *, title: str = "kvchat evaluation", synthetic: bool = False) -> None:
    """F1 and agreement vs budget, one line per method (with one budget, one bar per method); full KV as a dashed
    level; one legend for both panels; the budgets as plain numbers on the x axis; y from 0 to at least 0.1, however
    flat the values; each point's value written beside it when there are few; n above each panel."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("a PNG report needs matplotlib: pip install 'kvchat[plot]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    series = sorted({_series(r) for r in rows if r["budget"] is not None})
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    f1_label = "F1 (planted facts)" if synthetic else "F1 (LoCoMo scoring)"
    for ax, key, label in ((axes[0], "f1", f1_label), (axes[1], "agreement", "agreement with full KV")):
        values = [r[key] for r in rows if r[key] is not None]
        top = max(0.1, max(values, default=0) * 1.15)
        if len(budgets) == 1:
            _bars(ax, rows, series, key, budgets[0])
        else:
            _lines(ax, rows, series, key, budgets, labelled=len(budgets) <= 3)
        for r in rows:
            if r["budget"] is None and r[key] is not None:
                ax.axhline(r[key], color="black", linestyle="--", label="full KV")
                ax.annotate(f"full KV {r[key]:.2f}", (1, r[key]), xycoords=("axes fraction", "data"),
                            xytext=(-4, 3), textcoords="offset points", ha="right", fontsize=7)
        ax.set_ylim(0, top)  # markers are not clipped: a value of 0 shows on the axis, labelled
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=min(6, len(unique)) or 1, fontsize=8)
    fig.suptitle(title)
    if _n(rows) is not None:
        for ax in axes:
            ax.set_title(f"n = {_n(rows)} questions per point", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _lines(ax, rows: Sequence[dict], series: Sequence[str], key: str, budgets: Sequence[int], *,
           labelled: bool) -> None:
    """One line per method over the budgets (log 2 axis, the budgets as ticks); with `labelled`, values written."""
    from matplotlib.ticker import FixedLocator, NullLocator

    for name in series:
        points = sorted((r["budget"], r[key]) for r in rows if _series(r) == name and r[key] is not None)
        if points:
            line, = ax.plot(*zip(*points, strict=True), marker="o", label=name, clip_on=False)
            for x, y in points if labelled else ():
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=7, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(budgets))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(b) for b in budgets])
    ax.set_xlabel("budget (entries per layer and head)")


def _bars(ax, rows: Sequence[dict], series: Sequence[str], key: str, budget: int) -> None:
    """One bar per method at the single budget, its value written on it (a bar of 0 still says 0.00)."""
    colors = [f"C{i}" for i in range(len(series))]
    values = [next((r[key] for r in rows if _series(r) == name and r[key] is not None), None) for name in series]
    bars = ax.bar(range(len(series)), [v or 0.0 for v in values], color=colors, width=0.6)
    for bar, name in zip(bars, series, strict=True):
        bar.set_label(name)
    ax.bar_label(bars, labels=["–" if v is None else f"{v:.2f}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(series)), series, fontsize=8)
    ax.set_xlabel(f"method at budget {budget} (entries per layer and head)")


def _series(row: dict) -> str:
    """A variant without its budget: one line in the plot."""
    return re.sub(r"@\d+", "", row["variant"])


def _sampling(sampling) -> str:
    """How answer tokens are chosen, in words."""
    how = "greedy" if sampling.temperature == 0 else f"sampled at temperature {sampling.temperature:g}"
    return how + (f", repetition penalty {sampling.repetition_penalty:g}" if sampling.repetition_penalty != 1 else "")
