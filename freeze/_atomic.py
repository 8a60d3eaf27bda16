"""Atomic file writes, the one routine every writer in this repository uses (not API).

A temp file beside the target, fsync, rename over the target, fsync of the directory: a crash at any
point leaves either the old file or the new one, never a mix, and no reader ever sees a half-written
file. Shared by :mod:`freeze.testing` (spawned ranks' payloads) and the pipeline (run directories,
reports, benchmark results); it imports nothing heavy.

A process killed mid-write (SIGKILL, power loss) cannot remove its temp file; the temp names have one
pattern (:func:`is_temp_file`) so that the next owner of the directory can
(:func:`remove_stale_temp_files`).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

# ".<target name>.<8 random characters from mkstemp>.tmp"
_TEMP_PREFIX, _TEMP_SUFFIX = ".", ".tmp"
_TEMP_NAME = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry itself is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _RecordingFile:
    """A binary file that remembers the first OSError its ``write`` raised. Writers that catch it
    and raise their own error lose the reason and the file: torch.save on a full disk reports
    "unexpected pos 704 vs 598" instead of "No space left on device" (seen with a 1 MB tmpfs)."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def sync_directory(directory: str | Path) -> None:
    """The renames made into ``directory`` on disk (for a writer that moves finished files in)."""
    _fsync_dir(Path(directory))


def _with_path(err: OSError, path: Path) -> OSError:
    """``err`` naming ``path`` (the target, not the temp file): "[Errno 28] No space left on device: 'x.pt'"."""
    return type(err)(err.errno, err.strerror or str(err), str(path))


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a binary file that replaces ``path`` only once ``write`` has returned and
    the bytes are on disk. The parent directory must exist.

    Raises OSError naming ``path`` when the file system refuses (a full disk, a read-only mount),
    also when ``write`` turned that refusal into an error of its own.
    """
    path = Path(path)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f"{_TEMP_PREFIX}{path.name}.", suffix=_TEMP_SUFFIX)
    except OSError as err:
        raise _with_path(err, path) from None
    tmp = Path(tmp_name)
    recording = None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes 0600; results are meant to be read by others
            recording = _RecordingFile(f)
            write(recording)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        cause = recording.error if recording is not None and recording.error is not None else err
        if isinstance(cause, OSError):
            raise _with_path(cause, path) from None
        raise


def is_temp_file(path: str | Path) -> bool:
    """True for a name :func:`atomic_write` gives its temp files."""
    return bool(_TEMP_NAME.match(Path(path).name))


def remove_stale_temp_files(directory: str | Path) -> list[Path]:
    """Delete the temp files a killed :func:`atomic_write` left in ``directory`` (a checkpoint's is
    as large as the checkpoint); returns them. Only for a directory this process owns exclusively:
    another writer's temp file in progress would go too."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if is_temp_file(entry) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
