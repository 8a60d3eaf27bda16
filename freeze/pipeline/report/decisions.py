"""Where each adaptive policy moved the boundary, seed by seed (issue 37): a rule that decides from
a signal is judged by when it froze what, and whether it undid it, beside what that cost.

One row per group whose policy decides from a training signal (:data:`SIGNAL_POLICIES`; the
schedules - none, static, at, freezeout, linear, geometric, gradual-unfreeze - are known before the
run): its boundary changes per seed, read from each run's ``boundary_steps`` (the
optimizer step after which the boundary changed, and its new value), the first freeze as a fraction
of the run, the final boundary and the unfreezes (a change to a lower boundary: horizon's undos).
"""

from __future__ import annotations

import math

import numpy as np

from freeze.names import split_policy_spec
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.tables import NA, Baseline, Column, Table, complete_groups, csv_frame, display_columns
from freeze.policies import POLICIES

# The policies that decide from a training signal, read off the registry (freeze.policies imports no
# torch: the report reads run directories without it).
SIGNAL_POLICIES = tuple(name for name, cls in POLICIES.items() if cls.uses_gradients)

DECISIONS_CAPTION = (
    "Where each adaptive policy moved the boundary: per seed, every change as step->boundary (the optimizer step "
    "after which it took effect), from each run's metrics.jsonl; first freeze as a fraction of the run's steps "
    "(mean over seeds, with the seeds that never froze counted apart); unfreezes: changes to a lower boundary "
    "(horizon's undos on probation)."
)
NO_ADAPTIVE = f"no policy that reads a training signal ({', '.join(SIGNAL_POLICIES)}) in these runs: no decisions table"


def _moves(run: Run) -> str:
    if not run.boundary_steps:
        return "none"
    return ", ".join(f"{step}->{k}" for step, k in run.boundary_steps)


def first_freeze_fractions(members: list[Run]) -> list[float]:
    """Per run that froze, the step of its first boundary change over the run's steps."""
    return [r.boundary_steps[0][0] / r.final_step for r in members if r.boundary_steps]


def decisions_row(members: list[Run]) -> dict:
    """One adaptive group's decisions over its seeds."""
    members = sorted(members, key=lambda r: r.seed)
    first = first_freeze_fractions(members)
    unfreezes = sum(
        sum(1 for (_, before), (_, after) in zip(r.boundary_steps, r.boundary_steps[1:]) if after < before)
        for r in members
    )
    return {
        "setting": members[0].setting,
        "group": members[0].group,
        "policy": members[0].policy,
        "n_runs": len(members),
        "froze_runs": len(first),
        "first_freeze_fraction": float(np.mean(first)) if first else math.nan,
        "final_boundaries": " ".join(str(int(r.metrics["boundary"].iloc[-1])) for r in members),
        "unfreezes": unfreezes,
        "moves": "; ".join(f"s{r.seed}: {_moves(r)}" for r in members),
    }


def _columns() -> list[Column]:
    return [
        ("setting", "l", lambda r: r["setting"]),
        ("group", "l", lambda r: r["group"]),
        ("policy", "l", lambda r: f"`{r['policy']}`"),
        ("seeds", "r", lambda r: str(r["n_runs"])),
        (
            "first freeze (run fraction)",
            "r",
            lambda r: (
                NA
                if not math.isfinite(r["first_freeze_fraction"])
                else f"{r['first_freeze_fraction']:.2f}"
                + ("" if r["froze_runs"] == r["n_runs"] else f" ({r['froze_runs']}/{r['n_runs']} froze)")
            ),
        ),
        ("final boundary per seed", "l", lambda r: r["final_boundaries"]),
        ("unfreezes", "r", lambda r: str(r["unfreezes"])),
        ("changes per seed (step->boundary)", "l", lambda r: r["moves"]),
    ]


def decisions_table(runs: list[Run], baseline: Baseline) -> Table:
    """The decisions of every adaptive group (module docstring); ``baseline`` is named for symmetry
    with the other tables and not compared with: a decision needs no pairing."""
    rows = [
        decisions_row(members)
        for members in complete_groups(runs).values()
        if split_policy_spec(members[0].policy)[0] in SIGNAL_POLICIES
    ]
    rows.sort(key=lambda r: (r["setting"], r["group"]))
    display, align = display_columns(rows, _columns())
    return Table(
        "decisions", "Adaptive decisions", DECISIONS_CAPTION if rows else NO_ADAPTIVE, csv_frame(rows), display, align
    )
