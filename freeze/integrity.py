"""Is a file written by ``torch.save`` still the file that was written? Its own CRC32s say.

``torch.save`` writes a zip archive with a CRC32 per record (one record per tensor storage, plus
the pickle), and ``torch.load`` checks none of them: one flipped bit inside a tensor (a bad disk
sector, a copy gone wrong) loads without a word, and a resumed run trains on from the damaged
weight. :func:`check_torch_file` reads every record and compares its CRC32, so a resume can refuse
such a file before loading it::

    from freeze.integrity import check_torch_file

    check_torch_file("checkpoint.pt")  # CorruptFileError (one line) if a record is damaged
    state = torch.load("checkpoint.pt", weights_only=True)

It costs one sequential read of the file and a CRC32 over its bytes (``tests/test_integrity.py``
measures a ResNet-18 checkpoint). A file in torch's legacy (non-zip) format carries no checksums
and is refused as not checkable. Torch-free: imports only the standard library.
"""

from __future__ import annotations

import errno
import zipfile
from pathlib import Path


class CorruptFileError(ValueError):
    """A torch file whose bytes are not the ones written (or not a zip archive at all); one line."""


def check_torch_file(path: str | Path) -> int:
    """Check every record's CRC32 in the zip archive ``torch.save`` wrote to ``path``; returns the
    number of records checked.

    Raises:
        CorruptFileError: a record fails its CRC32 (named in the message), or the file is not a zip
            archive (truncated, overwritten, or torch's legacy format, which has no checksums).
        OSError: the file cannot be read (missing, no permission).
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # reads every record; the first whose CRC32 differs, or None
            count = len(archive.infolist())
    except zipfile.BadZipFile as err:
        raise CorruptFileError(
            f"{path} is not a complete torch zip file ({err}): truncated or overwritten, "
            "or saved in torch's legacy format, which carries no checksums"
        ) from None
    except (EOFError, ValueError, NotImplementedError) as err:
        # a damaged local header (zipfile raises these while reading the records)
        raise CorruptFileError(f"{path} is damaged: {err}") from None
    except RuntimeError as err:
        # a record's "encrypted" flag set: torch never encrypts, so a bit flipped in a header
        raise CorruptFileError(f"{path} is damaged: {err} (torch never writes encrypted records)") from None
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise  # the file cannot be read (missing, no permission): not a statement about its bytes
        # a directory offset flipped: zipfile seeks before the file's first byte
        raise CorruptFileError(f"{path} is damaged: its zip directory points outside the file") from None
    if damaged is not None:
        raise CorruptFileError(f"{path} is damaged: record {damaged} fails its CRC32 check (its bytes changed on disk)")
    return count


def main(argv: list[str] | None = None) -> int:
    """``python -m freeze.integrity FILE...``: check each file; one line per file, exit 1 if any is damaged."""
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m freeze.integrity", description=main.__doc__)
    parser.add_argument("files", nargs="+", help="files written by torch.save")
    bad = 0
    for name in parser.parse_args(argv).files:
        start_s = time.perf_counter()
        try:
            records = check_torch_file(name)
        except (CorruptFileError, OSError) as err:
            print(f"error: {err}")
            bad += 1
            continue
        size_mb = Path(name).stat().st_size / 1e6
        print(f"ok: {name}: {records} records, {size_mb:.1f} MB checked in {time.perf_counter() - start_s:.3f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
