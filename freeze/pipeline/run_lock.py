"""One writer per run directory: an exclusive ``flock`` on ``<run>/.lock`` held while the run is written.

Who holds it: the process that starts the run. ``python -m experiments.run`` with ``dist.nproc > 1``
and a sweep hold it for the whole run and start the workers with its token in
``FREEZE_RUN_LOCK_TOKEN``; rank 0 of those workers checks that the lock is still held under that token
instead of taking it (a second ``flock`` on the same file, even from the same machine's child, would
conflict). A single process, and rank 0 under a plain ``torchrun``, take the lock themselves.

Why ``flock``: the kernel releases it when the holder exits, however it exits (SIGKILL included), so a
dead holder never leaves a stale lock that blocks a resume, and nothing has to guess from a pid
whether the holder is alive. The file's content (pid, host, start time, token) only names the holder
in the refusal; the lock is the ``flock``, never the file's existence, so the file is never deleted
while the directory lives (deleting it would let two processes lock two different files).
On NFS, Linux implements ``flock`` with NFS byte-range locks, so the lock also holds across machines
that share ``runs/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
from pathlib import Path

from freeze._atomic import remove_stale_temp_files
from freeze.pipeline.runs import RunError, now_iso
from freeze.pipeline.schema import MANIFEST_FILE

LOCK_FILE = ".lock"
TOKEN_ENV = "FREEZE_RUN_LOCK_TOKEN"


class RunBusyError(RunError):
    """Another process writes this run directory; the message names it (pid, host)."""


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _open_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise RunError(f"cannot open the run's lock file {path}: {err.strerror}") from None


def _holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _is_held(path: Path) -> bool:
    """True while some process holds the lock on ``path`` (probed with a lock taken and dropped)."""
    fd = _open_lock_file(path)
    try:
        if not _try_lock(fd):
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _busy_message(run_dir: Path, holder: dict) -> str:
    if holder.get("pid") is None:
        who = "another process (it has not written its pid yet)"
    else:
        who = f"pid {holder['pid']} on host {holder.get('host', '?')} (since {holder.get('since', '?')})"
    return (
        f"run {run_dir} is being written by {who}; one writer per run: wait for it to finish, or stop it, then resume"
    )


class RunLock:
    """The right to write one run directory. Use :meth:`acquire` (a launcher, a single process) or
    :meth:`for_worker` (rank 0 of a run's workers); :meth:`release` when the run is over."""

    def __init__(self, run_dir: Path, fd: int | None, token: str, created: tuple[Path, ...] = ()):
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._fd = fd
        self.delegated = fd is None  # held by the launcher that started this worker, not by us
        self.token = token
        self.created = created  # the directories this lock made: the run directory, then its new parents

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunLock:
        """Take the lock (creating the run directory if needed), or RunBusyError naming the holder.
        Temp files a killed writer left behind are removed once the lock is ours."""
        run_dir = Path(run_dir)
        created = tuple(d for d in (run_dir, *run_dir.parents) if not d.exists())
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunError(f"cannot create the run directory {run_dir}: {err.strerror}") from None
        path = run_dir / LOCK_FILE
        fd = _open_lock_file(path)
        if not _try_lock(fd):
            os.close(fd)
            raise RunBusyError(_busy_message(run_dir, _holder(path)))
        token = secrets.token_hex(8)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso(), "token": token}
        try:
            # In place, not an atomic replace: the lock lives on this inode.
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
            remove_stale_temp_files(run_dir)
        except OSError as err:  # a full disk: refused, and a directory made for the run goes again
            refused = cls(run_dir, fd, token, created)
            refused.discard_if_unstarted()
            refused.release()
            raise RunError(f"cannot write {path}: {err.strerror}") from None
        return cls(run_dir, fd, token, created)

    @classmethod
    def for_worker(cls, run_dir: str | Path) -> RunLock:
        """Rank 0's lock: the launcher's when this worker was started with its token (checked to be
        still held under it), else its own (:meth:`acquire`). Either way, temp files a killed writer
        left behind are removed: under ``--max-restarts`` the writer killed mid-save was a worker of
        this same launcher, after the launcher had taken the lock (and cleaned up) once."""
        token = os.environ.get(TOKEN_ENV)
        if not token:
            return cls.acquire(run_dir)
        lock = cls(Path(run_dir), None, token)
        lock.check_held()
        try:
            # Safe while the lock is held: the launcher writes nothing while its workers run, and
            # torchrun restarts a worker only after stopping all of them.
            remove_stale_temp_files(lock.run_dir)
        except OSError as err:
            raise RunError(f"cannot remove stale temp files in {lock.run_dir}: {err.strerror}") from None
        return lock

    def check_held(self) -> None:
        """RunError unless this lock is still held: for a delegated lock, unless the launcher that
        passed its token on still holds it (it may have died, or a new writer taken over)."""
        if not self.delegated:
            return
        holder = _holder(self.path)
        if holder.get("token") == self.token and _is_held(self.path):
            return
        raise RunError(
            f"run {self.run_dir}: the launcher that started this worker no longer holds the run's lock "
            "(it exited, or another writer took over); stopping without writing"
        )

    def env(self) -> dict[str, str]:
        """What a worker started by this lock's holder needs in its environment."""
        return {TOKEN_ENV: self.token}

    def discard_if_unstarted(self) -> bool:
        """Remove the run directory when this lock created it and no run started in it (no
        manifest), and the parents it created if they are empty: a refused run leaves nothing
        behind. Returns whether it did."""
        if self.delegated or not self.created or (self.run_dir / MANIFEST_FILE).exists():
            return False
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for parent in self.created[1:]:
            try:
                parent.rmdir()  # only when empty: another run may have started beside this one
            except OSError:
                break
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        self.token = ""  # released: no worker may claim it any more

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
