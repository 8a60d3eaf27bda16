"""The FDSL-32 substrate: generator, data wiring, probes (tiny sizes; each test well under a few seconds)."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from freeze.pipeline.data import (
    CIFAR10_FOLDER,
    DATASET_NAMES,
    SYNTHETIC_MARKER,
    DataError,
    load_dataset,
    read_cifar10,
    split_validation,
    write_synthetic_cifar,
)
from freeze.pipeline.datasets import fdsl
from freeze.pipeline.models import build_model
from freeze.pipeline.substrate.probe import ProbeError, bn_shift, fit_logreg, linear_probe, pooled_features


# ------------------------------------------------------------------------------------- generator
def test_render_is_a_pure_function_of_its_arguments():
    a = fdsl.render_fdsl_split("target", 24, seed=3, split="train")
    b = fdsl.render_fdsl_split("target", 24, seed=3, split="train")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert a[0].shape == (24, 3, 32, 32) and a[0].dtype == np.uint8 and a[1].dtype == np.int64
    other_seed = fdsl.render_fdsl_split("target", 24, seed=4, split="train")[0]
    other_split = fdsl.render_fdsl_split("target", 24, seed=3, split="test")[0]
    assert not np.array_equal(a[0], other_seed) and not np.array_equal(a[0], other_split)


def test_labels_are_balanced_over_all_classes():
    _, y = fdsl.render_fdsl_split("source", 256, seed=0, split="train")
    assert np.bincount(y, minlength=128).tolist() == [2] * 128
    _, y = fdsl.render_fdsl_split("target", 35, seed=0, split="test")
    counts = np.bincount(y, minlength=10)
    assert counts.sum() == 35 and counts.max() - counts.min() <= 1


def test_images_are_not_flat_and_use_the_range():
    x, _ = fdsl.render_fdsl_split("source", 16, seed=0, split="train")
    assert 40 < x.mean() < 215 and x.std() > 25
    assert (x.reshape(16, -1).std(1) > 10).all()  # every image has structure


def test_class_systems_are_contractive_and_the_target_is_held_out():
    for task, count in (("source", 128), ("target", 10)):
        params, active, hue = fdsl.class_systems(task)
        assert params.shape == (count, 4, 7) and active.shape == (count, 4) and hue.shape == (count,)
        assert ((active.sum(1) >= 2) & (active.sum(1) <= 4)).all()
        maps = fdsl._maps(params).reshape(-1, 6)[:, :4].reshape(-1, 2, 2)
        assert np.linalg.norm(maps, ord=2, axis=(1, 2)).max() < 1.0  # every map contracts
        assert 0 < np.isnan(hue).sum() < count  # some shape-only classes, most with a class hue
    source, target = fdsl.class_systems("source")[0], fdsl.class_systems("target")[0]
    assert not any(np.allclose(t, s) for t in target for s in source)
    assert len(set(fdsl.class_names("source"))) == 128 and len(fdsl.class_names("target")) == 10


@pytest.mark.parametrize(
    "args, match",
    [
        (("validation", 4, 0, "train"), "task must be one of source, target, fine, pale, muted, mix"),
        (("source", 4, 0, "val"), "split must be 'train' or 'test'"),
        (("source", -1, 0, "train"), "n must be an integer >= 0"),
        (("source", 4, -2, "train"), "seed must be an integer >= 0"),
    ],
)
def test_bad_generator_input_is_one_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        fdsl.render_fdsl_split(*args)


# ----------------------------------------------------------------------------------- data wiring
def test_written_in_the_cifar_format_with_all_source_classes(tmp_path):
    folder = write_synthetic_cifar(tmp_path, "source", 300, 20, seed=1, family="fdsl32")
    arrays = read_cifar10(tmp_path, synthetic=True)
    assert folder == tmp_path / CIFAR10_FOLDER
    assert len(arrays.classes) == 128 and int(arrays.train_y.max()) == 127
    x, y = fdsl.render_fdsl_split("source", 300, seed=1, split="train")
    assert torch.equal(arrays.train_x, torch.from_numpy(x)) and torch.equal(arrays.train_y, torch.from_numpy(y))
    marker = json.loads((folder / SYNTHETIC_MARKER).read_text())
    assert marker["generator"] == "fdsl32" and marker["version"] == fdsl.FDSL_VERSION
    split = split_validation(arrays, 128, seed=0)
    assert split.num_classes == 128 and split.val_y.unique().numel() == 128  # stratified over all 128


def test_both_pairs_are_reachable_by_name(tmp_path):
    assert {"synthetic-source", "synthetic-target", "fdsl32-source", "fdsl32-target"} <= set(DATASET_NAMES)
    new = load_dataset("fdsl32-target", tmp_path, synthetic_train_size=40, synthetic_test_size=10)
    old = load_dataset("synthetic-target", tmp_path, synthetic_train_size=40, synthetic_test_size=10)
    assert len(new.classes) == 10 and new.classes[0].startswith("ifs-t")
    assert old.classes[0].endswith(("/warm", "/cool"))
    assert (tmp_path / "fdsl32-target-n40-10-s0").is_dir() and (tmp_path / "synthetic-target-n40-10-s0").is_dir()
    old_marker = json.loads((tmp_path / "synthetic-target-n40-10-s0" / CIFAR10_FOLDER / SYNTHETIC_MARKER).read_text())
    assert "generator" not in old_marker  # the old pair's folders are unchanged


def test_a_folder_of_an_older_generator_version_is_refused(tmp_path):
    load_dataset("fdsl32-target", tmp_path, synthetic_train_size=20, synthetic_test_size=10)
    marker = tmp_path / "fdsl32-target-n20-10-s0" / CIFAR10_FOLDER / SYNTHETIC_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": 0}))
    with pytest.raises(DataError, match="written by fdsl32 generator v0, this is v1: delete it"):
        load_dataset("fdsl32-target", tmp_path, synthetic_train_size=20, synthetic_test_size=10)


def test_unknown_generator_family_is_refused(tmp_path):
    with pytest.raises(DataError, match="generator family must be one of synthetic, fdsl32"):
        write_synthetic_cifar(tmp_path, "source", 10, 5, seed=0, family="fractal")


# ---------------------------------------------------------------------------------------- probes
def test_pooled_features_at_every_depth_of_resnet18():
    model = build_model("resnet18", 10, "imagenet")
    x = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    feats = pooled_features(model, x, batch_size=3)
    assert [f.shape for f in feats] == [(4, c) for c in (64, 64, 64, 128, 128, 256, 256, 512, 512)]
    assert model.training  # restored


def test_pooled_features_refuse_another_layout():
    with pytest.raises(ProbeError, match="lacks 'maxpool'"):
        pooled_features(nn.Sequential(nn.Conv2d(3, 4, 3)), torch.zeros(2, 3, 32, 32, dtype=torch.uint8))


def test_bn_shift_is_zero_when_running_stats_come_from_the_same_data():
    torch.manual_seed(0)
    model = build_model("resnet18", 10, "imagenet")
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = None  # cumulative average: after one batch, the running stats are that batch's
            m.track_running_stats = True
    # eval-mode inputs of each BN differ from train-mode ones after the first BN, so compare bn1 only
    model.train()
    with torch.no_grad():
        from freeze.pipeline.datasets.images import normalize_uint8

        model(normalize_uint8(x))
    rows = {name: (shift, ratio) for name, shift, ratio in bn_shift(model, x)}
    shift, ratio = rows["bn1"]
    assert shift < 1e-3 and ratio < 0.1  # running var is unbiased (n/(n-1)), the data's biased


def test_logistic_regression_fits_separable_data_and_c_is_chosen_on_validation():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 3, generator=g)
    x = torch.randn(300, 8, generator=g)
    y = (x @ w).argmax(1)
    lin = fit_logreg(x, y, 3, c=10.0)
    assert float((lin(x).argmax(1) == y).float().mean()) > 0.97
    result = linear_probe((x[:200], y[:200]), (x[200:250], y[200:250]), (x[250:], y[250:]), 3, (1e-4, 10.0))
    assert result.c == 10.0 and result.test_acc > 0.9 and result.val_by_c[1e-4] < result.val_by_c[10.0]


# ------------------------------------------------------------------------------ committed weights
def test_fp16_export_round_trips_into_the_fp32_model(tmp_path):
    from freeze.pipeline.datasets.weights import export_fp16, verify

    torch.manual_seed(0)
    source = build_model("resnet18", 128, "imagenet")
    torch.save({"model": source.state_dict(), "epoch": 1}, tmp_path / "checkpoint.pt")
    record = export_fp16(tmp_path / "checkpoint.pt", tmp_path / "w.pt", {"command": "test"})
    assert verify(tmp_path / "w.pt") == record["sha256"] and record["command"] == "test"
    assert record["max_rounding_error_relative_to_tensor_max"] < 1e-3
    model = build_model("resnet18", 10, "imagenet", tmp_path / "w.pt")
    for key, value in model.state_dict().items():
        if key.startswith("fc."):
            continue  # the head is always fresh
        expected = source.state_dict()[key]
        expected = expected.half().float() if expected.is_floating_point() else expected
        assert value.dtype == source.state_dict()[key].dtype and torch.equal(value, expected), key


def test_altered_or_missing_weights_are_refused_in_one_line(tmp_path):
    from freeze.pipeline.datasets.weights import WeightsError, sidecar, verify

    path = tmp_path / "w.pt"
    with pytest.raises(WeightsError, match="is missing: it is committed"):
        verify(path)
    path.write_bytes(b"weights")
    with pytest.raises(WeightsError, match="sha256 cannot be checked"):
        verify(path)
    sidecar(path).write_text("0" * 64 + "  w.pt\n")
    with pytest.raises(WeightsError, match="the file was altered"):
        verify(path)


def test_a_study_takes_committed_weights_instead_of_pretraining(tmp_path):
    from freeze.pipeline.datasets.weights import sha256_of, sidecar
    from freeze.pipeline.study.plan import read_study
    from freeze.pipeline.study.stages import pretrain_stage
    from freeze.pipeline.sweep import SweepError

    weights = tmp_path / "w.pt"
    weights.write_bytes(b"weights")
    body = '[study]\nname = "s"\nfinetune = "experiments/configs/fdsl32_finetune.toml"\nweights = "{w}"\n{extra}[arms]\nnone = []\n'
    study_file = tmp_path / "s.toml"
    study_file.write_text(body.format(w=weights, extra=""))
    with pytest.raises(SweepError, match="sha256 cannot be checked"):
        pretrain_stage(read_study(study_file), str(tmp_path))
    sidecar(weights).write_text(f"{sha256_of(weights)}  w.pt\n")
    assert pretrain_stage(read_study(study_file), str(tmp_path)) == ([], (f"model.weights={weights}",))
    study_file.write_text(body.format(w=weights, extra='pretrain = "experiments/configs/offline_pretrain.toml"\n'))
    with pytest.raises(SweepError, match="pretrain and weights both give the model's weights"):
        read_study(study_file)


# ----------------------------------------------------------------------------------------- gates
def test_paired_interval_and_relative_weight_change():
    from freeze.pipeline.substrate.gates import _relative_change, paired

    p = paired([1.0, 2.0, 3.0])
    assert p.mean == 2.0 and p.low == pytest.approx(2.0 - 4.302653 / 3**0.5) and p.high > 4
    assert paired([5.0]).n == 1 and "n=1" in paired([5.0]).text()
    initial = {"conv1.weight": torch.ones(4), "layer4.0.w": torch.ones(4), "bn1.running_mean": torch.zeros(4)}
    final = {"conv1.weight": torch.ones(4) * 1.1, "layer4.0.w": torch.ones(4) * 2, "bn1.running_mean": torch.ones(4)}
    assert _relative_change(initial, final, ("conv1.", "bn1.")) == pytest.approx(0.1)  # buffers are not weights
    assert _relative_change(initial, final, ("layer4.",)) == pytest.approx(1.0)


# -------------------------------------------------------------------------------- planted tasks
def test_planted_readout_is_a_linear_function_of_depth_d_features():
    from freeze.pipeline.datasets.planted import depth_maps, depth_of, fit_readout

    torch.manual_seed(0)
    model = build_model("resnet18", 10, "imagenet")
    x = torch.from_numpy(fdsl.render_fdsl_split("target", 120, seed=0, split="train")[0])
    readout = fit_readout(model, x, 5)
    z = depth_maps(model, x, [5])[5]
    assert z.shape == (120, 128 * 2 * 2) and readout.basis.shape == (512, 16)
    assert 0 < readout.residual_share <= 1
    y, margin = readout.assign(z)
    assert y.min() >= 0 and y.max() <= 9 and (margin >= 0).all()
    # nearest centroid in u = U^T z_std is argmax_j (2 mu_j . u - |mu_j|^2): linear in z
    u = ((z - readout.mean) / readout.std) @ readout.basis
    scores = 2 * u @ readout.centroids.T - (readout.centroids**2).sum(1)
    assert torch.equal(scores.argmax(1), y)
    with pytest.raises(ValueError, match="planted task must be one of d3, d5, d7"):
        depth_of("d4")


def _made_up_gate_study(tmp_path):
    """A gate study whose runs are made up (complete manifests, metrics, a final checkpoint in which
    only layer4 moved): checks arithmetic and plumbing, not any measurement."""
    from freeze.pipeline.datasets.weights import export_fp16
    from freeze.pipeline.substrate.gates import ARMS

    torch.manual_seed(0)
    model = build_model("resnet18", 128, "imagenet")
    torch.save({"model": model.state_dict()}, tmp_path / "pre.pt")
    export_fp16(tmp_path / "pre.pt", tmp_path / "w.pt", {})
    study = tmp_path / "gates.toml"
    arms = "\n".join(
        f'{a} = ["freeze.policy=static:k={a[-1]}"]' if a.startswith("static") else f"{a} = []" for a in ARMS
    )
    study.write_text(
        f'[study]\nname = "g"\nfinetune = "experiments/configs/fdsl32_finetune.toml"\nweights = "{tmp_path / "w.pt"}"\n'
        f'seeds = [0, 1]\nout_dir = "{tmp_path / "runs"}"\noverrides = ["data.root={tmp_path / "data"}", '
        '"data.synthetic_train_size=60", "data.synthetic_test_size=20", "data.val_size=20", "data.train_size=0", '
        f'"data.test_size=0"]\n[arms]\n{arms}\n'
    )
    accs = {"none": 0.90, "scratch": 0.60, "static-k3": 0.895, "static-k5": 0.88, "static-k7": 0.85, "static-k8": 0.82}
    accs["static-k9"] = 0.80
    final = build_model("resnet18", 10, "imagenet", tmp_path / "w.pt").state_dict()
    final["layer4.0.conv1.weight"] = final["layer4.0.conv1.weight"] * 1.5  # only layer4 moves
    for arm, acc in accs.items():
        for seed in (0, 1):
            run = tmp_path / "runs" / "g" / f"{arm}_seed={seed}"
            run.mkdir(parents=True)
            times = {"start_time": "2026-01-01T00:00:00+00:00", "end_time": "2026-01-01T00:01:00+00:00"}
            (run / "manifest.json").write_text(json.dumps({"status": "complete", "group": arm, "seed": seed, **times}))
            records = [
                {"test_acc": acc - 0.01, "val_acc": acc - 0.005},
                {"test_acc": acc + seed / 1000, "val_acc": acc},
            ]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            if arm == "none":
                torch.save({"model": final}, run / "checkpoint.pt")
    return study


def test_gates_tabulate_complete_runs_without_running(tmp_path):
    """The table and the JSON from run directories alone (made up here: this checks the arithmetic
    and the plumbing, not any measurement)."""
    from freeze.pipeline.substrate.gates import run_gates

    study = _made_up_gate_study(tmp_path)
    text = run_gates(str(study), tmp_path / "report", "test", run=False)
    record = json.loads((tmp_path / "report" / "gates-g.json").read_text())
    assert record["seeds"] == [0, 1] and record["costs"]["3"][0] == pytest.approx(-0.5)
    assert record["scratch_gain"][0] == pytest.approx(30.0)
    assert record["gates"]["pretraining helps"] and record["gates"]["shallow freezing is cheap"]
    assert record["gates"]["bottom-up stability"]  # stem + layer1 did not move
    assert "| static-k7 | 85.05 |" in text and (tmp_path / "report" / "curves.md").is_file()


def test_gates_on_validation_and_on_a_subset_of_seeds(tmp_path):
    """--split val tabulates validation accuracy into selection/ (never beside the test tables);
    --seeds takes a subset of the study's seeds and refuses others."""
    from freeze.pipeline.substrate.gates import GateError, run_gates

    study = _made_up_gate_study(tmp_path)
    text = run_gates(str(study), tmp_path / "report", "test", run=False, seeds=(0,), split="val")
    record = json.loads((tmp_path / "report" / "selection" / "gates-g.json").read_text())
    assert record["split"] == "val" and record["seeds"] == [0]
    assert record["costs"]["3"][0] == pytest.approx(-0.5)  # val 89.5 vs 90.0
    assert "VALIDATION" in text and not (tmp_path / "report" / "gates-g.json").exists()
    with pytest.raises(GateError, match="subset of the study's seeds"):
        run_gates(str(study), tmp_path / "report", "test", run=False, seeds=(7,))
    with pytest.raises(GateError, match="split must be one of"):
        run_gates(str(study), tmp_path / "report", "test", run=False, split="train")


def test_stability_table_per_stage(tmp_path):
    from freeze.pipeline.substrate.gates import GateError, stability_table

    torch.manual_seed(0)
    initial = build_model("resnet18", 10, "imagenet").state_dict()
    torch.save(initial, tmp_path / "w.pt")
    final = {k: v.clone() for k, v in initial.items()}
    final["layer4.0.conv1.weight"] *= 1.5
    final["layer1.0.conv1.weight"] *= 1.01
    run = tmp_path / "r"
    run.mkdir()
    torch.save(final, run / "model.pt")
    (run / "config.toml").write_text(
        '[data]\ndataset = "fdsl32-mix"\n[optim]\nname = "adamw"\nlr = 0.001\nweight_decay = 0.01\n'
    )
    (run / "metrics.jsonl").write_text(json.dumps({"val_acc": 0.9}) + "\n")
    text = stability_table(str(tmp_path / "w.pt"), [str(run)], tmp_path / "s.md", "cmd")
    row = next(line for line in text.splitlines() if line.startswith(f"| {tmp_path.name}/r |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:6] == ["fdsl32-mix", "adamw", "0.001", "0.01", "90.0"]
    assert cells[6] == "0.000" and float(cells[7]) > 0 and float(cells[10]) > float(cells[7])
    assert float(cells[11]) < 0.3  # stem + layer1 barely moved against layer4
    with pytest.raises(GateError, match="not a run directory"):
        stability_table(str(tmp_path / "w.pt"), [str(tmp_path)], tmp_path / "s.md", "cmd")


@pytest.mark.parametrize("task", ["mix", "size", "place"])
def test_split_diagnostic_merges_each_split_pair_into_its_system(task):
    from freeze.pipeline.substrate.diagnose import _label_sets

    sets = _label_sets(f"fdsl32-{task}")
    fn, k = sets["system (split pairs merged)"]
    assert k == 8 and fn(torch.arange(10)).tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 7, 7]
    names = fdsl.class_names(task)
    assert names[6].split("/")[0][-12:] == names[7].split("/")[0][-12:] and names[6] != names[7]


@pytest.mark.parametrize("name", ["planted.toml", "planted_dx.toml", "gates_d5.toml", "planted_d5_.toml"])
def test_planted_check_study_names_carry_d(tmp_path, name):
    from freeze.pipeline.substrate.gates import GateError, planted_check

    with pytest.raises(GateError, match="named planted_d<d>"):
        planted_check(str(tmp_path / name), tmp_path, "cmd", run=False)


def test_size_and_place_targets_split_two_systems_by_the_cue_their_names_say():
    # the split classes (6-9) come in pairs of one system: the same maps, told apart by size or place
    for task in ("size", "place"):
        params, active, hue = fdsl.class_systems(task)
        assert np.array_equal(params[6], params[7]) and np.array_equal(params[8], params[9])
        assert [n.split("/")[-1] for n in fdsl.class_names(task)[6:]] == (
            ["large", "small"] * 2 if task == "size" else ["top", "bottom"] * 2
        )
    params, active, _ = fdsl.class_systems("place")
    rng = np.random.default_rng(0)
    m = 64
    rows = np.arange(64)[None, :, None]
    for place, above in ((-1, True), (1, False)):
        counts = fdsl._instances(
            rng, np.repeat(params[6:7], m, 0), np.repeat(active[6:7], m, 0), 800, np.full(m, 0.6), 64, np.full(m, place)
        )
        centre = (counts * rows).sum((1, 2)) / counts.sum((1, 2))
        assert (centre < 32).all() if above else (centre > 32).all()
    # without a place, the same random numbers give the same counts (tasks without the cue unchanged)
    args = (np.repeat(params[6:7], 4, 0), np.repeat(active[6:7], 4, 0), 800, np.full(4, 0.6), 64)
    plain = fdsl._instances(np.random.default_rng(1), *args)
    assert np.array_equal(plain, fdsl._instances(np.random.default_rng(1), *args, np.zeros(4)))


def test_planted_checks_are_the_issues_one_sided_ones():
    from freeze.pipeline.substrate.gates import Paired, planted_checks

    def p(mean):
        return Paired(3, mean, mean - 1, mean + 1)

    # freezing at d gains 2.6 points (the labels live in the frozen prefix): passes
    assert all(planted_checks(p(94.4), p(+2.6), p(-6.4)).values())
    assert planted_checks(p(94.4), p(-0.6), p(-6.4))["cost(k=d) >= -0.5"] is False
    assert planted_checks(p(94.4), p(0.0), p(-2.9))["cost(k=d+2) <= -3"] is False
    assert planted_checks(p(89.9), p(0.0), p(-6.0))["full FT >= 90 %"] is False
