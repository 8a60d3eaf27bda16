"""The run directory: config.toml, manifest.json, metrics.jsonl, checkpoint.pt, model.pt, log.txt.

Everything a run leaves behind goes through here, and every file that a crash could leave half
written is written atomically (:mod:`freeze._atomic`: temp file in the same directory, fsync, rename,
fsync of the directory), so after a kill the directory holds either the old or the new version of
each file.
metrics.jsonl is the exception: it only grows, one fsynced line per epoch, and a half-written last
line is dropped on read (:mod:`freeze.pipeline.jsonl`, the reader the report uses too).
A write the file system refuses (a full disk) raises OSError naming the file.

A run whose manifest says "complete" is never overwritten; a run that has metrics or a checkpoint
is continued only on request (``resume=True``) and only with the identical config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pickle
import platform
import re
import socket
import subprocess
import tomllib
import zipfile
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import torch

from freeze._atomic import atomic_write, atomic_write_json, atomic_write_text
from freeze.integrity import CorruptFileError, check_torch_file
from freeze.pipeline.jsonl import JsonLinesError, read_json_lines
from freeze.pipeline.schema import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    LEGACY_RECORD_KEYS,
    LOG_FILE,
    MANIFEST_FILE,
    METRICS_FILE,
    MODEL_FILE,
    RUN_STATUSES,
    RunEnd,
    foreign_record_keys,
)

# Set (to "1") by a sweep or a study for the runs it starts: the sweep says what comes next, so a run
# leaves out its closing "report: python -m report ..." hint (the study makes the report itself; ten
# identical hints in its output told the reader nothing) and, when interrupted, its own resume line
# (the sweep's is "run the same command again").
IN_SWEEP_ENV = "FREEZE_IN_SWEEP"


def in_sweep() -> bool:
    """Whether a sweep or a study started this run (see :data:`IN_SWEEP_ENV`)."""
    return os.environ.get(IN_SWEEP_ENV) == "1"


RunStatus = Literal["absent", "running", "complete", "interrupted", "failed"]


class RunError(RuntimeError):
    """A run directory that cannot be used as asked; the message is one line."""


def now_iso() -> str:
    """Local time with its UTC offset, to the second: 2025-01-31T14:05:09+01:00."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# ---------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(obj: Any, path: str | Path) -> None:
    """torch.save ``obj`` to ``path`` atomically: a crash mid-save leaves the previous file intact.
    ``obj`` must hold tensors and plain data only, so that :func:`load_checkpoint` can read it."""
    atomic_write(path, lambda f: torch.save(obj, f))


class UnsafeFileError(ValueError):
    """A torch file that is not plain tensors and data; the message is one line."""


def load_torch_file(path: Path, map_location: Any = "cpu") -> Any:
    """torch.load with the weights-only unpickler and nothing else: tensors, dicts, lists, tuples,
    numbers and strings come back; a file that names any other object (a crafted pickle that
    would run code when loaded) is refused without running anything. There is no fallback to a
    full unpickle: what this tool writes loads this way.

    Raises:
        UnsafeFileError: the file refers to an object outside that set (named in the message).
        OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError: an
            unreadable or corrupt file.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = found.group(1) if found else _one_line(str(err)).split(". ")[-1][:120]
        raise UnsafeFileError(
            f"{path} refers to {what}, which is not a tensor or plain data: refused without loading it "
            "(loading would run code from the file)"
        ) from None


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` (:func:`load_torch_file`); RunError (one
    line) when it is missing, corrupt (its CRC32s checked first: torch.load loads a flipped bit
    inside a tensor silently) or refers to anything but tensors and plain data."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"checkpoint {path} does not exist")
    try:
        check_torch_file(path)
    except CorruptFileError as err:
        raise RunError(
            f"checkpoint {err}; refused (corrupt): put back a copy of an earlier epoch's checkpoint.pt "
            "if you kept one, or delete it to start the run over"
        ) from None
    except OSError as err:
        raise RunError(f"checkpoint {path} cannot be read: {err.strerror or err}") from None
    try:
        return load_torch_file(path, map_location)
    except UnsafeFileError as err:
        raise RunError(f"checkpoint {err}") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as err:
        # torch's messages run on for several sentences; the first one says what went wrong.
        detail = _one_line(str(err)).split(". ")[0] or type(err).__name__
        raise RunError(
            f"checkpoint {path} cannot be loaded (truncated or corrupt?): {detail}; "
            "delete it to start the run from scratch"
        ) from None


# ---------------------------------------------------------------------------------------------
# the run directory


def _flatten(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def first_differing_key(
    old_toml: str, new_toml: str, defaults: Mapping[str, Any] | None = None
) -> tuple[str, Any, Any] | None:
    """(dotted key, old value, new value) of the first key that differs, or None if equal as data."""
    return first_differing_key_of(tomllib.loads(old_toml), tomllib.loads(new_toml), defaults)


def first_differing_key_of(
    old_config: dict[str, Any], new_config: dict[str, Any], defaults: Mapping[str, Any] | None = None
) -> tuple[str, Any, Any] | None:
    """:func:`first_differing_key` of two configs already read (nested dicts, as TOML reads them).
    ``defaults`` (dotted key -> default): a key the old config lacks and the new one holds at its
    default is no difference: the key was added after the run started, at the value that keeps what
    the run did (a key is only ever added that way)."""
    old, new = dict(_flatten(old_config)), dict(_flatten(new_config))
    missing = object()
    defaults = defaults or {}
    for key in list(old) + [k for k in new if k not in old]:
        if key not in old and key in defaults and new.get(key, missing) == defaults[key]:
            continue
        if old.get(key, missing) != new.get(key, missing):
            return key, old.get(key), new.get(key)
    return None


# Serialises the manifest's read-modify-writes across processes (RunDir._manifest_lock).
MANIFEST_LOCK_FILE = ".manifest.lock"


def _end_fields(status: str, error: str | None) -> dict[str, Any]:
    """The manifest fields that record how a run ended."""
    if status not in ("complete", "interrupted", "failed"):
        raise ValueError(f"finish: status {status!r} is not accepted; accepted: complete, interrupted, failed")
    end = RunEnd(
        status=status,
        end_time=now_iso(),
        load_avg_1min_end=round(os.getloadavg()[0], 2),
        error=None if error is None else _one_line(error),
    )
    return dataclasses.asdict(end)


class RunDir:
    """One run directory: runs/<study>/<run-name>/."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_path = self.path / CONFIG_FILE
        self.manifest_path = self.path / MANIFEST_FILE
        self.metrics_path = self.path / METRICS_FILE
        self.checkpoint_path = self.path / CHECKPOINT_FILE
        self.model_path = self.path / MODEL_FILE
        self.log_path = self.path / LOG_FILE

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def has_progress(self) -> bool:
        """True when the run has trained at least something (a metrics line or a checkpoint)."""
        metrics_size = self.metrics_path.stat().st_size if self.metrics_path.is_file() else 0
        return metrics_size > 0 or self.checkpoint_path.exists()

    def status(self) -> RunStatus:
        """ "absent" when no manifest exists; else the manifest's status.

        "running" also describes a run whose process was killed (SIGKILL, a crash of the machine):
        nothing marks the run as stopped. Ctrl-C or SIGTERM mark it "interrupted". Resuming either
        is the way on.
        """
        if not self.manifest_path.exists():
            return "absent"
        status = self.read_manifest().get("status")
        if status not in RUN_STATUSES:
            raise RunError(f"{self.manifest_path}: status {status!r} is not one of {', '.join(RUN_STATUSES)}")
        return status

    def ensure_not_complete(self) -> RunStatus:
        """The run's status; RunError if it is complete (a complete run is never overwritten)."""
        status = self.status()
        if status == "complete":
            raise RunError(f"run {self.path} is complete; it is never overwritten: choose another run.name")
        return status

    def prepare(self, config_toml: str, resume: bool, defaults: Mapping[str, Any] | None = None) -> RunStatus:
        """Check that the run may start (or, with ``resume``, continue) under this config, and write
        it as config.toml; returns the status the run had. ``defaults`` (dotted key -> default): keys
        added since the run started pass at their default (:func:`first_differing_key_of`). Calling it again with the same config
        changes nothing: the launcher calls it before starting workers (which then load config.toml),
        and rank 0 again when the run starts, which also covers workers started by a plain torchrun.
        """
        status = self.ensure_not_complete()
        if self.has_progress() and not resume:
            raise RunError(
                f"run {self.path} already has metrics or a checkpoint (status {status}); "
                "pass --resume to continue it, or choose another run.name"
            )
        if resume and self.config_path.exists():
            self._check_same_config(config_toml, defaults)
        if resume and status != "absent":
            self._check_started_config(config_toml, defaults)
        if resume:
            self.check_resumable_records()  # a bad line stops the run here, before any worker trains
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.config_path, config_toml)
        except OSError as err:  # a full disk, a read-only mount: refused before the run starts
            raise RunError(f"cannot write {err.filename or self.config_path}: {err.strerror or err}") from None
        return status

    def begin(self, manifest: dict[str, Any], resume: bool, from_epoch: int | None = None) -> None:
        """Write the "running" manifest, after :meth:`prepare`. On resume the original start_time is
        kept and ``sessions`` gains this start: ``from_epoch`` (the checkpoint's epoch the run goes
        on from; by default the epochs the manifest says are done) and its commit. The caller's
        other manifest fields win."""
        previous: dict[str, Any] = {}
        if resume and self.manifest_path.exists():
            previous = self.read_manifest()
        record = {**previous, **manifest, "status": "running", "error": None, "end_time": None}
        record["start_time"] = previous.get("start_time") or manifest.get("start_time") or now_iso()
        session = {
            "from_epoch": from_epoch if from_epoch is not None else (previous.get("epochs_done", 0) if resume else 0),
            "git_commit": manifest.get("git_commit"),
            "start_time": manifest.get("start_time") or now_iso(),
        }
        earlier = previous.get("sessions")
        if earlier is None and previous:  # a manifest of an older version: its one session from what it kept
            earlier = [
                {"from_epoch": 0, "git_commit": previous.get("git_commit"), "start_time": previous.get("start_time")}
            ]
        record["sessions"] = [*(earlier or []), session]
        atomic_write_json(self.manifest_path, record)

    def create(self, config_toml: str, manifest: dict[str, Any], resume: bool) -> None:
        """Start (or, with ``resume``, continue) the run: :meth:`prepare`, then :meth:`begin`."""
        self.prepare(config_toml, resume)
        self.begin(manifest, resume)

    def _check_same_config(self, config_toml: str, defaults: Mapping[str, Any] | None) -> None:
        stored = self.config_path.read_text(encoding="utf-8")
        if stored == config_toml:
            return
        try:
            diff = first_differing_key(stored, config_toml, defaults)
        except tomllib.TOMLDecodeError as err:
            raise RunError(f"cannot resume {self.path}: {self.config_path} is not valid TOML: {err}") from None
        if diff is None:
            return  # same data, different formatting
        key, old, new = diff
        raise RunError(
            f"cannot resume {self.path} with a different config: {key} was {old!r}, now {new!r}; "
            "resume with the stored config, or choose another run.name"
        )

    def _check_started_config(self, config_toml: str, defaults: Mapping[str, Any] | None) -> None:
        """RunError unless ``config_toml`` is the config the run started with (the manifest's
        ``config``): config.toml itself may have been edited, and resuming through
        ``--config <run>/config.toml`` then passed :meth:`_check_same_config` while the checkpoint's
        optimizer state silently overrode, say, a new optim.lr. Manifests of older versions hold no
        config and are not checked."""
        started = self.read_manifest().get("config")
        if not isinstance(started, dict):
            return
        diff = first_differing_key_of(started, tomllib.loads(config_toml), defaults)
        if diff is None:
            return
        key, old, new = diff
        raise RunError(
            f"cannot resume {self.path}: the run started with {key} = {old!r} ({self.manifest_path.name}), "
            f"this config has {new!r} (was {self.config_path.name} edited?); resume with the config it "
            "started with, or choose another run.name"
        )

    # --- manifest

    def read_manifest(self) -> dict[str, Any]:
        try:
            text = self.manifest_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RunError(f"{self.manifest_path} does not exist") from None
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError as err:
            raise RunError(f"{self.manifest_path} is not valid JSON: {err}") from None
        if not isinstance(manifest, dict):
            raise RunError(f"{self.manifest_path}: expected a JSON object, got {type(manifest).__name__}")
        return manifest

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        with self._manifest_lock():
            return self._merge_into_manifest(fields)

    def finish(self, status: Literal["complete", "interrupted", "failed"], error: str | None = None) -> dict[str, Any]:
        return self.update_manifest(**_end_fields(status, error))

    def finish_if(
        self, current: tuple[RunStatus, ...], status: Literal["interrupted", "failed"], error: str | None = None
    ) -> bool:
        """Record how the run ended when its status is one of ``current``; True when it did.

        A compare-and-set under the manifest's lock: when a worker dies, the surviving rank 0 ("a
        peer's connection was lost"), the dead worker's node agent ("killed by SIGKILL") and the
        launcher may each record the end at the same moment, and an unlocked read-then-write let the
        consequence overwrite the cause. An unreadable or unwritable manifest is left as it is: the
        exit code still says it."""
        if not self.manifest_path.exists():
            return False  # never started: no lock file left in a directory that holds no run
        try:
            with self._manifest_lock():
                if self.status() not in current:
                    return False
                self._merge_into_manifest(_end_fields(status, error))
        except (RunError, OSError):
            return False
        return True

    @contextlib.contextmanager
    def _manifest_lock(self) -> Iterator[None]:
        """Held by every change of a started run's manifest (update_manifest, finish, finish_if): an
        exclusive ``flock`` on ``.manifest.lock`` (not ``.lock``, which the run's one writer holds for
        the whole run). ``begin`` writes the manifest as the run starts, before any other writer
        exists, and experiments.convert_runs holds ``.lock`` itself. A file opened for writing, as
        NFS's byte-range locks need, released by the kernel with its holder (a SIGKILLed writer
        never leaves it taken). Not re-entrant."""
        fd = os.open(self.path / MANIFEST_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _merge_into_manifest(self, fields: dict[str, Any]) -> dict[str, Any]:
        manifest = {**self.read_manifest(), **fields}
        atomic_write_json(self.manifest_path, manifest)
        return manifest

    def write_final_weights(self, state_dict: dict) -> None:
        """model.pt: the final weights, loadable with ``torch.load(path, weights_only=True)`` and as
        another run's ``model.weights``. Written before the checkpoint is dropped, so that a kill in
        between never leaves a run with neither."""
        save_checkpoint(state_dict, self.model_path)

    def drop_checkpoint(self) -> int:
        """Delete checkpoint.pt (what only a resume needs); returns the bytes it held (0: none)."""
        if not self.checkpoint_path.is_file():
            return 0
        size = self.checkpoint_path.stat().st_size
        self.checkpoint_path.unlink()
        return size

    def mark_interrupted(self) -> bool:
        """Set a running run's status to "interrupted" (Ctrl-C, SIGTERM); True when it did. A run
        that had not started, or had completed or failed meanwhile, is left as it is."""
        return self.finish_if(("running",), "interrupted")

    # --- metrics

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON line and fsync it: the newline marks the record as complete."""
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            if self.metrics_path.exists():
                # A crash may have left a torn last line; appending after it would bury it mid-file.
                _, valid_bytes = self._scan_metrics()
                if valid_bytes < self.metrics_path.stat().st_size:
                    with open(self.metrics_path, "r+b") as f:
                        f.truncate(valid_bytes)
            with open(self.metrics_path, "ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise type(err)(err.errno, err.strerror, str(self.metrics_path)) from None

    def read_metrics(self) -> list[dict[str, Any]]:
        """All complete metric records; a half-written last line (no newline, or not JSON) is dropped."""
        if not self.metrics_path.exists():
            return []
        return self._scan_metrics()[0]

    def _scan_metrics(self) -> tuple[list[dict[str, Any]], int]:
        """(complete records, byte length of the prefix that holds them)."""
        try:
            numbered, valid_bytes = read_json_lines(self.metrics_path.read_bytes())
        except JsonLinesError as err:
            raise RunError(f"{self.metrics_path}: {err}") from None
        return [record for _, record in numbered], valid_bytes

    def epoch_records(self) -> list[dict[str, Any]]:
        """:meth:`read_metrics` for a resume: RunError (one line, naming the file and line, what to
        do) for a bad line other than a torn last one, or a record without an integer epoch."""
        try:
            records = self.read_metrics()
        except RunError as err:
            raise RunError(f"cannot resume {self.path}: {err}; repair that line, or choose another run.name") from None
        for record in records:
            if not isinstance(record.get("epoch"), int) or isinstance(record.get("epoch"), bool):
                raise RunError(
                    f"cannot resume {self.path}: {self.metrics_path}: a record has no integer 'epoch': "
                    f"{str(record)[:120]}; repair it, or choose another run.name"
                )
        return records

    def check_resumable_records(self) -> None:
        """:meth:`epoch_records`, and RunError (one line) for a record with a key this version does not
        write: the report would refuse the run this resume completes (reliability case 24). Readers
        that tolerate older keys (a tracker's replay) call :meth:`epoch_records` alone."""
        for record in self.epoch_records():
            foreign = foreign_record_keys(record)
            if any(key in LEGACY_RECORD_KEYS for key in foreign):
                raise RunError(
                    f"cannot resume {self.path}: {self.metrics_path} was written by an older version (keys "
                    f"{', '.join(foreign)}); convert it once (python -m experiments.convert_runs {self.path}), or choose "
                    "another run.name"
                )
            if foreign:
                raise RunError(
                    f"cannot resume {self.path}: {self.metrics_path}: epoch {record['epoch']} has keys no version "
                    f"of freeze writes: {', '.join(foreign)}; remove them from that line, or choose another run.name"
                )

    def check_metrics_cover(self, epochs_done: int) -> None:
        """RunError (one line) unless metrics.jsonl holds a record of every epoch before
        ``epochs_done`` (the checkpoint's): a resume would otherwise complete a run whose missing
        epochs nothing re-runs, and mark it complete. Records past the checkpoint are fine (the
        resume re-runs those epochs and drops them first)."""
        have = {record["epoch"] for record in self.epoch_records()}
        missing = [epoch for epoch in range(epochs_done) if epoch not in have]
        if not missing:
            return
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        where = "has no metrics.jsonl" if not self.metrics_path.exists() else "metrics.jsonl lacks epoch(s) " + shown
        raise RunError(
            f"cannot resume {self.path}: its checkpoint is at epoch {epochs_done}, but the run {where}; "
            "put the file back, or delete checkpoint.pt to re-run it from epoch 0"
        )

    def truncate_metrics(self, num_epochs: int) -> list[dict[str, Any]]:
        """Keep only the records of epochs < ``num_epochs`` (atomic rewrite); used on resume."""
        records = self.epoch_records()
        kept = [r for r in records if r["epoch"] < num_epochs]
        if self.metrics_path.exists():
            atomic_write_text(self.metrics_path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
        return kept


# ---------------------------------------------------------------------------------------------
# environment


# The repository root: this file is <root>/freeze/pipeline/runs.py.
_REPO_DIR = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=_REPO_DIR, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> str | None:
    """HEAD of the repository this package lives in, "+dirty" when tracked files changed; None
    outside a git checkout (an installed copy) or without git."""
    # Without this check an installed copy in site-packages would report an unrelated outer repo.
    # ``.git`` is a directory in a clone and a file in a worktree or submodule: both count.
    if not (_REPO_DIR / ".git").exists():
        return None
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    changes = _git("status", "--porcelain", "--untracked-files=no")
    return commit + "+dirty" if changes else commit


def cpu_name() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) ..."), for manifests and benchmark reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def environment_info(device: str | None = None) -> dict[str, Any]:
    """git_commit, versions and hardware for the manifest.

    ``device`` is the device the run uses ("cpu" or "cuda"); by default, cuda when one is visible.
    """
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "git_commit": git_commit(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchvision": _version("torchvision"),
            "numpy": _version("numpy"),
        },
        "hardware": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "gpus": gpus,
            "device": device or ("cuda" if gpus else "cpu"),
        },
        "placement": placement_info(),
    }


# Set by the local executor (freeze.pipeline.sweep.executors) for the runs it starts side by side.
SIDE_BY_SIDE_ENV = "FREEZE_RUNS_SIDE_BY_SIDE"
_SLURM_FIELDS = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "nodelist": "SLURM_JOB_NODELIST",
    "partition": "SLURM_JOB_PARTITION",
    "cpus_on_node": "SLURM_CPUS_ON_NODE",  # the job's CPUs on rank 0's node (the node's all when --exclusive)
}


def cores_allowed() -> int:
    """The cores this process may use (taskset, cgroups, an emulated cluster node, a SLURM task's
    --cpus-per-task), not the machine's. SLURM without CPU binding (TaskPlugin=task/none) leaves the
    whole machine in the affinity mask: its SLURM_CPUS_PER_TASK is then the share to keep to, or two
    tasks on one node each run a thread per core (seen: epochs 8-15x slower)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    granted = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return min(cores, int(granted)) if granted.isdigit() and int(granted) > 0 else cores


def placement_info() -> dict[str, Any]:
    """Where rank 0 ran, for the report's timing pairs: the host, the cores it could use, how many
    runs shared the machine (the local executor says), and the SLURM job when there was one."""
    cores = cores_allowed()
    side_by_side = os.environ.get(SIDE_BY_SIDE_ENV, "1")
    slurm = {key: os.environ[var] for key, var in _SLURM_FIELDS.items() if var in os.environ}
    return {
        "host": socket.gethostname(),
        "cores_allowed": cores,
        "runs_side_by_side": int(side_by_side) if side_by_side.isdigit() else 1,
        "slurm": slurm or None,
    }
