"""One rank-aware logger and a rank-0 progress line.

Rank 0 prints INFO and above to stdout; other ranks print only warnings and errors (to stderr), so
N workers do not print N copies of every line. Any rank can also write everything (DEBUG and
above) to its own file. Nothing here touches ``print``.

    log = get_logger(rank, run_dir.log_path if rank == 0 else None)
    progress = ProgressLine(log, epoch, config.train.epochs, rank=rank, device=device)
    for step, batch in enumerate(loader, start=1):
        ...
        progress.update(step, steps_per_epoch, loss.detach(), step_s, data_s)
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch


def get_logger(rank: int, log_file: Path | str | None = None) -> logging.Logger:
    """The logger of this rank, configured afresh on every call (no duplicate handlers)."""
    logger = logging.getLogger(f"freeze.rank{rank}")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    # Not propagated: a root logger configured by someone else would print every line twice.
    logger.propagate = False
    logger.setLevel(logging.DEBUG if log_file is not None else logging.INFO)

    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setLevel(logging.INFO)
        console.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    else:
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        fmt = f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"
        console.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    logger.addHandler(console)

    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        to_file.setLevel(logging.DEBUG)
        to_file.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s"))
        logger.addHandler(to_file)
    return logger


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes; None where /proc is not available."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024  # the field is in kB
    except OSError:
        pass
    return None


def _max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


def process_rss_bytes() -> int:
    """Resident set size of this process now (peak RSS where /proc is not available)."""
    found = _proc_status_bytes("VmRSS")
    return found if found is not None else _max_rss_bytes()


def process_peak_rss_bytes() -> int:
    """This process's own peak resident set (VmHWM). Not ``getrusage``'s ru_maxrss, except where
    /proc is not available: Linux carries ru_maxrss across fork and exec, so every worker would
    report at least the peak of the process that started it (the study, which hosts torchrun)."""
    found = _proc_status_bytes("VmHWM")
    return found if found is not None else _max_rss_bytes()


def memory_bytes(device: torch.device | str | None) -> int:
    """CUDA max allocated on a CUDA device, else the process RSS."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device)
    return process_rss_bytes()


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: allocated by torch on a GPU, resident on a CPU, where the
    model, its activations and the activation cache all live in the process's memory."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return process_peak_rss_bytes()


class ProgressLine:
    """Rank-0 progress of one epoch, printed at most every ``every_s`` seconds and at the last step.

    ``epoch`` is 0-based as in metrics.jsonl and shown 1-based. loss, step time and data time are
    means over the steps since the previous line, so one slow step does not dominate the line.
    A loss given as a tensor is summed where it lives and read on the host only when a line is
    printed: a ``.item()`` per step would wait for the device on every step.
    """

    def __init__(
        self,
        logger: logging.Logger,
        epoch: int,
        num_epochs: int,
        *,
        rank: int = 0,
        every_s: float = 10.0,
        device: torch.device | str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger = logger
        self.epoch = epoch
        self.num_epochs = num_epochs
        self.enabled = rank == 0
        self.every_s = every_s
        self.device = device
        self.clock = clock
        self.start_s = clock()
        self.last_print_s = self.start_s
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_steps = 0
        self.window_loss = 0.0
        self.window_step_s = 0.0
        self.window_data_s = 0.0

    def update(
        self, step: int, total_steps: int, loss: float | torch.Tensor, step_s: float, data_s: float
    ) -> str | None:
        """Record step ``step`` (1-based, of ``total_steps``); return the line when one was printed."""
        if not self.enabled:
            return None
        self.window_steps += 1
        self.window_loss = self.window_loss + loss  # a tensor stays a tensor: no host sync here
        self.window_step_s += step_s
        self.window_data_s += data_s
        now_s = self.clock()
        if now_s - self.last_print_s < self.every_s and step < total_steps:
            return None
        line = self.format(step, total_steps, now_s)
        self.logger.info(line)
        self.last_print_s = now_s
        self._reset_window()
        return line

    def format(self, step: int, total_steps: int, now_s: float) -> str:
        n = max(self.window_steps, 1)
        eta_s = (now_s - self.start_s) / max(step, 1) * max(total_steps - step, 0)
        width = len(str(total_steps))
        mem_gb = memory_bytes(self.device) / 1e9
        return (
            f"epoch {self.epoch + 1}/{self.num_epochs} [{step:>{width}}/{total_steps}]  "
            f"eta {timedelta(seconds=round(eta_s))}  loss {float(self.window_loss) / n:.3f}  "
            f"step {1000 * self.window_step_s / n:.1f} ms  data {1000 * self.window_data_s / n:.1f} ms  "
            f"mem {mem_gb:.2f} GB"
        )
