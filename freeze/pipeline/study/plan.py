"""A study file -> the ordered list of runs: settings x arms x seeds, interleaved per seed.

    [study]
    name = "offline"                                        # runs/<name>/<run>/, runs/<name>-search/, -pretrain/
    finetune = "experiments/configs/offline_finetune.toml"  # the run config every run starts from
    pretrain = "experiments/configs/offline_pretrain.toml"  # optional: its checkpoint becomes model.weights
    weights = "experiments/weights/fdsl32_resnet18.pt"      # or: committed weights (sha256 checked), no pretraining
    overrides = []                                          # applied to every run (search runs too)
    seeds = [0, 1, 2, 3, 4]                                 # paired: every arm runs every seed
    order_seed = 0                                          # shuffles the arms within each seed's block
    target_fraction = 0.95                                  # time to target: x the baseline's final val acc
    margin_points = 0.5                                     # non-inferiority margin, accuracy points
    report_md = "report/my-study.md"                        # its table spans, spliced with --update-report
    predict = false                                         # true: the cost model's prediction of every
                                                            # run's train time beside the measured one
                                                            # (freeze.pipeline.study.predict; profiles
                                                            # this machine, needs report/costmodel probes)
    shorter_horizon = "frontier"                            # optional: a study of the same arms at a
                                                            # shorter horizon, its runs beside this one's:
                                                            # the horizons table compares the two

    [settings]                                              # name -> overrides; optional (one setting "")
    loopback = ["dist.nproc=2"]
    cluster-1gbit = ["dist.nproc=1", "cluster.nodes=2", "cluster.bandwidth=1gbit"]

    [arms]                                                  # group name -> overrides
    none = []                                               # the baseline (policy none)
    control = []                                            # policy none again: its speedup must be 1.00x
    static-k5 = ["freeze.policy=static:k=5", "freeze.cache=memory"]
    autofreeze = ["freeze.cache=memory"]                    # its policy comes from [search]
    # an arm only some settings run: a table instead of a list
    static-k8-nocache = { overrides = ["freeze.policy=static:k=8"], settings = ["cluster-1gbit"] }

    [frontier]                                              # optional: the budget frontier (issue 35)
    fractions = [0.5, 0.6, 0.7, 0.8, 0.9]                   # full fine-tuning on these fractions of the
    settings = ["loopback"]                                 # steps: arms budget-0.5 ... (the baseline is 1.0);
                                                            # settings optional (default: every setting)

    [search]                                                # optional: parameters chosen on validation only
    setting = "loopback"
    seeds = [100]
    qualify_margin_points = 0.25                            # default: half of margin_points
    [search.candidates]                                     # arm -> policy specs to try
    autofreeze = ["autofreeze:percentile=50", "autofreeze:percentile=80"]
    [search.same_as]                                        # arm -> the arm whose choice it takes
    autofreeze-nocache = "autofreeze"                       # or "best": the best searched arm's choice

Why interleave: runs are timed one after another on a machine whose speed drifts (+-20 % here
over minutes). Within a seed's block every arm runs once, in an order drawn from ``order_seed`` and
the seed, so slow and fast stretches of the machine fall on different arms in different blocks and
cancel in the per-seed ratios the report pairs (freeze.pipeline.report.paired).
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from pathlib import Path

from freeze.checks import is_int, is_number
from freeze.pipeline.config import ConfigError, load_config, validate
from freeze.pipeline.preflight import preflight
from freeze.pipeline.schema import run_name_part
from freeze.pipeline.sweep import RunSpec, SweepError, read_toml

_STUDY_KEYS = {
    "name",
    "finetune",
    "pretrain",
    "weights",
    "overrides",
    "seeds",
    "order_seed",
    "target_fraction",
    "margin_points",
    "report_md",
    "out_dir",
    "predict",
    "shorter_horizon",
}
_TABLES = {"study", "settings", "arms", "search", "frontier"}
_FRONTIER_KEYS = {"fractions", "settings"}
FRONTIER_ARM_PREFIX = "budget-"  # + the fraction: the frontier's arms (train.budget_fraction)
_SEARCH_KEYS = {"setting", "seeds", "candidates", "same_as", "qualify_margin_points"}
BASELINE_ARM = "none"
# search.same_as value: the searched arm whose chosen candidate is fastest among the qualifying ones
# (else the most accurate), e.g. to run the best adaptive policy once more without the cache.
BEST = "best"


@dataclass(frozen=True)
class Search:
    """Policy parameters chosen on the validation split of ``seeds`` (never the study's seeds)."""

    setting: str
    seeds: tuple[int, ...]
    candidates: dict[str, tuple[str, ...]]  # arm -> policy specs
    same_as: dict[str, str]  # arm -> the searched arm whose chosen policy it runs (e.g. without the cache), or BEST
    # A candidate qualifies at most this many validation points below the baseline. Stricter than
    # the study's margin (half of it by default): chosen at the margin it is then tested at, the
    # winner of a search is the candidate whose noise favoured it most, and the last study's five
    # searched arms all lost accuracy between search and study (mean -0.28 points).
    qualify_margin_points: float = 0.25

    def choices_for(self, chosen: dict[str, str], best: str | None = None) -> dict[str, str]:
        """Every searched or same_as arm -> its policy spec, from the searched arms' choices; ``best``
        is the searched arm a same_as of BEST takes (the search's :func:`best_arm`; before the search
        has run, the first searched arm stands in)."""
        best = best or next(iter(self.candidates))
        return {**chosen, **{arm: chosen[best if src == BEST else src] for arm, src in self.same_as.items()}}


@dataclass(frozen=True)
class Arm:
    overrides: tuple[str, ...]
    settings: tuple[str, ...] | None = None  # None: every setting


@dataclass(frozen=True)
class StudyFile:
    path: Path
    name: str
    finetune: str
    pretrain: str | None
    overrides: tuple[str, ...]
    seeds: tuple[int, ...]
    order_seed: int
    target_fraction: float
    margin_points: float
    report_md: str | None
    out_dir: str | None
    settings: dict[str, tuple[str, ...]]
    arms: dict[str, Arm]
    search: Search | None = None
    predict: bool = False  # the cost-model stage after the runs (freeze.pipeline.study.predict)
    weights: str | None = None  # committed pretrained weights (freeze.pipeline.datasets.weights), instead of pretrain
    frontier: dict[str, float] = dataclasses.field(default_factory=dict)  # budget arm -> its fraction of the steps
    shorter_horizon: str | None = None  # a study of the same arms at a shorter horizon (the horizons table)
    # section.key=value from the command line, applied to every run after all of the file's (e.g.
    # dist.nproc=8 on a machine with 8 GPUs): the study's machine, not its design, without editing it
    command_line_overrides: tuple[str, ...] = ()

    def cells(self) -> list[tuple[str, str]]:
        """(setting, arm) pairs the study runs for every seed."""
        return [
            (setting, arm)
            for setting in self.settings
            for arm, spec in self.arms.items()
            if spec.settings is None or setting in spec.settings
        ]


def _error(path, message: str) -> SweepError:
    return SweepError(f"study file {path}: {message}")


def _string_list(path, where: str, value) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _error(path, f'{where} must be a list of strings (overrides such as "dist.nproc=2")')
    return tuple(value)


def _int_list(path, where: str, value) -> tuple[int, ...]:
    ok = isinstance(value, list) and value and all(is_int(v) for v in value)
    if not ok or any(v < 0 for v in value) or len(set(value)) != len(value):
        raise _error(path, f"{where} must be a non-empty list of distinct non-negative integers")
    return tuple(value)


def _names(path, table: str, data: dict) -> dict[str, tuple[str, ...]]:
    out = {}
    for name, overrides in data.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._=+-]*", name):
            raise _error(path, f"[{table}] name {name!r} must be letters, digits and ._=+- (it names folders)")
        out[name] = _string_list(path, f"{table}.{name}", overrides)
    return out


def read_study(path: str | Path) -> StudyFile:
    """Parse and check a study file; every problem is one SweepError line naming the key."""
    data = read_toml(path, "study")
    unknown = set(data) - _TABLES
    if unknown:
        raise _error(path, f"unknown table(s) {', '.join(sorted(unknown))}; accepted: {', '.join(sorted(_TABLES))}")
    study = data.get("study")
    if not isinstance(study, dict) or "name" not in study or "finetune" not in study:
        raise _error(path, "needs a [study] table with 'name' and 'finetune'")
    unknown = set(study) - _STUDY_KEYS
    if unknown:
        raise _error(path, f"unknown key(s) {', '.join(sorted(unknown))}; accepted: {', '.join(sorted(_STUDY_KEYS))}")
    settings = _names(path, "settings", data.get("settings", {})) or {"": ()}
    arms = _read_arms(path, data.get("arms", {}), settings)
    frontier, budget_arms = _read_frontier(path, data.get("frontier"), settings, arms)
    arms.update(budget_arms)
    margin = study.get("margin_points", 0.5)
    if not is_number(margin) or not margin > 0:
        raise _error(path, f"margin_points must be a number > 0, got {margin!r}")
    fraction = study.get("target_fraction", 0.95)
    if not is_number(fraction) or not 0 < fraction <= 1:
        raise _error(path, f"target_fraction must be in (0, 1], got {fraction!r}")
    order_seed = study.get("order_seed", 0)
    if not is_int(order_seed):
        raise _error(path, f"order_seed must be an integer, got {order_seed!r}")
    seeds = _int_list(path, "seeds", study.get("seeds", [0]))
    if not isinstance(study.get("predict", False), bool):
        raise _error(path, f"predict must be true or false, got {study['predict']!r}")
    search = _read_search(path, data.get("search"), arms, settings, seeds, float(margin))
    weights = study.get("weights")
    if weights is not None and (not isinstance(weights, str) or not weights):
        raise _error(path, f"weights must be a path to a committed weights file, got {weights!r}")
    shorter = study.get("shorter_horizon")
    if shorter is not None and (not isinstance(shorter, str) or not shorter or shorter == study["name"]):
        raise _error(path, f"shorter_horizon must name another study (its runs beside this one's), got {shorter!r}")
    if weights is not None and study.get("pretrain"):
        raise _error(path, "pretrain and weights both give the model's weights; keep one")
    return StudyFile(
        path=Path(path),
        name=str(study["name"]),
        finetune=str(study["finetune"]),
        pretrain=study.get("pretrain"),
        overrides=_string_list(path, "overrides", study.get("overrides", [])),
        seeds=seeds,
        order_seed=order_seed,
        target_fraction=float(fraction),
        margin_points=float(margin),
        report_md=study.get("report_md"),
        out_dir=study.get("out_dir"),
        settings=settings,
        arms=arms,
        search=search,
        predict=study.get("predict", False),
        weights=weights,
        frontier=frontier,
        shorter_horizon=shorter,
    )


def _read_arms(path, data: dict, settings: dict) -> dict[str, Arm]:
    arms = {}
    for name, value in data.items():
        if isinstance(value, dict):
            if set(value) - {"overrides", "settings"}:
                unknown = ", ".join(sorted(set(value) - {"overrides", "settings"}))
                raise _error(path, f"arms.{name}: unknown key(s) {unknown}; accepted: overrides, settings")
            only = _string_list(path, f"arms.{name}.settings", value.get("settings", []))
            unknown = sorted(set(only) - set(settings))
            if unknown or not only:
                raise _error(
                    path, f"arms.{name}.settings {unknown or '[]'}: not settings; settings: {', '.join(settings)}"
                )
            value = {name: value.get("overrides", [])}
        else:
            only, value = None, {name: value}
        arms[name] = Arm(_names(path, "arms", value)[name], only)
    if BASELINE_ARM not in arms:
        raise _error(path, f"[arms] needs the baseline arm {BASELINE_ARM!r} (policy none); arms: {', '.join(arms)}")
    missing = [s for s in settings if arms[BASELINE_ARM].settings and s not in arms[BASELINE_ARM].settings]
    if missing:
        raise _error(path, f"arms.{BASELINE_ARM} must run in every setting (missing: {', '.join(missing)})")
    return arms


def _read_frontier(path, frontier, settings: dict, arms: dict) -> tuple[dict[str, float], dict[str, Arm]]:
    """[frontier] -> (budget arm name -> fraction, budget arm name -> its arm: policy none on that
    fraction of the steps, in the table's settings); every problem one line naming the key."""
    if frontier is None:
        return {}, {}
    if not isinstance(frontier, dict) or set(frontier) - _FRONTIER_KEYS:
        unknown = ", ".join(sorted(set(frontier) - _FRONTIER_KEYS)) if isinstance(frontier, dict) else "not a table"
        raise _error(path, f"[frontier]: {unknown}; accepted keys: {', '.join(sorted(_FRONTIER_KEYS))}")
    fractions = frontier.get("fractions")
    ok = isinstance(fractions, list) and fractions and all(is_number(f) for f in fractions)
    if not ok or not all(0 < f < 1 for f in fractions) or len(set(fractions)) != len(fractions):
        raise _error(
            path,
            f"frontier.fractions = {fractions!r}; accepted: a non-empty list of distinct numbers in (0, 1) "
            f"(1.0 is the baseline arm {BASELINE_ARM!r}, which every study runs)",
        )
    only = frontier.get("settings", [])
    if not isinstance(only, list) or not all(isinstance(v, str) for v in only):
        raise _error(path, f"frontier.settings = {only!r}; accepted: a list of setting names ({', '.join(settings)})")
    unknown = sorted(set(only) - set(settings))
    if unknown:
        raise _error(path, f"frontier.settings {unknown}: not settings; settings: {', '.join(settings)}")
    names = {f"{FRONTIER_ARM_PREFIX}{float(f)!r}": float(f) for f in sorted(fractions)}
    taken = sorted(set(names) & set(arms))
    if taken:
        raise _error(path, f"[arms] {', '.join(taken)}: the names of [frontier]'s arms; rename the arm(s)")
    where = tuple(only) or None  # None: every setting
    budget_arms = {
        name: Arm(("freeze.policy=none", f"train.budget_fraction={f!r}"), where) for name, f in names.items()
    }
    return names, budget_arms


def _read_search(path, search, arms: dict, settings: dict, seeds: tuple[int, ...], margin: float) -> Search | None:
    if search is None:
        return None
    if not isinstance(search, dict):
        raise _error(path, f"[search] must be a table with the keys {', '.join(sorted(_SEARCH_KEYS))}")
    if set(search) - _SEARCH_KEYS:
        unknown = ", ".join(sorted(set(search) - _SEARCH_KEYS))
        raise _error(path, f"[search]: unknown key(s) {unknown}; accepted: {', '.join(sorted(_SEARCH_KEYS))}")
    setting = search.get("setting", next(iter(settings)))
    if setting not in settings:
        raise _error(path, f"search.setting {setting!r} is not a setting; settings: {', '.join(settings)}")
    search_seeds = _int_list(path, "search.seeds", search.get("seeds", []))
    if set(search_seeds) & set(seeds):
        # Choosing parameters on the runs that are then reported is selection on the result.
        raise _error(path, f"search.seeds {sorted(set(search_seeds) & set(seeds))} are also study seeds; use others")
    candidates = {}
    for arm, specs in (search.get("candidates") or {}).items():
        if arm not in arms:
            raise _error(path, f"search.candidates.{arm}: no arm {arm!r}; arms: {', '.join(arms)}")
        if arms[arm].settings is not None and setting not in arms[arm].settings:
            raise _error(path, f"search.candidates.{arm}: arm {arm!r} does not run in the search setting {setting!r}")
        if any(o.startswith("freeze.policy=") for o in arms[arm].overrides):
            raise _error(path, f"arms.{arm} sets freeze.policy, but [search] chooses it; remove one")
        candidates[arm] = _string_list(path, f"search.candidates.{arm}", specs)
        if not candidates[arm]:
            raise _error(path, f"search.candidates.{arm} is empty")
    if not candidates:
        raise _error(path, "[search] needs a [search.candidates] table: arm -> list of policy specs")
    same_as = search.get("same_as") or {}
    for arm, source in same_as.items():
        if arm not in arms or (source not in candidates and source != BEST):
            raise _error(
                path,
                f"search.same_as.{arm} = {source!r}: needs an arm and a searched arm ({', '.join(candidates)}) or {BEST!r}",
            )
        if any(o.startswith("freeze.policy=") for o in arms[arm].overrides):
            raise _error(path, f"arms.{arm} sets freeze.policy, but search.same_as chooses it; remove one")
    qualify = search.get("qualify_margin_points", margin / 2)
    if not is_number(qualify) or not 0 < qualify <= margin:
        raise _error(
            path, f"search.qualify_margin_points = {qualify!r}; accepted: a number in (0, margin_points = {margin:g}]"
        )
    return Search(setting, search_seeds, candidates, dict(same_as), float(qualify))


def _spec(
    study: StudyFile,
    folder: str,
    setting: str,
    group: str,
    seed: int,
    overrides: tuple[str, ...],
    out_dir,
    produced: frozenset[str] = frozenset(),
) -> RunSpec:
    name = "_".join(p for p in (run_name_part(setting), run_name_part(group), f"seed={seed}") if p)
    run_overrides = [*study.overrides, *study.settings[setting], *overrides, *study.command_line_overrides]
    names = {"run.study": folder, "run.name": name, "run.group": group, "run.seed": seed}  # typed: no text round trip
    if setting:
        names["run.setting"] = setting
    if out_dir is not None:
        names["run.out_dir"] = str(out_dir)
    try:
        config = load_config(study.finetune, run_overrides, check_files=False, values=names)
        if config.model.weights not in produced:  # weights the study's pretraining writes are checked when written
            validate(config, check_files=True)  # a model.weights typed on the command line that is not there
        preflight(config)  # every run refused before the first one starts, not hours in
        return RunSpec(config)
    except ConfigError as e:
        raise SweepError(f"study file {study.path}: run {name}: {e}") from None


def interleaved(study: StudyFile, cells: list[tuple[str, str]], seed: int) -> list[tuple[str, str]]:
    """The (setting, arm) cells of one seed's block, in the order drawn from order_seed and seed."""
    order = list(cells)
    random.Random(f"{study.order_seed}/{seed}").shuffle(order)
    return order


def main_specs(
    study: StudyFile, chosen: dict[str, str], out_dir: str | None, extra_overrides: tuple[str, ...] = ()
) -> list[RunSpec]:
    """Every run of the study, in the order they run: one interleaved block per seed.

    Args:
        study: the parsed study file.
        chosen: arm -> policy spec picked by the search (arms without a search keep their overrides).
        out_dir: overrides run.out_dir of every run when given.
        extra_overrides: applied to every run after the model weights (e.g. the pretrained checkpoint).
    """
    specs = []
    for seed in study.seeds:
        for setting, arm in interleaved(study, study.cells(), seed):
            overrides = (*extra_overrides, *study.arms[arm].overrides)
            if arm in chosen:
                overrides += (f"freeze.policy={chosen[arm]}",)
            specs.append(_spec(study, study.name, setting, arm, seed, overrides, out_dir, _produced(extra_overrides)))
    return specs


def _produced(extra_overrides: tuple[str, ...]) -> frozenset[str]:
    """The weights files the study's own stages write (its pretraining's), named in ``extra_overrides``."""
    return frozenset(o.split("=", 1)[1] for o in extra_overrides if o.startswith("model.weights="))


def search_specs(study: StudyFile, out_dir: str | None, extra_overrides: tuple[str, ...] = ()) -> list[RunSpec]:
    """The search: the baseline and every candidate of every searched arm, in the search setting,
    on the search seeds, interleaved the same way. Group = "<arm>@<spec>" so each candidate is one group."""
    if study.search is None:
        return []
    setting = study.search.setting
    cells = [(BASELINE_ARM, "")] + [(arm, spec) for arm, specs in study.search.candidates.items() for spec in specs]
    specs = []
    for seed in study.search.seeds:
        for arm, policy in interleaved(study, cells, seed):
            overrides = (*extra_overrides, *study.arms[arm].overrides)
            group = BASELINE_ARM
            if policy:
                overrides += (f"freeze.policy={policy}",)
                group = f"{arm}@{policy}"
            specs.append(
                _spec(
                    study, f"{study.name}-search", setting, group, seed, overrides, out_dir, _produced(extra_overrides)
                )
            )
    return specs


# Keys the study sets itself for every run (its name, group, seed, setting, where runs go): an override
# of one would be overwritten, so it is refused rather than ignored. freeze.policy is the study's design
# (each arm's policy, the baseline's none): one value for every arm would leave nothing to compare.
STUDY_OWNED_KEYS = ("run.study", "run.name", "run.group", "run.seed", "run.setting", "run.out_dir", "freeze.policy")
_OWNED_HINTS = {
    "run.seed": "; choose seeds with --seeds",
    "run.out_dir": "; choose where runs go with --out-dir",
    "freeze.policy": "; each arm's policy is set in the study file's [arms]",
}


def with_command_line_overrides(study: StudyFile, overrides: tuple[str, ...]) -> StudyFile:
    """The study with ``overrides`` (section.key=value) applied last to every run; SweepError (one
    line) for a key the study owns. Each value is checked when the runs' configs are resolved."""
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key in STUDY_OWNED_KEYS:
            hint = _OWNED_HINTS.get(key, "")
            raise _error(
                study.path,
                f"override {override!r}: the study sets {key} for every run itself; "
                f"accepted: any key but {', '.join(STUDY_OWNED_KEYS)}{hint}",
            )
    return dataclasses.replace(study, command_line_overrides=tuple(overrides))


def only_seeds(study: StudyFile, seeds: tuple[int, ...]) -> StudyFile:
    """The study restricted to ``seeds``, a non-empty subset of its seeds (one part of a long study:
    each seed's block stays whole, so its pairing and interleaving hold)."""
    extra = sorted(set(seeds) - set(study.seeds))
    if extra or not seeds:
        raise _error(
            study.path,
            f"--seeds must be a non-empty subset of the study's seeds {list(study.seeds)}; got {list(seeds)}",
        )
    return dataclasses.replace(study, seeds=tuple(s for s in study.seeds if s in seeds))


def runs_root(study: StudyFile, out_dir: str | None) -> Path:
    return Path(out_dir or study.out_dir or "runs")
