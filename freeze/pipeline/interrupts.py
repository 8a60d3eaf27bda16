"""Ctrl-C in a command-line tool (the report, convert_runs, profile_run): one line and exit 130 at
any instant, never a traceback and never exit 0 (reliability cases 22 and 42).

Python raises KeyboardInterrupt wherever the main thread is when the signal lands. Two places let it
escape a command's own ``except KeyboardInterrupt``: the imports before ``main`` runs (a second of
pandas and matplotlib), and libraries that swallow it (an exception in a weakref callback is printed
and dropped, as matplotlib's are, and the command went on to exit 0). :class:`InterruptGuard` covers
both: a command enters it first, imports its heavy modules inside it, and asks :attr:`seen` at the
end, however the interrupt travelled. :func:`signals_deferred` holds Ctrl-C and SIGTERM through a
step that must not be cut in two (a report's files moved into their folder). Torch-free: it must load
before anything slow.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import TracebackType
from typing import NoReturn

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


class InterruptGuard:
    """While entered, SIGINT raises KeyboardInterrupt as by default and is remembered in :attr:`seen`;
    on exit the previous handler is back. Outside the main thread (a test calling ``main``) signals
    cannot be handled: the guard then only remembers nothing."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: object = None
        self._installed = False

    def _handler(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self) -> InterruptGuard:
        try:
            previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread
            self._installed = False
            return self
        # After the guard, the loading-time handler's "before it began" would be false: Python's default
        self._previous = signal.default_int_handler if getattr(previous, "while_loading", False) else previous
        self._installed = True
        # An interrupt raised where Python cannot raise it (a weakref callback, a __del__) is printed as
        # "Exception ignored in: ..." with its traceback, then dropped: it is remembered instead.
        self._previous_unraisable = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def caused(self, error: BaseException) -> bool:
        """Whether ``error`` ends the command as interrupted: the KeyboardInterrupt itself, or any error
        after a Ctrl-C a library swallowed (a module it left half imported fails when used next)."""
        return isinstance(error, KeyboardInterrupt) or self.seen

    def _unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            self.seen = True
            return
        self._previous_unraisable(unraisable)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
            sys.unraisablehook = self._previous_unraisable


def exit_on_interrupt_while_loading(message: str) -> None:
    """For a command's entry module run as ``__main__``, before its heavy imports (torch, pandas): a
    Ctrl-C until ``main`` enters its :class:`InterruptGuard` prints ``message`` and exits 130 at once.
    Nothing has been written by then, so there is nothing to clean up.

    Args:
        message: the one line, e.g. "convert_runs: interrupted before it began; nothing changed".
    """

    def handler(signum: int, frame: object) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os._exit(INTERRUPTED_EXIT)

    handler.while_loading = True  # type: ignore[attr-defined]  # what InterruptGuard does not give back
    signal.signal(signal.SIGINT, handler)


def exit_with(code: int) -> NoReturn:
    """End a command run as ``__main__`` with ``code``; after an interrupt at once (``os._exit``, the
    streams flushed): CPython remembers an interrupt that ended code it ran on a library's behalf
    and would then end the process by SIGINT at its exit (-2, seen in the test of this promise),
    whatever the code. Nothing is left to clean up by then: the command said what it kept."""
    if code == INTERRUPTED_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...]):
    """Signals that arrive inside the block are recorded and raised again after it, to the handlers
    that were in place. Python runs signal handlers in the main thread whichever thread the OS
    delivered to, so this holds with library threads about; off the main thread it defers nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in signums}
    if any(handler is None for handler in previous.values()):  # installed outside Python: cannot restore
        yield
        return
    arrived: list[int] = []
    for signum in signums:
        signal.signal(signum, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if arrived:
            signal.raise_signal(arrived[0])
