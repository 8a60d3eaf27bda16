"""FreezerCallback on 2 gloo ranks, and the regression test of Lightning-AI/pytorch-lightning#20340.

#20340: a backbone frozen first and unfrozen later under DDP. With Lightning's ``BaseFinetuning``
the wrapper Lightning built while the backbone was frozen never all-reduces its gradients, so the
replicas drift apart. With ``FreezerCallback`` (the same schedule: ``gradual-unfreeze`` over
[backbone, head]) the wrapper is rebuilt at the unfreeze: replicas stay bit-identical and the bytes
sent equal the trainable gradient bytes at every step. Both runs are the script of
docs/integrations/lightning.md, executed as written before and after its diff, in one spawn.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import doc_scripts
from tests.distributed_harness import run_distributed
from tests.optional_packages import requires

pytestmark = requires("lightning")


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def lightning_worker(rank, world, workdir):
    for k, v in {"LOCAL_RANK": rank, "NODE_RANK": 0, "WORLD_SIZE": world, "RANK": rank}.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29599")  # unused: the group exists already
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from freeze import comm
    from freeze.integrations.lightning import FreezerCallback

    before = doc_scripts.load("lightning.md", "before", workdir)
    after = doc_scripts.load("lightning.md", "after", workdir)

    class Record(pl.Callback):
        """Per optimizer step: bytes sent (the Freezer's counters, or the same counting hook on
        Lightning's own wrapper), the parameters and the buffers."""

        def __init__(self):
            self.freezer_cb, self.counter, self._last = None, None, 0
            self.steps, self.params, self.buffers = [], [], []

        def on_fit_start(self, trainer, pl_module):
            self.freezer_cb = next((c for c in trainer.callbacks if isinstance(c, FreezerCallback)), None)
            if self.freezer_cb is None:
                self.counter = comm.CommCounter()
                trainer.strategy.model.register_comm_hook(self.counter, comm._HOOKS["allreduce"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == len(self.params):
                return
            self.params.append(_flat(pl_module))
            self.buffers.append(torch.cat([b.detach().reshape(-1).double() for b in pl_module.buffers()]))
            if self.freezer_cb is not None:
                f = self.freezer_cb.freezer
                self.steps.append((f.counters.allreduce_bytes_last_step, f.trainable_grad_bytes, f.boundary))
            else:
                total = self.counter.allreduce_bytes_total
                self.steps.append((total - self._last, None, None))
                self._last = total

    out = {}
    # 1. the page's script before the change: #20340 with BaseFinetuning
    rec = Record()
    model, _ = before["main"](callbacks=[rec])
    out["base_finetuning"] = {"params": rec.params, "steps": rec.steps, "backbone": _flat(model.backbone)}

    # 2. after the change, with gradient accumulation and a checkpoint per epoch
    rec = Record()
    ckpt = ModelCheckpoint(dirpath=f"{workdir}/ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    # 2 optimizer steps per epoch: step-2 is written in on_train_batch_end of epoch 0's last batch,
    # before on_train_epoch_end (where the Freezer closes the epoch)
    steps = ModelCheckpoint(dirpath=f"{workdir}/steps", save_top_k=-1, every_n_train_steps=2, filename="step-{step}")
    model, cb = after["main"](callbacks=[rec, ckpt, steps], accumulate_grad_batches=2, enable_checkpointing=True)
    f = cb.freezer
    out["freezer"] = {
        "params": rec.params,
        "buffers": rec.buffers,
        "steps": rec.steps,
        "decisions": [(d.epoch, d.boundary_before, d.boundary_after) for d in f.decisions],
        "steps_seen": f.counters.steps,
        "history": [(h.epoch, h.steps) for h in f.history],
        "backbone_bytes": sum(p.numel() * 4 for p in model.backbone.parameters()),
        "backbone_numel": sum(p.numel() for p in model.backbone.parameters()),
        "final": _flat(model),
    }
    torch.distributed.barrier()

    # 3. resumed from the checkpoint written at the end of epoch 0 (boundary 1, about to unfreeze)
    model, cb = after["main"](ckpt_path=f"{workdir}/ckpt/epoch=0.ckpt", accumulate_grad_batches=2)
    out["resumed"] = {
        "decisions": [(d.epoch, d.boundary_before, d.boundary_after) for d in cb.freezer.decisions],
        "final": _flat(model),
    }
    torch.distributed.barrier()
    # 4. resumed from the step checkpoint written at epoch 0's last batch
    model, cb = after["main"](ckpt_path=f"{workdir}/steps/step-step=2.ckpt", accumulate_grad_batches=2)
    out["resumed_step"] = {
        "steps": cb.freezer.counters.steps,
        "history": [(h.epoch, h.steps) for h in cb.freezer.history],
        "decisions": [(d.epoch, d.boundary_before, d.boundary_after) for d in cb.freezer.decisions],
        "final": _flat(model),
    }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lightning")
    return run_distributed(lightning_worker, 2, workdir, str(workdir), deadline_s=300, collective_timeout_s=120)


@pytest.mark.processes
def test_issue_20340_base_finetuning_lets_replicas_diverge_after_unfreezing(runs):
    """The bug, shown: after the unfreeze the backbone's gradients are never all-reduced (the bytes
    per step do not grow), so each rank's backbone follows its own data."""
    r0, r1 = runs[0]["base_finetuning"], runs[1]["base_finetuning"]
    assert not torch.equal(r0["backbone"], r1["backbone"])
    assert len({sent for sent, _, _ in r0["steps"]}) == 1  # the same bytes before and after unfreezing


@pytest.mark.processes
def test_issue_20340_freezer_callback_keeps_replicas_bit_identical_at_every_step(runs):
    r0, r1 = runs[0]["freezer"], runs[1]["freezer"]
    assert r0["decisions"] == [(0, 1, 0)]  # frozen in epoch 0, unfrozen from epoch 1: #20340's schedule
    assert len(r0["params"]) == len(r1["params"]) > 0
    for t, (a, b) in enumerate(zip(r0["params"], r1["params"])):
        assert torch.equal(a, b), f"step {t}: replicas differ"


@pytest.mark.processes
def test_bytes_sent_equal_the_trainable_gradient_bytes_at_every_boundary(runs):
    for r in runs:
        steps = r["freezer"]["steps"]
        assert all(sent == trainable for sent, trainable, _ in steps), steps
        boundaries = [k for _, _, k in steps]
        assert 1 in boundaries and 0 in boundaries
        frozen_bytes = {sent for sent, _, k in steps if k == 1}
        open_bytes = {sent for sent, _, k in steps if k == 0}
        assert open_bytes == {frozen_bytes.pop() + r["freezer"]["backbone_bytes"]}


@pytest.mark.processes
def test_frozen_backbone_and_its_batchnorm_statistics_do_not_move_while_frozen(runs):
    """Weights, and BatchNorm statistics despite Lightning's model.train() at each epoch start,
    identical on both ranks while frozen (trainable statistics are rank-local between forwards)."""
    r0, r1 = runs[0]["freezer"], runs[1]["freezer"]
    first_open = next(t for t, (_, _, k) in enumerate(r0["steps"]) if k == 0)
    assert first_open >= 2
    backbone = r0["backbone_numel"]
    for t in range(1, first_open):
        assert torch.equal(r0["params"][t][:backbone], r0["params"][0][:backbone]), t
        assert torch.equal(r0["buffers"][t], r0["buffers"][0]), t
        assert torch.equal(r0["buffers"][t], r1["buffers"][t]), t


@pytest.mark.processes
def test_resume_from_a_lightning_checkpoint_reproduces_decisions_and_weights(runs):
    for r in runs:
        for resumed in ("resumed", "resumed_step"):  # from an epoch checkpoint; from a step one at an epoch's end
            assert r[resumed]["decisions"] == r["freezer"]["decisions"], resumed
            assert torch.equal(r[resumed]["final"], r["freezer"]["final"]), resumed
        # every epoch closed once, with its own steps, as in the uninterrupted run
        assert r["resumed_step"]["history"] == r["freezer"]["history"]
        assert r["resumed_step"]["steps"] == r["freezer"]["steps_seen"]


def diverged_worker(rank, world, workdir):
    """Rank 1 loads other weights in on_train_start, after FreezerCallback broadcast rank 0's (the
    LightningModule's hooks run after the callbacks'): Lightning then calls the Freezer's DDP wrapper
    with replicas that differ. The stock run (no callback) shows what that trains."""
    for k, v in {"LOCAL_RANK": rank, "NODE_RANK": 0, "WORLD_SIZE": world, "RANK": rank}.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29599")  # unused: the group exists already
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch import nn

    from freeze.freezer.engine import RankMismatchError
    from freeze.integrations.lightning import FreezerCallback

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.head = nn.Linear(16, 3)
            self.steps_run = 0

        def forward(self, x):
            return self.head(self.backbone(x))

        def on_train_start(self):
            if self.global_rank == 1:  # the mistake: a load on some ranks only, after on_fit_start
                torch.manual_seed(99)
                self.load_state_dict(Net().state_dict())

        def training_step(self, batch, batch_idx):
            self.steps_run += 1
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
    settings = {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_epochs": 1, "logger": False}
    quiet = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    out = {}
    for name, callbacks in (("stock", []), ("freezer", [FreezerCallback("static:k=1", blocks=["backbone", "head"])])):
        torch.manual_seed(0)
        model = Net()
        trainer = pl.Trainer(callbacks=callbacks, **settings, **quiet)
        try:
            trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
            out[name] = {"error": None}
        except RankMismatchError as e:
            out[name] = {"error": str(e)}
        released = [c.freezer.engine.closed for c in callbacks]
        out[name].update(steps_run=model.steps_run, params=_flat(model), released=released)
        torch.distributed.barrier()
    return out


@pytest.mark.processes
def test_ranks_that_hold_different_weights_are_refused_at_the_first_training_forward(tmp_path):
    """Lightning calls the Freezer's DDP wrapper itself (not freezer.module), so the Freezer's rank
    check runs in a pre-hook on each wrapper it installs. Stock Lightning trains the diverged
    replicas without a word; with FreezerCallback every rank refuses in one line, before any step,
    and the wrapper is released."""
    runs = run_distributed(diverged_worker, 2, tmp_path, str(tmp_path), deadline_s=240, collective_timeout_s=60)
    stock0, stock1 = runs[0]["stock"], runs[1]["stock"]
    assert stock0["error"] is None and stock0["steps_run"] > 0
    assert not torch.equal(stock0["params"], stock1["params"])  # the wrong numbers the check prevents
    for r in runs:
        error = r["freezer"]["error"]
        assert error is not None and "\n" not in error, error
        assert error.startswith("Freezer: rank 1 holds other weights than rank 0 at the first training step")
        assert "on_fit_start" in error and "setup()" in error
        assert r["freezer"]["steps_run"] == 0  # refused as the wrapper is entered, before training_step runs
        assert r["freezer"]["released"] == [True]


def test_unsupported_strategies_are_refused_in_one_line():
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from freeze.integrations.lightning import FreezerCallback

    cases = [
        (DDPStrategy(static_graph=True), "static_graph=False"),
        (DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook), "comm_hook='bf16'"),
    ]
    for strategy, fix in cases:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
        with pytest.raises(ValueError, match=fix) as e:
            FreezerCallback()._check_strategy(trainer)
        assert "\n" not in str(e.value)
