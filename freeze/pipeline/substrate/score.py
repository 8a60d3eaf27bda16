"""``python -m experiments.substrate score --config C``: freeze policies scored on the planted tasks.

On a planted task the best static boundary d is known by construction (planted.py), so a policy's
choice can be judged against it: issue 23 section 2, research note section 7.4. Per task d and seed,
one interleaved block runs full fine-tuning (``none``), the oracle (static k = d with the activation
cache) and every policy of the score file (with the cache), paired on the same data order. Policy
parameters may also be chosen on the validation split of search seeds disjoint from the scored
seeds (one choice per policy for all tasks: a choice per task would tell the policy d).

Per policy and task, over the seeds (mean and 95 % t-interval where paired):

- accuracy regret: final test accuracy minus full fine-tuning's (points); non-inferior above -margin;
- boundary error: final boundary minus d (< 0 leaves savings on the table, > 0 over-freezes);
- savings captured: (T_full - T_policy) / (T_full - T_oracle), T the training wall time of the same
  seed's block; and the same for all-reduce traffic (exact, no timing noise);
- time to d: the first step with boundary >= d, as a fraction of the run's steps ("never" if not);
- overshoot: the mean over the run's steps of max(0, boundary - d) (block-steps per step);
- tracking slope: the least-squares slope of the final boundary on d over all tasks and seeds
  (1 follows d; 0 ignores it).

Writes ``<out-dir>/<name>.md``, ``.json`` and ``<name>-tracking.png`` (final boundary against d per
policy), and splices the table and figure into the span ``<name>`` of the score file's ``report_md``
when it has one (checked before any run starts).
Complete runs are skipped, so an interrupted score continues where it stopped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from freeze._atomic import atomic_write, atomic_write_json, atomic_write_text
from freeze.checks import is_int, is_number
from freeze.pipeline import markdown
from freeze.pipeline.config import ConfigError
from freeze.pipeline.report.paired import UNDECIDED, non_inferiority
from freeze.pipeline.report.tables import ratio_ci95
from freeze.pipeline.runs import RunDir
from freeze.pipeline.study.plan import BASELINE_ARM, Arm, StudyFile, main_specs
from freeze.pipeline.study.stages import pretrain_stage, run_stage
from freeze.pipeline.substrate.gates import GateError, Paired, paired
from freeze.pipeline.substrate.report import splice_file
from freeze.pipeline.sweep import SweepError, check_runnable_here, read_toml
from freeze.policies import parse_policy

ORACLE = "oracle"
TASKS = (3, 5, 7)  # the planted tasks that exist (planted.py)
_SCORE_KEYS = frozenset(
    {
        "name",
        "finetune",
        "weights",
        "tasks",
        "seeds",
        "order_seed",
        "margin_points",
        "overrides",
        "setting",
        "report_md",
    }
)
_SETTING = "loopback"


@dataclass(frozen=True)
class ScoreFile:
    path: Path
    name: str
    finetune: str
    weights: str
    tasks: tuple[int, ...]
    seeds: tuple[int, ...]
    order_seed: int
    margin_points: float
    overrides: tuple[str, ...]
    setting: tuple[str, ...]
    report_md: str | None
    policies: dict[str, str]  # arm name -> policy spec
    search_seeds: tuple[int, ...]
    candidates: dict[str, tuple[str, ...]]  # policy arm -> specs to choose from on validation


def _error(path, message: str) -> GateError:
    return GateError(f"score file {path}: {message}")


def _strings(path, where: str, value) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _error(path, f"{where} must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def _ints(path, where: str, value, allowed: Sequence[int] | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(is_int(v) for v in value) or len(set(value)) < len(value):
        raise _error(path, f"{where} must be a non-empty list of distinct integers, got {value!r}")
    if allowed is not None and set(value) - set(allowed):
        raise _error(
            path, f"{where} {sorted(set(value) - set(allowed))}: no such planted task; accepted: {list(allowed)}"
        )
    return tuple(value)


def read_score(path: str | Path) -> ScoreFile:
    """Parse and check a score file; every problem is one GateError line naming the key."""
    try:
        data = read_toml(path, "score")
    except SweepError as e:
        raise GateError(str(e)) from None
    if set(data) - {"score", "policies", "search"}:
        raise _error(
            path,
            f"unknown table(s) {', '.join(sorted(set(data) - {'score', 'policies', 'search'}))}; "
            "accepted: score, policies, search",
        )
    score = _score_table(path, data.get("score"))
    policies = _policies_table(path, data.get("policies") or {})
    seeds = _ints(path, "seeds", score.get("seeds", [0, 1, 2]))
    search_seeds, candidates = _search_table(path, data.get("search") or {}, seeds, policies)
    return ScoreFile(
        path=Path(path),
        name=str(score["name"]),
        finetune=str(score["finetune"]),
        weights=str(score["weights"]),
        tasks=_ints(path, "tasks", score.get("tasks", list(TASKS)), TASKS),
        seeds=seeds,
        order_seed=int(score.get("order_seed", 0)),
        margin_points=float(score.get("margin_points", 0.5)),
        overrides=_strings(path, "overrides", score.get("overrides", [])),
        setting=_strings(path, "setting", score.get("setting", [])),
        report_md=score.get("report_md"),
        policies=policies,
        search_seeds=search_seeds,
        candidates=candidates,
    )


def _score_table(path: str | Path, score) -> dict:
    """[score], checked key by key."""
    if not isinstance(score, dict) or not {"name", "finetune", "weights"} <= set(score):
        raise _error(path, "needs a [score] table with 'name', 'finetune' and 'weights'")
    if set(score) - _SCORE_KEYS:
        unknown = ", ".join(sorted(set(score) - _SCORE_KEYS))
        raise _error(path, f"[score]: unknown key(s) {unknown}; accepted: {', '.join(sorted(_SCORE_KEYS))}")
    margin = score.get("margin_points", 0.5)
    if not is_number(margin) or not margin > 0:
        raise _error(path, f"margin_points must be a number > 0, got {margin!r}")
    if not is_int(score.get("order_seed", 0)):
        raise _error(path, f"order_seed must be an integer, got {score['order_seed']!r}")
    if not isinstance(score.get("report_md", ""), str):
        raise _error(path, f"report_md must be a path to a markdown file, got {score['report_md']!r}")
    if str(score["name"]) == "planted" or not str(score["name"]).strip():
        # its folders would be planted-d<d>, the planted checks' own (whose runs it would then reuse)
        raise _error(path, f"name {score['name']!r} is taken by the planted checks' folders; choose another")
    return score


def _policies_table(path: str | Path, policies) -> dict[str, str]:
    """[policies]: arm name -> policy spec."""
    if not isinstance(policies, dict) or not policies:
        raise _error(path, 'needs a [policies] table: one line per policy, name = "spec"')
    for arm, spec in policies.items():
        if arm in (BASELINE_ARM, ORACLE) or not isinstance(spec, str) or not spec:
            raise _error(
                path,
                f"policies.{arm} = {spec!r}: a policy spec string, under a name other than "
                f"{BASELINE_ARM!r} and {ORACLE!r}",
            )
    return dict(policies)


def _search_table(
    path: str | Path, search: dict, seeds: tuple[int, ...], policies: dict[str, str]
) -> tuple[tuple[int, ...], dict[str, tuple[str, ...]]]:
    """[search] (optional): its seeds, apart from the scored ones, and each policy's candidate specs."""
    if set(search) - {"seeds", "candidates"}:
        raise _error(
            path,
            f"[search]: unknown key(s) {', '.join(sorted(set(search) - {'seeds', 'candidates'}))}; "
            "accepted: seeds, candidates",
        )
    if not search:
        return (), {}
    search_seeds = _ints(path, "search.seeds", search.get("seeds"))
    if set(search_seeds) & set(seeds):
        # Choosing parameters on the runs that are then scored is selection on the result.
        raise _error(path, f"search.seeds {sorted(set(search_seeds) & set(seeds))} are also scored seeds; use others")
    if not isinstance(search.get("candidates", {}), dict):
        raise _error(path, "[search.candidates] must be a table: policy -> list of specs")
    candidates: dict[str, tuple[str, ...]] = {}
    for arm, specs in (search.get("candidates") or {}).items():
        if arm not in policies:
            raise _error(path, f"search.candidates.{arm}: no policy {arm!r}; policies: {', '.join(policies)}")
        candidates[arm] = _strings(path, f"search.candidates.{arm}", specs)
        if not candidates[arm]:
            raise _error(path, f"search.candidates.{arm} is empty; give at least one spec")
    if not candidates:
        raise _error(path, "[search] needs a [search.candidates] table: policy -> list of specs")
    return search_seeds, candidates


def _policy_arm(spec: str) -> tuple[str, ...]:
    return (f"freeze.policy={spec}", "freeze.cache=memory")


def task_study(
    score: ScoreFile, d: int, folder: str, seeds: tuple[int, ...], arms: dict[str, str], oracle: bool = True
) -> StudyFile:
    """The runs of one planted task as a study (so they are planned, interleaved and named as a
    study's): ``none``, the oracle static k = d (unless ``oracle`` is False: the search compares with
    full fine-tuning only) and ``arms`` (name -> policy spec), every freezing arm with the cache."""
    return StudyFile(
        path=score.path,
        name=folder,
        finetune=score.finetune,
        pretrain=None,
        overrides=(*score.overrides, f"data.dataset=planted-d{d}"),
        seeds=seeds,
        # each task its own block orders (the same order in every task would repeat position effects)
        order_seed=score.order_seed * 100 + d,
        target_fraction=0.95,
        margin_points=score.margin_points,
        report_md=None,
        out_dir=None,
        settings={_SETTING: score.setting},
        arms={
            BASELINE_ARM: Arm(()),
            **({ORACLE: Arm(_policy_arm(f"static:k={d}"))} if oracle else {}),
            **{name: Arm(_policy_arm(spec)) for name, spec in arms.items()},
        },
        weights=score.weights,
    )


def seed_major(studies: list[StudyFile], root: str, weights: tuple[str, ...]) -> list:
    """Every run of ``studies`` (one per task), one interleaved block per (seed, task), seeds first:
    an interruption leaves whole seeds of every task rather than every seed of one task."""
    blocks: dict[tuple[int, int], list] = {}
    for t, study in enumerate(studies):
        for spec in main_specs(study, {}, root, weights):
            blocks.setdefault((spec.config.run.seed, t), []).append(spec)
    return [spec for key in sorted(blocks) for spec in blocks[key]]


# ---------------------------------------------------------------------------- one run's numbers
@dataclass(frozen=True)
class RunNumbers:
    test_acc: float  # percent
    val_acc: float  # percent
    train_s: float
    allreduce_bytes: float
    boundaries: tuple[int, ...]  # the boundary in force at each optimizer step, in order
    start_time: str = ""  # ISO time the run started (its manifest)

    @property
    def final_boundary(self) -> int:
        return self.boundaries[-1]


def boundary_per_step(records: list[dict]) -> tuple[int, ...]:
    """The boundary in force at each optimizer step of a run, from its metrics.jsonl records.

    A change after step s (``boundary_steps``: [s, k]) sets the boundary of steps s+1 onwards; each
    epoch's ``boundary_at_epoch_start`` holds it at the epoch's first step (so a change at an epoch's
    last step, or one a record lacks, is still in force from the next epoch on)."""
    steps: list[int] = []
    start_step = 0
    for record in records:
        end_step = int(record["step"])
        if "boundary_steps" not in record or "boundary_at_epoch_start" not in record:
            raise GateError(
                f"metrics record of epoch {record.get('epoch')} lacks boundary_steps: a run of an older version"
            )
        k = int(record["boundary_at_epoch_start"])
        changes = {int(s): int(b) for s, b in record["boundary_steps"]}
        for step in range(start_step, end_step):
            steps.append(k)
            k = changes.get(step + 1, k)
        start_step = end_step
    return tuple(steps)


def run_numbers(run_dir: Path, manifest: dict | None = None) -> RunNumbers:
    records = RunDir(run_dir).read_metrics()
    last = records[-1]
    for key in ("test_acc", "val_acc"):
        if last.get(key) is None:
            raise GateError(f"{run_dir}: no {key} at the final epoch (data.val_size = 0, or test_eval not final?)")
    manifest = manifest or {}
    return RunNumbers(
        test_acc=100 * float(last["test_acc"]),
        val_acc=100 * float(last["val_acc"]),
        train_s=float(last["cumulative_wall_s"]),
        allreduce_bytes=float(sum(r["allreduce_bytes"] for r in records)),
        boundaries=boundary_per_step(records),
        start_time=str(manifest.get("start_time", "")),
    )


def time_to_boundary(boundaries: Sequence[int], d: int) -> float | None:
    """The first step with boundary >= d, as a fraction of the run's steps; None if never."""
    for step, k in enumerate(boundaries):
        if k >= d:
            return step / len(boundaries)
    return None


def overshoot(boundaries: Sequence[int], d: int) -> float:
    """Mean over steps of max(0, boundary - d): blocks frozen beyond d, per step."""
    return sum(max(0, k - d) for k in boundaries) / len(boundaries)


MIN_ORACLE_SAVING = 0.02  # below 2 % of full fine-tuning's, the oracle's saving is timing noise


def captured(full: float, policy: float, oracle: float) -> float:
    """(full - policy) / (full - oracle): the share of the oracle's saving the policy got; NaN when
    the oracle saved less than :data:`MIN_ORACLE_SAVING` of ``full`` (the ratio would be noise)."""
    return (full - policy) / (full - oracle) if full - oracle > MIN_ORACLE_SAVING * full else math.nan


def tracking_slope(points: Sequence[tuple[int, int]]) -> float:
    """Least-squares slope of the final boundary on d over (d, final boundary) points."""
    ds = [p[0] for p in points]
    if len(set(ds)) < 2:
        return math.nan
    mean_d = sum(ds) / len(ds)
    mean_k = sum(p[1] for p in points) / len(points)
    num = sum((d - mean_d) * (k - mean_k) for d, k in points)
    return num / sum((d - mean_d) ** 2 for d in ds)


@dataclass(frozen=True)
class Score:
    """One policy on one planted task, over the seeds."""

    policy: str
    spec: str
    d: int
    seeds: tuple[int, ...]
    regret: Paired
    final_boundaries: tuple[int, ...]
    time_captured: Paired
    bytes_captured: Paired
    time_to_d: tuple[float | None, ...]
    overshoot: float
    verdict: str
    oracle_time_saving: float = math.nan  # mean of 1 - T_oracle / T_full: the captured share's denominator
    interleaved: bool = True  # every run ran inside its seed's block (its times are paired)


def score_task(d: int, by_arm: dict[str, dict[int, RunNumbers]], specs: dict[str, str], margin: float) -> list[Score]:
    """Every policy arm of one task against its ``none`` and ``oracle`` runs (seeds complete on all three)."""
    out = []
    for arm, spec in specs.items():
        seeds = tuple(
            sorted(s for s in by_arm.get(arm, {}) if s in by_arm.get(BASELINE_ARM, {}) and s in by_arm.get(ORACLE, {}))
        )
        if not seeds:
            continue
        runs = [(by_arm[arm][s], by_arm[BASELINE_ARM][s], by_arm[ORACLE][s]) for s in seeds]
        regret = paired([p.test_acc - f.test_acc for p, f, _ in runs])
        # the study report's rule; one seed has no interval, so nothing is shown
        verdict = non_inferiority(regret.low, regret.high, margin) if regret.n >= 2 else UNDECIDED
        out.append(
            Score(
                policy=arm,
                spec=spec,
                d=d,
                seeds=seeds,
                regret=regret,
                final_boundaries=tuple(p.final_boundary for p, _, _ in runs),
                time_captured=paired([captured(f.train_s, p.train_s, o.train_s) for p, f, o in runs]),
                bytes_captured=paired(
                    [captured(f.allreduce_bytes, p.allreduce_bytes, o.allreduce_bytes) for p, f, o in runs]
                ),
                time_to_d=tuple(time_to_boundary(p.boundaries, d) for p, _, _ in runs),
                overshoot=sum(overshoot(p.boundaries, d) for p, _, _ in runs) / len(runs),
                verdict=verdict,
                oracle_time_saving=sum(1 - o.train_s / f.train_s for _, f, o in runs) / len(runs),
                interleaved=all(ran_in_its_block(by_arm, arm, s) for s in seeds if by_arm[arm][s].start_time),
            )
        )
    return out


def complete_runs(
    folder: Path, seeds: Sequence[int] | None = None, planned: dict[str, str] | None = None
) -> dict[str, dict[int, RunNumbers]]:
    """arm -> seed -> numbers, complete runs of one task's folder only (of ``seeds`` when given).

    Complete runs are skipped by name when a score is re-run, so a run left by an earlier version of
    the score file (another spec under the same arm name) would be scored under the new label:
    with ``planned`` (arm -> spec), such a run is refused in one line."""
    out: dict[str, dict[int, RunNumbers]] = {}
    for manifest in sorted(folder.glob("*/manifest.json")):
        m = json.loads(manifest.read_text())
        if m.get("status") != "complete" or (seeds is not None and int(m["seed"]) not in seeds):
            continue
        arm = m["group"]
        if planned is not None and arm in planned and not same_policy(m["policy"], planned[arm]):
            raise GateError(
                f"{manifest.parent}: ran policy {m['policy']!r}, but the score file now gives {arm} = "
                f"{planned[arm]!r}; move the run directory away (or rename the arm) and re-run"
            )
        out.setdefault(arm, {})[int(m["seed"])] = run_numbers(manifest.parent, m)
    return out


def ran_in_its_block(folder_runs: dict[str, dict[int, RunNumbers]], arm: str, seed: int) -> bool:
    """Did this run run inside its seed's block? A task folder's blocks run one after another, so in
    start-time order a run of another seed between it and its block's full fine-tuning run means
    it was timed apart from the runs it is paired with (e.g. a policy added to the score file later)."""
    mine = folder_runs[arm][seed].start_time
    base = folder_runs[BASELINE_ARM][seed].start_time
    low, high = min(mine, base), max(mine, base)
    return not any(low < run.start_time < high for runs in folder_runs.values() for s, run in runs.items() if s != seed)


# ---------------------------------------------------------------------------- choosing on validation
@dataclass(frozen=True)
class Candidate:
    policy: str
    spec: str
    val_diff: dict[int, float]  # task -> mean final val accuracy minus none's, points
    speedup: dict[int, float]  # task -> geometric mean of none's / the candidate's train time
    qualifies: bool
    chosen: bool = False


def choose(
    score: ScoreFile, numbers: dict[int, dict[str, dict[int, RunNumbers]]]
) -> tuple[dict[str, str], list[Candidate]]:
    """policy -> the spec chosen on validation, and every candidate's numbers.

    One choice per policy for all tasks: among the candidates whose mean final validation accuracy is
    at most ``margin_points`` below full fine-tuning's on every task, the largest mean (over tasks) log
    speedup; when none qualifies, the candidate whose worst task loses least (and the table says so).
    Test accuracy is not read."""
    chosen: dict[str, str] = {}
    rows: list[Candidate] = []
    for policy, specs in score.candidates.items():
        found = []
        for spec in specs:
            arm = search_arm(policy, spec)
            val_diff, speedup = {}, {}
            for d in score.tasks:
                base, runs = numbers[d].get(BASELINE_ARM, {}), numbers[d].get(arm, {})
                seeds = [s for s in score.search_seeds if s in base and s in runs]
                if len(seeds) < len(score.search_seeds):
                    raise GateError(f"search run(s) of {arm} on planted-d{d} not complete: re-run to continue")
                val_diff[d] = sum(runs[s].val_acc - base[s].val_acc for s in seeds) / len(seeds)
                speedup[d] = ratio_ci95([base[s].train_s / runs[s].train_s for s in seeds])[0]
            qualifies = min(val_diff.values()) >= -score.margin_points
            found.append(Candidate(policy, spec, val_diff, speedup, qualifies))
        qualified = [c for c in found if c.qualifies]
        if qualified:
            best = max(qualified, key=lambda c: sum(math.log(v) for v in c.speedup.values()))
        else:
            best = max(found, key=lambda c: min(c.val_diff.values()))
        chosen[policy] = best.spec
        rows += [Candidate(c.policy, c.spec, c.val_diff, c.speedup, c.qualifies, c is best) for c in found]
    return chosen, rows


def same_policy(spec: str, other: str) -> bool:
    """Do two specs make the same policy ("autofreeze" and "autofreeze:percentile=50" do)?"""

    return parse_policy(spec) == parse_policy(other)


def search_arm(policy: str, spec: str) -> str:
    return f"{policy}@{spec}"


def tuned_arm(policy: str) -> str:
    return f"{policy}-val"


# ---------------------------------------------------------------------------- tables and figure
def _interval(p: Paired, spec: str = "+.2f") -> str:
    if p.n == 0 or not math.isfinite(p.mean):
        return "n/a"
    if p.n < 2 or not math.isfinite(p.low):
        return f"{p.mean:{spec}}"
    return f"{p.mean:{spec}} [{p.low:{spec}}, {p.high:{spec}}]"


def _time_to_d(values: tuple[float | None, ...]) -> str:
    reached = [v for v in values if v is not None]
    never = len(values) - len(reached)
    text = f"{sum(reached) / len(reached):.2f}" if reached else "never"
    return text + (f" ({never} of {len(values)} never)" if reached and never else "")


def scores_markdown(scores: list[Score], slopes: dict[str, float], caption: str, margin: float = 0.5) -> str:
    rows = [
        [
            s.policy,
            f"`{s.spec}`",
            str(s.d),
            str(len(s.seeds)),
            _interval(s.regret),
            s.verdict,
            " ".join(f"{k - s.d:+d}" for k in s.final_boundaries),
            _interval(s.time_captured) + ("" if s.interleaved else " (not interleaved)"),
            f"{100 * s.oracle_time_saving:.0f} %",
            _interval(s.bytes_captured),
            _time_to_d(s.time_to_d),
            f"{s.overshoot:.2f}",
            f"{slopes.get(s.policy, math.nan):.2f}",
        ]
        for s in scores
    ]
    header = [
        "policy",
        "spec",
        "d",
        "seeds",
        "regret (points)",
        f"at {margin:g} points",
        "final k - d per seed",
        "time saving captured",
        "oracle's time saving",
        "traffic saving captured",
        "time to d (run fraction)",
        "overshoot (blocks)",
        "tracking slope",
    ]
    aligns = ["l", "l", "r", "r", "r", "l", "l", "r", "r", "r", "r", "r", "r"]
    return caption + "\n\n" + "\n".join(markdown.table(header, rows, aligns)) + "\n"


def search_markdown(candidates: list[Candidate], score: ScoreFile) -> str:
    tasks = list(score.tasks)
    header = [
        "policy",
        "spec",
        *(f"val diff d={d}" for d in tasks),
        *(f"speedup d={d}" for d in tasks),
        "qualifies",
        "chosen",
    ]
    rows = [
        [
            c.policy,
            f"`{c.spec}`",
            *(f"{c.val_diff[d]:+.2f}" for d in tasks),
            *(f"{c.speedup[d]:.2f}x" for d in tasks),
            "yes" if c.qualifies else "no",
            "**chosen**" if c.chosen else "",
        ]
        for c in candidates
    ]
    caption = (
        f"Policy parameters chosen on the validation split of search seeds {list(score.search_seeds)} (never the scored "
        f"seeds, never test): one choice per policy for every task; a candidate qualifies when its mean final validation "
        f"accuracy is at most {score.margin_points} points below full fine-tuning's on every task, and the chosen one has "
        "the largest mean log speedup; when none qualifies, the one whose worst task loses least."
    )
    aligns = ["l", "l"] + ["r"] * (2 * len(tasks)) + ["l", "l"]
    return caption + "\n\n" + "\n".join(markdown.table(header, rows, aligns)) + "\n"


def tracking_figure(scores: list[Score], out_png: Path) -> None:
    """Final boundary against d, one line per policy (mean over seeds, a bar for min..max), and the identity."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.4))
    ax = fig.add_subplot()
    tasks = sorted({s.d for s in scores})
    ax.plot(tasks, tasks, color="black", linestyle="--", linewidth=1, label="oracle (k = d)")
    policies = list(dict.fromkeys(s.policy for s in scores))
    colours = colormaps["tab10"]
    for i, policy in enumerate(policies):
        mine = sorted((s for s in scores if s.policy == policy), key=lambda s: s.d)
        offset = (i - (len(policies) - 1) / 2) * 0.06
        xs = [s.d + offset for s in mine]
        means = [sum(s.final_boundaries) / len(s.final_boundaries) for s in mine]
        lows = [m - min(s.final_boundaries) for m, s in zip(means, mine)]
        highs = [max(s.final_boundaries) - m for m, s in zip(means, mine)]
        ax.errorbar(xs, means, yerr=[lows, highs], marker="o", capsize=3, color=colours(i % 10), label=policy)
    ax.set_xlabel("planted boundary d (the best static boundary)")
    ax.set_ylabel("final freeze boundary k (mean; bar: min..max over seeds)")
    ax.set_xticks(tasks)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the lines, not on them
    ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(out_png, lambda f: fig.savefig(f, format="png", dpi=110))


# ---------------------------------------------------------------------------- the command
def _run(title: str, specs: list) -> None:

    if not run_stage(title, specs):
        raise GateError(f"{title}: not every run completed; re-run the same command to continue")


def run_score(path: str | Path, out_dir: Path, runs_root: str, command: str, run: bool = True) -> str:
    """Run (unless ``run`` is False) the search and the scored grid, skipping complete runs; then
    write the tables and the figure from the complete runs. Returns the scores table."""

    score = read_score(path)
    if score.report_md:  # a missing span is found now, not after the runs
        report = Path(score.report_md)
        try:
            markdown.read(report.read_text(encoding="utf-8"), score.name, report)
        except (OSError, markdown.MarkerError) as e:
            raise _error(path, f"report_md: {e}") from None
    root = Path(runs_root)
    search_folder = {d: f"{score.name}-search-d{d}" for d in score.tasks}
    folder = {d: f"{score.name}-d{d}" for d in score.tasks}
    try:
        _, weights = pretrain_stage(
            task_study(score, score.tasks[0], folder[score.tasks[0]], score.seeds, {}), str(root)
        )
        search_arms = {search_arm(p, spec): spec for p, specs in score.candidates.items() for spec in specs}
        search_studies = [
            task_study(score, d, search_folder[d], score.search_seeds, search_arms, oracle=False) for d in score.tasks
        ]
        search = seed_major(search_studies, str(root), weights) if score.candidates else []
        grid_arms = {**score.policies, **{tuned_arm(p): specs[0] for p, specs in score.candidates.items()}}
        check_runnable_here(
            search
            + seed_major(
                [task_study(score, d, folder[d], score.seeds, grid_arms) for d in score.tasks], str(root), weights
            )
        )  # every run's config is checked here, before the first run starts
    except (SweepError, ConfigError) as e:
        raise GateError(str(e)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    search_md = None
    tuned: dict[str, str] = {}
    if search:
        if run:
            _run("parameter search on the validation split", search)
        found = {d: complete_runs(root / search_folder[d], score.search_seeds, search_arms) for d in score.tasks}
        chosen, candidates = choose(score, found)
        search_md = search_markdown(candidates, score)
        # A tuned policy that chose its default runs once, under its own name.
        tuned = {tuned_arm(p): spec for p, spec in chosen.items() if not same_policy(spec, score.policies[p])}
    arms = {**score.policies, **tuned}
    studies = [task_study(score, d, folder[d], score.seeds, arms) for d in score.tasks]
    if run:
        _run("scored runs (one interleaved block per seed and task)", seed_major(studies, str(root), weights))
    scores: list[Score] = []
    for d in score.tasks:
        planned = {**arms, ORACLE: f"static:k={d}", BASELINE_ARM: "none"}
        scores += score_task(d, complete_runs(root / folder[d], score.seeds, planned), arms, score.margin_points)
    if not scores:
        raise GateError(f"no policy of {path} has a seed complete on every arm yet: re-run to continue")
    slopes = {p: tracking_slope([(s.d, k) for s in scores if s.policy == p for k in s.final_boundaries]) for p in arms}
    text = scores_markdown(scores, slopes, _caption(score, scores, command), score.margin_points)
    if search_md is not None:
        text += "\n" + search_md
        kept = [p for p in score.candidates if tuned_arm(p) not in tuned]
        if kept:  # no "-val" row for these: the default row is the validated one too
            text += f"\nChosen on validation and equal to the default (the default row stands for both): {', '.join(kept)}.\n"
    record = {
        "score": score.name,
        "command": command,
        "scores": [_score_json(s) for s in scores],
        "tracking_slope": slopes,
        "chosen_on_validation": tuned,
    }
    atomic_write_json(out_dir / f"{score.name}.json", record)
    atomic_write_text(out_dir / f"{score.name}.md", text)
    tracking_figure(scores, out_dir / f"{score.name}-tracking.png")
    if score.report_md:
        # the span named after the score file's name: planted-score for experiments/configs/planted_score.toml
        splice_file(
            Path(score.report_md), score.name, out_dir / f"{score.name}.md", out_dir / f"{score.name}-tracking.png"
        )
    return text


def _score_json(s: Score) -> dict:
    """A Score as JSON: every field, an interval as [mean, low, high]."""
    return {
        f.name: [v.mean, v.low, v.high] if isinstance(v, Paired) else list(v) if isinstance(v, tuple) else v
        for f in fields(s)
        for v in (getattr(s, f.name),)
    }


def _caption(score: ScoreFile, scores: list[Score], command: str) -> str:
    seeds = sorted({seed for s in scores for seed in s.seeds})
    return (
        f"Freeze policies on the planted-boundary tasks (d = {', '.join(map(str, score.tasks))}: the best static "
        f"boundary by construction), generated by `{command}` from the score file {score.path}. Seeds {seeds}, "
        "one interleaved block per seed and task (full fine-tuning, the oracle static k = d with the cache, and every "
        "policy with the cache), final-epoch test accuracy, 95 % t-intervals over the paired seeds; "
        f"{os.cpu_count()} CPU cores, no GPU, niced. Regret: accuracy minus full fine-tuning's (non-inferior when the "
        f"interval's low end is above -{score.margin_points}). Captured: (full - policy) / (full - oracle) of training "
        "wall time and of all-reduce bytes (1 = the oracle's saving; above 1 only by over-freezing). Time to d: first "
        "step with k >= d as a fraction of the run. Overshoot: mean over steps of max(0, k - d). Tracking slope: "
        "least-squares slope of the final k on d over every task and seed (1 follows d, 0 ignores it)."
    )
