"""Choose each searched arm's policy parameters on the validation split, never on the test set.

Rule (stated in the search table's caption): among the candidates whose mean final validation
accuracy over the search seeds is at least the search baseline's minus the margin, take the one
with the largest paired speedup in train wall time (geometric mean over the search seeds of the
baseline's time / the candidate's, same seed, same interleaved block); when none qualifies, take
the most accurate one and say so. Test accuracy is not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from freeze.pipeline import markdown
from freeze.pipeline.report.load import Run
from freeze.pipeline.report.paired import ratio_ci95
from freeze.pipeline.study.plan import BASELINE_ARM, BEST, Search


class SearchError(RuntimeError):
    """The search runs cannot support a choice (a run missing or incomplete); one line."""


@dataclass(frozen=True)
class Candidate:
    arm: str
    policy: str
    n_seeds: int
    val_acc: float  # mean final validation accuracy, fraction
    speedup: float  # geometric mean of baseline / candidate train wall time
    qualifies: bool
    chosen: bool = False


def _final_val(run: Run) -> float:
    value = float(run.metrics["val_acc"].iloc[-1])
    if math.isnan(value):
        raise SearchError(f"{run.run_dir}: no validation accuracy at the final epoch (data.val_size = 0?)")
    return value


def _wall_s(run: Run) -> float:
    return float(run.metrics["cumulative_wall_s"].iloc[-1])


def choose(search: Search, runs: list[Run]) -> tuple[dict[str, str], list[Candidate], float]:
    """arm -> chosen policy spec, every candidate's numbers, and the baseline's mean final val acc.

    Args:
        search: the study file's [search] table; a candidate qualifies at most
            ``search.qualify_margin_points`` below the baseline's val accuracy.
        runs: the search's run directories (loaded by freeze.pipeline.report.load).
    """
    by_group: dict[str, dict[int, Run]] = {}
    for run in runs:
        if not run.is_complete:
            raise SearchError(f"search run {run.run_dir} is not complete ({run.incomplete_reason}); re-run the study")
        by_group.setdefault(run.group, {})[run.seed] = run
    base = by_group.get(BASELINE_ARM, {})
    missing = sorted(set(search.seeds) - set(base))
    if missing:
        raise SearchError(f"search baseline has no complete run for seed(s) {missing}")
    base_val = float(np.mean([_final_val(base[s]) for s in search.seeds]))
    chosen: dict[str, str] = {}
    table: list[Candidate] = []
    for arm, policies in search.candidates.items():
        rows = []
        for policy in policies:
            members = by_group.get(f"{arm}@{policy}", {})
            if set(search.seeds) - set(members):
                raise SearchError(f"search candidate {arm}@{policy} has no complete run for every search seed")
            val = float(np.mean([_final_val(members[s]) for s in search.seeds]))
            speedup, _, _ = ratio_ci95([_wall_s(base[s]) / _wall_s(members[s]) for s in search.seeds])
            rows.append(
                Candidate(
                    arm,
                    policy,
                    len(search.seeds),
                    val,
                    speedup,
                    100 * (val - base_val) >= -search.qualify_margin_points,
                )
            )
        qualified = [c for c in rows if c.qualifies]
        best = max(qualified, key=lambda c: c.speedup) if qualified else max(rows, key=lambda c: c.val_acc)
        chosen[arm] = best.policy
        table += [Candidate(**{**c.__dict__, "chosen": c is best}) for c in rows]
    return chosen, table, base_val


def best_arm(candidates: list[Candidate]) -> str:
    """The searched arm whose chosen candidate is the fastest of the qualifying chosen ones; when
    none qualifies, the most accurate chosen one (what ``same_as = "best"`` takes)."""
    chosen = [c for c in candidates if c.chosen]
    qualified = [c for c in chosen if c.qualifies]
    return (max(qualified, key=lambda c: c.speedup) if qualified else max(chosen, key=lambda c: c.val_acc)).arm


def search_markdown(candidates: list[Candidate], base_val: float, search: Search) -> str:
    """The search table (markdown), with the rule in its caption."""
    lines = [
        f"Parameter search on the validation split: setting {search.setting or '(default)'}, search seeds "
        f"{', '.join(map(str, search.seeds))} (disjoint from the study's seeds); baseline final val acc "
        f"{100 * base_val:.2f} %. Rule: the fastest candidate (paired train-time speedup vs the search baseline) "
        f"whose mean final val accuracy is at most {search.qualify_margin_points:g} points below the baseline's; "
        "else the most accurate. Test accuracy is not read."
        + (
            f" {len(search.seeds)} search seed(s): fewer than 4 leave the choice to seed noise."
            if len(search.seeds) < 4
            else ""
        ),
        "",
    ]
    header = ["arm", "candidate policy", "seeds", "val acc % (final)", "vs baseline (points)", "speedup"]
    header += ["qualifies", "chosen"]
    rows = [
        (
            c.arm,
            c.policy,
            c.n_seeds,
            f"{100 * c.val_acc:.2f}",
            f"{100 * (c.val_acc - base_val):+.2f}",
            f"{c.speedup:.2f}x",
            "yes" if c.qualifies else "no",
            "**chosen**" if c.chosen else "",
        )
        for c in candidates
    ]
    lines += markdown.table(header, rows, align="llrrrrll")
    if BEST in search.same_as.values():
        takers = ", ".join(arm for arm, source in search.same_as.items() if source == BEST)
        lines += [
            "",
            f"Best searched arm (fastest qualifying choice): {best_arm(candidates)}; {takers} run its policy.",
        ]
    if any(c.chosen and not c.qualifies for c in candidates):
        lines += ["", "Note: no candidate of some arm qualified; the most accurate one was taken (marked chosen)."]
    return "\n".join(lines) + "\n"


def shift_markdown(candidates: list[Candidate], base_val: float, runs: list[Run], setting: str) -> str:
    """Each searched arm's validation accuracy against the baseline, in the search and then in the
    study (its seeds, the search's setting): a search that picks the candidate its noise favoured
    most shows as a drop (the FDSL-32 study: all five searched arms, mean -0.28 points)."""
    study_val: dict[str, list[float]] = {}
    for run in runs:
        if run.is_complete and run.setting == setting:
            study_val.setdefault(run.group, []).append(_final_val(run))
    base = study_val.get(BASELINE_ARM)
    rows, shifts = [], []
    for c in (c for c in candidates if c.chosen):
        arm = study_val.get(c.arm)
        if not base or not arm:
            continue
        search_diff = 100 * (c.val_acc - base_val)
        study_diff = 100 * (float(np.mean(arm)) - float(np.mean(base)))
        shifts.append(study_diff - search_diff)
        rows.append(
            (c.arm, c.policy, f"{search_diff:+.2f}", f"{study_diff:+.2f} ({len(arm)} seeds)", f"{shifts[-1]:+.2f}")
        )
    if not rows:
        return ""
    lines = [
        f"Search to study: each searched arm's final validation accuracy against the baseline's (points), on the "
        f"search seeds and then on the study's, in setting {setting or '(default)'}; a negative shift is accuracy "
        f"the search's choice lost on new seeds. Mean shift {np.mean(shifts):+.2f} points over {len(shifts)} "
        f"arm{'' if len(shifts) == 1 else 's'}.",
        "",
    ]
    header = ["arm", "chosen policy", "search: vs baseline", "study: vs baseline", "shift"]
    return "\n".join(lines + markdown.table(header, rows, align="llrrr")) + "\n"
