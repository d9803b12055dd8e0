"""The eval and profile PNGs: titled, readable axes, one legend (checked on the figure before saving)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")


@pytest.fixture
def figures(monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: saved.append(self))
    return saved


def _row(variant, method, budget, f1, agreement):
    return {"variant": variant, "method": method, "budget": budget, "f1": f1, "agreement": agreement}


def test_eval_plot(figures, tmp_path):
    from kvchat.eval import report

    rows = [_row("full", "full", None, 0.0, 1.0)] + [
        _row(f"{m}@{b}", m, b, 0.0, 0.5 + b / 4096) for m in ("epicache", "snapkv") for b in (128, 256, 1024)
    ]
    report.plot(rows, tmp_path / "p.png", title="kvchat eval (tiny): synthetic-0", synthetic=True)
    (fig,) = figures
    f1, agreement = fig.axes
    assert fig._suptitle.get_text() == "kvchat eval (tiny): synthetic-0"
    assert f1.get_ylim()[0] == 0 and f1.get_ylim()[1] >= 0.1  # all-zero F1 is not drawn on -0.04..0.04
    assert f1.get_ylabel() == "F1 (planted facts)"
    assert [t.get_text() for t in f1.get_xticklabels()] == ["128", "256", "1024"]  # not 2^7
    assert len(fig.legends) == 1 and not f1.get_legend() and not agreement.get_legend()
    assert {t.get_text() for t in fig.legends[0].get_texts()} == {"epicache", "snapkv", "full KV"}


def _scored(variant, method, budget, f1, questions=3):
    return {**_row(variant, method, budget, f1, 0.0 if budget else 1.0), "questions": questions, "relative_f1": None,
            "kl": 0.0, "recall": 0.0, "f1_by_category": {"single-hop": f1}}


def test_a_report_of_one_budget_and_zero_f1_states_its_settings_and_stays_readable(figures, tmp_path):
    """A 3-question run at one budget where every answer scores 0: bars with their values, not an empty chart."""
    from kvchat.config import EvalConfig, IngestConfig
    from kvchat.eval import report

    rows = [_scored("full", "full", None, 0.0), _scored("epicache@256", "epicache", 256, 0.0),
            _scored("snapkv@256", "snapkv", 256, 0.0)]
    ran = report.settings(EvalConfig(budgets=(256,), questions=3), IngestConfig(), model="tiny")
    report.write(tmp_path / "r.md", rows, title="kvchat eval (tiny)", sets=["synthetic-0"], synthetic=True,
                 settings=ran)
    (fig,) = figures
    f1, agreement = fig.axes
    assert [bar.get_height() for bar in f1.patches] == [0.0, 0.0]
    assert [t.get_text() for t in f1.texts] == ["0.00", "0.00", "full KV 0.00"]  # a bar of 0 still says its value
    assert [t.get_text() for t in f1.get_xticklabels()] == ["epicache", "snapkv"]
    assert "256" in f1.get_xlabel() and f1.get_ylim()[0] == 0 and f1.get_ylim()[1] >= 0.1
    assert f1.get_title() == agreement.get_title() == "n = 3 questions per point"
    assert {t.get_text() for t in fig.legends[0].get_texts()} == {"epicache", "snapkv", "full KV"}
    text = (tmp_path / "r.md").read_text()
    assert "- model: tiny" in text and "- budgets: 256 (KV entries kept per layer and KV head)" in text
    assert "- questions: at most 3 per conversation" in text
    assert "n = 3 questions per row (few: a difference between rows may be chance)." in text
    for _, header, _ in report.COLUMNS:  # every column explained
        assert f"- **{header}**: " in text


def test_zero_values_over_several_budgets_show_on_the_axis_with_their_values(figures, tmp_path):
    from kvchat.eval import report

    rows = [_scored(f"epicache@{b}", "epicache", b, 0.0, questions=5) for b in (128, 256)]
    report.plot(rows, tmp_path / "p.png", synthetic=True)
    (fig,) = figures
    f1 = fig.axes[0]
    (line,) = f1.get_lines()
    assert list(line.get_ydata()) == [0.0, 0.0] and not line.get_clip_on()  # drawn on the axis, not hidden
    assert [t.get_text() for t in f1.texts] == ["0.00", "0.00"]
    assert f1.get_ylim()[1] >= 0.1 and f1.get_title() == "n = 5 questions per point"


def test_profile_plot_title_and_budget(figures, tmp_path):
    from kvchat.ingest.layer_profiles import LayerProfile, save_plot

    profile = LayerProfile(model="default", weights="0123456789abcdef", settings={"budget": 256}, tokens=100,
                           similarity=[0.99, 0.98, 0.97], sensitivity=[0.01, 0.02, 0.03], alpha=1.2)
    save_plot(profile, tmp_path / "p.png")
    (fig,) = figures
    top, bottom = fig.axes
    assert top.get_title().startswith("Block-prefill sensitivity per layer of the default model")
    assert bottom.get_legend().get_texts()[0].get_text() == "uniform 256"  # the budget it was measured at
    assert sum(bar.get_height() for bar in bottom.patches) == pytest.approx(3 * 256, abs=3)
