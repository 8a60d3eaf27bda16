"""CIFAR-10 in its official python format, a synthetic stand-in written in that same format, and
in-memory loaders that keep the whole dataset on the training device.

Layout read and written: ``<root>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``,
each a pickle dict (``b'data'`` uint8 [n, 3072] channel-planar RGB, ``b'labels'``, ...). Everything
goes through the same reader, so the real and the offline pipelines differ only in where the bytes
came from. The files are pickles, and a crafted pickle runs code when loaded: they are read with an
unpickler that admits only what the official format holds (:class:`_CifarUnpickler`), and the
official md5 checksums are checked whenever the config says ``data.dataset = "cifar10"``. Nothing in
the data directory can switch either off: the ``SYNTHETIC.json`` beside generated data records its
generator version, nothing more.

Loaders: one permutation of the GLOBAL dataset per epoch, seeded by (seed, epoch); rank r takes its
contiguous slice of every global batch, and crop/flip parameters are drawn per global position (or,
for ``views:V``, per sample: see freeze.pipeline.augment), so 1 process with batch G sees exactly
the batches that W processes with batch G/W see together.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import check_integrity, download_and_extract_archive

from freeze.cache import CacheSource
from freeze.pipeline.augment import PAD, FixedViews, crop_flip
from freeze.pipeline.config import CROP_FLIP, Augment
from freeze.pipeline.datasets import fdsl, planted
from freeze.pipeline.datasets.fdsl import render_fdsl_split
from freeze.pipeline.datasets.images import normalize_uint8
from freeze.pipeline.datasets.synthetic import SYNTHETIC_VERSION, render_synthetic_split, synthetic_class_names
from freeze.pipeline.datasets.synthetic import TASKS as SYNTHETIC_TASKS
from freeze.pipeline.registry import registration

CIFAR10_FOLDER = CIFAR10.base_folder
NUM_CLASSES = 10  # of the official CIFAR-10; generated data may hold more (FDSL-32's source: 128)
IMAGE_BYTES = 3 * 32 * 32
SYNTHETIC_MARKER = "SYNTHETIC.json"


@dataclass(frozen=True)
class Generator:
    """A family of generated tasks: ``render(task, n, seed, split)`` -> (uint8 images, labels)."""

    render: object
    class_names: object
    version: int
    tasks: tuple[str, ...]


# data.dataset = "<family>-<task>". "synthetic" is the original pair (freeze.pipeline.datasets.synthetic),
# kept by name for comparison; "fdsl32" is the formula-driven substrate (freeze.pipeline.datasets.fdsl).
# The renderers are looked up when called (through this module's globals), so a test can replace one.
GENERATORS = {
    "synthetic": Generator(
        lambda *a, **k: render_synthetic_split(*a, **k), synthetic_class_names, SYNTHETIC_VERSION, SYNTHETIC_TASKS
    ),
    "fdsl32": Generator(lambda *a, **k: render_fdsl_split(*a, **k), fdsl.class_names, fdsl.FDSL_VERSION, fdsl.TASKS),
    # labels planted in the committed FDSL-32 weights' depth-d features (optimal boundary d known)
    "planted": Generator(
        lambda *a, **k: planted.render_planted_split(*a, **k),
        planted.planted_class_names,
        planted.PLANTED_VERSION,
        planted.TASKS,
    ),
}
DATASET_NAMES = ("cifar10", *(f"{family}-{task}" for family, g in GENERATORS.items() for task in g.tasks))
_TRAIN_FILES = tuple((name, md5) for name, md5 in CIFAR10.train_list)
_TEST_FILES = tuple((name, md5) for name, md5 in CIFAR10.test_list)
_META_FILE = (CIFAR10.meta["filename"], CIFAR10.meta["md5"])


class DataError(Exception):
    """A dataset problem, as one line that names the file and what to do about it."""


class DownloadError(DataError):
    """The official data could not be fetched (offline, or a broken archive): the caller may add what
    else the run needs from the internet, so that an offline user learns every file in one message."""


@dataclass(frozen=True, eq=False)
class CifarArrays:
    train_x: torch.Tensor  # uint8 [N, 3, 32, 32]
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: tuple[str, ...]
    synthetic: bool


@dataclass(frozen=True, eq=False)
class DataSplit:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: tuple[str, ...]  # the dataset's class names; label i is classes[i]

    @property
    def num_classes(self) -> int:
        """Size of the classification head: every class of the dataset, whether or not a (small)
        split happens to contain an image of it."""
        return len(self.classes)


# --------------------------------------------------------------------------------------- reading
def _redo(path: Path, synthetic: bool) -> str:
    """What to do about a bad file: synthetic data is regenerated, official data downloaded again."""
    return f"delete {path.parent.parent} and it is regenerated" if synthetic else "delete it and download again"


class _NotCifar(pickle.UnpicklingError):
    """The pickle asks for something the official format never holds."""


def _uint8_dtype(name, align=False, copy=False) -> np.dtype:
    dtype = np.dtype(name, align, copy)
    if dtype != np.uint8:
        raise _NotCifar(f"an array of dtype {dtype} (the official format holds uint8 images only)")
    return dtype


def _ndarray(subtype, shape, code) -> np.ndarray:
    if subtype is not np.ndarray:
        raise _NotCifar(f"an array of type {getattr(subtype, '__name__', subtype)!r}")
    # An empty array, whatever shape the file claims (a crafted one could claim terabytes):
    # __setstate__ then sets dtype, shape and bytes, and refuses bytes that do not fill the shape.
    return np.ndarray.__new__(np.ndarray, (0,), np.uint8)


class _CifarUnpickler(pickle.Unpickler):
    """Admits what the official files hold and nothing else: dicts, bytes and str keys, lists of ints
    and bytes, and uint8 numpy arrays. An array pickle names three globals (numpy's ``_reconstruct``
    under its numpy 1 and numpy 2 module names, ``ndarray`` and ``dtype``); they are replaced by
    versions that build only a plain uint8 array. Any other global, the way a crafted pickle reaches
    code (``os.system``, ``builtins.exec``), is refused before it is looked up, as the "Restricting
    Globals" recipe of Python's pickle documentation does."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _ndarray,
        ("numpy._core.multiarray", "_reconstruct"): _ndarray,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): _uint8_dtype,
    }

    def find_class(self, module: str, name: str):
        allowed = self._ALLOWED.get((module, name))
        if allowed is None:
            raise _NotCifar(f"global {module}.{name}, which is not part of the CIFAR-10 format")
        return allowed


def _load_pickle(path: Path, synthetic: bool) -> dict:
    redo = _redo(path, synthetic)
    try:
        with open(path, "rb") as f:
            # encoding="bytes" is what the official Python 3 snippet uses: keys come back as b'data'.
            obj = _CifarUnpickler(f, encoding="bytes").load()
    except FileNotFoundError:
        raise DataError(f"{path} is missing: run with data.download=true or place the official archive there") from None
    except _NotCifar as exc:
        raise DataError(f"{path} is not a CIFAR-10 batch file: it asks for {exc}; refused without loading it") from None
    except Exception as exc:  # truncated files raise EOFError, garbage raises UnpicklingError/ValueError/...
        raise DataError(f"{path} is truncated or corrupt (pickle error: {type(exc).__name__}): {redo}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a {type(obj).__name__}, not the official pickle dict: {redo}")
    return obj


def _read_batch(path: Path, synthetic: bool, num_classes: int = NUM_CLASSES) -> tuple[np.ndarray, np.ndarray]:
    batch = _load_pickle(path, synthetic)
    missing = [k.decode() for k in (b"data", b"labels") if k not in batch]
    if missing:
        raise DataError(f"{path} lacks the key(s) {missing}: it is not an official CIFAR-10 batch file")
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != IMAGE_BYTES:
        shape = getattr(data, "shape", None)
        raise DataError(
            f"{path}: b'data' must be a uint8 array of shape [n, {IMAGE_BYTES}], got {shape}: {_redo(path, synthetic)}"
        )
    try:
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (TypeError, ValueError):
        raise DataError(f"{path}: b'labels' must be a list of integers 0..9: {_redo(path, synthetic)}") from None
    if labels.shape != (data.shape[0],):
        raise DataError(f"{path}: {labels.size} labels for {data.shape[0]} images: {_redo(path, synthetic)}")
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.size:
        raise DataError(f"{path}: label {int(bad[0])} is outside 0..{num_classes - 1}: {_redo(path, synthetic)}")
    return data, labels


def _read_classes(path: Path, synthetic: bool) -> tuple[str, ...]:
    """The class names; official data has exactly 10, generated data 2 or more (the labels' range)."""
    meta = _load_pickle(path, synthetic)
    names = meta.get(b"label_names")
    if not synthetic and (not isinstance(names, list) or len(names) != NUM_CLASSES):
        raise DataError(f"{path}: b'label_names' must be a list of {NUM_CLASSES} class names")
    if synthetic and (not isinstance(names, list) or len(names) < 2):
        raise DataError(f"{path}: b'label_names' must be a list of at least 2 class names: {_redo(path, synthetic)}")
    return tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)


def _to_tensors(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    x = np.concatenate([p[0] for p in parts]).reshape(-1, 3, 32, 32)
    y = np.concatenate([p[1] for p in parts])
    return torch.from_numpy(x), torch.from_numpy(y)


def read_cifar10(root: str | Path, synthetic: bool = False) -> CifarArrays:
    """Read ``<root>/cifar-10-batches-py``. Official data (``synthetic=False``, the config's
    ``data.dataset = "cifar10"``) must match torchvision's md5 sums; data this pipeline generated
    (``synthetic=True``) has none to match. Every file goes through :class:`_CifarUnpickler`."""
    folder = Path(root) / CIFAR10_FOLDER
    if not folder.is_dir():
        raise DataError(f"{folder} is missing: run with data.download=true or place the official archive there")
    for name, md5 in _TRAIN_FILES + _TEST_FILES + (_META_FILE,):
        path = folder / name
        if not path.is_file() and synthetic:
            raise DataError(f"{path} is missing: {_redo(path, synthetic)}")
        if not path.is_file():
            raise DataError(f"{path} is missing: run with data.download=true or place the official archive there")
        if not synthetic and not check_integrity(str(path), md5):
            hint = ""
            if (folder / SYNTHETIC_MARKER).is_file():
                hint = (
                    " (this folder holds generated data: set data.dataset to the generator's name, e.g. fdsl32-target)"
                )
            raise DataError(f"{path} fails the official md5 checksum ({md5}): delete it and download again{hint}")
    classes = _read_classes(folder / _META_FILE[0], synthetic)
    train_x, train_y = _to_tensors([_read_batch(folder / n, synthetic, len(classes)) for n, _ in _TRAIN_FILES])
    test_x, test_y = _to_tensors([_read_batch(folder / n, synthetic, len(classes)) for n, _ in _TEST_FILES])
    return CifarArrays(train_x, train_y, test_x, test_y, classes, synthetic)


def _official_files_valid(folder: Path) -> bool:
    return all(check_integrity(str(folder / n), md5) for n, md5 in _TRAIN_FILES + _TEST_FILES + (_META_FILE,))


def cifar10_layout(root: str | Path) -> str:
    """Where the official files go, as a user who fetched the archive elsewhere must lay them out."""
    folder = Path(root) / CIFAR10_FOLDER
    names = [n for n, _ in _TRAIN_FILES + _TEST_FILES + (_META_FILE,)]
    return f"extract {CIFAR10.filename} ({CIFAR10.url}) into {root}, so that {folder}/ holds {', '.join(names)}"


def _first_bad_file(folder: Path) -> tuple[Path, str] | None:
    """The first official file under ``folder`` that is present but fails its md5 (path, md5), if any."""
    for name, md5 in _TRAIN_FILES + _TEST_FILES + (_META_FILE,):
        if (folder / name).is_file() and not check_integrity(str(folder / name), md5):
            return folder / name, md5
    return None


def download_cifar10(root: str | Path) -> None:
    """Fetch and extract the official archive into ``root`` unless a valid copy is already there."""
    root = Path(root)
    if _official_files_valid(root / CIFAR10_FOLDER):
        return
    try:
        download_and_extract_archive(CIFAR10.url, str(root), filename=CIFAR10.filename, md5=CIFAR10.tgz_md5)
    except Exception as exc:  # offline: URLError/OSError; bad archive: RuntimeError
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # Files that are there but wrong are the problem to name: "could not download" told a user
        # who had placed them to place them (issue 32).
        if (bad := _first_bad_file(root / CIFAR10_FOLDER)) is not None:
            raise DataError(
                f"{bad[0]} fails the official md5 checksum ({bad[1]}) and a fresh copy could not be downloaded "
                f"({reason}): delete {root / CIFAR10_FOLDER} and {cifar10_layout(root)}"
            ) from None
        raise DownloadError(
            f"could not download {CIFAR10.url} into {root} ({reason}): {cifar10_layout(root)}; "
            "or train on generated data, e.g. data.dataset=fdsl32-target"
        ) from None


# --------------------------------------------------------------------------------------- writing
class _Py2StrPickler(pickle._Pickler):  # the pure-Python pickler: its dispatch table is open
    """Protocol 2 with ``bytes`` written as Python 2 ``str`` opcodes, as in the official files, so
    ``encoding="bytes"`` readers get ``b'data'`` and ``encoding="latin1"`` ones (torchvision) ``'data'``."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_bytes(self, obj: bytes) -> None:
        size = len(obj)
        header = pickle.SHORT_BINSTRING + bytes([size]) if size < 256 else pickle.BINSTRING + size.to_bytes(4, "little")
        self.write(header + obj)
        self.memoize(obj)

    dispatch[bytes] = save_bytes


def _dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        _Py2StrPickler(f, protocol=2).dump(obj)


def write_synthetic_cifar(
    root: str | Path, task: str, n_train: int, n_test: int, seed: int, family: str = "synthetic"
) -> Path:
    """Write a generated task in the official layout under ``<root>/cifar-10-batches-py``; returns
    that folder. ``family``: a key of :data:`GENERATORS` ("synthetic": the original pair, "fdsl32":
    the formula-driven substrate); ``task``: "source" or "target" (different classes of one generator).
    Labels run over all the task's classes (FDSL-32's source has 128; b'label_names' lists them)."""
    for field, value, low in (("n_train", n_train, 5), ("n_test", n_test, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or value < low:
            raise DataError(f"synthetic {field} must be an integer >= {low}, got {value!r}")
    if family not in GENERATORS:
        raise DataError(f"generator family must be one of {', '.join(GENERATORS)}, got {family!r}")
    generator = GENERATORS[family]
    if task not in generator.tasks:
        raise DataError(f"{family} task must be one of {', '.join(generator.tasks)}, got {task!r}")
    names = generator.class_names(task)
    folder = Path(root) / CIFAR10_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    train_x, train_y = generator.render(task, n_train, seed, split="train")
    test_x, test_y = generator.render(task, n_test, seed, split="test")
    flat = train_x.reshape(n_train, IMAGE_BYTES)
    for i, idx in enumerate(np.array_split(np.arange(n_train), len(_TRAIN_FILES))):
        _dump(
            folder / _TRAIN_FILES[i][0],
            {
                b"batch_label": f"training batch {i + 1} of {len(_TRAIN_FILES)}".encode(),
                b"labels": train_y[idx].tolist(),
                b"data": flat[idx],
                b"filenames": [f"{family}_{task}_{j:06d}.png".encode() for j in idx],
            },
        )
    _dump(
        folder / _TEST_FILES[0][0],
        {
            b"batch_label": b"testing batch 1 of 1",
            b"labels": test_y.tolist(),
            b"data": test_x.reshape(n_test, IMAGE_BYTES),
            b"filenames": [f"{family}_{task}_test_{j:06d}.png".encode() for j in range(n_test)],
        },
    )
    _dump(
        folder / _META_FILE[0],
        {
            b"num_cases_per_batch": int(np.ceil(n_train / len(_TRAIN_FILES))),
            b"label_names": [n.encode() for n in names],
            b"num_vis": IMAGE_BYTES,
            b"synthetic": True,
        },
    )
    marker = {"task": task, "n_train": n_train, "n_test": n_test, "seed": seed, "version": generator.version}
    if family != "synthetic":  # the original pair's marker stays as it was, so its folders stay valid
        marker["generator"] = family
    (folder / SYNTHETIC_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return folder


def _synthetic_root(root: Path, task: str, n_train: int, n_test: int, seed: int, family: str = "synthetic") -> Path:
    target = root / f"{family}-{task}-n{n_train}-{n_test}-s{seed}"
    version_now = GENERATORS[family].version
    if not (target / CIFAR10_FOLDER).is_dir():
        # Written in a temp dir and renamed, so a crash never leaves a half-written dataset and
        # concurrent ranks race harmlessly: the first rename wins, the others discard their copy.
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=root))
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise DataError(f"cannot write a synthetic dataset under {root} ({reason}): choose another root") from None
        try:
            write_synthetic_cifar(tmp, task, n_train, n_test, seed, family)
            tmp.chmod(0o755)  # mkdtemp makes it private; the dataset is not
            os.rename(tmp, target)
        except OSError as exc:
            if not (target / CIFAR10_FOLDER).is_dir():
                raise DataError(f"cannot write {target} ({exc.strerror}): choose a writable data root") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    marker = target / CIFAR10_FOLDER / SYNTHETIC_MARKER
    try:
        version = json.loads(marker.read_text()).get("version")
    except (OSError, ValueError):
        raise DataError(f"{marker} is missing or unreadable: delete {target} and it is regenerated") from None
    if version != version_now:
        raise DataError(f"{target} was written by {family} generator v{version}, this is v{version_now}: delete it")
    return target


def load_dataset(
    name: str,
    root: str | Path,
    download: bool = False,
    synthetic_train_size: int = 20000,
    synthetic_test_size: int = 4000,
    synthetic_seed: int = 0,
) -> CifarArrays:
    """``name``: "cifar10" (official files under ``root``), "<family>-<task>" of a generator
    (:data:`GENERATORS`: "fdsl32-source"/"fdsl32-target", the original "synthetic-source"/
    "synthetic-target"), generated once under ``root``, then read by the same reader, or a name a
    plugin registered (:func:`register_dataset`)."""
    root = Path(root)
    check_dataset(name)  # one line for a name neither this pipeline's nor registered
    if name == "cifar10":
        if download:
            download_cifar10(root)
        return read_cifar10(root)
    if name in DATASETS:
        return _registered_arrays(name, root)
    family, task = name.rsplit("-", 1)
    folder = _synthetic_root(root, task, synthetic_train_size, synthetic_test_size, synthetic_seed, family)
    return read_cifar10(folder, synthetic=True)


# ------------------------------------------------------------------------------------- your own data
# name -> builder(root: Path) -> ImageArrays; filled by @register_dataset in a plugin module
DATASETS: dict[str, Callable[[Path], ImageArrays]] = {}


@dataclass(frozen=True, eq=False)
class ImageArrays:
    """What a registered dataset's builder returns: the whole training and test sets in memory, as the
    pipeline holds CIFAR-10 (the validation split, sharding, augmentation and the cache are its own)."""

    train_x: torch.Tensor  # uint8 [N, 3, H, W]
    train_y: torch.Tensor  # integer class indices [N], 0 .. len(classes) - 1
    test_x: torch.Tensor  # uint8 [M, 3, H, W]
    test_y: torch.Tensor
    classes: tuple[str, ...]


def register_dataset(name: str) -> Callable[[Callable[[Path], ImageArrays]], Callable[[Path], ImageArrays]]:
    """Decorator: make ``builder(root) -> ImageArrays`` a ``data.dataset`` the pipeline accepts by name
    (``root`` is ``data.root``: where the builder may keep its files). Import the module through the
    config's ``[plugins] modules`` (or an entry point) so that runs, sweeps and studies know the name.

    Raises:
        DataError: the name is empty, one of this pipeline's own, or another builder's.
    """
    return registration(
        "register_dataset", name, DATASETS, lambda: DATASET_NAMES, "one of this pipeline's datasets", DataError
    )


def check_dataset(name: str) -> None:
    """DataError (one line naming data.dataset and what is accepted) for a name neither this
    pipeline's nor registered (:func:`register_dataset`)."""
    if name in DATASET_NAMES or name in DATASETS:
        return
    own = f", or your own: {', '.join(sorted(DATASETS))}" if DATASETS else ""
    raise DataError(
        f"data.dataset: {name!r} is not accepted; accepted: {', '.join(DATASET_NAMES)}{own} (a dataset of your own: "
        "@register_dataset in a module [plugins] modules names, docs/policies.md)"
    )


def _registered_arrays(name: str, root: Path) -> CifarArrays:
    """The registered builder's arrays, checked once, as the pipeline's readers return theirs."""
    arrays = DATASETS[name](root)
    if not isinstance(arrays, ImageArrays):
        raise DataError(f"data.dataset {name!r}: its builder returned {type(arrays).__name__}; accepted: ImageArrays")
    classes = tuple(str(c) for c in arrays.classes)
    for part, (x, y) in {"train": (arrays.train_x, arrays.train_y), "test": (arrays.test_x, arrays.test_y)}.items():
        try:
            _check_images(x, y)
        except DataError as err:
            raise DataError(f"data.dataset {name!r}, {part} set: {err}") from None
        if y.dtype.is_floating_point or y.numel() == 0 or int(y.min()) < 0 or int(y.max()) >= len(classes):
            raise DataError(
                f"data.dataset {name!r}, {part} set: labels must be integers in 0..{len(classes) - 1} "
                f"(one per class name), with at least one image"
            )
    return CifarArrays(
        arrays.train_x, arrays.train_y.long(), arrays.test_x, arrays.test_y.long(), classes, synthetic=False
    )


CIFAR10_TRAIN_IMAGES = 50_000  # the official training set (data_batch_1..5)


def planned_train_images(data_cfg) -> int | None:
    """The training images a run will see, from its ``data`` config alone (the generated datasets
    have data.synthetic_train_size, CIFAR-10 its official count, less the validation split, capped
    by data.train_size): what a launcher checks a run's length with before any data is read. None
    for a dataset whose size only reading it tells."""
    if data_cfg.dataset == "cifar10":
        available = CIFAR10_TRAIN_IMAGES
    elif data_cfg.dataset in DATASET_NAMES:
        available = data_cfg.synthetic_train_size
    else:
        return None
    remaining = available - data_cfg.val_size
    if remaining <= 0:
        return None  # the split refuses this data.val_size in its own words when the run reads the data
    return min(data_cfg.train_size, remaining) if data_cfg.train_size else remaining


def optimizer_steps_per_epoch(train_cfg, batches_per_epoch: int) -> int:
    """Optimizer steps in an epoch of ``batches_per_epoch`` batches per worker, under ``train_cfg``'s
    accumulation, step cap and budget (0 when accumulation leaves none): what a worker trains and
    what a launcher plans with (:func:`planned_steps_per_epoch`)."""
    steps_per_epoch = batches_per_epoch // train_cfg.accumulate_steps
    if train_cfg.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, train_cfg.max_steps_per_epoch)
    if train_cfg.budget_fraction < 1.0 and steps_per_epoch >= 1:
        # The same epochs and evaluations, each epoch a random fraction of its batches (the head of
        # the epoch's shuffled order), and the schedule over the shorter run: a warm-up given in
        # epochs shrinks with it and a decaying schedule still decays to its end.
        steps_per_epoch = max(1, round(steps_per_epoch * train_cfg.budget_fraction))
    return steps_per_epoch


def planned_steps_per_epoch(cfg) -> int | None:
    """The optimizer steps per epoch a run of ``cfg`` will take, from the config alone, at the world
    size its launcher starts (dist.nproc workers on each emulated node, or on this machine); None
    when the dataset's size is known only once read. A multi-node SLURM or torchrun run has more
    workers, so fewer steps: its workers check again with the real count."""
    images = planned_train_images(cfg.data)
    if images is None:
        return None
    world_size = cfg.dist.nproc * max(cfg.cluster.nodes, 1)
    return optimizer_steps_per_epoch(cfg.train, images // (cfg.train.batch_size * world_size))


# ------------------------------------------------------------------------------------- splitting
def _stratified_counts(labels: torch.Tensor, total: int, num_classes: int = NUM_CLASSES) -> torch.Tensor:
    """Per-class counts summing to ``total``, proportional to class frequency (largest remainder)."""
    freq = torch.bincount(labels, minlength=num_classes).double()
    exact = freq * total / freq.sum()
    counts = exact.floor().long()
    remainder_order = torch.argsort(exact - counts, descending=True, stable=True)
    counts[remainder_order[: total - int(counts.sum())]] += 1
    return counts


def split_validation(
    arrays: CifarArrays, val_size: int, seed: int, train_size: int = 0, test_size: int = 0
) -> DataSplit:
    """Hold out a stratified validation set of ``val_size`` training images. ``train_size`` and
    ``test_size``: 0 keeps all, N keeps the first N after a shuffle seeded by ``seed``."""
    n_train = arrays.train_y.numel()
    if not 0 <= val_size < n_train:
        raise DataError(f"data.val_size must be in 0..{n_train - 1} (training images available), got {val_size}")
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_train, generator=gen)
    num_classes = max(len(arrays.classes), int(arrays.train_y.max()) + 1)
    counts = _stratified_counts(arrays.train_y, val_size, num_classes)
    shuffled_y = arrays.train_y[order]
    # rank of each shuffled image within its own class: the first counts[c] of class c go to val
    rank_in_class = torch.zeros(n_train, dtype=torch.long)
    for c in range(num_classes):
        in_c = shuffled_y == c
        rank_in_class[in_c] = torch.arange(int(in_c.sum()))
    is_val = rank_in_class < counts[shuffled_y]
    val_idx, train_idx = order[is_val], order[~is_val]
    if train_size:
        if not 0 < train_size <= train_idx.numel():
            raise DataError(f"data.train_size must be 0 (all) or 1..{train_idx.numel()}, got {train_size}")
        train_idx = train_idx[:train_size]
    n_test = arrays.test_y.numel()
    test_idx = torch.arange(n_test)
    if test_size:
        if not 0 < test_size <= n_test:
            raise DataError(f"data.test_size must be 0 (all) or 1..{n_test}, got {test_size}")
        test_idx = torch.randperm(n_test, generator=gen)[:test_size]
    x, y = arrays.train_x, arrays.train_y
    test_x, test_y = arrays.test_x[test_idx], arrays.test_y[test_idx]
    return DataSplit(x[train_idx], y[train_idx], x[val_idx], y[val_idx], test_x, test_y, arrays.classes)


# --------------------------------------------------------------------------------------- loading
def _check_shard_args(batch_size: int, rank: int, world_size: int) -> None:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"batch_size must be a positive integer (per rank), got {batch_size!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise DataError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise DataError(f"rank must be in 0..{world_size - 1}, got {rank!r}")


def _check_images(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[1] != 3:
        raise DataError(f"images must be a uint8 tensor [N, 3, H, W], got {x.dtype} {tuple(x.shape)}")
    if y.shape != (x.shape[0],):
        raise DataError(f"labels must be a tensor [{x.shape[0]}], got {tuple(y.shape)}")


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The CPU generator of one epoch: a pure function of (seed, epoch), so resume needs no RNG state."""
    if seed < 0 or epoch < 0:
        raise DataError(f"seed and epoch must be >= 0, got seed={seed} epoch={epoch}")
    mixed = np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed))


class TrainLoader:
    """Shuffled, augmented batches of this rank's slice of every global batch (see module doc).

    ``len(loader)`` is the number of steps in a full epoch; after ``set_epoch(e, start_step=s)`` an
    iteration yields steps s..len-1 of epoch e. With ``drop_last=False`` the last, partial global
    batch is split into ``world_size`` near-equal parts (dropped if smaller than ``world_size``).

    ``augment``: the config's parsed ``data.augment`` (crop-flip, views:V or none). Iterating
    yields ``(x, y)``; :meth:`iter_keyed` yields ``(x, y, keys)``, where a key
    identifies the exact input (``sample * V + view``; None under crop-flip, whose inputs never repeat),
    and :meth:`cache_source` hands those keys' inputs to the activation cache."""

    pad = PAD

    def __init__(
        self,
        x_uint8: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        augment: Augment = CROP_FLIP,
        device: str | torch.device = "cpu",
        drop_last: bool = True,
    ) -> None:
        _check_images(x_uint8, y)
        _check_shard_args(batch_size, rank, world_size)
        self.device = torch.device(device)
        self.x = x_uint8.to(self.device)
        self.y = y.to(self.device, torch.int64)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.global_batch_size = batch_size * world_size
        self.seed, self.drop_last = seed, drop_last
        self.augment = augment
        n = self.x.shape[0]
        # Fixed views are seeded by the data seed alone: they must not change with the epoch.
        self.views = FixedViews(n, self.augment.views, seed, self.pad) if self.augment.kind == "views" else None
        full, partial = divmod(n, self.global_batch_size)
        self.steps_per_epoch = full + int(not drop_last and partial >= world_size)
        if self.steps_per_epoch == 0:
            raise DataError(f"{n} training images are fewer than one global batch ({batch_size} x {world_size} ranks)")
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        if not 0 <= start_step <= self.steps_per_epoch:
            raise DataError(f"start_step must be in 0..{self.steps_per_epoch}, got {start_step}")
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def num_keys(self) -> int:
        return self.x.shape[0] * self.augment.views

    def _rank_slice(self, step: int) -> slice:
        begin = step * self.global_batch_size
        length = min(self.global_batch_size, self.x.shape[0] - begin)
        if length == self.global_batch_size:
            return slice(begin + self.rank * self.batch_size, begin + (self.rank + 1) * self.batch_size)
        bounds = [begin + length * r // self.world_size for r in range(self.world_size + 1)]
        return slice(bounds[self.rank], bounds[self.rank + 1])

    def _epoch_keys_by_position(self, epoch: int, gen: torch.Generator) -> torch.Tensor:
        """The key at every global position of ``epoch`` (after the permutation was drawn)."""
        perm = torch.randperm(self.x.shape[0], generator=gen)
        if self.views is None:
            return perm
        return perm * self.augment.views + self.views.epoch_views(epoch)[perm]

    def images(self, keys: torch.Tensor) -> torch.Tensor:
        """Normalized float inputs of ``keys`` (not under crop-flip, whose inputs have no key)."""
        if not self.augment.finite:
            raise DataError("data.augment: crop-flip draws a new view every epoch; its inputs have no key")
        keys = keys.to(self.device)
        if self.views is None:
            return normalize_uint8(self.x[keys])
        return normalize_uint8(self.views.images(self.x, keys))

    def epoch_keys(self, epoch: int) -> torch.Tensor:
        """Every key read in ``epoch`` (all ranks together), in global order."""
        keys = self._epoch_keys_by_position(epoch, epoch_generator(self.seed, epoch))
        return keys[: min(self.steps_per_epoch * self.global_batch_size, keys.numel())]

    def cache_source(self) -> CacheSource:
        """What the activation cache needs to build its entries (keys -> inputs, which keys each epoch reads)."""
        return CacheSource(
            inputs=self.images,
            num_keys=self.num_keys,
            epoch_keys=self.epoch_keys,
        )

    def iter_keyed(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Like iterating, with each batch's keys (None under crop-flip)."""
        n = self.x.shape[0]
        gen = epoch_generator(self.seed, self.epoch)
        # Every random number is drawn per GLOBAL position of the epoch, so a rank's batch does
        # not depend on how many ranks share the global batch. The keys stay on the host: the
        # activation cache looks them up there (keys on a GPU would cost a sync per step).
        keys = self._epoch_keys_by_position(self.epoch, gen)
        if self.augment.kind == "crop-flip":
            offsets = torch.randint(0, 2 * self.pad + 1, (2, n), generator=gen).to(self.device)
            flips = torch.randint(0, 2, (n,), generator=gen).bool().to(self.device)
        for step in range(self.start_step, self.steps_per_epoch):
            part = self._rank_slice(step)
            if self.augment.kind == "crop-flip":
                idx = keys[part].to(self.device)
                x = crop_flip(self.x[idx], offsets[0, part], offsets[1, part], flips[part], self.pad)
                yield normalize_uint8(x), self.y[idx], None
            else:
                batch_keys = keys[part]
                labels = self.y[(batch_keys // self.augment.views).to(self.device)]
                yield self.images(batch_keys), labels, batch_keys

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y, _ in self.iter_keyed():
            yield x, y


class EvalLoader:
    """In-order, unaugmented batches of this rank's contiguous shard; the shards of all ranks cover
    every sample exactly once (ranks may differ by one sample; the caller all-reduces counts)."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        rank: int,
        world_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        _check_images(x, y)
        _check_shard_args(batch_size, rank, world_size)
        n = x.shape[0]
        begin, end = n * rank // world_size, n * (rank + 1) // world_size
        self.device = torch.device(device)
        self.x = x[begin:end].to(self.device)
        self.y = y[begin:end].to(self.device, torch.int64)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-self.x.shape[0] // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for begin in range(0, self.x.shape[0], self.batch_size):
            end = begin + self.batch_size
            yield normalize_uint8(self.x[begin:end]), self.y[begin:end]
