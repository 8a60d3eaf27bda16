"""Progress bars: rank 0's epoch bar on a terminal (off elsewhere, as tqdm's disable=None), led by
the sweep's or study's place in the work; the log lines still reach the console, above the bar."""

import io
import logging
from pathlib import Path

import pytest

from freeze.pipeline.config import ConfigError, load_config
from freeze.pipeline.log import PROGRESS_ENV, PROGRESS_PREFIX_ENV, ProgressLine, get_logger, progress_bar_wanted
from freeze.pipeline.preflight import preflight
from freeze.pipeline.runs import SIDE_BY_SIDE_ENV
from freeze.pipeline.sweep.runner import WorkEta

SMOKE_CONFIG = Path(__file__).parents[2] / "experiments" / "configs" / "smoke.toml"


class Terminal(io.StringIO):
    """What a worker's stderr is when the user ran the command in a terminal."""

    def isatty(self) -> bool:
        return True


def _run_epoch(stream, logger, steps=4) -> list[str]:
    clock = [0.0]
    progress = ProgressLine(logger, 1, 3, every_s=1.0, clock=lambda: clock[0], bar_stream=stream)
    lines = []
    with progress:
        for step in range(1, steps + 1):
            clock[0] = step
            lines.append(progress.update(step, steps, 0.5, 0.1, 0.01))
    return [line for line in lines if line]


@pytest.fixture
def clean_env(monkeypatch):
    for key in (PROGRESS_ENV, PROGRESS_PREFIX_ENV, SIDE_BY_SIDE_ENV):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_a_terminal_gets_a_bar_led_by_the_sweeps_place_and_the_log_lines_above_it(clean_env, capsys):
    clean_env.setenv(PROGRESS_PREFIX_ENV, "run 4/203, about 2 h 10 min left")
    terminal = Terminal()
    logger = get_logger(0)  # the console handler writes to sys.stdout, as on a worker
    lines = _run_epoch(terminal, logger)
    drawn = terminal.getvalue()
    assert "run 4/203, about 2 h 10 min left | epoch 2/3" in drawn and "4/4" in drawn and "step" in drawn
    assert "loss 0.500" in drawn  # the loss of the last line printed, as the bar's postfix
    out = capsys.readouterr().out
    assert len(lines) == 4 and all(line in out for line in lines)  # every line still on the console
    # the bar is gone with its epoch and the console handler is back, at its level
    assert [type(h) for h in logger.handlers] == [logging.StreamHandler]
    assert logger.handlers[0].level == logging.INFO


def test_no_bar_off_a_terminal_for_runs_side_by_side_or_when_turned_off(clean_env):
    not_terminal = io.StringIO()
    _run_epoch(not_terminal, logging.getLogger("freeze.test.bar"))
    assert not_terminal.getvalue() == ""  # a log file, a pipe, a SLURM job's output
    clean_env.setenv(SIDE_BY_SIDE_ENV, "2")
    assert not progress_bar_wanted(Terminal())  # two bars would overwrite each other's line
    clean_env.setenv(SIDE_BY_SIDE_ENV, "1")
    clean_env.setenv(PROGRESS_ENV, "off")
    assert not progress_bar_wanted(Terminal())
    clean_env.setenv(PROGRESS_ENV, "on")
    assert progress_bar_wanted(io.StringIO())
    quiet_rank = ProgressLine(logging.getLogger("freeze.test.bar"), 0, 1, rank=1, bar_stream=Terminal())
    assert not quiet_rank.wants_bar


def test_a_bad_freeze_progress_is_refused_in_one_line_before_a_run_starts(clean_env):
    clean_env.setenv(PROGRESS_ENV, "yes")
    with pytest.raises(ConfigError) as refused:
        preflight(load_config(SMOKE_CONFIG))
    assert str(refused.value) == "environment FREEZE_PROGRESS='yes'; accepted: auto, on, off"


def test_the_sweeps_place_in_the_bar_says_the_time_left_once_a_run_trained():
    eta = WorkEta(runs_total=3)
    assert eta.position() == "run 1/3"
    eta.record(120.0)
    assert eta.position() == "run 2/3, about 4 min left"
    eta.record(None)  # resumed: says nothing about a fresh run's length
    assert eta.position() == "run 3/3, about 2 min left"
