"""`kvchat eval --report`: the summary rows as markdown tables and a PNG of F1 and agreement vs budget."""

from __future__ import annotations

import re
from collections.abc import Sequence
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
    ("peak_layer_entries", "peak entries/layer", "{}"),
    ("ingest_seconds", "ingest s", "{:.0f}"),
    ("answer_tokens_per_s", "answer tok/s", "{:.1f}"),
)


def cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "–" if value is None else fmt.format(value)


def write(path: Path, rows: Sequence[dict], *, spec: str, sets: Sequence[str], notes: Sequence[str] = (),
          synthetic: bool = False) -> None:
    """The markdown report at `path` and its plot beside it (the same name, .png), for model `spec` on `sets`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    png = path.with_suffix(".png")
    plot(rows, png, title=f"kvchat eval ({spec}): {', '.join(sorted(sets))}", synthetic=synthetic)
    path.write_text(markdown(rows, title=f"kvchat eval ({spec})", notes=notes, plot=png.name))


def markdown(rows: Sequence[dict], *, title: str, notes: Sequence[str] = (), plot: str | None = None) -> str:
    """The summary table, then F1 per question category, then `notes` (what was run, on what)."""
    lines = [f"# {title}", ""]
    lines += [f"- {note}" for note in notes]
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
    if plot:
        lines += ["", f"![F1 and agreement vs budget]({plot})"]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], path: Path, *, title: str = "kvchat eval", synthetic: bool = False) -> None:
    """F1 and agreement vs budget, one line per method; full KV as a dashed level; one legend for both
    panels; the budgets as plain numbers on the x axis; y from 0, however flat the values."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError:
        raise UserError("a PNG report needs matplotlib: pip install 'kvchat[plot]'") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    series = sorted({_series(r) for r in rows if r["budget"] is not None})
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    f1_label = "F1 (planted facts)" if synthetic else "F1 (LoCoMo scoring)"
    for ax, key, label in ((axes[0], "f1", f1_label), (axes[1], "agreement", "agreement with full KV")):
        values = [r[key] for r in rows if r[key] is not None]
        for name in series:
            points = sorted((r["budget"], r[key]) for r in rows if _series(r) == name and r[key] is not None)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        for r in rows:
            if r["budget"] is None and r[key] is not None:
                ax.axhline(r[key], color="black", linestyle="--", label="full KV")
        if len(budgets) > 1:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(budgets))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(b) for b in budgets])
        ax.set_ylim(0, max(0.1, max(values, default=0) * 1.15))
        ax.set_xlabel("budget (entries per layer and head)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=min(6, len(unique)) or 1, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _series(row: dict) -> str:
    """A variant without its budget: one line in the plot."""
    return re.sub(r"@\d+", "", row["variant"])
