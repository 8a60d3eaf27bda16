"""Hand-made monitor histories, run progress and error checks shared by the policy tests
(tests/test_policies_base.py, tests/test_policies_rules.py)."""

from __future__ import annotations

import pytest

from freeze.monitor import IntervalStats
from freeze.policies import PolicyError, Pricing, Progress

PROGRESS = Progress(epochs_completed=4, epochs_total=10, steps_completed=400, steps_total=1000)


def interval(index: int, norms: list[float | None], boundary: int = 0) -> IntervalStats:
    return IntervalStats(
        index=index,
        epoch=index,
        end_step=10 * (index + 1),
        steps=10,
        skipped_steps=0,
        boundary=boundary,
        summed_grad_norm=tuple(norms),
        summed_grad_l1_norm=tuple(norms),
        mean_step_grad_norm=tuple(norms),
    )


def eta_history(etas: list[float | None], boundary: int = 0) -> list[IntervalStats]:
    """Two intervals whose relative change per block is exactly ``etas`` (None: block not observed).

    G_prev = 10 and G_cur = 10 * (1 - eta): |10 - 10 (1 - eta)| / 10 is exact for one-decimal etas."""
    prev = [None if e is None else 10.0 for e in etas]
    cur = [None if e is None else 10.0 - 10.0 * e for e in etas]
    return [interval(0, prev, boundary), interval(1, cur, boundary)]


def at_fraction(f: float) -> Progress:
    return Progress(epochs_completed=0, epochs_total=1, steps_completed=round(f * 1000), steps_total=1000)


def after_epochs(epochs_completed: int, epochs_total: int = 50) -> Progress:
    return Progress(epochs_completed=epochs_completed, epochs_total=epochs_total, steps_completed=0, steps_total=0)


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(PolicyError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "accepted:" in message
    return message


NON_DEFAULT = {
    "none": {},
    "static": {"k": 3},
    "freezeout": {"t0": 0.5, "scale": "squared"},
    "linear": {"freeze_start": 0.25, "freeze_level": 0.75},
    "geometric": {"alpha": 0.2},
    "autofreeze": {"percentile": 30.0, "min_intervals": 4, "norm": "l2"},
    "cs744": {},
    "gradual-unfreeze": {"every_epochs": 3},
    "payoff": {"exchange": 2.0, "window": 3, "min_intervals": 4},
    "at": {"k": 4, "t": 0.7},
    "horizon": {"exchange": 5.0, "window": 1, "span": 2, "probation": 0, "tolerance": 0.1, "hold_off": 3},
}


def sizes(policy, num_blocks: int, steps_total: int = 1000) -> dict:
    """What the Freezer passes a policy beyond the four arguments: equal block bytes to one that
    weighs them; to one that prices its freezes, step times falling with the boundary and a constant LR."""
    extra = {"block_bytes": (1,) * num_blocks} if policy.uses_block_bytes else {}
    if policy.uses_pricing:
        step_time_s = tuple(1.0 - 0.1 * k for k in range(num_blocks))
        extra["pricing"] = Pricing(step_time_s=step_time_s, lr_per_step=(0.01,) * steps_total)
    return extra
