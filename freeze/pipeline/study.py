"""The whole study in one command: pretrain (optional), the fine-tuning grid, then the report.

    python -m experiments.study --config experiments/configs/study_offline.toml     # = make study

Study file:

    [study]
    name = "offline"                                       # runs/<name>/<run>/ and runs/<name>-pretrain/
    finetune = "experiments/configs/offline_finetune.toml" # the run config of every fine-tuning run
    pretrain = "experiments/configs/offline_pretrain.toml" # optional: its checkpoint becomes model.weights
    overrides = []                                         # applied to every fine-tuning run
    target_fraction = 0.95                                 # time-to-accuracy target, x baseline's final val acc
    report_md = "report/REPORT.md"                         # optional: splice the generated tables in
    [grid]
    "freeze.policy" = ["none", "static:k=3", "autofreeze:percentile=50"]
    "run.seed" = [0, 1, 2]

Re-running resumes: complete runs are skipped, interrupted ones continue from their checkpoints.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from freeze._atomic import atomic_write_bytes, atomic_write_text
from freeze.pipeline.config import ConfigError
from freeze.pipeline.sweep import SweepError, check_runnable_here, check_table, expand, read_toml, run_specs

_STUDY_KEYS = {
    "name": str,
    "finetune": str,
    "pretrain": str,
    "overrides": list,
    "target_fraction": float,
    "report_md": str,
    "out_dir": str,
}


def read_study(path: str | Path) -> dict:
    data = read_toml(path, "study")
    study = check_table(f"study file {path}: [study]", data.get("study"), _STUDY_KEYS, ("name", "finetune"))
    grid = data.get("grid", {})
    if not isinstance(grid, dict):
        raise SweepError(f'study file {path}: [grid] must be a table of "section.key" = [values]')
    return {**study, "grid": grid}


def splice_tables(report_md: Path, tables_dir: Path) -> list[str]:
    """Replace each ``<!-- generated:NAME -->...<!-- /generated:NAME -->`` span of ``report_md`` with
    ``tables_dir/NAME.md``: REPORT.md's tables are generated, never typed."""
    text = report_md.read_text(encoding="utf-8")
    replaced = []

    def fill(match: re.Match) -> str:
        name = match.group(1)
        source = tables_dir / f"{name}.md"
        if not source.exists():
            return match.group(0)
        replaced.append(name)
        return f"<!-- generated:{name} -->\n{source.read_text(encoding='utf-8').strip()}\n<!-- /generated:{name} -->"

    text = re.sub(r"<!-- generated:([\w-]+) -->.*?<!-- /generated:\1 -->", fill, text, flags=re.S)
    atomic_write_text(report_md, text)
    return replaced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.study", description="Run the study and its report.")
    parser.add_argument("--config", required=True, help="study TOML file")
    parser.add_argument(
        "--out-dir", default=None, help="where run directories go (default: the study's out_dir or runs)"
    )
    args = parser.parse_args(argv)
    start_s = time.perf_counter()
    try:
        study = read_study(args.config)
        if study.get("report_md") and not Path(study["report_md"]).is_file():
            raise SweepError(f"study file {args.config}: report_md '{study['report_md']}' does not exist")
        out_dir = args.out_dir or study.get("out_dir", "runs")
        overrides = list(study.get("overrides", []))
        pretrain_specs = []
        if study.get("pretrain"):
            pretrain_specs = expand(study["pretrain"], f"{study['name']}-pretrain", {}, [], out_dir)
            overrides.append(f"model.weights={pretrain_specs[0].config.run_dir() / 'checkpoint.pt'}")
        specs = expand(study["finetune"], study["name"], study["grid"], overrides, out_dir)
        check_runnable_here(pretrain_specs + specs)
    except (SweepError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if pretrain_specs:
        print(f"== pretraining ({study['pretrain']})", flush=True)
        summary = run_specs(pretrain_specs)
        if not summary.ok:
            print(f"error: pretraining failed: {(summary.failed + summary.busy)[0][1]}", file=sys.stderr)
            return 1
    print(f"== fine-tuning: {len(specs)} runs", flush=True)
    summary = run_specs(specs)
    for line in summary.lines():
        print(line)

    from freeze.pipeline.report import ReportInputError, build_report  # the report reads run directories only

    runs_dir = Path(out_dir) / study["name"]
    report_dir = runs_dir.parent / f"{study['name']}-report"
    try:
        written = build_report(runs_dir, report_dir, target_fraction=float(study.get("target_fraction", 0.95)))
    except ReportInputError as e:
        print(f"error: report: {e}", file=sys.stderr)
        return 1
    print(f"== report: {report_dir}")
    main_table = report_dir / "main.md"
    if main_table.exists():
        print(main_table.read_text(encoding="utf-8"))
    if study.get("report_md"):
        report_md = Path(study["report_md"])
        names = splice_tables(report_md, report_dir)
        figures = report_md.parent / "figures" / study["name"]
        figures.mkdir(parents=True, exist_ok=True)
        for path in sorted(report_dir.glob("*.png")):
            atomic_write_bytes(figures / path.name, path.read_bytes())
        print(f"== {report_md}: tables {', '.join(names) or 'none'} regenerated; figures in {figures}")
    print(f"== study wall time {time.perf_counter() - start_s:.0f} s ({len(written)} report files)")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
