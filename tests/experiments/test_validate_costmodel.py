"""experiments.validate_costmodel: the error summary (fitted point excluded), its figure, and
refusal of a --fit-at outside the grid. The cluster run itself is exercised by hand (minutes)."""

import argparse

from experiments import validate_costmodel as vc


def _point(n, bw, k, measured, predicted, fitted=False):
    return {
        "nodes": n,
        "bandwidth": bw,
        "k": k,
        "cache": False,
        "measured_ms": measured,
        "predicted_ms": predicted,
        "error": (predicted - measured) / measured,
        "fitted": fitted,
    }


def test_summary_excludes_the_fitted_point_and_figure_is_written(tmp_path):
    points = [
        _point(2, "1gbit", 0, 100, 100, fitted=True),
        _point(2, "1gbit", 8, 100, 110),  # +10 %
        _point(2, "uncapped", 0, 200, 150),  # -25 %
        _point(2, "uncapped", 8, 100, 95),  # -5 %
    ]
    args = argparse.Namespace(model="m", batch_size=8, steps=3, warmup=1, fit_at_used=(2, "1gbit", 0), fitted_share=0.4)
    text = vc.summary(points, args, {"command": "cmd", "wall_s": 1.0, "load": (1.0, 2.0)})
    # |errors| 10, 25, 5 %: median 10 %, worst 25 %
    assert "Median |error| 10.0%, worst 25.0% over 3 predicted points" in text
    assert "+0.0% (fitted)" in text
    vc.figure(points, tmp_path / "v.png", "t")
    assert (tmp_path / "v.png").stat().st_size > 0


def test_fit_point_outside_the_grid_is_refused(tmp_path, capsys):
    code = vc.main(
        ["--nodes", "2", "--bandwidths", "1gbit", "--ks", "0", "--fit-at", "3,1gbit,0", "--out-dir", str(tmp_path)]
    )
    assert code == 2
    assert "--fit-at" in capsys.readouterr().err
