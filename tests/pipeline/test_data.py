import pickle
import shutil
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.datasets import CIFAR10

import freeze.pipeline.data as data
from freeze.pipeline.config import parse_augment
from freeze.pipeline.data import (
    CifarArrays,
    DataError,
    EvalLoader,
    TrainLoader,
    load_dataset,
    read_cifar10,
    split_validation,
    write_synthetic_cifar,
)
from freeze.pipeline.datasets.images import CIFAR10_MEAN, CIFAR10_STD, normalize_uint8
from freeze.pipeline.datasets.synthetic import render_synthetic_split, synthetic_class_names

N_TRAIN, N_TEST = 200, 50


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic_cifar(root, "source", N_TRAIN, N_TEST, seed=0)
    return root


@pytest.fixture
def copy_root(synthetic_root, tmp_path) -> Path:
    shutil.copytree(synthetic_root, tmp_path / "copy")
    return tmp_path / "copy"


def _error_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------- reader/writer
def test_synthetic_files_are_in_the_official_format(synthetic_root):
    folder = synthetic_root / "cifar-10-batches-py"
    with open(folder / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    assert set(batch) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (N_TRAIN // 5, 3072)
    with open(folder / "batches.meta", "rb") as f:  # torchvision reads with latin1 and str keys
        meta = pickle.load(f, encoding="latin1")
    assert meta["label_names"] == list(synthetic_class_names("source"))
    with open(folder / "data_batch_1", "rb") as f:
        assert np.array_equal(pickle.load(f, encoding="latin1")["data"], batch[b"data"])

    arrays = read_cifar10(synthetic_root, synthetic=True)
    assert arrays.synthetic and arrays.classes == synthetic_class_names("source")
    assert arrays.train_x.shape == (N_TRAIN, 3, 32, 32) and arrays.train_x.dtype == torch.uint8
    assert arrays.test_x.shape == (N_TEST, 3, 32, 32) and arrays.test_y.dtype == torch.int64
    assert torch.equal(arrays.train_x[: N_TRAIN // 5].reshape(-1, 3072), torch.from_numpy(batch[b"data"]))
    assert torch.bincount(arrays.train_y, minlength=10).tolist() == [N_TRAIN // 10] * 10


def test_synthetic_generation_is_deterministic_and_tasks_differ():
    a, ya = render_synthetic_split("source", 30, seed=3, split="train")
    b, yb = render_synthetic_split("source", 30, seed=3, split="train")
    c, _ = render_synthetic_split("source", 30, seed=4, split="train")
    t, _ = render_synthetic_split("source", 30, seed=3, split="test")
    assert np.array_equal(a, b) and np.array_equal(ya, yb)
    assert not np.array_equal(a, c) and not np.array_equal(a, t)
    assert a.std() > 20  # images, not a constant fill
    assert not set(synthetic_class_names("source")) & set(synthetic_class_names("target"))


def test_missing_directory_and_file(tmp_path, copy_root):
    with pytest.raises(DataError) as err:
        read_cifar10(tmp_path / "nothing")
    assert "cifar-10-batches-py is missing" in _error_line(err) and "data.download=true" in str(err.value)
    (copy_root / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError) as err:
        read_cifar10(copy_root, synthetic=True)
    assert "data_batch_3 is missing" in _error_line(err)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_truncated_or_corrupt_file(copy_root, damage):
    path = copy_root / "cifar-10-batches-py" / "data_batch_2"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage == "truncate" else b"not a pickle at all" * 10)
    with pytest.raises(DataError) as err:
        read_cifar10(copy_root, synthetic=True)
    assert "data_batch_2 is truncated or corrupt" in _error_line(err)


def _rewrite_batch(path: Path, changes: dict) -> None:
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    batch.update(changes)
    with open(path, "wb") as f:
        pickle.dump(batch, f)


def test_label_out_of_range_and_bad_shape(copy_root):
    path = copy_root / "cifar-10-batches-py" / "test_batch"
    _rewrite_batch(path, {b"labels": [10] + [0] * (N_TEST - 1)})
    with pytest.raises(DataError) as err:
        read_cifar10(copy_root, synthetic=True)
    assert "test_batch" in _error_line(err) and "label 10 is outside 0..9" in str(err.value)
    _rewrite_batch(path, {b"labels": [0] * N_TEST, b"data": np.zeros((N_TEST, 100), np.uint8)})
    with pytest.raises(DataError) as err:
        read_cifar10(copy_root, synthetic=True)
    assert "test_batch" in _error_line(err) and "[n, 3072]" in str(err.value)


def test_official_data_is_checked_against_official_md5(copy_root):
    with pytest.raises(DataError) as err:
        read_cifar10(copy_root)
    assert "data_batch_1 fails the official md5 checksum" in _error_line(err)


def test_load_dataset_writes_synthetic_once(tmp_path):
    kwargs = {"synthetic_train_size": 60, "synthetic_test_size": 20, "synthetic_seed": 5}
    first = load_dataset("synthetic-target", tmp_path, **kwargs)
    folder = tmp_path / "synthetic-target-n60-20-s5" / "cifar-10-batches-py"
    assert [p.name for p in tmp_path.iterdir()] == ["synthetic-target-n60-20-s5"]  # no temp leftovers
    stamp = (folder / "data_batch_1").stat().st_mtime_ns
    second = load_dataset("synthetic-target", tmp_path, **kwargs)
    assert (folder / "data_batch_1").stat().st_mtime_ns == stamp
    assert torch.equal(first.train_x, second.train_x) and first.classes == synthetic_class_names("target")
    with pytest.raises(DataError) as err:
        load_dataset("imagenet", tmp_path)
    assert "cifar10, synthetic-source, synthetic-target" in _error_line(err)


def test_a_crash_while_writing_leaves_no_partial_dataset(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(data, "render_synthetic_split", crash)
    with pytest.raises(RuntimeError):
        load_dataset("synthetic-source", tmp_path, synthetic_train_size=60, synthetic_test_size=20)
    assert list(tmp_path.iterdir()) == []


def test_download_uses_official_url_and_skips_valid_data(copy_root, monkeypatch):
    calls = []
    monkeypatch.setattr(data, "download_and_extract_archive", lambda url, root, filename, md5: calls.append((url, md5)))
    with pytest.raises(DataError):  # the fake download wrote nothing into an empty root
        load_dataset("cifar10", copy_root / "empty", download=True)
    assert calls == [(CIFAR10.url, CIFAR10.tgz_md5)]

    (copy_root / "cifar-10-batches-py" / "SYNTHETIC.json").unlink()
    monkeypatch.setattr(data, "check_integrity", lambda path, md5=None: True)  # pretend official md5s
    arrays = load_dataset("cifar10", copy_root, download=True)
    assert len(calls) == 1 and not arrays.synthetic and arrays.train_x.shape[0] == N_TRAIN


def test_offline_download_is_one_clear_line(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(data, "download_and_extract_archive", offline)
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", tmp_path, download=True)
    assert "could not download" in _error_line(err) and str(tmp_path) in str(err.value)
    # the exact layout, not "place the archive there, extracted" (issue 32), and the offline alternative
    assert f"so that {tmp_path / 'cifar-10-batches-py'}/ holds data_batch_1, data_batch_2" in str(err.value)
    assert "test_batch, batches.meta" in str(err.value) and "data.dataset=fdsl32-target" in str(err.value)


def _offline(*args, **kwargs):
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


def test_corrupt_files_with_download_on_and_no_internet_get_the_checksum_message(tmp_path, monkeypatch):
    """The newcomer placed a broken cifar-10-batches-py/ and, with the reference default download = true,
    was told "could not download ... place the archive there": what they had just done."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(b"not the official file")
    monkeypatch.setattr(data, "download_and_extract_archive", _offline)
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", tmp_path, download=True)
    line = _error_line(err)
    assert line.startswith(f"{folder / 'data_batch_1'} fails the official md5 checksum (")
    assert "could not be downloaded" in line and f"delete {folder}" in line and "could not download" not in line


def test_offline_preparation_names_the_data_and_the_weights_in_one_message(tmp_path, monkeypatch):
    """The real study offline: both files it needs, where each goes, in the first message."""
    from freeze.pipeline.config import load_config
    from freeze.pipeline.distributed import WorkerContext
    from freeze.pipeline.prepare import load_data

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "experiments" / "configs" / "reference.toml", [f"data.root={tmp_path / 'data'}"])
    ctx = WorkerContext(
        rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend=None
    )
    monkeypatch.setattr(data, "download_and_extract_archive", _offline)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))  # no cached weights
    with pytest.raises(DataError) as err:
        load_data(cfg, ctx)
    line = _error_line(err)
    assert f"so that {tmp_path / 'data' / 'cifar-10-batches-py'}/ holds data_batch_1" in line
    weights = tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert "also needs the ImageNet weights of resnet18, not on this machine either: put resnet18-f37072fd.pth" in line
    assert f"at {weights}, or anywhere and pass model.weights=/path/to/resnet18-f37072fd.pth" in line
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"cached")  # where torchvision reads it from: the data is all that is missing
    with pytest.raises(DataError) as err:
        load_data(cfg, ctx)
    assert "ImageNet weights" not in _error_line(err)


# -------------------------------------------------------------------------------------- loaders
def _indexed_images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images whose label is their index, so a batch says which images it holds."""
    x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return x, torch.arange(n)


def _epoch(loader: TrainLoader, epoch: int, start_step: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch, start_step)
    return list(loader)


def test_train_loader_is_a_function_of_seed_and_epoch():
    x, y = _indexed_images(N_TRAIN)
    a, b = TrainLoader(x, y, 16, 0, 1, seed=1), TrainLoader(x, y, 16, 0, 1, seed=1)
    assert len(a) == N_TRAIN // 16
    _epoch(b, 5)  # iterating other epochs first leaves no hidden state behind
    e0, e0_again, e1 = _epoch(a, 0), _epoch(b, 0), _epoch(a, 1)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(e0, e0_again))
    assert not torch.equal(e0[0][1], e1[0][1])
    # the same images in another order must also be augmented differently in another epoch
    by_id0 = {int(i): img for xb, yb in e0 for i, img in zip(yb, xb)}
    by_id1 = {int(i): img for xb, yb in e1 for i, img in zip(yb, xb)}
    common = sorted(by_id0.keys() & by_id1.keys())
    assert sum(not torch.equal(by_id0[i], by_id1[i]) for i in common) > len(common) // 2
    tail = _epoch(a, 0, start_step=3)
    assert len(tail) == len(a) - 3 and all(torch.equal(p[0], q[0]) for p, q in zip(tail, e0[3:]))


@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_partition_the_single_process_global_batches(drop_last):
    x, y = _indexed_images(N_TRAIN)  # 200 = 12 x 16 + 8: the last global batch is partial
    world = 4
    single = _epoch(TrainLoader(x, y, 16, 0, 1, seed=2, drop_last=drop_last), 3)
    ranks = [_epoch(TrainLoader(x, y, 4, r, world, seed=2, drop_last=drop_last), 3) for r in range(world)]
    assert len(single) == (12 if drop_last else 13) and all(len(r) == len(single) for r in ranks)
    for step, (gx, gy) in enumerate(single):
        assert torch.equal(torch.cat([r[step][0] for r in ranks]), gx)
        assert torch.equal(torch.cat([r[step][1] for r in ranks]), gy)
    seen = torch.cat([yb for r in ranks for _, yb in r])
    assert seen.unique().numel() == seen.numel() == (192 if drop_last else N_TRAIN)


def test_without_augmentation_batches_are_the_normalized_images():
    x, y = _indexed_images(64)
    (xb, yb), *_ = _epoch(TrainLoader(x, y, 32, 0, 1, seed=0, augment=parse_augment("none")), 0)
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    assert xb.dtype == torch.float32 and yb.dtype == torch.int64
    assert torch.equal(xb, normalize_uint8(x[yb]))
    assert torch.allclose(xb.double(), (x[yb].double() / 255 - mean.double()) / std.double(), atol=1e-5)


def test_augmentation_is_a_padded_crop_with_optional_flip():
    x, y = _indexed_images(32)
    (xb, yb), *_ = _epoch(TrainLoader(x, y, 32, 0, 1, seed=0), 0)
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    shifts = set()
    for out, i in zip(xb[:8], yb[:8]):
        matches = [
            (dy, dx, flip)
            for dy in range(9)
            for dx in range(9)
            for flip in (False, True)
            if torch.equal(
                out,
                normalize_uint8(
                    (lambda c: c.flip(-1) if flip else c)(padded[i : i + 1, :, dy : dy + 32, dx : dx + 32])
                )[0],
            )
        ]
        assert len(matches) == 1
        shifts.add(matches[0])
    assert len(shifts) > 1


def test_loader_arguments_are_validated():
    x, y = _indexed_images(20)
    with pytest.raises(DataError, match="rank must be in 0..1"):
        TrainLoader(x, y, 4, 2, 2, seed=0)
    with pytest.raises(DataError, match="fewer than one global batch"):
        TrainLoader(x, y, 16, 0, 2, seed=0)
    with pytest.raises(DataError, match="uint8"):
        EvalLoader(x.float(), y, 4, 0, 1)


def test_eval_loader_covers_every_sample_once_across_ranks():
    x, y = _indexed_images(203)
    shards = [list(EvalLoader(x, y, 16, r, 4)) for r in range(4)]
    seen = torch.cat([yb for shard in shards for _, yb in shard])
    assert sorted(seen.tolist()) == list(range(203))
    for shard in shards:
        for xb, yb in shard:
            assert torch.equal(xb, normalize_uint8(x[yb]))


# ------------------------------------------------------------------------------------ splitting
def _arrays_with_ids(labels: list[int]) -> CifarArrays:
    n = len(labels)
    x = torch.zeros(n, 3, 32, 32, dtype=torch.uint8)
    x[:, 0, 0, 0] = torch.arange(n) % 256  # the pixel pair encodes the image's index
    x[:, 0, 0, 1] = torch.arange(n) // 256
    test_x = torch.zeros(40, 3, 32, 32, dtype=torch.uint8)
    test_x[:, 0, 0, 0] = torch.arange(40)
    return CifarArrays(x, torch.tensor(labels), test_x, torch.arange(40) % 10, tuple("abcdefghij"), True)


def _ids(x: torch.Tensor) -> list[int]:
    return (x[:, 0, 0, 0].long() + 256 * x[:, 0, 0, 1].long()).tolist()


def test_split_validation_is_disjoint_stratified_and_deterministic():
    labels = [0] * 100 + [1] * 50 + [2] * 50 + list(range(3, 10)) * 20  # uneven class sizes, 340 images
    arrays = _arrays_with_ids(labels)
    split = split_validation(arrays, val_size=34, seed=0)
    train_ids, val_ids = _ids(split.train_x), _ids(split.val_x)
    assert not set(train_ids) & set(val_ids) and sorted(train_ids + val_ids) == list(range(len(labels)))
    assert torch.bincount(split.val_y, minlength=10).tolist() == [10, 5, 5, 2, 2, 2, 2, 2, 2, 2]
    assert torch.equal(arrays.train_y[_ids(split.val_x)], split.val_y)
    again, other = split_validation(arrays, 34, seed=0), split_validation(arrays, 34, seed=1)
    assert _ids(again.val_x) == val_ids and _ids(other.val_x) != val_ids

    small = split_validation(arrays, 34, seed=0, train_size=100, test_size=15)
    assert _ids(small.train_x) == train_ids[:100] and _ids(small.val_x) == val_ids
    assert small.test_x.shape[0] == 15 and len(set(small.test_x[:, 0, 0, 0].tolist())) == 15
    with pytest.raises(DataError, match="data.val_size"):
        split_validation(arrays, 340, seed=0)


def test_split_carries_the_class_list_even_when_a_class_has_no_image():
    arrays = _arrays_with_ids([0, 1, 2] * 20)  # classes 3..9 have no training image
    split = split_validation(arrays, val_size=6, seed=0, test_size=3)
    assert split.classes == tuple("abcdefghij")
    assert split.num_classes == 10  # the head covers every class, not max label + 1


def _keyed_epoch(loader: TrainLoader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return list(loader.iter_keyed())


def test_fixed_views_are_keyed_and_the_same_in_every_epoch_rank_and_world_size():
    x, y = _indexed_images(48)
    views = 3
    single = TrainLoader(x, y, 8, 0, 1, seed=4, augment=parse_augment(f"views:{views}"))
    seen: dict[int, torch.Tensor] = {}
    for epoch in range(4):
        batches = _keyed_epoch(single, epoch)
        keys = torch.cat([k for _, _, k in batches])
        assert torch.equal(keys, single.epoch_keys(epoch))  # the cache knows every epoch's keys in advance
        assert sorted((keys // views).tolist()) == list(range(48))  # one view of every sample per epoch
        for xb, yb, kb in batches:
            assert torch.equal(yb, kb // views) and torch.equal(xb, single.images(kb))
            for key, img in zip(kb.tolist(), xb):
                assert key not in seen or torch.equal(seen[key], img)  # a key is always the same image
                seen[key] = img
    assert len(seen) > 48  # several views per sample were drawn over the epochs
    by_sample = {}
    for key, img in seen.items():
        by_sample.setdefault(key // views, []).append(img)
    assert all(img.shape == (3, 32, 32) for img in seen.values())
    assert any(not torch.equal(a, b) for imgs in by_sample.values() for a in imgs for b in imgs)  # views differ
    ranks = [
        _keyed_epoch(TrainLoader(x, y, 4, r, 2, seed=4, augment=parse_augment(f"views:{views}")), 2) for r in range(2)
    ]
    for step, (gx, _, gk) in enumerate(_keyed_epoch(single, 2)):
        assert torch.equal(torch.cat([r[step][2] for r in ranks]), gk)
        assert torch.equal(torch.cat([r[step][0] for r in ranks]), gx)


def test_keys_without_augmentation_are_the_samples_and_crop_flip_has_none():
    x, y = _indexed_images(32)
    (xb, yb, kb), *_ = _keyed_epoch(TrainLoader(x, y, 16, 0, 1, seed=0, augment=parse_augment("none")), 1)
    assert torch.equal(kb, yb) and torch.equal(xb, normalize_uint8(x[kb]))
    (_, _, none_keys), *_ = _keyed_epoch(TrainLoader(x, y, 16, 0, 1, seed=0, augment=parse_augment("crop-flip")), 1)
    assert none_keys is None
