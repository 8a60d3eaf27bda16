"""Reliability of the pipeline (issue 10): a file never runs code, one writer per run directory,
no worker outlives its launcher, and user errors are one line.

The malicious files carry a payload that would create a marker file when unpickled; each test
shows the load refused in one line and no marker."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from freeze.pipeline.data import DataError, read_cifar10, write_synthetic_cifar
from freeze.pipeline.models import ModelError, build_model, load_weights
from freeze.pipeline.runs import RunError, load_checkpoint


class _Payload:
    """Unpickling this calls os.system("touch <marker>"): what a crafted file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "PWNED"
    # The payload works when loaded the old way: the tests below would see the marker.
    with open(tmp_path / "probe.pkl", "wb") as f:
        pickle.dump(_Payload(path), f)
    with open(tmp_path / "probe.pkl", "rb") as f:
        pickle.load(f)
    assert path.exists()
    path.unlink()
    return path


# ----------------------------------------------------------------------------- a file never runs code
def test_crafted_checkpoint_is_refused_on_resume(tmp_path, marker):
    path = tmp_path / "checkpoint.pt"
    torch.save({"epoch": 1, "model": {}, "rng": _Payload(marker)}, path)
    with pytest.raises(RunError) as err:
        load_checkpoint(path)
    message = _one_line(err)
    assert str(path) in message and "posix.system" in message and "refused" in message
    assert not marker.exists()


def test_crafted_weights_file_is_refused_without_a_full_unpickle(tmp_path, marker):
    path = tmp_path / "weights.pt"
    torch.save({"conv1.weight": torch.zeros(1), "x": _Payload(marker)}, path)
    with pytest.raises(ModelError) as err:
        load_weights(build_model("resnet18", num_classes=10), path)
    message = _one_line(err)
    assert message.startswith("model.weights:") and "posix.system" in message
    assert not marker.exists()


@pytest.mark.parametrize("synthetic", [True, False], ids=["generated", "official"])
def test_crafted_cifar_batch_is_refused_even_beside_a_synthetic_marker(tmp_path, marker, synthetic):
    write_synthetic_cifar(tmp_path / "data", "source", 20, 10, seed=0)
    folder = tmp_path / "data" / "cifar-10-batches-py"
    assert (folder / "SYNTHETIC.json").is_file()  # it once switched the md5 check off
    with open(folder / "data_batch_1", "wb") as f:
        pickle.dump({b"data": _Payload(marker), b"labels": [0]}, f)
    with pytest.raises(DataError) as err:
        read_cifar10(tmp_path / "data", synthetic=synthetic)
    message = _one_line(err)
    # generated data: the unpickler refuses the global; official data: the md5 check comes first
    expected = "global posix.system" if synthetic else "fails the official md5 checksum"
    assert "data_batch_1" in message and expected in message
    assert not marker.exists()


def test_our_own_checkpoint_loads_weights_only(tmp_path):
    from freeze.pipeline.prepare import _rng_state, _set_rng_state

    path = tmp_path / "c.pt"
    torch.save({"rng": _rng_state()}, path)
    import numpy as np

    expected = np.random.rand()
    _set_rng_state(torch.load(path, weights_only=True)["rng"])
    assert np.random.rand() == expected  # numpy's RNG survives the tensor form exactly
