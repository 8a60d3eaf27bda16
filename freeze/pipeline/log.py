"""One rank-aware logger and a rank-0 progress line (with a progress bar on a terminal).

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

import contextlib
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch

from freeze.pipeline.config import ConfigError
from freeze.pipeline.runs import SIDE_BY_SIDE_ENV

# FREEZE_PROGRESS: "auto" (the default: a bar when stderr is a terminal, as tqdm's disable=None),
# "on" or "off". FREEZE_PROGRESS_PREFIX: what a sweep or a study puts before the epoch in the bar
# (the run's place in the work and the time left for all of it), so one bar line says both.
PROGRESS_ENV = "FREEZE_PROGRESS"
PROGRESS_PREFIX_ENV = "FREEZE_PROGRESS_PREFIX"
PROGRESS_CHOICES = ("auto", "on", "off")


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


def progress_choice() -> str:
    """FREEZE_PROGRESS as one of PROGRESS_CHOICES; ConfigError (one line) for any other value,
    which the launcher's preflight raises before a run starts."""
    choice = os.environ.get(PROGRESS_ENV, "auto").strip().lower() or "auto"
    if choice not in PROGRESS_CHOICES:
        raise ConfigError(f"environment {PROGRESS_ENV}={choice!r}; accepted: {', '.join(PROGRESS_CHOICES)}")
    return choice


def progress_bar_wanted(stream: TextIO) -> bool:
    """A bar on ``stream`` unless FREEZE_PROGRESS says otherwise: in "auto", only on a terminal and
    never for runs side by side (their bars would overwrite each other's line)."""
    choice = progress_choice()
    if choice != "auto":
        return choice == "on"
    side_by_side = os.environ.get(SIDE_BY_SIDE_ENV, "1")
    isatty = getattr(stream, "isatty", None)
    return side_by_side in ("", "1") and callable(isatty) and bool(isatty())


class ProgressLine:
    """Rank-0 progress of one epoch, printed at most every ``every_s`` seconds and at the last step.

    ``epoch`` is 0-based as in metrics.jsonl and shown 1-based. loss, step time and data time are
    means over the steps since the previous line, so one slow step does not dominate the line.
    A loss given as a tensor is summed where it lives and read on the host only when a line is
    printed: a ``.item()`` per step would wait for the device on every step.

    On a terminal (:func:`progress_bar_wanted`) a tqdm bar on ``bar_stream`` also counts the steps,
    led by FREEZE_PROGRESS_PREFIX; while it shows, the logger's console lines are written above it
    (tqdm's logging redirect), and it is erased at the epoch's last step or :meth:`close`.
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
        bar_stream: TextIO | None = None,
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
        self.bar_stream = sys.stderr if bar_stream is None else bar_stream
        self.wants_bar = self.enabled and progress_bar_wanted(self.bar_stream)
        self._bar = None  # made at the first step, when the epoch's length is known
        self._bar_context = contextlib.ExitStack()

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Erase the bar (if one shows) and give the console lines back their stream."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._bar_context.close()

    def _open_bar(self, step: int, total_steps: int) -> None:
        try:
            from tqdm import tqdm  # a worker is never a notebook
            from tqdm.contrib.logging import logging_redirect_tqdm
        except ImportError:  # the optional package is missing: the progress line alone, as off a terminal
            self.wants_bar = False
            return
        prefix = os.environ.get(PROGRESS_PREFIX_ENV, "").strip()
        epoch = f"epoch {self.epoch + 1}/{self.num_epochs}"
        # the handlers tqdm's redirect replaces (its own test): a stream handler on stdout or stderr
        console_levels = [
            h.level
            for h in self.logger.handlers
            if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
        ]
        if console_levels:  # without a console there is nothing to write above the bar
            self._bar_context.enter_context(logging_redirect_tqdm(loggers=[self.logger]))
            # tqdm's handler takes the console's place but not its level (INFO on rank 0)
            self.logger.handlers[-1].setLevel(console_levels[0])
        self._bar = tqdm(
            total=total_steps,
            initial=step - 1,  # an epoch resumed mid-way starts at its step
            desc=f"{prefix} | {epoch}" if prefix else epoch,
            unit="step",
            file=self.bar_stream,
            leave=False,
            dynamic_ncols=True,
        )

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
        if self.wants_bar and self._bar is None:
            self._open_bar(step, total_steps)
        if self._bar is not None:
            self._bar.update(1)  # tqdm redraws at most every 0.1 s: cheap enough per step
        self.window_steps += 1
        self.window_loss = self.window_loss + loss  # a tensor stays a tensor: no host sync here
        self.window_step_s += step_s
        self.window_data_s += data_s
        now_s = self.clock()
        if now_s - self.last_print_s < self.every_s and step < total_steps:
            return None
        line = self.format(step, total_steps, now_s)
        if self._bar is not None:
            # redrawn with the line (every 10 s): tqdm's own redraws come only with steps 0.1 s apart
            self._bar.set_postfix_str(f"loss {float(self.window_loss) / max(self.window_steps, 1):.3f}", refresh=True)
        self.logger.info(line)
        self.last_print_s = now_s
        self._reset_window()
        if step >= total_steps:
            self.close()
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
