"""The committed pretrained weights of the substrate: exported once from the pretraining run, stored
in fp16, verified by sha256 before any study loads them.

Storage: every floating-point tensor of the final checkpoint's model state dict is rounded to the
nearest fp16 (``tensor.half()``; no value of a ResNet-18 state dict is near fp16's range limit, and
the export refuses a non-finite result); integer buffers (BatchNorm's ``num_batches_tracked``) stay
int64. Loading (``model.weights = <file>``, :func:`freeze.pipeline.models.load_weights`) copies each
tensor into the fp32 model with ``load_state_dict``, whose ``copy_`` converts fp16 -> fp32 exactly
(every fp16 value is an fp32 value): the loaded model holds the rounded weights, bit for bit the
same on every machine. The rounding's effect is stated by the export (largest relative error).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from freeze.pipeline.runs import load_torch_file

WEIGHTS_FILE = Path("experiments/weights/fdsl32_resnet18.pt")


class WeightsError(Exception):
    """A weights file that is missing, altered or not exportable, as one line."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def verify(path: str | Path) -> str:
    """The file's sha256, after checking it against ``<path>.sha256`` (``sha256sum`` format)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(
            f"weights file {path} is missing: it is committed (git checkout -- {path}) or made by "
            "`python -m experiments.substrate pretrain`"
        )
    side = sidecar(path)
    if not side.is_file():
        raise WeightsError(f"{side} is missing: the weights' sha256 cannot be checked")
    expected = side.read_text().split()[0]
    actual = sha256_of(path)
    if actual != expected:
        raise WeightsError(
            f"{path} has sha256 {actual}, {side} says {expected}: the file was altered; check it out again"
        )
    return actual


def export_fp16(checkpoint: Path, out: Path, provenance: dict) -> dict:
    """Write the checkpoint's model state dict as fp16 to ``out``, ``out.sha256`` and ``out``'s
    provenance JSON (``out`` with suffix .json); returns the provenance written."""
    obj = load_torch_file(checkpoint)
    state = obj["model"] if isinstance(obj, dict) and isinstance(obj.get("model"), dict) else obj
    half, worst = {}, 0.0
    for key, value in state.items():
        if value.is_floating_point():
            rounded = value.detach().to(torch.float16)
            if not torch.isfinite(rounded).all():
                raise WeightsError(f"{checkpoint}: {key} does not fit fp16 (a value beyond +-65504)")
            scale = value.abs().max().clamp_min(1e-12)
            worst = max(worst, float((rounded.float() - value).abs().max() / scale))
            half[key] = rounded.contiguous()
        else:
            half[key] = value.detach().clone()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(half, out)
    digest = sha256_of(out)
    sidecar(out).write_text(f"{digest}  {out.name}\n")
    record = {
        **provenance,
        "file": out.name,
        "sha256": digest,
        "bytes": out.stat().st_size,
        "storage": "fp16 floating tensors (tensor.half()), int64 buffers; loading casts to fp32 exactly",
        "max_rounding_error_relative_to_tensor_max": worst,
        "tensors": len(half),
        "parameters": sum(v.numel() for k, v in half.items() if v.is_floating_point()),
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return record
