"""The ``--device`` argument the benchmarks share: cpu, or cuda where a CUDA device is visible."""

from __future__ import annotations

import argparse

import torch


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")


def parsed_device(parser: argparse.ArgumentParser, value: str) -> torch.device:
    """``value`` as a device, or the parser's one-line error naming what is accepted here."""
    if value not in ("cpu", "cuda"):
        parser.error(f"--device: '{value}' is not accepted; accepted: cpu, cuda")
    if value == "cuda" and not torch.cuda.is_available():
        parser.error("--device: cuda, but no CUDA device is visible; accepted here: cpu")
    return torch.device(value)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
