"""fp16 with a GradScaler inside FreezeTrainer, as far as a CPU machine can run it (2 gloo ranks).

What the pinned stack does on CPU (transformers 5.23.0, accelerate 1.15.0): ``fp16=True`` is not
refused, it is dropped. ``Accelerator.__init__`` builds the GradScaler and turns on autocast only
when ``mixed_precision == "fp16" and device.type != "cpu"``, so on CPU ``native_amp`` stays False,
``accelerator.scaler`` stays None and the model computes in float32, without a word. The first
scenario pins that down.

The second puts back by hand what accelerate does on CUDA, with CPU kernels: ``native_amp=True``
(autocast to float16, on the CPU) and a ``torch.amp.GradScaler("cpu")`` whose first scale is large
enough to overflow the float16 backward. The Trainer's own fp16 machinery then runs as on a GPU
(``scaler.scale(loss).backward()``, ``unscale_`` before clipping, ``scaler.step`` skipping overflowed
steps, ``scaler.update``), and the test checks what the Freezer does inside it: every step the
scaler skipped is one the Freezer detected on the device and did not read, the statistics it read are
the unscaled gradients' (FreezeTrainer passes the scaler's scale tensor), bytes stay exact, ranks
stay identical. Not run here: CUDA kernels, the CUDA GradScaler, float16 gradients reduced by NCCL.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests import doc_scripts
from tests.distributed_harness import run_distributed
from tests.optional_packages import requires

pytestmark = [requires("transformers", "accelerate"), pytest.mark.processes]

INTERVAL = 3  # decisions every 3 optimizer steps: intervals close inside the run


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def fp16_worker(rank, world, workdir):
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from transformers import TrainerCallback, TrainingArguments

    from freeze.integrations.transformers import FreezeTrainer

    doc = doc_scripts.load("transformers.md", "after", workdir)

    class Recording(FreezeTrainer):
        """Where FreezeTrainer calls after_backward (the micro-batch whose backward all-reduced,
        gradients still scaled, before clipping): the same statistic computed by hand, unscaled
        with the host's copy of the scale; the bytes of the step."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.reference, self.scales, self.bytes = [], [], []

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.accelerator.sync_gradients:
                f, scaler = self.freezer, self.accelerator.scaler
                scale = scaler.get_scale() if scaler is not None else 1.0
                norms = []
                for i, block in enumerate(f.blocks):
                    grads = [p.grad.float().reshape(-1) for p in block.params if p.grad is not None]
                    norms.append(None if i < f.boundary or not grads else float(torch.cat(grads).norm()) / scale)
                self.reference.append(norms)
                self.scales.append(scale)
                self.bytes.append((f.counters.allreduce_bytes_last_step, f.trainable_grad_bytes))
            return loss

    class Steps(TrainerCallback):
        """Per optimizer step: skipped by the scaler or not, and the parameters after it; the dtype
        a trained layer computes in."""

        def __init__(self, trainer):
            self.trainer, self.skipped, self.params, self.dtypes = trainer, [], [], set()

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.params.append(_params(model))
            layer = model.bert.encoder.layer[2].output.dense
            layer.register_forward_hook(lambda m, a, o: self.dtypes.add(str(o.dtype)) if m.training else None)

        def on_step_end(self, args, state, control, model=None, **kw):
            # GradScaler.update() backs the scale off exactly when the step found inf/NaN and
            # skipped (growth_interval outlasts the run). accelerate's optimizer_step_was_skipped
            # reads False on those steps in this emulation, with the stock Trainer too.
            scaler = self.trainer.accelerator.scaler
            self.skipped.append(scaler is not None and scaler.get_scale() < self.trainer.scales[-1])
            self.params.append(_params(model))

    def run(name, inject, **over):
        settings = {
            "use_cpu": True, "fp16": True, "ddp_backend": "gloo", "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2, "num_train_epochs": 2, "learning_rate": 5e-3, "max_grad_norm": 1.0,
            "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True, "report_to": [], "seed": 0,
            "data_seed": 0,
        }  # fmt: skip
        args = TrainingArguments(output_dir=f"{workdir}/{name}-rank{rank}", **{**settings, **over})
        trainer = Recording(
            model=doc["tiny_bert"](),
            args=args,
            train_dataset=doc["dataset"](),
            freeze_policy="autofreeze",
            freeze_interval_steps=INTERVAL,
        )
        acc = trainer.accelerator
        shipped = {"mixed_precision": acc.mixed_precision, "native_amp": acc.native_amp, "scaler": acc.scaler}
        if inject:
            # What Accelerator.__init__ sets up for fp16 on CUDA, on the CPU. A first scale of 2**30
            # overflows the float16 backward; backing off by 2**-8 reaches a finite scale in a few steps.
            acc.native_amp = True
            acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, backoff_factor=2.0**-8, growth_interval=1000)
        steps = Steps(trainer)
        trainer.add_callback(steps)
        trainer.train()
        f = trainer.freezer
        return {
            "shipped": {**shipped, "scaler": None if shipped["scaler"] is None else type(shipped["scaler"]).__name__},
            "dtypes": sorted(steps.dtypes),
            "skipped": steps.skipped,
            "params": steps.params,
            "reference": trainer.reference,
            "scales": trainer.scales,
            "bytes": trainer.bytes,
            "history": [(h.end_step, h.steps, h.skipped_steps, h.mean_step_grad_norm) for h in f.history],
            "declared_skips": f.counters.skipped_steps,
        }

    out = {"as_shipped": run("shipped", inject=False, max_steps=2)}
    torch.distributed.barrier()
    out["scaler"] = run("scaler", inject=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hf_fp16")
    return run_distributed(fp16_worker, 2, workdir, str(workdir), deadline_s=300, collective_timeout_s=120)


def test_fp16_on_cpu_is_dropped_by_accelerate_not_refused(runs):
    """The pinned accelerate builds no GradScaler and no autocast on CPU: fp16=True trains in
    float32. So the fp16 path cannot run here as shipped (it needs a CUDA, XPU, NPU, ... device)."""
    for r in runs:
        shipped = r["as_shipped"]
        assert shipped["shipped"] == {"mixed_precision": "fp16", "native_amp": False, "scaler": None}
        assert shipped["dtypes"] == ["torch.float32"]
        assert shipped["scales"] == [1.0, 1.0]  # no scaler: gradients are never scaled
        assert all(sent == trainable for sent, trainable in shipped["bytes"])


def test_with_a_grad_scaler_the_trainer_computes_in_fp16_and_skips_overflowed_steps(runs):
    """The scaler's skipped steps leave every parameter as it was; the others move them."""
    r = runs[0]["scaler"]
    assert r["dtypes"] == ["torch.float16"]
    skipped = r["skipped"]
    assert any(skipped) and not all(skipped), skipped  # the scenario has both kinds of step
    for t, was_skipped in enumerate(skipped):
        unchanged = torch.equal(r["params"][t], r["params"][t + 1])
        assert unchanged == was_skipped, (t, was_skipped)


def test_every_step_the_scaler_skipped_is_one_the_freezer_detected_and_did_not_read(runs):
    """Per closed interval: its skipped steps are exactly the scaler's (none declared with
    skipped=True: the Freezer found them on the device), and its mean per-step gradient norm per block
    is the mean over the other steps of the unscaled norms (the loss scale was taken into account)."""
    for r in runs:
        s = r["scaler"]
        assert len(s["history"]) >= 2 and s["declared_skips"] == 0
        for end_step, steps, skipped_steps, mean_norms in s["history"]:
            window = range(end_step - steps, end_step)
            assert skipped_steps == sum(s["skipped"][t] for t in window), (end_step, s["skipped"])
            read = [t for t in window if not s["skipped"][t]]
            for i, measured in enumerate(mean_norms):
                if measured is None:
                    continue
                expected = sum(s["reference"][t][i] for t in read) / len(read)
                assert math.isfinite(measured) and math.isclose(measured, expected, rel_tol=1e-4), (end_step, i)
        overflowed = [t for t, sk in enumerate(s["skipped"]) if sk]
        assert all(not math.isfinite(sum(n for n in s["reference"][t] if n is not None)) for t in overflowed)


def test_bytes_stay_exact_and_ranks_identical_through_overflowed_steps(runs):
    for r in runs:
        assert all(sent == trainable for sent, trainable in r["scaler"]["bytes"]), r["scaler"]["bytes"]
    r0, r1 = runs[0]["scaler"], runs[1]["scaler"]
    assert r0["skipped"] == r1["skipped"]
    for t, (a, b) in enumerate(zip(r0["params"], r1["params"])):
        assert torch.equal(a, b), t
