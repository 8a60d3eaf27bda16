"""The Freezer's golden runs: tiny deterministic trainings whose checkpoint, written halfway and
mid-interval by one version of the code, must load in every later version and continue to the same
statistics, decisions and weights, bit for bit (tests/test_golden_runs.py).

Written by the code on ``sys.path``, so a checkout's own version writes them:

    PYTHONPATH=<checkout> python -m tests.golden_runs tests/fixtures/golden

Only the library's public API is used (Freezer, split_blocks, make_policy, the training state), so
the same script drives the code that wrote the files and the code that replays them.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from freeze import Freezer, make_policy, split_blocks
from tests.tiny_models import TinyNet, freezer_step

# Gradient-reading rules: the monitor's step norms, summed gradients (L1 for autofreeze, L2 for
# cs744) and overflow masks feed their decisions. "none" with every statistic tracked: the record.
POLICIES = {"autofreeze": "autofreeze:percentile=60", "cs744": "cs744", "none-tracked": "none"}
EPOCHS, STEPS_PER_EPOCH, INTERVAL_STEPS = 4, 5, 3
HALFWAY_EPOCHS = 2  # the checkpoint: after epoch 2 (step 10), one step into the 4th interval


def build(name: str) -> tuple[TinyNet, Freezer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    freezer = Freezer(
        model,
        split_blocks(model),
        make_policy(POLICIES[name]),
        optimizer=optimizer,
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        interval_steps=INTERVAL_STEPS,
        track_summed_grads=name == "none-tracked",
    )
    return model, freezer, optimizer


def train_epochs(freezer: Freezer, optimizer: torch.optim.Optimizer, epochs: range) -> None:
    for epoch in epochs:
        freezer.train()
        for i in range(STEPS_PER_EPOCH):
            freezer_step(freezer, optimizer, epoch * STEPS_PER_EPOCH + i)
            freezer.after_step()  # a policy evaluation every INTERVAL_STEPS steps
        freezer.end_epoch(epoch)


def outcome(model: TinyNet, freezer: Freezer) -> dict:
    """What the rest of the run measured and decided, and where the weights ended."""
    return {
        "history": [stats.to_dict() for stats in freezer.monitor.history],
        "decisions": [asdict(d) for d in freezer.decisions],
        "boundary": freezer.boundary,
        "model": {k: v.clone() for k, v in model.state_dict().items()},
    }


def write(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in POLICIES:
        model, freezer, optimizer = build(name)
        train_epochs(freezer, optimizer, range(HALFWAY_EPOCHS))
        halfway = copy.deepcopy(freezer.training_state_dict())  # its tensors are the live weights
        train_epochs(freezer, optimizer, range(HALFWAY_EPOCHS, EPOCHS))
        torch.save({"halfway": halfway, "outcome": outcome(model, freezer)}, out_dir / f"{name}.pt")
        freezer.close()


if __name__ == "__main__":
    # One thread, as the suite runs (tests/conftest.py): with two, a convolution's backward sums in
    # another order and the recorded floats would differ from the replay's in their last bits.
    torch.set_num_threads(1)
    write(Path(sys.argv[1]))
