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
