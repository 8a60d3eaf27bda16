"""freeze.policies.payoff: the project's rule prices each prefix (bytes saved against gradient
signal stopped), freezes the best-paying one bottom-up, and is wired through the Freezer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from freeze import Freezer, split_blocks
from freeze.policies import make_policy
from freeze.policies.payoff import Payoff
from tests.policy_histories import PROGRESS, interval, one_line_error


def decaying(signal_per_block: list[list[float | None]], boundary: int = 0) -> list:
    """One interval per row: the per-step summed-gradient norm of each block (10 steps each)."""
    return [
        interval(i, [None if g is None else 10.0 * g for g in row], boundary) for i, row in enumerate(signal_per_block)
    ]


def test_signal_is_the_windowed_norm_over_its_own_peak():
    history = decaying([[1.0, 4.0], [3.0, 4.0], [1.0, 2.0], [1.0, 1.0]])
    # window 2: means 2, 2, 1 (block 0) and 4, 3, 1.5 (block 1); now over peak
    assert Payoff(window=2).signals(history, 2) == [pytest.approx(0.5), pytest.approx(1.5 / 4)]
    assert Payoff(window=1).signals(history, 2) == [pytest.approx(1 / 3), pytest.approx(0.25)]
    # a block not observed in the window has no signal
    history = decaying([[1.0, 1.0], [1.0, 1.0], [None, 1.0]])
    assert Payoff(window=2).signals(history, 2)[0] is None


def test_nothing_freezes_while_every_block_is_at_its_peak():
    flat = decaying([[1.0] * 5] * 6)
    for boundary in range(4):
        assert Payoff(exchange=1.5).decide(boundary, flat, PROGRESS, 5, block_bytes=(1, 1, 1, 1, 1)) == boundary


def test_heavy_top_blocks_pay_for_freezing_the_whole_body_at_once():
    # ResNet-like bytes: the last body block holds most; every block's signal fell to 0.3 of its peak
    block_bytes = (1, 2, 10, 80, 1)
    history = decaying([[1.0] * 5, [1.0] * 5, [0.3] * 5, [0.3] * 5])
    # exchange 3: each block pays share * (1 - 0.9) > 0, the whole body most
    assert Payoff(exchange=3.0, window=2).decide(0, history, PROGRESS, 5, block_bytes=block_bytes) == 4
    assert Payoff(exchange=5.0, window=2).decide(0, history, PROGRESS, 5, block_bytes=block_bytes) == 0  # 1 - 1.5 < 0
    # a small block that still learns rides along with heavy settled ones above it (the rule's assumption)
    still_learning = decaying([[1.0] * 5, [1.0] * 5, [1.0, 0.3, 0.3, 0.3, 0.3], [1.0, 0.3, 0.3, 0.3, 0.3]])
    assert Payoff(exchange=3.0, window=2).decide(0, still_learning, PROGRESS, 5, block_bytes=block_bytes) == 4


def test_equal_blocks_freeze_only_the_settled_leading_run():
    block_bytes = (1, 1, 1, 1, 1)
    rows = [[1.0] * 5, [1.0] * 5, [0.05, 0.05, 1.0, 0.05, 1.0], [0.05, 0.05, 1.0, 0.05, 1.0]]
    policy = Payoff(exchange=2.0, window=2)
    # each block's share is 0.2: a settled block pays 0.2 * (1 - 0.1) = 0.18, an active one 0.2 * (1 - 2) = -0.2
    assert policy.decide(0, decaying(rows), PROGRESS, 5, block_bytes=block_bytes) == 2  # block 2 still learns
    assert policy.gains(0, policy.signals(decaying(rows), 5), [0.2] * 5, 5) == pytest.approx([0.18, 0.36, 0.16, 0.34])


def test_waits_for_a_peak_and_never_moves_back_or_past_the_head():
    block_bytes = (1, 1, 1, 1)
    settled = decaying([[1.0] * 4, [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    assert Payoff(min_intervals=4).decide(0, settled, PROGRESS, 4, block_bytes=block_bytes) == 0
    assert Payoff(min_intervals=3).decide(0, settled, PROGRESS, 4, block_bytes=block_bytes) == 3
    assert Payoff(min_intervals=3).decide(3, settled, PROGRESS, 4, block_bytes=block_bytes) == 3
    frozen_below = decaying([[None, 1.0, 1.0, 1.0]] * 3, boundary=1)
    assert Payoff().decide(1, frozen_below, PROGRESS, 4, block_bytes=block_bytes) == 1


def test_bad_block_bytes_and_history_width_are_one_line_errors():
    history = decaying([[1.0] * 3] * 3)
    assert "block_bytes" in one_line_error(Payoff().decide, 0, history, PROGRESS, 3)
    assert "3 non-negative byte counts" in one_line_error(Payoff().decide, 0, history, PROGRESS, 3, block_bytes=(1, 2))
    assert "not all zero" in one_line_error(Payoff().decide, 0, history, PROGRESS, 3, block_bytes=(0, 0, 0))
    assert "exactly num_blocks = 4" in one_line_error(Payoff().decide, 0, history, PROGRESS, 4, block_bytes=(1,) * 4)
    assert "accepted: float > 0" in one_line_error(make_policy, "payoff", exchange=0)


def test_explain_names_signal_and_gains():
    history = decaying([[1.0] * 3, [1.0] * 3, [0.5] * 3])
    line = Payoff().explain(0, history, PROGRESS, 3, block_bytes=(1, 1, 1))
    assert "signal per block [0.75 0.75 0.75]" in line and "gain" in line
    assert "peak needs 3" in Payoff().explain(0, history[:1], PROGRESS, 3, block_bytes=(1, 1, 1))


def test_the_freezer_passes_block_bytes_and_freezes_the_heavy_body():
    """End to end on one process: a model whose last body block is the heaviest; gradients that vanish
    after a few intervals (the loss is made flat) drive the signal down and the body freezes at once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 64), nn.Linear(64, 2))
    blocks = split_blocks(model)
    assert len(blocks) == 4
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    policy = make_policy("payoff:exchange=2,window=1,min_intervals=2")
    freezer = Freezer(model, blocks, policy, optimizer=optimizer, interval_steps=2)
    x = torch.randn(8, 4)
    for step in range(40):
        scale = 1.0 if step < 8 else 0.01  # the signal falls to 1 % of its peak
        loss = scale * freezer.module(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        freezer.after_backward()
        optimizer.step()
        freezer.after_step()
    assert freezer.boundary == 3
    assert [d.boundary_after for d in freezer.decisions] == [3]
