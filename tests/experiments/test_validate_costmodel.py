"""experiments.validate_costmodel: cache-on points measured and predicted beside cache off (from
hand-written bench rows and a profile file the test writes; nothing is timed), the error summary per
cache setting (fitted point excluded), the figure, the BENCH.md section, and one-line refusals. The
cluster run itself is exercised by hand (minutes)."""

import argparse
import json

import pytest

from experiments import bench_cluster as bc
from experiments import bench_workers as bw
from experiments import validate_costmodel as vc
from experiments import validate_costmodel_report as vr
from freeze.pipeline import markdown
from freeze.pipeline.costmodel import PROFILE_FORMAT, Link, load_profile, save_profile
from tests.pipeline.test_costmodel import _block, _probe, write_profile


def _profile(tmp_path):
    path = tmp_path / "profile-N2.json"
    path.write_text(
        json.dumps(
            {
                "format": PROFILE_FORMAT,
                "model": "three-block",
                "batch_size": 8,
                "threads": 1,
                "nodes_per_core": 1,
                "optimizer": "sgd(momentum=0.9)",
                "forward_overhead_ms": 1.0,
                "after_backward_ms": [4.0, 3.0, 2.0],
                "blocks": [
                    _block(
                        "b0", [1000], forward_ms=5.0, frozen_ms=3.0, backward_ms=None, first_ms=30.0, cache_read_ms=None
                    ),
                    _block(
                        "b1", [1000], forward_ms=6.0, frozen_ms=4.0, backward_ms=20.0, first_ms=15.0, cache_read_ms=0.5
                    ),
                    _block(
                        "b2", [1000], forward_ms=7.0, frozen_ms=None, backward_ms=10.0, first_ms=8.0, cache_read_ms=0.25
                    ),
                ],
                "meta": {},
            }
        )
    )
    return load_profile(path)


# No latency, no cap, no CPU per byte: the all-reduces and the broadcast take 0 ms, so a step is
# overhead + forward + backward + after, worked out by hand below.
FREE_LINK = Link(alpha_s=0.0, bandwidth_bytes_per_s=None, gamma_s_per_byte=0.0)


def _row(approach, k, median_ms, forward=1.0, backward=2.0, monitor=0.5, optimizer=0.25):
    return {
        "approach": approach,
        "k": k,
        "median_ms": median_ms,
        "forward_ms": forward,
        "backward_ms": backward,
        "monitor_ms": monitor,
        "optimizer_ms": optimizer,
    }


def test_measured_points_pair_cache_on_with_off_from_k1_and_carry_the_prefix():
    rows = [
        _row(bw.ENGINE, 0, 80.0),
        _row(bw.ENGINE_CACHE, 0, 81.0),  # k = 0 caches nothing: not a cache-on point
        _row(bw.ENGINE, 1, 50.0),
        _row(bw.ENGINE_CACHE, 1, 44.0, forward=0.75),
        _row(bw.PREFIX_FORWARD, 1, 3.5),
    ]
    points = vc.measured_points(rows, ("off", "on"))
    assert [(p["k"], p["cache"], p["measured_ms"]) for p in points] == [
        (0, "off", 80.0),
        (1, "off", 50.0),
        (1, "on", 44.0),
    ]
    on = points[2]
    assert on["measured_forward_ms"] == 0.75 and on["measured_after_ms"] == 0.75 and on["measured_prefix_ms"] == 3.5
    assert points[0]["measured_prefix_ms"] is None
    assert [(p["k"], p["cache"]) for p in vc.measured_points(rows, ("on",))] == [(1, "on")]


def _measured(k, cache, measured_ms):
    return {"nodes": 2, "bandwidth": "uncapped", "k": k, "cache": cache, "measured_ms": measured_ms}


def test_cache_on_rows_are_predicted_from_the_profiles_cache_read(tmp_path):
    profile = _profile(tmp_path)
    points = [
        _measured(0, "off", 83.0),
        _measured(1, "off", 50.0),
        _measured(1, "on", 50.0),
        _measured(2, "off", 20.0),
        _measured(2, "on", 36.5),
    ]
    share = vc.predict_points(points, {2: profile}, {(2, "uncapped"): FREE_LINK}, (2, "uncapped", 0, "off"))
    assert share == 0.5  # no communication: every share fits, the tie goes to 0.5
    predicted = {(p["k"], p["cache"]): p["predicted_ms"] for p in points}
    # k=0: 1 + (5 + 6 + 7) forward + (10 + 20 + 30) backward + 4 after = 83
    # k=1 off: 1 + 3 (b0 frozen) + 6 + 7 | 10 + 15 (b1 first) | 3 = 45
    # k=1 on:  1 + 0.5 (read at b1) + 6 + 7 | 10 + 15 | 3 = 42.5
    # k=2 off: 1 + 3 + 4 + 7 | 8 (b2 first) | 2 = 25
    # k=2 on:  1 + 0.25 (read at b2) + 7 | 8 | 2 = 18.25
    assert predicted == pytest.approx(
        {(0, "off"): 83, (1, "off"): 45, (1, "on"): 42.5, (2, "off"): 25, (2, "on"): 18.25}
    )
    on1 = next(p for p in points if (p["k"], p["cache"]) == (1, "on"))
    assert on1["predicted_forward_ms"] == pytest.approx(14.5) and on1["predicted_after_ms"] == 3.0
    assert on1["predicted_backward_ms"] == pytest.approx(25.0)
    assert [p["fitted"] for p in points] == [True, False, False, False, False]
    # errors: off -10 %, +25 %; on -15 %, -50 % (the fitted point, 0 %, excluded)
    summary = vr.error_summary(points)
    assert summary["cache off"] == pytest.approx((2, 0.175, 0.25))
    assert summary["cache on"] == pytest.approx((2, 0.325, 0.50))
    assert summary["all"] == pytest.approx((4, 0.20, 0.50))

    args = argparse.Namespace(
        model="m",
        batch_size=8,
        steps=3,
        warmup=1,
        cache_keys=64,
        fit_at_used=(2, "uncapped", 0, "off"),
        fitted_share=share,
    )
    text = vr.summary(points, args, {"command": "cmd", "wall_s": 1.0, "load": (1.0, 2.0)})
    assert "| cache off | 2 | 17.5% | 25.0% | **MISSED** |" in text
    assert "| cache on | 2 | 32.5% | 50.0% | **MISSED** |" in text
    assert "| all | 4 | 20.0% | 50.0% | **MISSED** |" in text
    assert "| 2 | uncapped | 1 | on | 50 | 42 | -15.0% |" in text  # 42.5 prints as 42 (round half to even)
    assert "| 2 | uncapped | 0 | off | 83 | 83 | +0.0% (fitted) |" in text
    vr.figure(points, tmp_path / "v.png", "t")
    assert (tmp_path / "v.png").stat().st_size > 0


def test_the_fit_point_must_have_been_measured(tmp_path):
    with pytest.raises(ValueError, match="fit point"):
        vc.predict_points([_measured(1, "off", 50.0)], {2: _profile(tmp_path)}, {}, (2, "uncapped", 1, "on"))


def test_bench_section_replaces_only_its_own(tmp_path):
    out = tmp_path / "costmodel"
    out.mkdir()
    (out / "validation.png").write_bytes(b"png")
    bench = tmp_path / "BENCH.md"
    cluster = markdown.span(bc.SECTION, "cluster rows")
    bench.write_text(f"# Engine\n\ntable\n\n{cluster}\n\ntail\n")
    (out / "validation.md").write_text("## Cost model\n\nfirst run\n")
    vr.write_bench_section(out, bench)
    (out / "validation.md").write_text("## Cost model\n\nsecond run\n")
    vr.write_bench_section(out, bench)
    text = bench.read_text()
    assert text.startswith(f"# Engine\n\ntable\n\n{cluster}\n\ntail\n")
    assert "second run" in text and "first run" not in text and text.count(markdown.markers(vr.SECTION)[0]) == 1
    assert "![predicted vs measured step time](costmodel/validation.png)" in text


def test_splice_only_writes_an_earlier_run_into_bench_md(tmp_path, capsys):
    (tmp_path / "validation.md").write_text("## Cost model\n")
    (tmp_path / "validation.png").write_bytes(b"png")
    bench = tmp_path / "BENCH.md"
    argv = ["--splice-only", "--out-dir", str(tmp_path), "--bench-md", str(bench)]
    assert vc.main(argv) == 0
    assert "## Cost model" in bench.read_text() and "](validation.png)" in bench.read_text()
    assert vc.main(["--splice-only", "--out-dir", str(tmp_path / "none"), "--bench-md", str(bench)]) == 2
    assert "no validation.md, validation.png" in capsys.readouterr().err
    start = markdown.markers(vr.SECTION)[0]
    bench.write_text(bench.read_text() + start + "\n")  # a second start marker: refused, file untouched
    before = bench.read_text()
    assert vc.main(argv) == 2
    assert capsys.readouterr().err == f"error: {bench}: {start} is on 2 lines, expected on exactly one\n"
    assert bench.read_text() == before


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--cache", "maybe"], "--cache 'maybe': not accepted; accepted: off, on or off,on"),
        (["--cache", "on", "--ks", "0"], "--cache on: needs a k >= 1 in --ks"),
        (["--fit-at", "3,1gbit,0"], "--fit-at 3,1gbit,0,off: not a point of the grid"),
        (["--fit-at", "2,1gbit,0,on"], "--fit-at 2,1gbit,0,on: cache on needs k >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, expected):
    code = vc.main(["--nodes", "2", "--bandwidths", "1gbit", "--ks", "0,5", "--out-dir", str(tmp_path), *argv])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err


def test_reused_profiles_and_probes_must_match_the_grid(tmp_path, capsys):
    argv = ["--nodes", "2", "--bandwidths", "1gbit", "--ks", "0,5", "--out-dir", str(tmp_path)]
    (tmp_path / "w").mkdir()
    save_profile(write_profile(tmp_path / "w", model="resnet18", batch_size=8), tmp_path / "profile-N2.json")
    assert vc.main(argv) == 2
    assert "profile-N2.json profiles resnet18 at batch 8, not resnet18 at batch 64" in capsys.readouterr().err
    # With the batch the profile has, the probe (uncapped, under the 1gbit name) is what is refused.
    (tmp_path / "probe-2x1gbit.json").write_text(json.dumps(_probe(2, None, 6e-9)))
    assert vc.main([*argv, "--batch-size", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "probe-2x1gbit.json was probed at 2 nodes, None bit/s, not 2 nodes, 1gbit" in err
