"""No host synchronisation on the hot path: steady-state training steps on CUDA, with and without the
activation cache (its store on the device, and on the host behind the pinned staging buffers), fp32
and bf16, and with the horizon rule's monitoring, make no synchronising CUDA call at all; with fp16
and a GradScaler the only one is torch's own (GradScaler.step reads found_inf on the host), none of
ours. Run under ``torch.cuda.set_sync_debug_mode``: "warn" to name every sync
(experiments/sync_audit.py), then "error", the mode that raises at the first."""

import os
import traceback
import warnings

import pytest
import torch

from experiments.sync_audit import FREEZE_DIR, TORCH_DIR, _attribute, audit, make_step, recording, summarize
from tests.gpu.devices import CUDA_MARKS

NO_SYNC = ["fp32", "fp32-cache-device", "fp32-cache-host", "bf16-cache-device", "fp32-horizon"]


def _frame(path: str, line: int) -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, "f")


def test_a_sync_is_attributed_to_the_line_that_made_it():
    """Runs without CUDA: the attribution the audit reports, on made-up stacks."""
    caller, ours = _frame("/work/train.py", 10), _frame(os.path.join(FREEZE_DIR, "monitor.py"), 42)
    scaler = _frame(os.path.join(TORCH_DIR, "amp", "grad_scaler.py"), 7)
    ddp = _frame(os.path.join(TORCH_DIR, "nn", "parallel", "distributed.py"), 3)
    functional = _frame(os.path.join(TORCH_DIR, "nn", "functional.py"), 5)
    assert _attribute([caller, ours]).owner == "freeze"
    assert _attribute([caller, ours, functional]).owner == "freeze"  # our line called torch's API
    assert _attribute([caller, ours, ddp]).owner == "torch"  # DDP's own code, reached through ours
    in_scaler = _attribute([caller, scaler])  # GradScaler's own: attributed to the line that called it
    assert (
        in_scaler.owner == "torch" and in_scaler.where.endswith("train.py:10") and "grad_scaler.py:7" in in_scaler.stack
    )
    assert _attribute([caller]).owner == "caller"


def _warn_as_torch_does() -> None:
    """What torch's C++ TORCH_WARN becomes in Python: a UserWarning at the calling line."""
    warnings.warn("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp:1.)", stacklevel=1)


def test_recording_catches_the_warning_under_pytests_own_capture(monkeypatch):
    """Runs without CUDA: the mode switch is stubbed, the warning is the one torch emits."""
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with recording() as found:
        _warn_as_torch_does()
        warnings.warn("an unrelated warning", stacklevel=1)  # not a sync: not recorded
    assert modes == ["warn", 0]
    assert [s.owner for s in found] == ["caller"] and "test_cuda_sync.py" in found[0].where


@pytest.mark.parametrize("owner", [pytest.param("caller", marks=CUDA_MARKS, id="cuda")])
def test_the_audit_sees_a_planted_sync(owner):
    with recording() as found:
        torch.ones(1, device="cuda").item()
    assert [s.owner for s in found] == [owner]


@CUDA_MARKS[0]
@CUDA_MARKS[1]
@pytest.mark.parametrize("config", NO_SYNC)
def test_steady_state_steps_make_no_host_sync(config):
    found = audit(config)
    assert not found, "host syncs on the hot path:\n" + "\n".join(map(str, summarize(found, 4)))
    step = make_step(config, torch.device("cuda", torch.cuda.current_device()))
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3, 6):
            step(i)  # raises "called a synchronizing CUDA operation" at the first one
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@CUDA_MARKS[0]
@CUDA_MARKS[1]
@pytest.mark.parametrize("config", ["fp16-scaler", "fp16-scaler-cache"])
def test_fp16_steps_sync_only_in_the_grad_scaler(config):
    found = audit(config)
    ours = [s for s in found if s.owner != "torch"]
    assert not ours, "host syncs of ours on the fp16 hot path:\n" + "\n".join(map(str, summarize(ours, 4)))
    assert all("grad_scaler.py" in s.stack for s in found), summarize(found, 4)
