"""A signal of a policy's own (freeze.signals, issue 47): the monitor runs the signals a policy's
needs() declares, records their values per interval, keeps them in checkpoints, and refuses a
declaration or a value it cannot use in one line."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from freeze import Freezer, split_blocks
from freeze.policies import Needs, Policy, param
from freeze.signals import Signal
from tests.tiny_models import TinyNet, freezer_step


class StepCount(Signal):
    """Counts observed steps per interval for the active blocks: a signal with state mid-interval."""

    name: ClassVar[str] = "step_count"

    def bind(self, blocks):
        super().bind(blocks)
        self.steps = 0

    def observe(self, first_active, grad_scale):
        self.steps += 1

    def close(self, first_active):
        counted, self.steps = self.steps, 0
        return [float(counted)] * len(self.blocks)

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class HeadNorm(Signal):
    """The weight norm of each block (a value read at close only)."""

    name: ClassVar[str] = "weight_norm"

    def close(self, first_active):
        return [sum(float(p.norm()) ** 2 for p in b.params) ** 0.5 for b in self.blocks]


@dataclass(frozen=True)
class FreezeOnCount(Policy):
    """Freezes one more block whenever the last interval counted at least `steps` steps."""

    name: ClassVar[str] = "freeze-on-count"
    steps: int = param(3, low=1)

    def needs(self) -> Needs:
        return Needs(signals=(StepCount, HeadNorm))

    def decide(self, boundary, history, progress, num_blocks):
        count = history[-1].signals["step_count"][-1]
        return min(boundary + 1, num_blocks - 1) if count >= self.steps else boundary


def _step(freezer: Freezer, optimizer, step: int) -> None:
    freezer_step(freezer, optimizer, step)
    freezer.after_step()  # the policy decides every interval_steps steps


def _freezer(interval_steps: int = 3) -> tuple[Freezer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = FreezeOnCount(steps=3)
    return Freezer(model, split_blocks(model), policy, optimizer=optimizer, interval_steps=interval_steps), optimizer


def test_the_declared_signals_are_recorded_per_interval_and_none_for_frozen_blocks():
    freezer, optimizer = _freezer()
    for step in range(6):
        _step(freezer, optimizer, step)
    first, second = freezer.history
    assert first.signals["step_count"] == (3.0, 3.0, 3.0, 3.0) and freezer.boundary == 2
    assert second.signals["step_count"] == (None, 3.0, 3.0, 3.0)  # block 0 frozen during the second interval
    norms = second.signals["weight_norm"]
    assert norms[0] is None and all(v > 0 for v in norms[1:])
    assert freezer.monitor.history[0].to_dict()["signals"]["step_count"] == (3.0, 3.0, 3.0, 3.0)


def test_a_run_resumed_mid_interval_reads_the_signals_the_uninterrupted_run_read():
    whole, optimizer = _freezer()
    for step in range(8):
        _step(whole, optimizer, step)

    cut, cut_optimizer = _freezer()
    for step in range(4):  # one step into the second interval: the signal holds a partial count
        _step(cut, cut_optimizer, step)
    buffer = io.BytesIO()
    torch.save(
        {"freezer": cut.state_dict(), "model": cut.model.state_dict(), "opt": cut_optimizer.state_dict()}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, resumed_optimizer = _freezer()
    resumed.model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["freezer"])
    resumed_optimizer.load_state_dict(saved["opt"])
    for step in range(4, 8):
        _step(resumed, resumed_optimizer, step)
    assert [s.signals for s in resumed.history] == [s.signals for s in whole.history]
    assert resumed.boundary == whole.boundary


def test_a_monitor_state_saved_before_signals_existed_loads():
    freezer, optimizer = _freezer()
    _step(freezer, optimizer, 0)
    state = freezer.state_dict()
    assert state["monitor"]["signals"]["step_count"] == {"steps": 1}  # what the older state lacks
    state["monitor"].pop("signals")
    again, _ = _freezer()
    again.load_state_dict(state)
    assert again.monitor.signals[0].steps == 0  # started afresh


@dataclass(frozen=True)
class Declares(Policy):
    name: ClassVar[str] = "declares"
    what: ClassVar[tuple] = ()

    def needs(self) -> Needs:
        return Needs(signals=self.what)

    def decide(self, boundary, history, progress, num_blocks):
        return boundary


class Nameless(Signal):
    def close(self, first_active):
        return []


@pytest.mark.parametrize(
    ("declared", "expected"),
    [
        ((int,), "Needs.signals holds <class 'int'>; accepted: subclasses of freeze.signals.Signal with a name"),
        ((Nameless,), "Needs.signals holds"),
        ((StepCount, StepCount), "Needs.signals names step_count, step_count; accepted: distinct names"),
    ],
)
def test_a_declaration_the_monitor_cannot_run_is_refused_when_the_freezer_is_built(declared, expected):
    policy = type("D", (Declares,), {"what": declared})()
    model = TinyNet()
    with pytest.raises(ValueError) as err:
        Freezer(model, split_blocks(model), policy)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_signal_with_a_value_per_block_of_another_model_is_one_line():
    class Short(Signal):
        name: ClassVar[str] = "short"

        def close(self, first_active):
            return [1.0]

    policy = type("D", (Declares,), {"what": (Short,)})()
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    freezer = Freezer(model, split_blocks(model), policy, optimizer=optimizer, interval_steps=1)
    with pytest.raises(ValueError, match=r"^signal 'short': close\(\) gave 1 values; accepted: one per block \(4\)$"):
        _step(freezer, optimizer, 0)
