"""freeze.integrity: a torch file's own CRC32s catch what torch.load does not."""

import struct
import zipfile

import pytest
import torch

from freeze.integrity import CorruptFileError, check_torch_file, main
from freeze.pipeline.models import build_model
from freeze.pipeline.runs import RunError, load_checkpoint, save_checkpoint


def flip_bit_in_largest_record(path, offset_in_record: int = 1003) -> str:
    """XOR one bit of the largest record's data (a tensor storage); returns the record's name."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + name_len + extra_len + offset_in_record
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    return info.filename


@pytest.fixture
def resnet_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"epoch": 1, "model": build_model("resnet18", num_classes=10).state_dict()}, path)
    return path


def test_a_flipped_bit_loads_silently_with_torch_but_is_refused_here(resnet_checkpoint):
    clean = torch.load(resnet_checkpoint, weights_only=True)["model"]
    assert check_torch_file(resnet_checkpoint) == len(zipfile.ZipFile(resnet_checkpoint).infolist())
    record = flip_bit_in_largest_record(resnet_checkpoint)
    damaged = torch.load(resnet_checkpoint, weights_only=True)["model"]  # what the resume did
    assert any(not torch.equal(clean[k], damaged[k]) for k in clean)
    with pytest.raises(CorruptFileError) as err:
        check_torch_file(resnet_checkpoint)
    message = str(err.value)
    assert "\n" not in message and str(resnet_checkpoint) in message and record in message and "CRC32" in message


def test_a_corrupt_checkpoint_is_refused_on_resume_saying_what_to_do(resnet_checkpoint):
    flip_bit_in_largest_record(resnet_checkpoint)
    with pytest.raises(RunError) as err:
        load_checkpoint(resnet_checkpoint)
    message = str(err.value)
    assert "\n" not in message and "fails its CRC32 check" in message
    assert "earlier epoch's checkpoint.pt" in message and "delete it to start the run over" in message


def test_legacy_truncated_and_missing_files(tmp_path, capsys):
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CorruptFileError, match="legacy format, which carries no checksums"):
        check_torch_file(legacy)
    cut = tmp_path / "cut.pt"
    torch.save({"w": torch.ones(1000)}, cut)
    cut.write_bytes(cut.read_bytes()[:2000])
    with pytest.raises(CorruptFileError, match="not a complete torch zip file"):
        check_torch_file(cut)
    with pytest.raises(FileNotFoundError):
        check_torch_file(tmp_path / "missing.pt")
    ok = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(3)}, ok)
    assert main([str(ok), str(cut)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"ok: {ok}: ") and lines[1].startswith(f"error: {cut} ")


def _set_encrypted_flag_in_central_directory(path) -> None:
    """Set bit 0 ("encrypted") of the first central-directory entry's flags, as a flipped bit would."""
    data = bytearray(path.read_bytes())
    entry = data.find(b"PK\x01\x02")
    data[entry + 8] |= 0x01  # general purpose bit flag, 8 bytes into the entry
    path.write_bytes(bytes(data))


def _flip_directory_offset(path) -> None:
    """Flip a bit of the directory's offset in the zip64 end-of-central-directory record (torch writes
    zip64 records, and zipfile reads the offset from there)."""
    data = bytearray(path.read_bytes())
    end = data.rfind(b"PK\x06\x06")
    data[end + 52] ^= 0x01  # the 8-byte offset of the central directory (48 bytes in): + 4 GiB
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (_set_encrypted_flag_in_central_directory, "torch never writes encrypted records"),
        (_flip_directory_offset, "its zip directory points outside the file"),
    ],
)
def test_a_flipped_zip_flag_or_offset_is_one_line_from_the_cli_and_the_resume(
    resnet_checkpoint, capsys, damage, expected
):
    """Reliability probe case 31: these flips came out as an 18-line RuntimeError from the CLI, a
    74-line double traceback from the resume, and an OSError without the file's name."""
    damage(resnet_checkpoint)
    with pytest.raises(CorruptFileError, match=expected) as err:
        check_torch_file(resnet_checkpoint)
    assert "\n" not in str(err.value) and str(resnet_checkpoint) in str(err.value)
    assert main([str(resnet_checkpoint)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"error: {resnet_checkpoint} ")
    with pytest.raises(RunError) as resumed:
        load_checkpoint(resnet_checkpoint)
    assert "\n" not in str(resumed.value) and "delete it to start the run over" in str(resumed.value)
