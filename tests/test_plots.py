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
    from kvchat import report

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


def test_profile_plot_title_and_budget(figures, tmp_path):
    from kvchat.profile import LayerProfile, save_plot

    profile = LayerProfile(model="default", weights="0123456789abcdef", settings={"budget": 256}, tokens=100,
                           similarity=[0.99, 0.98, 0.97], sensitivity=[0.01, 0.02, 0.03], alpha=1.2)
    save_plot(profile, tmp_path / "p.png")
    (fig,) = figures
    top, bottom = fig.axes
    assert top.get_title().startswith("Block-prefill sensitivity per layer of the default model")
    assert bottom.get_legend().get_texts()[0].get_text() == "uniform 256"  # the budget it was measured at
    assert sum(bar.get_height() for bar in bottom.patches) == pytest.approx(3 * 256, abs=3)
