"""freeze._atomic: a write replaces its target whole or not at all, says what the file system refused,
and its temp files have one recognisable name."""

import errno
import io
import json
import os
import stat

import pytest
import torch

from freeze._atomic import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    is_temp_file,
    remove_stale_temp_files,
)


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


def test_a_write_replaces_the_target_whole_readable_by_others_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("old")
    atomic_write_json(path, {"a": 1, "b": [2, 3]})
    assert json.loads(path.read_text()) == {"a": 1, "b": [2, 3]} and path.read_text().endswith("}\n")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # mkstemp's 0600 would hide results from others
    atomic_write_text(path, "é\n")
    assert path.read_bytes() == "é\n".encode()
    atomic_write_bytes(path, b"")
    assert path.read_bytes() == b""
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_the_temp_file_of_a_write_in_progress_has_the_name_is_temp_file_recognises(tmp_path):
    seen = []

    def write(f):
        f.write(b"x")
        seen.extend(p for p in tmp_path.iterdir())

    atomic_write(tmp_path / "ckpt.pt", write)
    assert len(seen) == 1 and is_temp_file(seen[0]) and seen[0].name.startswith(".ckpt.pt.")
    assert not is_temp_file(tmp_path / "ckpt.pt")


def test_a_writer_that_fails_leaves_the_old_file_and_its_own_error(tmp_path):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")

    def half(f):
        f.write(b"new, half")
        raise KeyError("writer bug")

    with pytest.raises(KeyError, match="writer bug"):  # not an OSError: passed on unchanged
        atomic_write(path, half)
    assert path.read_bytes() == b"old" and list(tmp_path.iterdir()) == [path]


def test_a_missing_parent_directory_is_an_oserror_naming_the_target(tmp_path):
    path = tmp_path / "no" / "such" / "file.txt"
    with pytest.raises(OSError) as err:
        atomic_write_text(path, "x")
    assert err.value.errno == errno.ENOENT and err.value.filename == str(path)


def test_removing_stale_temp_files_touches_only_files_of_that_name(tmp_path):
    assert remove_stale_temp_files(tmp_path / "missing") == []  # a directory not made yet: nothing to do
    looks_like_one = tmp_path / ".run.abcdefgh.tmp"
    looks_like_one.mkdir()  # a directory is never a temp file of atomic_write
    assert remove_stale_temp_files(tmp_path) == [] and looks_like_one.is_dir()
    assert not is_temp_file(".run.abcdefg.tmp")  # mkstemp's part has 8 characters, not 7
    assert not is_temp_file("run.abcdefgh.tmp")  # and the name starts with a dot
