"""``python -m experiments.substrate pretrain``: the substrate's one-off pretraining, resumable, then
the fp16 export of its weights with their sha256 and provenance (freeze.pipeline.datasets.weights).

The run is an ordinary pipeline run (``python -m experiments.run``, a checkpoint every epoch); this
command starts it, or continues it from its checkpoint when an earlier invocation was interrupted
(re-running is always safe: a complete run is not run again), and exports once it is complete.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from freeze.pipeline.config import load_config
from freeze.pipeline.datasets.weights import export_fp16
from freeze.pipeline.runs import RunDir

REPO = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    """The workers import this checkout's freeze, whatever an editable install elsewhere points to."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def pretrain(config_path: str, out: Path, command: str) -> int:
    cfg = load_config(config_path)
    run = RunDir(cfg.run_dir())
    status = run.status()
    if status != "complete":
        argv = [sys.executable, "-m", "experiments.run", "--config", config_path]
        if run.checkpoint_path.exists() or status != "absent":
            argv.append("--resume")
        print(f"== pretraining ({status}): {' '.join(argv[1:])}", flush=True)
        code = subprocess.call(argv, env=_env())
        if code != 0:
            print(f"error: the pretraining run exited {code}; re-run this command to continue it", file=sys.stderr)
            return code
    manifest = run.read_manifest()
    lines = run.read_metrics()
    last = lines[-1]
    provenance = {
        "command": command,
        "config": config_path,
        "run_dir": str(run.path),
        "epochs": manifest.get("epochs_done"),
        "final_train_acc": last.get("train_acc"),
        "final_val_acc": last.get("val_acc"),
        "final_test_acc": last.get("test_acc"),
        "cumulative_wall_s": last.get("cumulative_wall_s"),
        "world_size": manifest.get("world_size"),
        "start_time": manifest.get("start_time"),
        "end_time": manifest.get("end_time"),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "device": "cpu"},
        "exported": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    record = export_fp16(run.checkpoint_path, out, provenance)
    print(json.dumps(record, indent=1))
    return 0
