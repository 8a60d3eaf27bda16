"""A stage of runs handed to a scheduler, written once where its tasks can read it.

``<runs of the study>/.scheduler/<stage>-<digest>/`` holds ``runs.json`` (the run names in array
order and the nodes each run spans), ``configs/<index>.toml`` (each run's resolved config, as a run
directory's config.toml holds it), the sbatch script and the tasks' logs. The digest is of the
resolved configs: the same stage submitted again maps to the same folder (and its queued tasks are
found again by the job name), while a changed grid gets a folder of its own, so a task queued for
the old grid never runs the new grid's run at its index.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from freeze._atomic import atomic_write_text
from freeze.pipeline.config import ConfigError, config_to_toml, load_config
from freeze.pipeline.runs import now_iso
from freeze.pipeline.schema import run_name_part
from freeze.pipeline.sweep.grid import RunSpec, SweepError

SCHEDULER_DIR = ".scheduler"
RUNS_FILE = "runs.json"
JOBS_FILE = "jobs.jsonl"
DRIVER_LOCK_FILE = ".driver.lock"


@dataclass(frozen=True)
class Stage:
    path: Path

    @classmethod
    def of(cls, name: str, specs: list[RunSpec], nodes: int = 1) -> Stage:
        """The stage of ``specs``, each run on ``nodes`` nodes: part of its identity (and digest), so
        a resubmission with another node count never re-attaches to tasks of the old one."""
        if not specs:
            raise SweepError(f"stage {name}: no runs")
        text = "\n".join(config_to_toml(s.config) for s in specs) + f"\nnodes = {nodes}\n"
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return cls(specs[0].config.run_dir().parent / SCHEDULER_DIR / f"{run_name_part(name)}-{digest[:8]}")

    @property
    def job_name(self) -> str:
        """The SLURM job name of this stage's arrays, as squeue shows it: the study's folder and the
        stage's, without the characters SLURM's lists and #SBATCH lines split on (comma, space)."""
        return re.sub(r"[^A-Za-z0-9._=+-]", "-", f"{self.path.parent.parent.name}-{self.path.name}")

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def log_path(self, index: int) -> Path:
        """The log of the run at ``index``'s task (appended across its restarts)."""
        return self.logs / f"{index}.log"

    @property
    def jobs_path(self) -> Path:
        return self.path / JOBS_FILE

    def job_ids(self) -> list[str]:
        """The SLURM jobs this stage submitted, oldest first (jobs.jsonl)."""
        ids = []
        with contextlib.suppress(OSError):
            for line in self.jobs_path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError, AttributeError):
                    ids.append(str(json.loads(line)["job_id"]))
        return ids

    def record_job(self, job_id: str, indices: list[int]) -> None:
        with open(self.jobs_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"job_id": job_id, "indices": indices, "submitted": now_iso()}) + "\n")

    @contextlib.contextmanager
    def driver_lock(self, log) -> Iterator[None]:
        """One driver at a time per stage: between reading the queue and submitting, a second driver
        of the same stage would submit its runs again. A second one waits here, then re-attaches."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / DRIVER_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"another driver submits and awaits this stage ({self.path}); waiting for it to finish")
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def config_path(self, index: int) -> Path:
        return self.path / "configs" / f"{index}.toml"

    def write(self, specs: list[RunSpec], nodes: int) -> None:
        (self.path / "configs").mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        for index, spec in enumerate(specs):
            atomic_write_text(self.config_path(index), config_to_toml(spec.config))
        runs = {"nodes": nodes, "runs": [spec.name for spec in specs]}
        atomic_write_text(self.path / RUNS_FILE, json.dumps(runs, indent=1) + "\n")

    def _runs(self) -> dict:
        try:
            return json.loads((self.path / RUNS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise SweepError(f"stage {self.path}: cannot read {RUNS_FILE}: {e}") from None

    @property
    def nodes(self) -> int:
        return int(self._runs().get("nodes", 1))

    def spec(self, index: int) -> RunSpec:
        names = self._runs().get("runs", [])
        if not 0 <= index < len(names):
            raise SweepError(f"stage {self.path}: no run at index {index} (it has {len(names)})")
        try:
            return RunSpec(load_config(self.config_path(index)))
        except ConfigError as e:
            raise SweepError(f"stage {self.path}, run {names[index]}: {e}") from None
