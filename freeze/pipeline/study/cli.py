"""The whole study in one command: pretrain (optional), the parameter search on validation, the
interleaved grid of settings x arms x seeds, the cost model's prediction of every run's training
time (opt-in: ``[study] predict = true``, freeze.pipeline.study.predict), then the report.

    python -m experiments.study --config experiments/configs/study_offline.toml        # = make study
    python -m experiments.study --config experiments/configs/study_fdsl32.toml --seeds 0   # one seed block
    python -m experiments.study --config experiments/configs/study_fdsl32.toml --update-report  # = make study-full
    python -m experiments.study --config experiments/configs/study_horizon.toml --from-rows --update-report
        # the page regenerated from its committed per-seed rows, running only what they lack

The study file's format is in :mod:`freeze.pipeline.study.plan`. Re-running resumes: complete runs
are skipped, interrupted ones continue from their checkpoints, and the search's choice is recomputed
from its (complete, unchanged) runs, so it is the same choice.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from freeze._atomic import atomic_write_bytes, atomic_write_text
from freeze.pipeline import markdown
from freeze.pipeline.config import ConfigError
from freeze.pipeline.study.committed_rows import check_from_rows, has_run_dirs, per_seed_path, still_to_run
from freeze.pipeline.study.plan import (
    StudyFile,
    main_specs,
    only_seeds,
    read_study,
    runs_root,
    search_specs,
    with_command_line_overrides,
)
from freeze.pipeline.study.search import (
    Candidate,
    SearchError,
    best_arm,
    choose,
    search_markdown,
    shift_markdown,
)
from freeze.pipeline.study.stages import pretrain_stage, run_stage
from freeze.pipeline.sweep import (
    INTERRUPTED_EXIT_CODE,
    INTERRUPTED_MESSAGE,
    RunSpec,
    SweepError,
    WorkEta,
)
from freeze.pipeline.sweep.executor_args import add_executor_arguments, executor_from_args
from freeze.pipeline.sweep.executors import Executor
from freeze.pipeline.sweep.slurm_executor import SlurmExecutor

# The name of the cost model's table (freeze.pipeline.report.predicted, not imported: a dry run never
# pays for pandas): predicted.md/.csv/.tex, spliced into the study page's span named predicted.
PREDICTED_TABLE = "predicted"
SEARCH_TABLE = "search"  # search.md, written by this module when the study file has a [search]


def splice_tables(report_md: Path, tables_dir: Path, not_run: Mapping[str, str] | None = None) -> list[str]:
    """Replace each span ``<!-- NAME:start -->...<!-- NAME:end -->`` (freeze.pipeline.markdown) of
    ``report_md`` with ``tables_dir/NAME.md``: a study page's tables are generated, never typed.

    Args:
        report_md: the markdown file whose spans are regenerated (rewritten atomically).
        tables_dir: the study's report folder (NAME.md per table).
        not_run: NAME -> the one line a span gets when this study does not make that table (a span
            left with an earlier study's table would read as this study's result).

    Returns:
        The names of the spans regenerated, in the order they appear.

    Raises:
        markdown.MarkerError: a span's start or end marker is missing or doubled (nothing written).
    """
    not_run = not_run or {}
    text = report_md.read_text(encoding="utf-8")
    replaced = []
    for name, _ in markdown.spans(text, report_md):
        source = tables_dir / f"{name}.md"
        if name in not_run:
            body = not_run[name]
        elif source.exists():
            body = source.read_text(encoding="utf-8").strip()
        else:
            continue
        text = markdown.splice(text, name, body, report_md)
        replaced.append(name)
    atomic_write_text(report_md, text)
    return replaced


def not_run_tables(study: StudyFile) -> dict[str, str]:
    """Tables an earlier study may have left that this one does not make -> the line that says so."""
    tables = {}
    if not study.predict:
        tables[PREDICTED_TABLE] = (
            f"The cost model's prediction was not run for study {study.name} (`[study] predict = false` in "
            f"{study.path})."
        )
    if study.search is None:
        tables[SEARCH_TABLE] = f"No parameter search in study {study.name} ({study.path} has no [search])."
    return tables


def remove_stale_tables(report_dir: Path, names: Iterable[str]) -> list[Path]:
    """Delete ``NAME.md/.csv/.tex`` of the tables this study does not make from its report folder: a
    predicted.md left by an earlier run with predict = true would be read (and spliced) as current."""
    removed = []
    for name in names:
        for suffix in (".md", ".csv", ".tex"):
            path = report_dir / f"{name}{suffix}"
            if path.is_file():
                path.unlink()
                removed.append(path)
    return removed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.study",
        description="Run a study (search on validation, interleaved grid) and write its report. "
        'Study file format: freeze/pipeline/study/plan.py and docs/study.md ("The first offline study, and the '
        'study file"); the real CIFAR-10 study: docs/study.md, "Submit it". '
        "[study] predict = true adds the cost model's predicted training time of every run beside the "
        "measured one (predicted.md; profiles this machine, needs the probes and calibration in report/costmodel).",
    )
    parser.add_argument("--config", required=True, help="study TOML file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="applied to every run after the study file's own overrides, e.g. dist.nproc=8 on one machine with "
        '8 GPUs (docs/study.md, "One process, or one machine with several GPUs")',
    )
    parser.add_argument(
        "--out-dir", default=None, help="where run directories go (default: the study's out_dir or runs)"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the runs in the order they would run and exit")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="run only these of the study's seeds (whole interleaved blocks: a long study in parts); "
        "the report covers every complete run",
    )
    add_executor_arguments(parser)
    parser.add_argument(
        "--update-report",
        action="store_true",
        help="splice the tables into the study's report_md (e.g. report/frontier-study.md), copy its figures and commit its per-seed rows (report/per-seed/<study>.csv)",
    )
    parser.add_argument(
        "--from-rows",
        action="store_true",
        help="read every run that has no directory under the out dir from the study's committed per-seed rows "
        "(report/per-seed/<study>.csv, and the shorter horizon's) and do not run it again: a study finished on "
        "another machine, or its page regenerated on a fresh clone without training",
    )
    return parser


def _print_plan(study: StudyFile, pretrain: list[RunSpec], search: list[RunSpec], grid: list[RunSpec]) -> None:
    for spec in pretrain:
        print(f"pretrain  {spec.name}")
    for spec in search:
        print(f"search    {spec.name}  ({spec.config.freeze.policy})")
    searched = set(study.search.candidates) | set(study.search.same_as) if study.search else set()
    for spec in grid:
        policy = "policy chosen by the search" if spec.group in searched else spec.config.freeze.policy
        print(f"study     {spec.name}  ({policy})")
    if study.predict:
        print("predict   every study run's training time with the cost model (profiles in <study dir>/costmodel)")
    print(f"{len(pretrain)} pretraining, {len(search)} search and {len(grid)} study runs")


def _publish(study: StudyFile, report_dir: Path, from_rows: bool = False) -> None:
    """Splice the tables into report_md, copy the figures, commit the per-seed rows. ``from_rows``: the
    report read runs back from committed rows, which cannot draw every figure (eta, phase times): the
    figures it did not draw stay, drawn from the directories of the same runs."""
    report_md = Path(study.report_md)
    names = splice_tables(report_md, report_dir, not_run_tables(study))
    figures = report_md.parent / "figures" / study.name
    figures.mkdir(parents=True, exist_ok=True)
    current = sorted(report_dir.glob("*.png"))
    for path in current:
        atomic_write_bytes(figures / path.name, path.read_bytes())
    undrawn = sorted(set(figures.glob("*.png")) - {figures / p.name for p in current})
    for stale in [] if from_rows else undrawn:
        stale.unlink()  # an earlier report's figure this one did not draw
    if from_rows and undrawn:
        print(f"== kept {len(undrawn)} figures in {figures} that the per-seed rows cannot draw (eta, phase times)")
    # the runs' own numbers, committed beside the report (runs/ is not): every paired number recomputes
    per_seed = per_seed_path(study)
    per_seed.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(per_seed, (report_dir / "per_seed.csv").read_bytes())
    print(
        f"== {report_md}: tables {', '.join(names) or 'none'} regenerated; figures in {figures}; per-seed data {per_seed}"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, or a run that was interrupted (sweep.INTERRUPTED_EXIT_CODE)
        print(INTERRUPTED_MESSAGE, file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except SweepError as e:  # a stage's scheduler refused, or can never start its runs (one line)
        print(f"error: {e}", file=sys.stderr)
        return 1


class _Plan(NamedTuple):
    """What one invocation runs, built and checked before anything runs."""

    executor: Executor
    study: StudyFile
    out_dir: str
    weights: tuple[str, ...]  # the override that makes the pretrained or committed weights the model's
    pretrain: list[RunSpec]
    search: list[RunSpec]
    grid: list[RunSpec]  # with placeholder choices for the searched arms until the search has chosen
    rows: Path | None  # --from-rows: the committed per-seed rows that stand in for missing run directories


class _Searched(NamedTuple):
    """The search's outcome: the grid with its choices, and what the report says about them."""

    grid: list[RunSpec]
    markdown: str
    candidates: list[Candidate]
    base_val: float


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    start_s = time.perf_counter()
    try:
        plan = _plan(args)
    except (SweepError, ConfigError, markdown.MarkerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        _print_plan(plan.study, plan.pretrain, plan.search, plan.grid)
        return 0

    study = plan.study
    eta = WorkEta(len(plan.pretrain) + len(plan.search) + len(plan.grid))  # the whole study's time left
    if plan.pretrain and not run_stage(
        f"pretraining ({study.pretrain})", plan.pretrain, eta, plan.executor, "pretrain"
    ):
        return _stopped_after_stage(plan)
    grid, searched = plan.grid, None
    if plan.search:
        searched = _search(plan, eta)
        if searched is None:
            return _stopped_after_stage(plan)
        grid = searched.grid
    if grid or plan.rows is None:
        ok = run_stage("study grid (interleaved per seed)", grid, eta, plan.executor, "grid")
    else:
        print(f"== study grid: every run is in a run directory or in {plan.rows} (--from-rows): nothing to run")
        ok = True
    if not ok and _emit_only(plan):
        return _stopped_after_stage(plan)

    runs_dir = Path(plan.out_dir) / study.name
    report_dir = runs_dir.parent / f"{study.name}-report"
    written = _report(study, runs_dir, report_dir, searched, plan.rows)
    if written is None or not _conclude(study, report_dir, args.update_report, plan.rows is not None):
        return 1
    print(f"== study wall time {time.perf_counter() - start_s:.0f} s ({len(written)} report files)")
    return 0 if ok else 1


def _plan(args: argparse.Namespace) -> _Plan:
    """The study file with --seeds and the overrides applied, and every stage's runs (each run's
    config validated here, before any runs).

    Raises:
        SweepError: the study, --update-report or the machine refuses (one line).
        ConfigError: a run's config is invalid.
        markdown.MarkerError: --update-report's file has a broken span.
    """
    study = read_study(args.config)
    if args.seeds is not None:
        study = only_seeds(study, tuple(args.seeds))
    study = with_command_line_overrides(study, tuple(args.overrides))
    if args.update_report and not (study.report_md and Path(study.report_md).is_file()):
        raise SweepError(f"study file {args.config}: --update-report needs report_md naming an existing file")
    # A broken span is found now, not after the study's hours of runs; a page with none would take
    # nothing while the study still published figures and per-seed rows beside it.
    if args.update_report and not markdown.spans(Path(study.report_md).read_text(encoding="utf-8"), study.report_md):
        raise SweepError(
            f"study file {args.config}: --update-report: report_md {study.report_md} has no table span "
            "(<!-- NAME:start --> and <!-- NAME:end --> lines, NAME a report table such as summary or paired); "
            "add one where the table goes, or name another page"
        )
    out_dir = str(runs_root(study, args.out_dir))
    pretrain, weights = pretrain_stage(study, out_dir)
    search = search_specs(study, out_dir, weights)
    placeholder = {arm: specs[0] for arm, specs in (study.search.candidates if study.search else {}).items()}
    if study.search:
        placeholder = study.search.choices_for(placeholder)
    grid = main_specs(study, placeholder, out_dir, weights)  # validates every run's config up front
    rows = check_from_rows(study) if args.from_rows else None
    if rows is not None:
        grid = still_to_run(grid, rows)
        pretrain = pretrain if grid else []  # the weights only the runs still to run would load
    executor = executor_from_args(args)
    # a dry run lists names for other machines: this one's hardware is moot; so with nothing to run
    if not args.dry_run and (pretrain or search or grid):
        executor.check(pretrain + search + grid)
    return _Plan(executor, study, out_dir, weights, pretrain, search, grid, rows)


def _emit_only(plan: _Plan) -> bool:
    return isinstance(plan.executor, SlurmExecutor) and plan.executor.emit_only


def _stopped_after_stage(plan: _Plan) -> int:
    """A stage did not complete: 1; with --emit-sbatch, its script is written (0): the next stage
    depends on its results (the search's choice), so it is written by the same command once they exist."""
    if not _emit_only(plan):
        return 1
    print(
        "== the next stages depend on this one's results: once its array completed, run the same command "
        "again to write the next stage's script"
    )
    return 0


def _search(plan: _Plan, eta: WorkEta) -> _Searched | None:
    """Run the parameter search on validation, choose, and rebuild the grid with the choices.
    None: a search run did not complete or no choice could be made (said on stderr)."""
    # The report's reader, imported here so a dry run never pays for pandas.
    from freeze.pipeline.report.load import load_runs

    if not run_stage("parameter search on the validation split", plan.search, eta, plan.executor, "search"):
        return None
    search = plan.study.search
    try:
        chosen, candidates, base_val = choose(search, load_runs(plan.search[0].config.run_dir().parent))
    except SearchError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    search_md = search_markdown(candidates, base_val, search)
    print(search_md)
    grid = main_specs(plan.study, search.choices_for(chosen, best_arm(candidates)), plan.out_dir, plan.weights)
    return _Searched(grid, search_md, candidates, base_val)


def _horizons(study: StudyFile, runs_dir: Path, sources: list[Path], from_rows: bool):
    """The horizons table: this study's arms against the same arms of ``study.shorter_horizon``,
    whose run directories sit beside this study's (with ``from_rows``, and its committed rows)."""
    from freeze.pipeline.report import ReportInputError
    from freeze.pipeline.report.horizons import horizons_table
    from freeze.pipeline.report.rows import load_sources

    shorter_dir = runs_dir.parent / study.shorter_horizon
    shorter_rows = per_seed_path(study, study.shorter_horizon)
    shorter = [shorter_dir] if has_run_dirs(shorter_dir) else []
    if from_rows and shorter_rows.is_file():
        shorter.append(shorter_rows)
    if not shorter:
        raise ReportInputError(
            f"shorter_horizon: {shorter_dir} is not a folder of runs; run that study first (its runs beside "
            "this one's), or read its committed rows with --from-rows"
        )
    print(f"== horizons: {' '.join(map(str, shorter))} against {' '.join(map(str, sources))}", flush=True)
    return horizons_table(
        load_sources(shorter),
        load_sources(sources),
        study.shorter_horizon,
        study.name,
        study.target_fraction,
        study.margin_points,
    )


def _report(
    study: StudyFile, runs_dir: Path, report_dir: Path, searched: _Searched | None, rows: Path | None = None
) -> dict[str, Path] | None:
    """Build the report from the run directories, and ``rows`` for the runs that have none (with the
    cost model's table when the study asks), write the search's table, print the main tables. Returns
    the files written; None: the report could not be built (said on stderr)."""
    # The report reads run directories only; imported here so a dry run never pays for pandas.
    from freeze.pipeline.report import ReportInputError, build_report
    from freeze.pipeline.report.load import load_runs

    for path in remove_stale_tables(report_dir, not_run_tables(study)):
        print(f"== removed {path}: left by an earlier invocation; this study does not make that table")
    try:
        extra = []
        if study.predict:
            from freeze.pipeline.study.predict import predict_study

            print("== cost model: predicted training time of every complete study run", flush=True)
            extra.append(predict_study(runs_dir))
        # the run directories first; with --from-rows the committed rows fill in (all of them when runs/ is gone)
        sources = [runs_dir] if rows is None or has_run_dirs(runs_dir) else []
        sources += [rows] if rows is not None else []
        if study.shorter_horizon:
            extra.append(_horizons(study, runs_dir, sources, rows is not None))
        written = build_report(
            sources,
            report_dir,
            target_fraction=study.target_fraction,
            log=print,
            margin_points=study.margin_points,
            extra_tables=extra,
        )
    except ReportInputError as e:  # e.g. every run refused before writing its directory
        print(f"error: report: {e}", file=sys.stderr)
        return None
    if searched is not None:
        shift = shift_markdown(searched.candidates, searched.base_val, load_runs(runs_dir), study.search.setting)
        atomic_write_text(report_dir / f"{SEARCH_TABLE}.md", searched.markdown + (f"\n{shift}" if shift else ""))
    print(f"== report: {report_dir}")
    for name in ("paired.md", "convergence.md", *((f"{PREDICTED_TABLE}.md",) if study.predict else ())):
        if (report_dir / name).exists():
            print((report_dir / name).read_text(encoding="utf-8"))
    return written


def _conclude(study: StudyFile, report_dir: Path, update_report: bool, from_rows: bool = False) -> bool:
    """What the report means, and with --update-report the study's report_md regenerated. False:
    report_md's spans changed during the study (said on stderr)."""
    from freeze.pipeline.report.verdict import verdict_lines

    meaning = verdict_lines(report_dir, study.margin_points)
    if update_report:
        try:
            _publish(study, report_dir, from_rows)
        except markdown.MarkerError as e:  # the file changed during the study
            print(f"error: {e}", file=sys.stderr)
            return False
    elif study.report_md:
        print(f"== {study.report_md} left as it is (--update-report regenerates the tables of a page that has spans)")
        meaning.append(f"The measured answer is in {study.report_md} (docs/study.md).")
    if meaning:
        print("== what this means")
        for line in meaning:
            print(line)
    return True
