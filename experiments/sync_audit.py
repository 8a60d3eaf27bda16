"""Which host synchronisations a steady-state training step makes on CUDA, and whose they are.

``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call (a blocking copy, an
``.item()``, a stream or event wait) warn; :func:`audit` records each warning with the Python stack
that made it and attributes it to the innermost frame of this project (freeze/) or, when the call
came from torch's own code with no frame of ours in between, to torch (GradScaler.step reads
``found_inf`` on the host: a sync of torch's own, on every fp16 step). Used by
tests/gpu/test_cuda_sync.py (the claim) and experiments/gpu_check.py (the audit table)."""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import freeze
from freeze import Freezer, split_blocks
from freeze.cache import CacheSource

FREEZE_DIR = os.path.dirname(freeze.__file__) + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
CONFIGS = (
    "fp32",
    "fp32-cache-device",
    "fp32-cache-host",
    "bf16-cache-device",
    "fp16-scaler",
    "fp16-scaler-cache",
    "fp32-horizon",
)
# fp32-horizon: the horizon rule's monitoring (freeze.policies.horizon) on the step: its 8-step
# intervals close after the audited steps (3 to 6), and its first interval is one whose gradient the
# descent sums (freeze.descent), so the audit sees the summing a step adds, not the close's reads.
HORIZON_INTERVAL_STEPS = 8


@dataclass(frozen=True)
class Sync:
    owner: str  # "freeze" (a line of ours synchronised), "torch" (torch's own code did), "caller"
    where: str  # file:line of the frame the sync is attributed to
    stack: str  # the innermost frames, for the report


def _attribute(frames: list[traceback.FrameSummary]) -> Sync:
    frames = [f for f in frames if not f.filename.endswith("warnings.py")]
    inner = frames[-1]
    ours = next((f for f in reversed(frames) if f.filename.startswith(FREEZE_DIR)), None)
    torch_inner = inner.filename.startswith(TORCH_DIR)
    if inner.filename.startswith(FREEZE_DIR):
        owner, at = "freeze", inner
    elif torch_inner and ours is not None and _called_directly(frames, ours):
        owner, at = "freeze", ours  # a torch function our line called synchronised
    elif torch_inner:
        owner, at = "torch", next((f for f in reversed(frames) if not f.filename.startswith(TORCH_DIR)), inner)
    else:
        owner, at = "caller", inner
    stack = " <- ".join(f"{os.path.relpath(f.filename)}:{f.lineno}" for f in reversed(frames[-4:]))
    return Sync(owner, f"{os.path.relpath(at.filename)}:{at.lineno}", stack)


def _called_directly(frames: list[traceback.FrameSummary], ours: traceback.FrameSummary) -> bool:
    """Whether every frame after our innermost one is torch's tensor/functional API (not a torch
    module we only passed through, such as DDP's forward or an nn.Module's __call__)."""
    after = frames[frames.index(ours) + 1 :]
    through_modules = any(f.filename.endswith(("module.py", "distributed.py", "grad_scaler.py")) for f in after)
    return not through_modules


@contextlib.contextmanager
def recording() -> Iterator[list[Sync]]:
    """Every synchronising CUDA call made inside, attributed (see :func:`_attribute`)."""
    found: list[Sync] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" in str(message):
            found.append(_attribute(traceback.extract_stack()[:-1]))

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def make_step(config: str, device: torch.device) -> Callable[[int], None]:
    """One training step of a ``config`` (see CONFIGS) on ``device``: TinyNet, boundary 2, SGD with
    momentum, inputs pinned on the host and copied without blocking (as a DataLoader with pin_memory
    hands them), sample ids on the host."""
    from tests.gpu.devices import autocast
    from tests.tiny_models import TinyNet  # the suite's toy model

    torch.manual_seed(0)
    model = TinyNet().to(device)
    inputs = torch.randn(64, 3, 8, 8).pin_memory()
    labels = torch.randint(0, 5, (64,)).pin_memory()
    cache = "memory" if "cache" in config else None
    source = CacheSource(lambda k: inputs[k], 64) if cache else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    freezer = Freezer(
        model,
        split_blocks(model),
        optimizer=optimizer,
        cache=cache,
        cache_source=source,
        **(_horizon_arguments(model) if "horizon" in config else {"interval_steps": 10**6}),
    )
    with _store_on_host("cache-host" in config):  # the placement is chosen here, the build is at step 0
        freezer.set_boundary(2)
    freezer.train()
    precision = config.split("-")[0]
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    def step(i: int) -> None:
        keys = torch.arange(i * 8 % 64, i * 8 % 64 + 8)
        x = inputs[keys].pin_memory().to(device, non_blocking=True)
        y = labels[keys].pin_memory().to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast("cuda", precision):
            loss = F.cross_entropy(freezer.module(x, sample_ids=keys if cache else None), y)
        scaler.scale(loss).backward()
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        freezer.after_backward()
        scaler.step(optimizer)
        scaler.update()
        freezer.after_step()

    return step


def _horizon_arguments(model: torch.nn.Module) -> dict:
    """The Freezer's arguments for the horizon rule: a run long enough for its evaluations, a pricing
    by hand, a held-out check that is never reached in the audited steps."""
    from freeze.policies import Pricing, make_policy

    steps = 16 * HORIZON_INTERVAL_STEPS  # the default window and span need 9 evaluations
    return {
        "policy": make_policy("horizon"),
        "epochs": 1,
        "steps_per_epoch": steps,
        "interval_steps": HORIZON_INTERVAL_STEPS,
        "pricing": Pricing(step_time_s=(1.0, 0.8, 0.6, 0.4), lr_per_step=(0.01,) * steps),
        "probe": lambda: 0.0,
    }


@contextlib.contextmanager
def _store_on_host(host: bool) -> Iterator[None]:
    """A cache store on the host even where it would fit on the GPU: its reads go through the pinned
    staging buffers."""
    import freeze.cache.cache as cache_module

    saved = cache_module.DEVICE_STORE_SHARE
    cache_module.DEVICE_STORE_SHARE = 0.0 if host else saved
    try:
        yield
    finally:
        cache_module.DEVICE_STORE_SHARE = saved


def audit(config: str, warmup_steps: int = 3, steps: int = 4) -> list[Sync]:
    """The synchronisations of ``steps`` steady-state steps of ``config``, after ``warmup_steps``
    (the cache's build and its one input check, the monitor's per-boundary index tensors)."""
    step = make_step(config, torch.device("cuda", torch.cuda.current_device()))
    for i in range(warmup_steps):
        step(i)
    torch.cuda.synchronize()
    with recording() as found:
        for i in range(warmup_steps, warmup_steps + steps):
            step(i)
    torch.cuda.synchronize()
    return found


def summarize(found: list[Sync], steps: int) -> list[tuple[str, str, float, str]]:
    """(owner, where, syncs per step, stack) per distinct place."""
    counts = Counter(found)
    return [(s.owner, s.where, n / steps, s.stack) for s, n in sorted(counts.items(), key=lambda kv: kv[0].where)]
