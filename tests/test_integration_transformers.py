"""FreezeTrainer on 2 gloo ranks: the script of docs/integrations/transformers.md (a tiny BERT
built from a config, no download), executed as written, before and after its diff.

One spawn runs every scenario: the changed script (bf16 autocast, gradient accumulation,
max_grad_norm, save_steps checkpoints); the same run resumed from a mid-run checkpoint; and the
unchanged script freezing the usual way (requires_grad_(False) in a callback), which keeps sending
every bucket.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import doc_scripts
from tests.distributed_harness import run_distributed
from tests.optional_packages import requires

pytestmark = requires("transformers", "accelerate")

POLICY_KW = {"freeze_interval_steps": 3}  # decisions every 3 steps: several boundaries in 12 steps
# 4 optimizer steps per epoch: checkpoint-4 is written at an epoch's last step (before the Trainer's
# on_epoch_end) and in the middle of a decision interval; the resume starts from it.
RESUME_AT = 4
TEST_ARGS = {"ddp_backend": "gloo", "logging_strategy": "no", "data_seed": 0, "disable_tqdm": True, "save_steps": 4}


def _flat(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def freeze_trainer_worker(rank, world, workdir):
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        os.environ[k] = str(v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from transformers import TrainerCallback

    from freeze import comm

    after = doc_scripts.load("transformers.md", "after", workdir)
    before = doc_scripts.load("transformers.md", "before", workdir)

    class Record(TrainerCallback):
        """Per optimizer step: bytes sent, trainable bytes, boundary (after after_backward, before
        the decision), and the parameters after the step; the dtype a trained layer computes in."""

        def __init__(self):
            self.trainer, self.bytes, self.params, self.dtypes = None, [], [], set()

        def on_train_begin(self, args, state, control, model=None, **kw):
            layer = model.bert.encoder.layer[2].output.dense
            layer.register_forward_hook(lambda m, a, o: self.dtypes.add(str(o.dtype)) if m.training else None)

        def on_pre_optimizer_step(self, args, state, control, **kw):
            f = self.trainer.freezer
            self.bytes.append((f.counters.allreduce_bytes_last_step, f.trainable_grad_bytes, f.boundary))

        def on_step_end(self, args, state, control, model=None, **kw):
            self.params.append(_flat(model))

    out = {}
    # 1. the page's script, as changed
    rec = Record()
    trainer = _run(after, rec, f"{workdir}/full", trainer_kwargs=POLICY_KW, **TEST_ARGS)
    f = trainer.freezer
    model = trainer.model
    blocks = [[n for n, p in model.named_parameters() if any(p is q for q in b.params)] for b in f.blocks]
    out["full"] = {
        "bytes": rec.bytes,
        "params": rec.params,
        "decisions": [(d.step, d.boundary_before, d.boundary_after) for d in f.decisions],
        "blocks": blocks,
        "autocast": sorted(rec.dtypes),
        "is_freezer_module": trainer.model_wrapped is f.module,
        "checkpoints": sorted(os.listdir(f"{workdir}/full")),
        "has_state": os.path.isfile(f"{workdir}/full/checkpoint-{RESUME_AT}/freezer.pt"),
        "final": _flat(model),
    }
    torch.distributed.barrier()
    # 2. resumed from checkpoint-4 (an epoch's last step, inside a decision interval)
    rec2 = Record()
    trainer2 = _run(
        after,
        rec2,
        f"{workdir}/full",
        resume_from_checkpoint=f"{workdir}/full/checkpoint-{RESUME_AT}",
        trainer_kwargs=POLICY_KW,
        **TEST_ARGS,
    )
    out["resumed"] = {
        "decisions": [(d.step, d.boundary_before, d.boundary_after) for d in trainer2.freezer.decisions],
        "final": _flat(trainer2.model),
        "bytes": rec2.bytes,
    }
    torch.distributed.barrier()

    # 3. the page's script before the change, freezing the usual way: requires_grad_(False) in a
    # callback at the same steps and boundaries (the Trainer's default find_unused_parameters=True
    # keeps it running), counted with the Freezer's hook on the Trainer's own DDP wrapper
    schedule = {step: after_k for step, _, after_k in out["full"]["decisions"]}
    counter, sent = comm.CommCounter(), []
    holder = {}

    class FreezeByHand(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            holder["trainer"].model_wrapped.register_comm_hook(counter, comm._HOOKS["allreduce"])

        def on_pre_optimizer_step(self, args, state, control, **kw):
            sent.append(counter.allreduce_bytes_total - sum(sent))

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step in schedule:
                frozen = {n for b in blocks[: schedule[state.global_step]] for n in b}
                for n, p in model.named_parameters():
                    p.requires_grad_(n not in frozen)

    import transformers

    init = transformers.Trainer.__init__

    def remember(self, *a, **k):  # the page's script builds the Trainer itself
        init(self, *a, **k)
        holder["trainer"] = self

    transformers.Trainer.__init__ = remember
    try:
        before["main"](f"{workdir}/plain", callbacks=[FreezeByHand()], save_strategy="no", **TEST_ARGS)
    finally:
        transformers.Trainer.__init__ = init
    out["plain"] = {"bytes": sent, "full_model_bytes": sum(p.numel() * 4 for p in model.parameters())}
    return out


def _run(doc, recorder, output_dir, **kwargs):
    """The page's main(), with the recorder bound to the FreezeTrainer main() builds."""
    import freeze.integrations.transformers as integration

    init = integration.FreezeTrainer.__init__

    def remember(self, *a, **k):
        init(self, *a, **k)
        recorder.trainer = self

    integration.FreezeTrainer.__init__ = remember
    try:
        return doc["main"](output_dir, callbacks=[recorder], **kwargs)
    finally:
        integration.FreezeTrainer.__init__ = init


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


@pytest.mark.processes
def test_the_trainer_trains_through_freezer_module_and_freezes(runs):
    r0 = runs[0]["full"]
    assert r0["is_freezer_module"]
    assert r0["decisions"], "the policy never moved the boundary: the scenario tests nothing"
    assert len({b for _, _, b in r0["bytes"]}) >= 2


@pytest.mark.processes
def test_bytes_sent_equal_the_trainable_gradient_bytes_at_every_step(runs):
    for r in runs:
        for step, (sent, trainable, boundary) in enumerate(r["full"]["bytes"]):
            assert sent == trainable, (step, boundary, sent, trainable)


@pytest.mark.processes
def test_frozen_parameters_do_not_move_and_ranks_stay_identical(runs):
    r0, r1 = runs[0]["full"], runs[1]["full"]
    assert _frozen_moved(r0["params"], r0["bytes"], r0["blocks"]) == []
    for t, (a, b) in enumerate(zip(r0["params"], r1["params"])):
        for n in a:
            assert torch.equal(a[n], b[n]), (t, n)


@pytest.mark.processes
def test_bf16_autocast_is_still_active_inside_the_freezer_wrapper(runs):
    assert runs[0]["full"]["autocast"] == ["torch.bfloat16"]


@pytest.mark.processes
def test_checkpoints_carry_the_freezer_state_and_resume_reproduces_decisions_and_weights(runs):
    for r in runs:
        assert r["full"]["has_state"] and f"checkpoint-{RESUME_AT}" in r["full"]["checkpoints"]
        assert r["resumed"]["decisions"] == r["full"]["decisions"]
        for n, p in r["full"]["final"].items():
            assert torch.equal(p, r["resumed"]["final"][n]), n
        assert r["resumed"]["bytes"] == r["full"]["bytes"][RESUME_AT:]


@pytest.mark.processes
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

    doc = doc_scripts.load("transformers.md", "after", tmp_path)
    cases = [
        ({"torch_compile": True}, "torch_compile=False"),
        ({"ddp_static_graph": True, "gradient_accumulation_steps": 2}, "ddp_static_graph=False"),
    ]
    for over, fix in cases:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **over)
        with pytest.raises(ValueError, match=fix) as e:
            FreezeTrainer(model=doc["tiny_bert"](), args=args, train_dataset=doc["dataset"]())
        assert "\n" not in str(e.value)


INTERVAL_STEPS = 2  # 2 epochs of 4 optimizer steps per rank: evaluations at steps 2, 4, 6 (and not 8)


def interval_semantics_worker(rank, world, workdir):
    """FreezeTrainer with ``freeze_interval_steps``: when the policy is asked, and whether the run's
    last step can still move the boundary (it rebuilt a DDP wrapper that never trained: issue 32)."""
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        os.environ[k] = str(v)
    from transformers import TrainingArguments

    from freeze.integrations.transformers import FreezeTrainer

    doc = doc_scripts.load("transformers.md", "after", workdir)
    args = TrainingArguments(
        output_dir=f"{workdir}/interval",
        use_cpu=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=5e-3,
        save_strategy="no",
        report_to=[],
        seed=0,
        **{k: v for k, v in TEST_ARGS.items() if k != "save_steps"},
    )
    # linear freezing grows with the run's progress: the boundary would move at every evaluation
    trainer = FreezeTrainer(
        model=doc["tiny_bert"](),
        args=args,
        train_dataset=doc["dataset"](),
        freeze_policy="linear:freeze_start=0.0,freeze_level=1.0",
        freeze_interval_steps=INTERVAL_STEPS,
    )
    trainer.train()
    f = trainer.freezer
    return {
        "max_steps": trainer.state.max_steps,
        "evaluated_at": [s.end_step for s in f.monitor.history],
        "decisions": [(d.step, d.boundary_before, d.boundary_after) for d in f.decisions],
    }


@pytest.mark.processes
def test_interval_decisions_start_at_the_interval_and_never_come_at_the_last_step(tmp_path):
    r0, r1 = run_distributed(interval_semantics_worker, 2, tmp_path, str(tmp_path), deadline_s=240)
    assert r0 == r1
    assert r0["max_steps"] == 8
    assert r0["evaluated_at"] == [2, 4, 6]  # the first at the interval, none at step 8
    assert r0["decisions"] and all(step < r0["max_steps"] for step, _, _ in r0["decisions"])


def test_the_hf_extra_installs_only_transformers_that_freeze_trainer_runs_on():
    """`pip install -e ".[hf]"` let in transformers 4.57, on which FreezeTrainer refuses to import."""
    import ast
    from pathlib import Path

    import transformers
    from packaging.requirements import Requirement

    from freeze.integrations.transformers import TRANSFORMERS_MIN_MAJOR

    tree = ast.parse((Path(__file__).parents[1] / "setup.py").read_text())
    extras = next(
        ast.literal_eval(k.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg == "extras_require"
    )
    spec = next(Requirement(r).specifier for r in extras["hf"] if Requirement(r).name == "transformers")
    assert not spec.contains(f"{TRANSFORMERS_MIN_MAJOR - 1}.99.0") and spec.contains(f"{TRANSFORMERS_MIN_MAJOR}.0.0")
    assert spec.contains(transformers.__version__)  # the version the suite runs
