"""Reliability of the library parts: an atomic write says what the file system refused and leaves no
temp file behind."""

import errno
import io

import pytest
import torch

from freeze._atomic import atomic_write, is_temp_file, remove_stale_temp_files


# --------------------------------------------------------------------------------- a full disk
class _FullDisk(io.RawIOBase):
    """A file on a disk with ``free`` bytes left: the write that would pass them fails with ENOSPC."""

    def __init__(self, f, free: int):
        self._f, self._free = f, free

    def write(self, data) -> int:
        if len(data) > self._free:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._free -= len(data)
        return self._f.write(data)

    # io.RawIOBase defines these (fileno raising, close not closing ``f``): __getattr__ never sees them.
    def fileno(self) -> int:
        return self._f.fileno()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()
        super().close()

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.fixture
def disk_with_1kb_free(monkeypatch):
    import freeze._atomic

    real_fdopen = freeze._atomic.os.fdopen
    monkeypatch.setattr(freeze._atomic.os, "fdopen", lambda fd, mode: _FullDisk(real_fdopen(fd, mode), 1024))


def test_a_full_disk_is_named_with_the_file_not_torch_unexpected_pos(tmp_path, disk_with_1kb_free):
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(OSError) as err:
        # torch.save alone reports "[enforce fail at inline_container.cc] . unexpected pos 704 vs 598"
        atomic_write(path, lambda f: torch.save({"w": torch.zeros(10_000)}, f))
    assert err.value.errno == errno.ENOSPC
    assert "No space left on device" in str(err.value) and str(path) in str(err.value)
    assert list(tmp_path.iterdir()) == []  # neither a half file nor its temp file


def test_temp_files_of_a_killed_writer_are_recognised_and_removed(tmp_path):
    stale = tmp_path / ".checkpoint.pt.k2j3h4_x.tmp"  # what mkstemp names for atomic_write
    stale.write_bytes(b"\0" * 1000)
    keep = [tmp_path / "checkpoint.pt", tmp_path / ".lock", tmp_path / "notes.tmp", tmp_path / ".x.tmp"]
    for path in keep:
        path.write_text("x")
    assert is_temp_file(stale) and not any(is_temp_file(p) for p in keep)
    assert remove_stale_temp_files(tmp_path) == [stale]
    assert sorted(tmp_path.iterdir()) == sorted(keep)
