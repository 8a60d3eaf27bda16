"""FreezeTrainer on 2 gloo ranks with a tiny BERT built from a config (no download).

One spawn runs every scenario: a run with bf16 autocast, gradient accumulation, gradient clipping
and save_steps checkpoints; the same run resumed from a mid-run checkpoint; and the stock Trainer
with the same freezing done by a callback (the usual recipe), whose frozen weights still move.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch

from tests.distributed_harness import run_distributed

SAMPLES, SEQ, VOCAB, LABELS = 64, 8, 50, 3
POLICY = "autofreeze:percentile=80"


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg)


def dataset():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    labels = (ids[:, 0] % LABELS).long()  # learnable, so gradients keep changing
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels[i]}
        for i in range(SAMPLES)
    ]


def training_args(output_dir, **over):
    from transformers import TrainingArguments

    base = {
        "output_dir": output_dir,
        "use_cpu": True,
        "ddp_backend": "gloo",
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "num_train_epochs": 3,
        "learning_rate": 5e-3,
        "max_grad_norm": 1.0,
        "bf16": True,
        "save_strategy": "steps",
        "save_steps": 5,
        "logging_strategy": "no",
        "report_to": [],
        "seed": 0,
        "data_seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    base.update(over)
    return TrainingArguments(**base)


def _flat(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Recorder:
    """Per optimizer step: the bytes DDP sent, the trainable bytes, the boundary, the parameters."""

    def __init__(self):
        from transformers import TrainerCallback

        rec = self

        class _CB(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                f = rec.trainer.freezer
                rec.bytes.append((f.counters.allreduce_bytes_last_step, f.trainable_grad_bytes, f.boundary))

            def on_step_end(self, args, state, control, **kw):
                rec.params.append(_flat(rec.trainer.model))

        self.callback = _CB()
        self.bytes, self.params, self.trainer = [], [], None


def freeze_trainer_worker(rank, world, workdir):
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from transformers import Trainer, TrainerCallback

    from freeze.integrations.transformers import FreezeTrainer

    out = {}
    # 1. the full run
    rec = Recorder()
    model = tiny_bert()
    autocast_dtypes = []
    model.bert.encoder.layer[2].output.dense.register_forward_hook(
        lambda m, a, o: autocast_dtypes.append(o.dtype) if m.training else None
    )
    trainer = FreezeTrainer(
        model=model,
        args=training_args(f"{workdir}/full"),
        train_dataset=dataset(),
        freeze_policy=POLICY,
        freeze_interval_steps=2,
        callbacks=[rec.callback],
    )
    rec.trainer = trainer
    trainer.train()
    f = trainer.freezer
    blocks = [[n for n, p in model.named_parameters() if any(p is q for q in b.params)] for b in f.blocks]
    out["full"] = {
        "bytes": rec.bytes,
        "params": rec.params,
        "decisions": [(d.step, d.boundary_before, d.boundary_after) for d in f.decisions],
        "blocks": blocks,
        "autocast": sorted({str(d) for d in autocast_dtypes}),
        "is_freezer_module": trainer.model_wrapped is f.module,
        "checkpoints": sorted(os.listdir(f"{workdir}/full")),
        "has_state": os.path.isfile(f"{workdir}/full/checkpoint-5/freezer.pt"),
        "final": _flat(model),
    }
    torch.distributed.barrier()
    # 2. resumed from the checkpoint at step 5 (mid-epoch, inside a decision interval)
    rec2 = Recorder()
    trainer2 = FreezeTrainer(
        model=tiny_bert(),
        args=training_args(f"{workdir}/full"),
        train_dataset=dataset(),
        freeze_policy=POLICY,
        freeze_interval_steps=2,
        callbacks=[rec2.callback],
    )
    rec2.trainer = trainer2
    trainer2.train(resume_from_checkpoint=f"{workdir}/full/checkpoint-5")
    out["resumed"] = {
        "decisions": [(d.step, d.boundary_before, d.boundary_after) for d in trainer2.freezer.decisions],
        "final": _flat(trainer2.model),
        "bytes": rec2.bytes,
    }
    torch.distributed.barrier()

    # 3. the usual recipe: the stock Trainer, freezing with requires_grad_(False) in a callback at the
    # same steps and boundaries (the Trainer's default find_unused_parameters=True keeps it running)
    schedule = {step: after for step, _, after in out["full"]["decisions"]}
    names_of = blocks

    class FreezeByHand(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step in schedule:
                frozen = {n for b in names_of[: schedule[state.global_step]] for n in b}
                for n, p in model.named_parameters():
                    p.requires_grad_(n not in frozen)

    from freeze import comm

    plain_model = tiny_bert()
    counter, sent = comm.CommCounter(), []

    class Count(TrainerCallback):  # the Freezer's counting hook on the Trainer's own DDP wrapper
        def on_train_begin(self, args, state, control, **kw):
            plain.model_wrapped.register_comm_hook(counter, comm._HOOKS["allreduce"])

        def on_pre_optimizer_step(self, args, state, control, **kw):
            sent.append(counter.allreduce_bytes_total - sum(sent))

    plain = Trainer(
        model=plain_model,
        args=training_args(f"{workdir}/plain", save_strategy="no"),
        train_dataset=dataset(),
        callbacks=[FreezeByHand(), Count()],
    )
    plain.train()
    out["plain"] = {"bytes": sent, "full_model_bytes": sum(p.numel() * 4 for p in plain_model.parameters())}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hf")
    return run_distributed(freeze_trainer_worker, 2, workdir, str(workdir), deadline_s=300, collective_timeout_s=120)


def _frozen_moved(params, bytes_, blocks):
    """Names of parameters that changed in a step during which their block was frozen."""
    moved = []
    for t in range(1, len(params)):
        boundary = bytes_[t][2]
        for name in (n for b in blocks[:boundary] for n in b):
            if not torch.equal(params[t - 1][name], params[t][name]):
                moved.append((t, name))
    return moved


def test_the_trainer_trains_through_freezer_module_and_freezes(runs):
    r0 = runs[0]["full"]
    assert r0["is_freezer_module"]
    assert r0["decisions"], "the policy never moved the boundary: the scenario tests nothing"
    assert len({b for _, _, b in r0["bytes"]}) >= 2


def test_bytes_sent_equal_the_trainable_gradient_bytes_at_every_step(runs):
    for r in runs:
        for step, (sent, trainable, boundary) in enumerate(r["full"]["bytes"]):
            assert sent == trainable, (step, boundary, sent, trainable)


def test_frozen_parameters_do_not_move_and_ranks_stay_identical(runs):
    r0, r1 = runs[0]["full"], runs[1]["full"]
    assert _frozen_moved(r0["params"], r0["bytes"], r0["blocks"]) == []
    for t, (a, b) in enumerate(zip(r0["params"], r1["params"])):
        for n in a:
            assert torch.equal(a[n], b[n]), (t, n)


def test_bf16_autocast_is_still_active_inside_the_freezer_wrapper(runs):
    assert runs[0]["full"]["autocast"] == ["torch.bfloat16"]


def test_checkpoints_carry_the_freezer_state_and_resume_reproduces_decisions_and_weights(runs):
    for r in runs:
        assert r["full"]["has_state"] and "checkpoint-5" in r["full"]["checkpoints"]
        assert r["resumed"]["decisions"] == r["full"]["decisions"]
        for n, p in r["full"]["final"].items():
            assert torch.equal(p, r["resumed"]["final"][n]), n
        assert r["resumed"]["bytes"] == r["full"]["bytes"][5:]


def test_the_usual_recipe_keeps_sending_every_bucket_where_ours_sends_the_trainable_bytes(runs):
    """requires_grad_(False) in a callback, on the wrapper the Trainer built before the freeze (its
    default find_unused_parameters=True keeps it running): DDP still all-reduces every bucket."""
    full, plain = runs[0]["full"], runs[0]["plain"]
    assert len(plain["bytes"]) == len(full["bytes"])
    assert all(b == plain["full_model_bytes"] for b in plain["bytes"])
    frozen_steps = [t for t, (_, _, k) in enumerate(full["bytes"]) if k > 0]
    assert frozen_steps and all(full["bytes"][t][0] < plain["bytes"][t] for t in frozen_steps)


def test_unsupported_settings_are_refused_in_one_line(tmp_path):
    from transformers import TrainingArguments

    from freeze.integrations.transformers import FreezeTrainer

    cases = [
        ({"torch_compile": True}, "torch_compile=False"),
        ({"ddp_static_graph": True, "gradient_accumulation_steps": 2}, "ddp_static_graph=False"),
    ]
    for over, fix in cases:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **over)
        with pytest.raises(ValueError, match=fix) as e:
            FreezeTrainer(model=tiny_bert(), args=args, train_dataset=dataset())
        assert "\n" not in str(e.value)
