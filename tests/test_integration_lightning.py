"""FreezerCallback on 2 gloo ranks, and the regression test of Lightning-AI/pytorch-lightning#20340.

#20340: a backbone frozen first and unfrozen later under DDP. With Lightning's ``BaseFinetuning``
the wrapper Lightning built while the backbone was frozen never all-reduces its gradients, so the
replicas drift apart. With ``FreezerCallback`` (the same schedule: ``gradual-unfreeze`` over
[backbone, head]) the wrapper is rebuilt at the unfreeze: replicas stay bit-identical and the bytes
sent equal the trainable gradient bytes at every step. One spawn runs every scenario.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed_harness import run_distributed

EPOCHS = 3


def _modules():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.backbone(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):  # as BaseFinetuning's docs ask: the parameters that train now
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)

    return Net


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=g)
    y = torch.randint(0, 3, (64,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def lightning_worker(rank, world, workdir):
    for k, v in {"LOCAL_RANK": rank, "NODE_RANK": 0, "WORLD_SIZE": world, "RANK": rank}.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29599")  # unused: the group exists already
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint

    from freeze import comm
    from freeze.integrations.lightning import FreezerCallback

    Net = _modules()

    def trainer(callbacks, **over):
        kw = {
            "accelerator": "cpu",
            "devices": world,
            "strategy": "ddp",
            "max_epochs": EPOCHS,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": callbacks,
        }
        kw.update(over)
        return pl.Trainer(**kw)

    class Record(pl.Callback):
        """Per optimizer step: bytes sent (the counting hook on whatever wrapper Lightning runs),
        and the parameters."""

        def __init__(self, freezer_cb=None):
            self.freezer_cb, self.steps, self.params, self.buffers, self.counter = freezer_cb, [], [], [], None
            self._last = 0

        def on_fit_start(self, trainer, pl_module):
            if self.freezer_cb is None:  # Lightning's own wrapper: count with the same hook
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

    # 1. #20340 with BaseFinetuning: backbone frozen before training, unfrozen at epoch 1
    class BackboneLater(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, current_epoch, optimizer):
            if current_epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer)

    torch.manual_seed(0)
    model = Net()
    rec = Record()
    trainer(callbacks=[BackboneLater(), rec]).fit(model, _data())
    out["base_finetuning"] = {"params": rec.params, "steps": rec.steps, "backbone": _flat(model.backbone)}

    # 2. the same schedule with FreezerCallback, gradient accumulation, and a checkpoint per epoch
    torch.manual_seed(0)
    model = Net()
    cb = FreezerCallback("gradual-unfreeze", blocks=["backbone", "head"])
    rec = Record(cb)
    ckpt = ModelCheckpoint(dirpath=f"{workdir}/ckpt", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    trainer(callbacks=[cb, rec, ckpt], accumulate_grad_batches=2, enable_checkpointing=True).fit(model, _data())
    f = cb.freezer
    out["freezer"] = {
        "params": rec.params,
        "buffers": rec.buffers,
        "steps": rec.steps,
        "decisions": [(d.epoch, d.boundary_before, d.boundary_after) for d in f.decisions],
        "backbone_bytes": sum(p.numel() * 4 for p in model.backbone.parameters()),
        "final": _flat(model),
    }
    torch.distributed.barrier()

    # 3. resumed from the checkpoint written at the end of epoch 0 (boundary 1, about to unfreeze)
    torch.manual_seed(1)  # other initial weights: the checkpoint must restore them
    model = Net()
    cb = FreezerCallback("gradual-unfreeze", blocks=["backbone", "head"])
    trainer(callbacks=[cb], accumulate_grad_batches=2).fit(model, _data(), ckpt_path=f"{workdir}/ckpt/epoch=0.ckpt")
    out["resumed"] = {
        "decisions": [(d.epoch, d.boundary_before, d.boundary_after) for d in cb.freezer.decisions],
        "final": _flat(model),
    }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lightning")
    return run_distributed(lightning_worker, 2, workdir, str(workdir), deadline_s=300, collective_timeout_s=120)


def test_issue_20340_base_finetuning_lets_replicas_diverge_after_unfreezing(runs):
    """The bug, shown: after the unfreeze the backbone's gradients are never all-reduced (the bytes
    per step do not grow), so each rank's backbone follows its own data."""
    r0, r1 = runs[0]["base_finetuning"], runs[1]["base_finetuning"]
    assert not torch.equal(r0["backbone"], r1["backbone"])
    assert len({sent for sent, _, _ in r0["steps"]}) == 1  # the same bytes before and after unfreezing


def test_issue_20340_freezer_callback_keeps_replicas_bit_identical_at_every_step(runs):
    r0, r1 = runs[0]["freezer"], runs[1]["freezer"]
    assert r0["decisions"] == [(0, 1, 0)]  # frozen in epoch 0, unfrozen from epoch 1: #20340's schedule
    assert len(r0["params"]) == len(r1["params"]) > 0
    for t, (a, b) in enumerate(zip(r0["params"], r1["params"])):
        assert torch.equal(a, b), f"step {t}: replicas differ"


def test_bytes_sent_equal_the_trainable_gradient_bytes_at_every_boundary(runs):
    for r in runs:
        steps = r["freezer"]["steps"]
        assert all(sent == trainable for sent, trainable, _ in steps), steps
        boundaries = [k for _, _, k in steps]
        assert 1 in boundaries and 0 in boundaries
        frozen_bytes = {sent for sent, _, k in steps if k == 1}
        open_bytes = {sent for sent, _, k in steps if k == 0}
        assert open_bytes == {frozen_bytes.pop() + r["freezer"]["backbone_bytes"]}


def test_frozen_backbone_and_its_batchnorm_statistics_do_not_move_while_frozen(runs):
    """Weights, and BatchNorm statistics despite Lightning's model.train() at each epoch start,
    identical on both ranks while frozen (trainable statistics are rank-local between forwards)."""
    r0, r1 = runs[0]["freezer"], runs[1]["freezer"]
    first_open = next(t for t, (_, _, k) in enumerate(r0["steps"]) if k == 0)
    assert first_open >= 2
    backbone = sum(p.numel() for p in _modules()().backbone.parameters())
    for t in range(1, first_open):
        assert torch.equal(r0["params"][t][:backbone], r0["params"][0][:backbone]), t
        assert torch.equal(r0["buffers"][t], r0["buffers"][0]), t
        assert torch.equal(r0["buffers"][t], r1["buffers"][t]), t


def test_resume_from_a_lightning_checkpoint_reproduces_decisions_and_weights(runs):
    for r in runs:
        assert r["resumed"]["decisions"] == r["freezer"]["decisions"]
        assert torch.equal(r["resumed"]["final"], r["freezer"]["final"])


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
