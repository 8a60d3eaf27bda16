"""Free the disk that complete runs of earlier versions hold: keep their final weights, drop their
resume checkpoint. Runs now do this themselves when they complete (unless run.keep_checkpoint = true).

    python -m experiments.prune runs/offline            # every complete run below the folder
    python -m experiments.prune runs/offline --dry-run  # what it would free, nothing changed

A run's checkpoint.pt holds what a resume needs: the model, the optimizer's momentum, the scheduler,
the Freezer and every RNG (about 90 MB for ResNet-18). A complete run is never resumed, so only its
final weights are worth keeping: they go to model.pt (a plain state dict, loadable with
``torch.load(path, weights_only=True)`` and as ``model.weights`` of another run), and checkpoint.pt
is deleted. The report reads only manifest.json, config.toml and metrics.jsonl, so it is unchanged.
Runs that are not complete (running, interrupted, failed) keep their checkpoint: it is how they
resume. `make study` left 868 MB in runs/offline, a 6-run smoke sweep 481 MB.

Prune a study's pretraining run only once the study is done: its fine-tuning runs name its
checkpoint.pt as their model.weights.

Every run, complete or not, also loses the temp files a writer killed mid-save left behind
(``.checkpoint.pt.XXXXXXXX.tmp``, as large as a checkpoint): prune takes each run's lock to do so
(and to prune), and leaves a run another process writes as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freeze._atomic import is_temp_file
from freeze.pipeline.run_lock import RunBusyError, RunLock
from freeze.pipeline.runs import RunDir, RunError, load_checkpoint
from freeze.pipeline.schema import find_run_dirs


def prune_run(run_dir: Path, dry_run: bool = False) -> tuple[int, int] | None:
    """Replace a complete run's checkpoint.pt by model.pt; returns (checkpoint bytes removed, model.pt
    bytes written; 0 in a dry run), or None for a run left as it is.

    Raises:
        RunError: the checkpoint cannot be read (one line naming it).
    """
    run = RunDir(run_dir)
    if run.status() != "complete" or not run.checkpoint_path.is_file():
        return None
    size = run.checkpoint_path.stat().st_size
    if dry_run:
        return size, 0
    state = load_checkpoint(run.checkpoint_path)
    weights = state.get("model") if isinstance(state, dict) else None
    if not isinstance(weights, dict):
        raise RunError(f"{run.checkpoint_path}: no 'model' entry; left as it is")
    run.write_final_weights(weights)  # before the checkpoint goes
    run.drop_checkpoint()
    return size, run.model_path.stat().st_size


def stale_temp_bytes(run_dir: Path) -> int:
    """Bytes held by the temp files of killed writers in ``run_dir`` (atomic writes cut short)."""
    return sum(p.stat().st_size for p in run_dir.iterdir() if is_temp_file(p) and p.is_file())


def prune_locked(run_dir: Path, dry_run: bool) -> tuple[tuple[int, int] | None, int] | None:
    """:func:`prune_run` under the run's lock, which also removes its stale temp files; returns
    (prune_run's result, temp bytes removed or, in a dry run, found), or None when another process
    writes the run (left as it is)."""
    if dry_run:
        return prune_run(run_dir, dry_run=True), stale_temp_bytes(run_dir)
    temp_bytes = stale_temp_bytes(run_dir)
    try:
        lock = RunLock.acquire(run_dir)  # removes the temp files of killed writers
    except RunBusyError:
        return None
    with lock:
        return prune_run(run_dir), temp_bytes - stale_temp_bytes(run_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.prune", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", type=Path, help="a run directory or a folder of them (searched recursively)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be freed, change nothing")
    args = parser.parse_args(argv)
    if not args.runs_dir.is_dir():
        print(f"error: {args.runs_dir} is not a directory", file=sys.stderr)
        return 2
    removed = written = pruned = kept = temp_bytes = temp_runs = busy = 0
    try:
        for run_dir in find_run_dirs(args.runs_dir):
            outcome = prune_locked(run_dir, args.dry_run)
            if outcome is None:
                busy += 1
                continue
            done, run_temp_bytes = outcome
            temp_bytes, temp_runs = temp_bytes + run_temp_bytes, temp_runs + (run_temp_bytes > 0)
            if done is None:
                kept += 1
            else:
                pruned, removed, written = pruned + 1, removed + done[0], written + done[1]
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    left = f"{kept} left as they are (not complete, or pruned before)"
    left += f", {busy} busy (another process writes them)" if busy else ""
    if args.dry_run:
        print(f"prune: would remove {removed / 1e6:.0f} MB of checkpoint.pt in {pruned} complete run(s); {left}")
    else:
        print(
            f"prune: removed {removed / 1e6:.0f} MB of checkpoint.pt in {pruned} complete run(s), "
            f"kept their final weights in model.pt ({written / 1e6:.0f} MB); {left}"
        )
    if temp_runs:
        verb = "would remove" if args.dry_run else "removed"
        print(f"prune: {verb} {temp_bytes / 1e6:.0f} MB of temp files that killed writers left in {temp_runs} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
