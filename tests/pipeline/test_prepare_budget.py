"""train.budget_fraction: the budget frontier's runs (issue 35) train a fraction of every epoch's
steps with the LR schedule over the shorter run, and everything else unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freeze.pipeline.config import ConfigError, load_config
from freeze.pipeline.distributed import WorkerContext
from freeze.pipeline.models import build_blocks, build_model
from freeze.pipeline.prepare import build_policy, build_training, load_data

SMOKE = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "smoke.toml"
ONE_PROCESS = WorkerContext(0, 1, 0, 1, torch.device("cpu"), None)


def _training(tmp_path: Path, *overrides: str):
    # smoke.toml: 256 training images in batches of 32 per worker: 8 steps per epoch in one process.
    cfg = load_config(
        SMOKE, [f"run.out_dir={tmp_path}", "schedule.name=cosine", "schedule.warmup_epochs=1", *overrides]
    )
    split = load_data(cfg, ONE_PROCESS)
    model = build_model(cfg.model.arch, split.num_classes, cfg.model.stem, cfg.model.weights)
    blocks = build_blocks(model, cfg.model.blocks)
    return build_training(cfg, ONE_PROCESS, split, model, blocks, build_policy(cfg, blocks))


def _lrs(t, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(t.optimizer.param_groups[0]["lr"])
        t.optimizer.step()
        t.scheduler.step()
    return lrs + [t.optimizer.param_groups[0]["lr"]]


@pytest.mark.slow
def test_half_the_budget_is_half_of_every_epoch_with_warm_up_and_decay_over_the_shorter_run(tmp_path):
    full = _training(tmp_path)
    half = _training(tmp_path, "train.budget_fraction=0.5")
    assert (full.steps_per_epoch, half.steps_per_epoch) == (8, 4)
    assert half.freezer.clock.steps_per_epoch == 4  # run-length policies read the shorter run too
    full_lrs, half_lrs = _lrs(full, 16), _lrs(half, 8)  # 2 epochs each
    # Warm-up over one (shorter) epoch, then a cosine that ends at 0 at the run's own last step.
    assert half_lrs[3] == pytest.approx(full_lrs[7]) == pytest.approx(0.05)
    assert half_lrs[-1] == pytest.approx(0.0, abs=1e-12) and full_lrs[-1] == pytest.approx(0.0, abs=1e-12)
    assert half_lrs[4 + 2] == pytest.approx(full_lrs[8 + 4])  # half-way through decay in both


@pytest.mark.parametrize("value", ["0", "-0.5", "1.01"])
def test_a_budget_fraction_outside_0_1_is_refused_in_one_line_naming_the_field(value):
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, [f"train.budget_fraction={value}"])
    assert str(err.value) == f"train.budget_fraction: expected a number in (0, 1], got {value}"
