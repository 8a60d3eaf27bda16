"""Convert run directories of earlier versions to the current contract, once, in place, so that the
report and a resume read them without branches for old versions:

    python -m experiments.convert_runs runs/offline            # every run below the folder
    python -m experiments.convert_runs runs/offline --dry-run  # what it would change, nothing changed

What changes, and only where a run directory has it:
- metrics.jsonl: the key ``boundary_during`` becomes ``boundary_at_epoch_start`` (same value, same
  place in the line; the lines are written as the training loop writes them). A torn last line is
  kept as it is.
- config.toml and the manifest's ``config``: a boolean ``data.augment`` becomes ``"crop-flip"``
  (true) or ``"none"`` (false); a missing ``run.keep_checkpoint`` is added at its default, false
  (what those runs did: they kept their checkpoint only until ``prune``). A resume compares both
  with the config it is given, so an interrupted old run resumes.

Each run is converted under its lock (a run another process writes is left as it is and counted
as busy), and each file is replaced atomically. A converted run converts to itself again. Once every
run directory is converted this script has done its job.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from freeze.pipeline.interrupts import INTERRUPTED_EXIT, InterruptGuard, exit_on_interrupt_while_loading, exit_with

if __name__ == "__main__":  # torch loads below (RunError's module): a Ctrl-C meanwhile is one line
    exit_on_interrupt_while_loading("convert_runs: interrupted before it began; nothing changed")

from freeze._atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from freeze.pipeline.jsonl import JsonLinesError, read_json_lines
from freeze.pipeline.run_lock import RunBusyError, RunLock
from freeze.pipeline.runs import RunError
from freeze.pipeline.schema import CONFIG_FILE, LEGACY_RECORD_KEYS, MANIFEST_FILE, METRICS_FILE, find_run_dirs

((OLD_BOUNDARY_KEY, BOUNDARY_KEY),) = LEGACY_RECORD_KEYS.items()
AUGMENT_OF_BOOLEAN = {True: "crop-flip", False: "none"}


class ConvertError(RunError):
    """A file this script cannot convert; the message is one line naming it."""


def convert_record(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl record under today's keys (the key order kept)."""
    return {(BOUNDARY_KEY if key == OLD_BOUNDARY_KEY else key): value for key, value in record.items()}


def convert_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config (as TOML reads it) with today's data.augment and run.keep_checkpoint."""
    data, run = dict(config.get("data", {})), dict(config.get("run", {}))
    if isinstance(data.get("augment"), bool):
        data["augment"] = AUGMENT_OF_BOOLEAN[data["augment"]]
    run.setdefault("keep_checkpoint", False)
    converted = {**config, "run": run}
    if "data" in config:
        converted["data"] = data
    return converted


def _convert_metrics(path: Path, dry_run: bool) -> bool:
    data = path.read_bytes()
    try:
        numbered, valid_bytes = read_json_lines(data)
    except JsonLinesError as err:
        raise ConvertError(f"{path}:{err.line}: {err.reason}; left as it is") from None
    records = [record for _, record in numbered]
    if not any(OLD_BOUNDARY_KEY in r for r in records):
        return False
    if not dry_run:
        # As RunDir.append_metrics writes a line; the torn tail (if any) stays after the last one.
        converted = (json.dumps(convert_record(r), separators=(",", ":")) + "\n" for r in records)
        lines = b"".join(line.encode("utf-8") for line in converted)
        atomic_write_bytes(path, lines + data[valid_bytes:])
    return True


def _convert_config_text(path: Path, text: str) -> str:
    """``text`` with today's data.augment and run.keep_checkpoint, the rest of its lines as they were."""
    old = tomllib.loads(text)
    if convert_config(old) == old:
        return text
    augment = old.get("data", {}).get("augment")
    if isinstance(augment, bool):
        text = re.sub(r"(?m)^(augment\s*=\s*)(true|false)(\s*(#.*)?)$", rf'\1"{AUGMENT_OF_BOOLEAN[augment]}"\3', text)
    if "keep_checkpoint" not in old.get("run", {}):
        if re.search(r"(?m)^\[run\]\s*$", text):
            text = re.sub(r"(?m)^(\[run\]\s*)$", r"\1\nkeep_checkpoint = false", text, count=1)
        else:
            text = text.rstrip("\n") + "\n\n[run]\nkeep_checkpoint = false\n"
    if tomllib.loads(text) != convert_config(old):
        raise ConvertError(f"{path}: data.augment or run.keep_checkpoint written in a form this script does not edit")
    return text


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:  # a hand-edited file saved in another encoding
        raise ConvertError(f"{path}: not UTF-8 ({err.reason} at byte {err.start}); left as it is") from None


def _convert_config(path: Path, dry_run: bool) -> bool:
    text = _read_text(path)
    try:
        converted = _convert_config_text(path, text)
    except tomllib.TOMLDecodeError as err:
        raise ConvertError(f"{path}: not valid TOML ({err}); left as it is") from None
    if converted == text:
        return False
    if not dry_run:
        atomic_write_text(path, converted)
    return True


def _convert_manifest(path: Path, dry_run: bool) -> bool:
    try:
        manifest = json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise ConvertError(f"{path}: not valid JSON ({err}); left as it is") from None
    started = manifest.get("config") if isinstance(manifest, dict) else None
    if not isinstance(started, dict) or convert_config(started) == started:
        return False  # a manifest of a version that recorded no config: nothing a resume compares
    if not dry_run:
        atomic_write_json(path, {**manifest, "config": convert_config(started)})
    return True


def convert_run(run_dir: Path, dry_run: bool = False) -> list[str] | None:
    """Convert one run directory under its lock; returns the names of the files it changed (would
    change, in a dry run, which takes no lock), or None when another process writes the run.

    Raises:
        ConvertError: a file it cannot read or edit (one line naming it), left as it is.
    """
    if dry_run:
        return _convert_files(run_dir, dry_run=True)
    try:
        lock = RunLock.acquire(run_dir)
    except RunBusyError:
        return None
    with lock:
        _convert_files(run_dir, dry_run=True)  # every file read and parsed first: a refusal changes none
        return _convert_files(run_dir, dry_run=False)


def _convert_files(run_dir: Path, dry_run: bool) -> list[str]:
    converters = ((METRICS_FILE, _convert_metrics), (CONFIG_FILE, _convert_config), (MANIFEST_FILE, _convert_manifest))
    return [name for name, convert in converters if (run_dir / name).is_file() and convert(run_dir / name, dry_run)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.convert_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", type=Path, help="a run directory or a folder of them (searched recursively)")
    parser.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    args = parser.parse_args(argv)
    if not args.runs_dir.is_dir():
        print(f"error: {args.runs_dir} is not a directory", file=sys.stderr)
        return 2
    changed = unchanged = busy = 0
    interrupted = False
    with InterruptGuard() as interrupt:
        try:
            for run_dir in find_run_dirs(args.runs_dir):
                files = convert_run(run_dir, args.dry_run)
                if files is None:
                    busy += 1
                elif files:
                    changed += 1
                    print(f"{'would convert' if args.dry_run else 'converted'} {run_dir}: {', '.join(files)}")
                else:
                    unchanged += 1
        except RunError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except UnicodeDecodeError as err:  # a hand-edited config.toml or manifest.json in another encoding
            print(
                f"error: {run_dir}: a file is not UTF-8 ({err.reason} at byte {err.start}); left as it is",
                file=sys.stderr,
            )
            return 1
        except BaseException as error:
            if not interrupt.caused(error):
                raise
            interrupted = True
        if interrupted or interrupt.seen:  # raised here, or swallowed on its way
            # each run converts under its lock, file by file: a run cut mid-way is finished by the next call
            done = "nothing changed"
            if not args.dry_run:
                done = f"{changed} run(s) converted before it, the one it was converting maybe in part (the rerun finishes it)"
            print(f"interrupted: {done}; run the same command again to convert the rest", file=sys.stderr)
            return INTERRUPTED_EXIT
        verb = "would convert" if args.dry_run else "converted"
        left = f", {busy} busy (another process writes them)" if busy else ""
        print(f"convert_runs: {verb} {changed} run(s); {unchanged} already current{left}")
        return 0


if __name__ == "__main__":
    exit_with(main())
