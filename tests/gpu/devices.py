"""The devices a GPU claim runs on. The CPU variant runs everywhere (``make test``, CI): it is how each
claim is shown able to fail without a GPU. The CUDA variant is marked ``cuda`` (``pytest -m cuda`` selects
it: the GPU check, experiments/gpu_check.py) and skipped where no CUDA device is visible."""

import contextlib

import pytest
import torch

CUDA_AVAILABLE = torch.cuda.is_available()
NO_CUDA = "no CUDA device visible (make gpu-check runs it on a GPU)"
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_AVAILABLE, reason=NO_CUDA)]
CUDA = pytest.param("cuda", marks=CUDA_MARKS, id="cuda")
DEVICES = [pytest.param("cpu", id="cpu"), CUDA]


def cuda_only(*values, id: str):
    """A parameter set that needs CUDA (e.g. fp16 autocast with a GradScaler, or a device pair)."""
    return pytest.param(*values, marks=CUDA_MARKS, id=id)


def deterministic(monkeypatch) -> None:
    """cuDNN's deterministic kernels: two forwards of the same bits then give the same bits (the CPU's are)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


def autocast(device_type: str, precision: str):
    """The training forward's autocast: bf16 or fp16, or none at all for fp32 (no autocast state is
    touched, as in a plain fp32 loop)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)
