"""A sweep file and its grid: read, expanded into one resolved config per run, checked before anything runs."""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from freeze.pipeline.config import Config, ConfigError, load_config
from freeze.pipeline.distributed import check_hardware
from freeze.pipeline.preflight import preflight
from freeze.pipeline.schema import run_name_part

SEED_KEY = "run.seed"
POLICY_KEY = "freeze.policy"
BUDGET_KEY = "train.budget_fraction"
BASELINE_POLICY = "none"


class SweepError(ValueError):
    """A sweep file that cannot be expanded; one line naming the file and the key."""


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its resolved config (validated once, in :func:`expand`)."""

    config: Config

    @property
    def name(self) -> str:
        return self.config.run.name

    @property
    def group(self) -> str:
        return self.config.run_group()


def _slug(key: str, value) -> str:
    short = key.split(".")[-1]
    text = str(value)
    if key == "budget":  # as the study names its budget arms
        return run_name_part(f"budget-{text}")
    return run_name_part(text if key == POLICY_KEY else f"{short}={text}")


def read_toml(path: str | Path, kind: str) -> dict:
    """A sweep or study file as a dict; a missing file or bad TOML is one SweepError line."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"{kind} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SweepError(f"{kind} file {path} cannot be read as UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{kind} file {path}: {e}") from None


SWEEP_KEYS = ("base", "study", "overrides", "budgets")


def read_sweep(path: str | Path) -> dict:
    data = read_toml(path, "sweep")
    unknown = set(data) - {"sweep", "grid"}
    if unknown:
        raise SweepError(f"sweep file {path}: unknown table(s) {', '.join(sorted(unknown))}; accepted: sweep, grid")
    sweep = data.get("sweep")
    if not isinstance(sweep, dict):
        raise SweepError(f"sweep file {path}: needs a [sweep] table with 'base' and 'study'")
    # A key meant for [grid] (or misspelled) would otherwise be ignored: the sweep would run the base
    # config once instead of the grid, silently.
    unknown = set(sweep) - set(SWEEP_KEYS)
    if unknown:
        raise SweepError(
            f"sweep file {path}: unknown key(s) {', '.join(repr(k) for k in sorted(unknown))} under [sweep]; "
            f"accepted: {', '.join(SWEEP_KEYS)} (grid values go under [grid])"
        )
    if "base" not in sweep or "study" not in sweep:
        raise SweepError(f"sweep file {path}: needs a [sweep] table with 'base' and 'study'")
    for key in ("base", "study"):
        if not isinstance(sweep[key], str):
            raise SweepError(f"sweep file {path}: '{key}' under [sweep] must be a string, got {sweep[key]!r}")
    overrides = sweep.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise SweepError(f'sweep file {path}: overrides must be a list of "section.key=value" strings')
    grid = data.get("grid", {})
    if not isinstance(grid, dict):
        raise SweepError(f'sweep file {path}: [grid] must be a table of "section.key" = [values]')
    for key, values in grid.items():
        if isinstance(values, dict):  # TOML reads an unquoted freeze.policy = [...] as a table
            dotted = _first_dotted_key(key, values)
            raise SweepError(
                f'sweep file {path}: grid key {dotted} is read as a table; quote dotted keys: "{dotted}" = [...]'
            )
        if not isinstance(values, list) or not values:
            raise SweepError(f'sweep file {path}: grid."{key}" must be a non-empty list')
    budgets = _checked_budgets(path, sweep.get("budgets", []), grid)
    return {
        "base": sweep["base"],
        "study": sweep["study"],
        "overrides": list(sweep.get("overrides", [])),
        "grid": grid,
        "budgets": budgets,
    }


def _checked_budgets(path: str | Path, budgets, grid: dict) -> list[float]:
    """The [sweep] budgets: fractions of the baseline's steps, each run as full fine-tuning beside the
    baseline (the budget frontier that every freezing arm is read against: docs/frontier.md)."""
    fractions_ok = isinstance(budgets, list) and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < 1 for b in budgets
    )
    if not fractions_ok or len(set(budgets)) != len(budgets):
        raise SweepError(
            f"sweep file {path}: budgets = {budgets!r}; accepted: a list of distinct fractions of the "
            "baseline's steps, each in (0, 1), e.g. [0.5, 0.7]"
        )
    if budgets and BASELINE_POLICY not in grid.get(POLICY_KEY, []):
        raise SweepError(
            f'sweep file {path}: budgets shorten the baseline; accepted: "{BASELINE_POLICY}" in grid."{POLICY_KEY}"'
        )
    if budgets and BUDGET_KEY in grid:
        raise SweepError(f'sweep file {path}: budgets and grid."{BUDGET_KEY}" both set it; accepted: one of them')
    varied = sorted(set(grid) - {SEED_KEY, POLICY_KEY})
    if budgets and varied:
        # the report reads one frontier per setting: budget runs of several learning rates (say) would
        # mix into one frontier without a word
        raise SweepError(
            f"sweep file {path}: budgets with grid keys {', '.join(varied)}; accepted: budgets in a grid that varies "
            f'only "{SEED_KEY}" and "{POLICY_KEY}" (one sweep file per value of the others)'
        )
    return [float(b) for b in budgets]


def _first_dotted_key(key: str, table: dict) -> str:
    """``freeze`` + ``{"policy": [...]}`` -> ``freeze.policy``: the key as the user typed it."""
    while isinstance(table, dict) and table:
        key, table = f"{key}.{next(iter(table))}", next(iter(table.values()))
    return key


def expand(
    base: str,
    study: str,
    grid: dict,
    overrides: list[str],
    out_dir: str | None = None,
    budgets: list[float] | tuple[float, ...] = (),
) -> list[RunSpec]:
    """Cartesian product of the grid, validated against the base config before anything runs; after
    each baseline point (policy none), the same run at each of ``budgets`` (train.budget_fraction),
    so its seed block holds its own frontier."""
    keys = list(grid)
    specs = []
    for values in itertools.product(*(grid[k] for k in keys)):
        pairs = list(zip(keys, values))
        specs.append(_grid_point(base, study, pairs, overrides, out_dir))
        if dict(pairs).get(POLICY_KEY) == BASELINE_POLICY:
            for fraction in budgets:
                budget_pairs = [(k, v) if k != POLICY_KEY else ("budget", fraction) for k, v in pairs]
                specs.append(_grid_point(base, study, budget_pairs, overrides, out_dir))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise SweepError("sweep: two grid points map to the same run name; make the grid values distinct")
    return specs


def _grid_point(base: str, study: str, pairs: list, overrides: list[str], out_dir: str | None) -> RunSpec:
    """One run: the grid's (key, value) pairs (("budget", fraction) for a budget run of the baseline)
    over the base config and the overrides, preflighted."""
    point = {(BUDGET_KEY if k == "budget" else k): v for k, v in pairs} | {"run.study": study}  # typed
    if BUDGET_KEY in point:  # a budget run is the baseline on fewer steps, whatever the base file's policy
        point[POLICY_KEY] = BASELINE_POLICY
    if pairs:  # an empty grid is one run that keeps the config's own run.name and run.group
        name = "_".join(_slug(k, v) for k, v in pairs)
        group = "_".join(_slug(k, v) for k, v in pairs if k != SEED_KEY) or name
        point |= {"run.name": name, "run.group": group}
    if out_dir is not None:
        point["run.out_dir"] = str(out_dir)
    try:
        config = load_config(base, overrides, check_files=False, values=point)
        preflight(config)  # every point refused before the first run starts, not hours in
    except ConfigError as e:
        raise SweepError(f"run {'_'.join(_slug(k, v) for k, v in pairs) or base}: {e}") from None
    return RunSpec(config)


def dry_run_lines(specs: list[RunSpec]) -> list[str]:
    """What ``--dry-run`` prints: where the runs go, then one run name per line."""
    studies = sorted({str(Path(s.config.run.out_dir) / s.config.run.study) for s in specs})
    return [f"{len(specs)} run{'' if len(specs) == 1 else 's'} in {', '.join(studies)}/:"] + [
        f"  {spec.name}" for spec in specs
    ]


def check_runnable_here(specs: list[RunSpec]) -> None:
    """ConfigError (one line naming the run and the key) for a run that asks for hardware this
    machine lacks: refused before the first run starts, not after the others have run."""
    for spec in specs:
        try:
            check_hardware(spec.config)
        except ConfigError as e:
            raise ConfigError(f"run {spec.name}: {e}") from None
