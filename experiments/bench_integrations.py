"""Each trainer's usual way of freezing against freeze's integration, at the same boundary.

    .venv/bin/python -m experiments.bench_integrations                  # all four trainers, 2 gloo ranks
    .venv/bin/python -m experiments.bench_integrations --trainers hf,timm --rounds 7 --steps 20

The usual way: the trainer builds DDP over the whole model (``find_unused_parameters=True``, which
freezing after the wrap needs), then blocks ``0 .. k-1`` get ``requires_grad_(False)``: in the HF
Trainer from a callback, in Lightning from a ``BaseFinetuning`` callback, in Accelerate and timm right
after wrapping. Ours: ``FreezeTrainer`` / ``FreezerCallback`` / the documented recipes with the
policy ``static:k``. Both send through the same counting comm hook, so bytes compare exactly.

A control runs in the same rotation: the usual way again, a run of its own, so its true ratio to
the usual way is 1.00 and its interval says how far the machine alone moves a ratio; where the
control's interval misses 1.00, that trainer's ratio is no claim. The three approaches rotate within
every round (usual, ours, control; ours, control, usual; ...), each run does ``--warmup`` untimed and
``--steps`` timed optimizer steps; a round's statistic is the median step time of rank 0. The report
gives the median over rounds and a 95% bootstrap interval of the median per-round ratio (ours /
usual, control / usual). It refuses to measure on a busy machine (1-minute load >= 1.5) unless
``--allow-busy``, and records the load before and after. Writes ``<out-dir>/bench_integrations.csv``
and ``<out-dir>/BENCH_INTEGRATIONS.md``; no number is typed by hand. ``--tiny`` shrinks every model
to check that the script runs (tests/test_bench_integrations.py): its times are no measurement.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from freeze._atomic import atomic_write_text
from freeze.pipeline import markdown
from freeze.pipeline.runs import cpu_name
from freeze.testing import run_gloo_rank, spawn_and_collect

TRAINERS = ("hf", "lightning", "accelerate", "timm")
USUAL = {
    "hf": "Trainer + requires_grad_(False) in a callback",
    "lightning": "BaseFinetuning.freeze() after the wrap, ddp_find_unused_parameters_true",
    "accelerate": "prepare(model) + requires_grad_(False), find_unused_parameters=True",
    "timm": "DDP(model, find_unused_parameters=True) + requires_grad_(False)",
}
OURS = {
    "hf": "FreezeTrainer(freeze_policy='static:k=K')",
    "lightning": "FreezerCallback('static:k=K')",
    "accelerate": "the recipe of docs/integrations/accelerate.md, static:k=K",
    "timm": "Freezer(blocks_from_timm(model)), static:k=K",
}
BATCH = 8
APPROACHES = ("usual", "ours", "control")  # control: the usual way again (true ratio 1.00)
# Model sizes: the measured ones, and the smoke test's (the same blocks, so the same boundaries).
SIZES = {
    "full": {"bert_hidden": 256, "bert_vocab": 2000, "seq": 64, "samples": 4096, "width": 1024, "image": 64},
    "tiny": {"bert_hidden": 32, "bert_vocab": 100, "seq": 16, "samples": 256, "width": 32, "image": 32},
}


def _env(rank: int, world: int) -> None:
    for k, v in {
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": rank,
        "LOCAL_WORLD_SIZE": world,
        "NODE_RANK": 0,
    }.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29597")  # unused: the group exists already


def _count(ddp):
    from freeze import comm

    counter = comm.CommCounter()
    ddp.register_comm_hook(counter, comm._HOOKS["allreduce"])
    return counter


class _Clock:
    """Per optimizer step: seconds and bytes (a running total read at each step end)."""

    def __init__(self, warmup: int):
        self.warmup, self.times, self.bytes, self._t0, self._last, self._n = warmup, [], [], 0.0, 0, 0

    def begin(self) -> None:
        self._t0 = time.perf_counter()

    def end(self, bytes_total: int) -> None:
        elapsed = time.perf_counter() - self._t0
        if self._n >= self.warmup:
            self.times.append(elapsed)
            self.bytes.append(bytes_total - self._last)
        self._last, self._n = bytes_total, self._n + 1


# ---------------------------------------------------------------------- HF Trainer
def _hf_model(size):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=size["bert_vocab"],
        hidden_size=size["bert_hidden"],
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=4 * size["bert_hidden"],
        max_position_embeddings=size["seq"],
        num_labels=4,
    )
    return BertForSequenceClassification(cfg)


def _hf_run(approach, k, steps, warmup, workdir, size):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from freeze import split_blocks
    from freeze.integrations.transformers import FreezeTrainer

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["bert_vocab"], (size["samples"], size["seq"]), generator=g)
    data = [{"input_ids": ids[i], "labels": ids[i, 0] % 4} for i in range(len(ids))]
    args = TrainingArguments(
        output_dir=workdir,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=BATCH,
        max_steps=warmup + steps,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    model = _hf_model(size)
    clock, holder = _Clock(warmup), {}
    frozen = [p for b in split_blocks(model)[:k] for p in b.params]

    class Time(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if approach == "usual":
                holder["counter"] = _count(holder["trainer"].model_wrapped)
                for p in frozen:
                    p.requires_grad_(False)

        def on_step_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            t = holder["trainer"]
            clock.end(
                holder["counter"].allreduce_bytes_total
                if approach == "usual"
                else t.freezer.counters.allreduce_bytes_total
            )

    if approach == "usual":
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Time()])
    else:
        trainer = FreezeTrainer(
            model=model, args=args, train_dataset=data, callbacks=[Time()], freeze_policy=f"static:k={k}"
        )
    holder["trainer"] = trainer
    trainer.train()
    return clock


# ---------------------------------------------------------------------- Lightning
def _lightning_run(approach, k, steps, warmup, workdir, size):
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import BaseFinetuning
    from torch import nn

    from freeze.integrations.lightning import FreezerCallback

    width, depth = size["width"], 6
    names = [f"backbone.{i}" for i in range(depth)] + ["head"]

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            return self.head(self.backbone(x))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class FreezeAfterWrap(BaseFinetuning):  # the usual way to freeze once training runs
        def freeze_before_training(self, pl_module):
            pass

        def finetune_function(self, pl_module, current_epoch, optimizer):
            if current_epoch == 0:
                self.freeze([pl_module.get_submodule(n) for n in names[:k]], train_bn=False)

    clock, holder = _Clock(warmup), {}

    class Time(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            if approach == "usual":
                holder["counter"] = _count(trainer.strategy.model)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            total = (
                holder["counter"].allreduce_bytes_total
                if approach == "usual"
                else holder["cb"].freezer.counters.allreduce_bytes_total
            )
            clock.end(total)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(size["samples"], width, generator=g), torch.randint(0, 10, (size["samples"],), generator=g)
    )
    if approach == "usual":
        callbacks, strategy = [FreezeAfterWrap(), Time()], "ddp_find_unused_parameters_true"
    else:
        holder["cb"] = FreezerCallback(f"static:k={k}", blocks=names)
        callbacks, strategy = [holder["cb"], Time()], "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=BATCH))
    return clock


# ---------------------------------------------------------------------- Accelerate and timm (own loops)
def _resnet():
    import timm

    torch.manual_seed(0)
    return timm.create_model("resnet18", num_classes=10)


def _loop(forward, optimizer, clock, total, bytes_total, after_backward=None, image=64):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    for _ in range(total):
        x, y = torch.randn(BATCH, 3, image, image, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        clock.begin()
        F.cross_entropy(forward(x), y).backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        optimizer.zero_grad()
        clock.end(bytes_total())


def _usual_loop(ddp, blocks, k, optimizer, clock, total, image):
    """The usual way in a loop of one's own: DDP already built over the whole model, then
    ``requires_grad_(False)`` on blocks ``0 .. k-1``; bytes counted by a hook on that wrapper."""
    counter = _count(ddp)
    for p in (p for b in blocks[:k] for p in b.params):
        p.requires_grad_(False)
    _loop(ddp, optimizer, clock, total, lambda: counter.allreduce_bytes_total, image=image)


def _freezer_loop(freezer, optimizer, clock, total, image):
    """Ours in a loop of one's own: ``freezer.module`` forward, ``after_backward`` each step."""

    def bytes_total():
        return freezer.counters.allreduce_bytes_total

    _loop(freezer.module, optimizer, clock, total, bytes_total, freezer.after_backward, image)
    freezer.close()


def _accelerate_run(approach, k, steps, warmup, workdir, size):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    from freeze import Freezer, make_policy, split_blocks

    model = _resnet()
    blocks = split_blocks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    clock, total = _Clock(warmup), warmup + steps
    AcceleratorState._reset_state(True)
    if approach == "usual":
        accelerator = Accelerator(
            cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]
        )
        ddp, optimizer = accelerator.prepare(model, optimizer)
        _usual_loop(ddp, blocks, k, optimizer, clock, total, size["image"])
    else:
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare_model(model, evaluation_mode=True)
        optimizer = accelerator.prepare(optimizer)
        freezer = Freezer(model, blocks, make_policy(f"static:k={k}"))
        freezer.attach_optimizer(optimizer)
        _freezer_loop(freezer, optimizer, clock, total, size["image"])
    return clock


def _timm_run(approach, k, steps, warmup, workdir, size):
    from torch.nn.parallel import DistributedDataParallel

    from freeze import Freezer, make_policy
    from freeze.integrations.timm import blocks_from_timm

    model = _resnet()
    blocks = blocks_from_timm(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    clock, total = _Clock(warmup), warmup + steps
    if approach == "usual":
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        _usual_loop(ddp, blocks, k, optimizer, clock, total, size["image"])
    else:
        freezer = Freezer(model, blocks, make_policy(f"static:k={k}"), optimizer=optimizer)
        _freezer_loop(freezer, optimizer, clock, total, size["image"])
    return clock


RUNS = {"hf": _hf_run, "lightning": _lightning_run, "accelerate": _accelerate_run, "timm": _timm_run}
BOUNDARY = {"hf": 3, "lightning": 4, "accelerate": 8, "timm": 8}  # from a third to two thirds of the bytes frozen


def rotation(r: int) -> tuple[str, ...]:
    """Round ``r``'s order of the approaches: each starts a round in turn."""
    shift = r % len(APPROACHES)
    return APPROACHES[shift:] + APPROACHES[:shift]


def _worker(rank, world, trainer, rounds, steps, warmup, size, workdir):
    _env(rank, world)
    out = []
    for r in range(rounds):
        for approach in rotation(r):
            run_as = "usual" if approach == "control" else approach
            rundir = f"{workdir}/{trainer}-{r}-{approach}-rank{rank}"  # each rank writes its own files
            clock = RUNS[trainer](run_as, BOUNDARY[trainer], steps, warmup, rundir, SIZES[size])
            out.append({"round": r, "approach": approach, "times": clock.times, "bytes": clock.bytes})
            torch.distributed.barrier()
    return out


def _spawned(rank, world, workdir, *args):
    torch.set_num_threads(1)
    run_gloo_rank(rank, world, workdir, 300.0, lambda: _worker(rank, world, *args, workdir))


def measure(
    trainer: str,
    rounds: int,
    steps: int,
    warmup: int,
    size: str = "full",
    workdir: str | None = None,
    deadline_s: float = 3600.0,
) -> list[dict]:
    """Rank 0's runs of ``trainer`` on 2 spawned gloo ranks (rendezvous and payloads under ``workdir``,
    a fresh temporary directory when None)."""
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(workdir or scratch) / trainer
        shutil.rmtree(where, ignore_errors=True)  # a killed earlier run's rendezvous file must not be reused
        where.mkdir(parents=True)
        args = (2, str(where), trainer, rounds, steps, warmup, size)
        payloads = spawn_and_collect(_spawned, args, 2, where, deadline_s)
    for r, p in enumerate(payloads):
        if not p["ok"]:
            raise RuntimeError(f"{trainer}: rank {r} failed:\n{p['error']}")
    return payloads[0]["result"]


def _bootstrap_ratio(usual: np.ndarray, ours: np.ndarray, n: int = 10000) -> tuple[float, float, float]:
    ratios = ours / usual
    rng = np.random.default_rng(0)
    boots = np.median(rng.choice(ratios, (n, len(ratios))), axis=1)
    return float(np.median(ratios)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def _table_row(t: str, rows: list[dict]) -> tuple[list[str], bool]:
    """The table cells of trainer ``t``, and whether its control holds (CI contains 1.00)."""
    per = {
        ap_: sorted((r for r in rows if r["trainer"] == t and r["approach"] == ap_), key=lambda r: r["round"])
        for ap_ in APPROACHES
    }
    med = {ap_: np.array([np.median(r["times"]) for r in v]) for ap_, v in per.items()}
    bytes_ = {ap_: ", ".join(map(str, sorted({b for r in v for b in r["bytes"]}))) for ap_, v in per.items()}
    ratio, lo, hi = _bootstrap_ratio(med["usual"], med["ours"])
    c_ratio, c_lo, c_hi = _bootstrap_ratio(med["usual"], med["control"])
    holds = c_lo <= 1.0 <= c_hi
    ms = {ap_: f"{1000 * np.median(v):.1f}" for ap_, v in med.items()}
    cells = [t, BOUNDARY[t], USUAL[t], bytes_["usual"], bytes_["ours"], ms["usual"], ms["ours"], ms["control"]]
    cells += [f"{ratio:.3f} ({lo:.3f}-{hi:.3f})", f"{c_ratio:.3f} ({c_lo:.3f}-{c_hi:.3f})"]
    cells.append("holds" if holds else "**does not hold**: no claim")
    return cells, holds


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out-dir", default=None, help="where the CSV and table go (default report/; --tiny needs one)")
    ap.add_argument("--allow-busy", action="store_true", help="measure even when the 1-minute load is >= 1.5")
    ap.add_argument("--tiny", action="store_true", help="tiny models: checks that the script runs, measures nothing")
    ap.add_argument("--work-dir", default=None, help="rendezvous and payloads (default: a temporary directory)")
    ap.add_argument("--deadline-s", type=float, default=3600.0, help="per trainer: its ranks are killed after it")
    return ap


def _refusal(a: argparse.Namespace, trainers: list[str], load_before: float) -> tuple[str, int] | None:
    """(the one line, the exit code) when the command must not measure; None when it may."""
    unknown = [t for t in trainers if t not in TRAINERS]
    if unknown:
        return f"bench_integrations: unknown trainer {unknown[0]}; accepted: {', '.join(TRAINERS)}", 2
    if a.tiny and a.out_dir is None:
        return (
            "bench_integrations: --tiny checks the script and measures nothing: pass --out-dir (by default it "
            "would replace the measured report/BENCH_INTEGRATIONS.md)",
            2,
        )
    if load_before >= 1.5 and not a.allow_busy:
        return (
            f"bench_integrations: the machine is busy (1-minute load {load_before:.2f} >= 1.5); rerun when quiet, "
            "or pass --allow-busy (the step times are then not representative)",
            3,
        )
    return None


def _write_csv(path: Path, rows: list[dict]) -> None:
    """One line per timed step of every run: its time and the bytes the comm hook counted."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["trainer", "k", "round", "approach", "step", "step_s", "bytes"])
    for row in rows:
        for i, (s, b) in enumerate(zip(row["times"], row["bytes"])):
            w.writerow([row["trainer"], row["k"], row["round"], row["approach"], i, f"{s:.6f}", b])
    atomic_write_text(path, buf.getvalue())


def _markdown(
    a: argparse.Namespace, command_args: list[str], trainers: list[str], rows: list[dict], machine: dict
) -> tuple[list[str], dict[str, bool]]:
    """BENCH_INTEGRATIONS.md's lines (``machine``: the wall time and the load before and after),
    and per trainer whether its control holds."""
    load_before, load_after = machine["load_before"], machine["load_after"]
    # The bench's own 2 ranks raise the 1-minute load by about 2: beyond that, other work shared the machine.
    busy = load_before >= 1.5 or load_after - 2 >= 1.5
    lines = [
        "# Freezing inside trainers: the usual way against freeze, same boundary",
        "",
        "Generated by `.venv/bin/python -m experiments.bench_integrations "
        + " ".join(command_args)
        + f"` in {machine['wall_s']:.0f} s wall time; do not edit by hand."
        + (" TINY MODELS: a check that the script runs, not a measurement." if a.tiny else ""),
        f"2 gloo ranks on one machine ({cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"Python {platform.python_version()}), 1 thread per rank; 1-minute load {load_before:.2f} before, "
        f"{load_after:.2f} after{' (BUSY: step times not representative)' if busy else ''}.",
        f"{a.rounds} rounds, the three approaches rotating within each round; {a.warmup} untimed + {a.steps} "
        "timed optimizer steps per run; step time = rank 0's median per run. The control is the usual way run "
        "again (true ratio 1.00): where its 95% interval misses 1.00, the machine moved that trainer's ratios "
        "more than their intervals say, and they are no claim.",
        "",
    ]
    held, table_rows = {}, []
    for t in trainers:
        cells, held[t] = _table_row(t, rows)
        table_rows.append(cells)
    header = ["trainer", "k", "usual way", "bytes/step usual", "bytes/step freeze", "step ms usual"]
    header += ["step ms freeze", "step ms control", "ratio freeze/usual (95% CI)", "ratio control/usual (95% CI)"]
    lines += markdown.table([*header, "control"], table_rows)
    lines += [
        "",
        "Ours: " + "; ".join(f"{t}: {OURS[t]}" for t in trainers) + ".",
        "Bytes are counted by the same DDP comm hook in every approach (gradient buckets only; "
        "DDP's used-parameter map under find_unused_parameters=True is not in it).",
    ]
    return lines, held


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    trainers = [t.strip() for t in a.trainers.split(",") if t.strip()]
    load_before = os.getloadavg()[0]
    refusal = _refusal(a, trainers, load_before)
    if refusal is not None:
        print(refusal[0], file=sys.stderr)
        return refusal[1]
    size = "tiny" if a.tiny else "full"
    started = time.perf_counter()
    rows = []
    for t in trainers:
        for res in measure(t, a.rounds, a.steps, a.warmup, size, a.work_dir, a.deadline_s):
            rows.append({"trainer": t, "k": BOUNDARY[t], **res})
    machine = {"wall_s": time.perf_counter() - started, "load_before": load_before, "load_after": os.getloadavg()[0]}
    out = Path(a.out_dir or "report")
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(out / "bench_integrations.csv", rows)
    lines, held = _markdown(a, argv if argv is not None else sys.argv[1:], trainers, rows, machine)
    atomic_write_text(out / "BENCH_INTEGRATIONS.md", "\n".join(lines) + "\n")
    print(f"wrote {out / 'BENCH_INTEGRATIONS.md'} and {out / 'bench_integrations.csv'}")
    missed = [t for t, ok in held.items() if not ok]
    if missed:
        print(f"bench_integrations: the control misses 1.00 for {', '.join(missed)}: those ratios are no claim")
    return 0


if __name__ == "__main__":
    sys.exit(main())
