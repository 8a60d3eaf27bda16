"""The pricing a horizon run trains with (freeze.pipeline.pricing), from the profiles the horizon study
committed, and what the launcher refuses before any worker starts (preflight)."""

from pathlib import Path

import pytest

from freeze.pipeline.cluster.spec import CLUSTER_CORES_ENV
from freeze.pipeline.config import ConfigError, load_config
from freeze.pipeline.costmodel import load_profile
from freeze.pipeline.preflight import preflight
from freeze.pipeline.pricing import run_pricing

REPO = Path(__file__).resolve().parents[2]
FINETUNE = REPO / "experiments/configs/fdsl32_finetune.toml"
PROFILES = REPO / "report/horizon"
STUDY = [
    "data.dataset=fdsl32-mix",
    "data.augment=views:4",
    "optim.name=adamw",
    "optim.lr=1e-3",
    "optim.weight_decay=0.01",
    "freeze.cache=memory",
    "freeze.policy=horizon:exchange=10",
]
LOOPBACK = ["dist.nproc=2", f"freeze.cost_profile={PROFILES / 'profile-loopback-adamw.json'}"]
CLUSTER = [
    "dist.nproc=1",
    "cluster.nodes=2",
    "cluster.bandwidth=1gbit",
    f"freeze.cost_profile={PROFILES / 'profile-cluster-adamw.json'}",
]


@pytest.fixture(autouse=True)
def the_profiles_machine(monkeypatch):
    """The committed profiles were measured on 2 cores (one process each): the run's layout is laid out
    as on that machine, whatever cores this one has."""
    monkeypatch.setattr("freeze.pipeline.cluster.spec.available_cores", lambda: [0, 1])
    monkeypatch.delenv(CLUSTER_CORES_ENV, raising=False)


def config(*overrides):
    return load_config(FINETUNE, [*STUDY, *overrides], check_files=False)


def blocks_of(cfg) -> list[str]:
    return [b.name for b in load_profile(cfg.freeze.cost_profile).blocks]


def test_pricing_follows_the_topology_the_cache_and_the_schedule():
    loopback, cluster = config(*LOOPBACK), config(*CLUSTER)
    on_loopback = run_pricing(loopback, 34, blocks_of(loopback))
    on_cluster = run_pricing(cluster, 34, blocks_of(cluster))
    bf16 = run_pricing(config(*CLUSTER, "freeze.comm_hook=bf16"), 34, blocks_of(cluster))
    for pricing in (on_loopback, on_cluster, bf16):
        assert len(pricing.step_time_s) == 10 and len(pricing.lr_per_step) == 5 * 34
        assert list(pricing.step_time_s) == sorted(pricing.step_time_s, reverse=True)  # freezing more is never slower
    assert on_cluster.step_time_s[0] > 1.5 * on_loopback.step_time_s[0]  # the 1 Gbit/s link's all-reduce
    assert bf16.step_time_s[0] < on_cluster.step_time_s[0]  # half the bytes on that link
    assert on_loopback.lr_per_step[0] == pytest.approx(1e-3) and on_loopback.lr_per_step[-1] < 1e-6  # cosine to zero


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (("freeze.comm_hook=powersgd4",), "freeze.comm_hook: powersgd4 is not priced"),
        (("train.batch_size=32",), "measured at batch 64, this run's is 32"),
        (("optim.name=sgd", "optim.lr=0.05"), "measured with optimizer adamw"),
        (("dist.threads_per_worker=2",), "measured in core layout c0t1-c1t1, this run's on this machine is c0t2-c1t2"),
    ],
)
def test_what_the_cost_model_cannot_price_is_refused_in_one_line(overrides, field):
    cfg = config(*LOOPBACK, *overrides)
    with pytest.raises(ConfigError) as err:
        run_pricing(cfg, 34, blocks_of(cfg))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_inside_a_cluster_node_the_layout_is_the_whole_clusters(monkeypatch):
    """An emulated node's worker is pinned to its own core: its pricing must check the profile against
    the cluster's layout, which the launcher names (the horizon study's cluster runs of seed 2 were
    refused before it did)."""
    monkeypatch.setattr("freeze.pipeline.cluster.spec.available_cores", lambda: [0])  # node 0's view
    cluster = config(*CLUSTER)
    with pytest.raises(ConfigError, match="this run's on this machine is c0t1-c0t1"):
        run_pricing(cluster, 34, blocks_of(cluster))
    monkeypatch.setenv(CLUSTER_CORES_ENV, "0,1")  # as freeze.pipeline.cluster.launch sets it
    assert len(run_pricing(cluster, 34, blocks_of(cluster)).step_time_s) == 10


def test_the_launcher_refuses_horizon_without_a_profile_or_held_out_images():
    with pytest.raises(ConfigError, match="^freeze.cost_profile: not set; .*experiments.profile_run"):
        preflight(config("dist.nproc=2"))
    with pytest.raises(ConfigError, match="^data.val_size: freeze.policy=horizon checks"):
        preflight(config(*LOOPBACK, "data.val_size=0"))
    preflight(config(*LOOPBACK, "freeze.policy=horizon:probation=0", "data.val_size=0"))  # no check: no images needed


def test_a_resume_prices_with_what_the_run_recorded_not_an_edited_profile(tmp_path):
    """Issue 50 (reliability.md case 5): the profile rewritten between an interruption and the resume
    changed the resumed run's decisions. The pricing a run started with is recorded in its directory
    and a resume from a checkpoint reads only that."""
    import json

    from freeze.pipeline.pricing import PRICING_FILE, recorded_pricing

    live = tmp_path / "live.json"
    live.write_text((PROFILES / "profile-loopback-adamw.json").read_text())
    cfg = config("dist.nproc=2", f"freeze.cost_profile={live}")
    blocks = blocks_of(cfg)
    first = recorded_pricing(cfg, tmp_path, 34, blocks, cfg.optim.lr, resuming=False, write=True)
    assert json.loads((tmp_path / PRICING_FILE).read_text())["step_time_s"] == list(first.step_time_s)
    profile = json.loads(live.read_text())  # another machine's costs, same layout: every block 3x dearer
    for block in profile["blocks"]:
        for key, value in block.items():
            if key.endswith("_ms") and isinstance(value, (int, float)):
                block[key] = 3 * value
    live.write_text(json.dumps(profile))
    assert recorded_pricing(cfg, tmp_path, 34, blocks, cfg.optim.lr, resuming=True, write=True) == first
    # a fresh start (no checkpoint to resume) prices from the files again, and records that
    again = recorded_pricing(cfg, tmp_path, 34, blocks, cfg.optim.lr, resuming=False, write=True)
    assert again != first
    # a record for another run shape is refused in one line
    with pytest.raises(ConfigError, match=r"pricing.json: prices 10 boundaries over 170 steps, .* 1700 steps"):
        recorded_pricing(
            config("dist.nproc=2", f"freeze.cost_profile={live}", "train.epochs=50"),
            tmp_path,
            34,
            blocks,
            cfg.optim.lr,
            resuming=True,
            write=False,
        )


def test_a_profile_measured_on_another_cpu_is_refused(tmp_path, monkeypatch):
    """Reliability.md case 6: a profile "from another machine" in the same core layout passed. A profile
    now names its CPU (profiles older than that, as the committed ones, pass on their layout alone)."""
    import json

    other = json.loads((PROFILES / "profile-loopback-adamw.json").read_text())
    other["meta"]["cpu"], other["meta"]["host"] = "Imaginary CPU 9000", "elsewhere"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    monkeypatch.setattr("freeze.pipeline.pricing.cpu_name", lambda: "AMD EPYC here")
    cfg = config("dist.nproc=2", f"freeze.cost_profile={path}")
    with pytest.raises(
        ConfigError, match=r"measured on Imaginary CPU 9000 \(host elsewhere\), this machine is AMD EPYC"
    ):
        run_pricing(cfg, 34, blocks_of(cfg))
    other["meta"]["cpu"] = "AMD EPYC here"  # the same kind of CPU on another host (a cluster's nodes): priced
    path.write_text(json.dumps(other))
    assert len(run_pricing(cfg, 34, blocks_of(cfg)).step_time_s) == 10


def test_the_pricing_lr_is_the_lr_the_run_trains_at():
    cfg = config(*LOOPBACK)
    plain = run_pricing(cfg, 34, blocks_of(cfg))
    doubled = run_pricing(cfg, 34, blocks_of(cfg), base_lr=2 * cfg.optim.lr)
    assert doubled.lr_per_step == pytest.approx([2 * lr for lr in plain.lr_per_step])


def test_a_profile_of_another_process_count_is_refused_where_the_runs_are_planned():
    """Reliability.md case 18: a horizon arm on 1 process priced with the 2-process profile passed the
    study's up-front check and was refused only when its turn came, up to an hour in."""
    with pytest.raises(ConfigError, match="measured with 2 processes, this run has 1"):
        preflight(config("dist.nproc=1", f"freeze.cost_profile={PROFILES / 'profile-loopback-adamw.json'}"))


def test_a_priced_run_too_short_for_its_first_decision_is_refused_before_it_starts():
    """Reliability probe case 11: too few evaluations for the first rates was found only when the
    run's turn came (a study's other runs hours in); the launcher now counts them from the config."""
    from freeze.pipeline.data import planned_steps_per_epoch

    assert planned_steps_per_epoch(config(*LOOPBACK)) == 34  # 4352 images / (64 x 2 workers), as the loader
    assert planned_steps_per_epoch(config(*CLUSTER)) == 34  # 1 worker on each of 2 nodes
    assert planned_steps_per_epoch(config(*LOOPBACK, "train.budget_fraction=0.5")) == 17
    preflight(config(*LOOPBACK))  # every 6 steps: 28 evaluations, 9 needed
    with pytest.raises(ConfigError) as refused:
        preflight(config(*LOOPBACK, "freeze.interval_steps=24"))  # 170 // 24 = 7
    message = str(refused.value)
    assert message.startswith("freeze.interval_steps: 24; Freezer: policy 'horizon:")
    assert "needs 9 evaluations before its first decision and this run has 7" in message and "\n" not in message
