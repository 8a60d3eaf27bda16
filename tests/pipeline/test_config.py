import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from freeze.pipeline.config import (
    SECTIONS,
    Augment,
    Config,
    ConfigError,
    OptimConfig,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
    section_keys,
)
from freeze.pipeline.preflight import preflight

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_match_the_schema():
    config = load_config(None)
    assert config == Config()
    assert SECTIONS == (
        "run",
        "data",
        "model",
        "freeze",
        "optim",
        "schedule",
        "train",
        "dist",
        "cluster",
        "log",
        "plugins",
    )
    assert (config.run.name, config.run.study, config.run.out_dir, config.run.seed) == ("run", "default", "runs", 0)
    assert (config.data.dataset, config.data.val_size, config.data.augment.spec()) == ("cifar10", 5000, "crop-flip")
    assert (config.model.arch, config.model.stem, config.model.weights, config.model.blocks) == (
        "resnet18",
        "imagenet",
        "none",
        "default",
    )
    assert (config.freeze.policy, config.freeze.comm_hook, config.freeze.bucket_cap_mb) == ("none", "allreduce", 25.0)
    assert config.optim.betas == (0.9, 0.999) and config.optim.weight_decay == 1e-4 and config.optim.eps == 1e-8
    assert (config.schedule.name, config.schedule.step_size_epochs, config.schedule.gamma) == ("constant", 30, 0.1)
    assert (config.train.epochs, config.train.batch_size, config.train.precision) == (50, 64, "fp32")
    assert (config.dist.nproc, config.dist.backend, config.dist.device, config.dist.timeout_s) == (
        1,
        "auto",
        "auto",
        300,
    )
    assert config.run_dir() == Path("runs") / "default" / "run"
    assert config.run_group() == "none"


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().optim.lr = 1.0  # type: ignore[misc]


def test_file_values_and_int_for_float(tmp_path):
    path = write(tmp_path, '[optim]\nname = "adamw"\nlr = 1\nbetas = [0.8, 0.9]\n[run]\nname = "a"\nstudy = "s"\n')
    config = load_config(path)
    assert config.optim.name == "adamw"
    assert config.optim.lr == 1.0 and type(config.optim.lr) is float
    assert config.optim.betas == (0.8, 0.9)
    assert config.optim.momentum == 0.9  # untouched keys keep defaults
    assert config.run_dir() == Path("runs") / "s" / "a"


BAD_OVERRIDES = [
    # (overrides, substrings the single error line must contain)
    (["optim.name=adam"], ["optim.name", "'adam'", "accepted: sgd, adamw"]),
    (["train.precision=fp8"], ["train.precision", "accepted: fp32, bf16, fp16"]),
    (["data.dataset=imagenet"], ["data.dataset", "cifar10, synthetic-source, synthetic-target"]),
    (["schedule.name=linear"], ["schedule.name", "constant, step, cosine, exponential"]),
    (["dist.backend=mpi"], ["dist.backend", "auto, gloo, nccl"]),
    (["model.blocks=layers"], ["model.blocks", "default, children"]),
    (["train.epochs=ten"], ["train.epochs", "expected an integer >= 1", "'ten'"]),
    (["train.epochs=0"], ["train.epochs", "expected an integer >= 1", "got 0"]),
    (["train.epochs=true"], ["train.epochs", "expected an integer", "got true"]),
    (["train.batch_size=1.5"], ["train.batch_size", "expected an integer >= 1", "1.5"]),
    (["run.seed=-1"], ["run.seed", ">= 0"]),
    (["optim.lr=0"], ["optim.lr", "expected a number > 0", "got 0"]),
    (["optim.lr=fast"], ["optim.lr", "expected a number > 0", "'fast'"]),
    (["optim.lr=inf"], ["optim.lr", "finite number"]),
    (["optim.lr=false"], ["optim.lr", "expected a number", "got false"]),
    (["optim.momentum=1.0"], ["optim.momentum", "in [0, 1)"]),
    (["schedule.gamma=1.5"], ["schedule.gamma", "in (0, 1]"]),
    (["train.label_smoothing=-0.1"], ["train.label_smoothing", "in [0, 1)"]),
    (["freeze.bucket_cap_mb=0"], ["freeze.bucket_cap_mb", "> 0"]),
    (["optim.betas=[0.9]"], ["optim.betas", "list of 2 numbers"]),
    (["optim.betas=[0.9, 1.5]"], ["optim.betas", "list of 2 numbers in [0, 1)", "1.5"]),
    (["optim.betas=0.9"], ["optim.betas", "list of 2 numbers"]),
    (["data.augment=1"], ["data.augment", "'1' is not accepted", "crop-flip, views:V"]),
    (["data.augment=yes"], ["data.augment", "'yes' is not accepted", "none"]),
    (["data.augment=views:0"], ["data.augment", "'views:0' is not accepted"]),
    (["freeze.cache=memory"], ["freeze.cache = 'memory'", "data.augment = 'crop-flip'", "views:V"]),
    (["freeze.cache=ram"], ["freeze.cache", "accepted: off, memory, disk, auto"]),
    (["freeze.policy=autofreez"], ["freeze.policy: unknown policy 'autofreez' (did you mean 'autofreeze'?)"]),
    (
        ["optim.lrr=0.1"],
        ["config: unknown key 'optim.lrr'", "did you mean 'optim.lr'", "keys in [optim]: name, lr, momentum"],
    ),
    (
        ["foo.bar=1"],
        ["config: unknown section [foo]", "sections: run, data, model, freeze, optim, schedule, train, dist"],
    ),
    (["lr=0.1"], ["override 'lr=0.1'", "section.key=value"]),
    (["optim.lr"], ["override 'optim.lr'", "section.key=value"]),
    (
        ["model.weights=no-such-file.pt"],
        ["model.weights", "'no-such-file.pt' does not exist", "accepted: none, imagenet, or a path to a weights file"],
    ),
    (["model.arch=resnet19"], ["model.arch", "'resnet19'", "torchvision classification model", "resnet18"]),
    (["run.name=a/b"], ["run.name", "without '/'"]),
    (["run.study="], ["run.study", "non-empty"]),
    (["optim.nesterov=true", "optim.momentum=0"], ["optim.nesterov", "optim.momentum > 0"]),
]


@pytest.mark.parametrize("overrides,expected", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_bad_override_gives_one_clear_line(overrides, expected):
    with pytest.raises(ConfigError) as info:
        preflight(load_config(None, overrides))  # what a launcher, sweep or study does before any run
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


BAD_FILES = [
    ("[optim]\nlrr = 0.1\n", ["unknown key 'optim.lrr'", "keys in [optim]"]),
    ("[foo]\nx = 1\n", ["unknown section [foo]", "sections: run, data"]),
    ("optim = 3\n", ["[optim] must be a table", "name, lr"]),
    ('[optim]\nname = "adam"\n', ["optim.name", "accepted: sgd, adamw"]),
    ('[train]\nepochs = "ten"\n', ["train.epochs", "expected an integer >= 1", "'ten'"]),
    ("[train]\nepochs = true\n", ["train.epochs", "got true"]),
    ("[dist]\ntimeout_s = 0\n", ["dist.timeout_s", ">= 1"]),
    ("[run]\nname = 3\n", ["run.name", "expected a string", "got 3"]),
    ("[optim.extra]\nx = 1\n", ["unknown key 'optim.extra'"]),
]


@pytest.mark.parametrize("text,expected", BAD_FILES, ids=[t.splitlines()[0] for t, _ in BAD_FILES])
def test_bad_file_gives_one_clear_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"config {path}: "), message  # the file the key was read from
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_a_key_error_names_the_file_only_when_the_file_set_the_key(tmp_path):
    """A typo inside a config file named the key and the accepted ones but not the file; an
    override's error names no file (the command line, sweep or study that gave it says where)."""
    path = write(tmp_path, "[train]\nepoch = 2\n", name="mine.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["train.epochs=3"])
    assert str(info.value).startswith(f"config {path}: unknown key 'train.epoch' (did you mean 'train.epochs'?)")
    assert "keys in [train]: epochs, batch_size" in str(info.value)
    path = write(tmp_path, "[train]\nepochs = 0\n", name="zero.toml")
    with pytest.raises(ConfigError, match=rf"^config {re.escape(str(path))}: train\.epochs: expected an integer >= 1"):
        load_config(path)
    assert load_config(path, ["train.epochs=2"]).train.epochs == 2  # the override replaced the bad value
    with pytest.raises(ConfigError, match=r"^train\.epochs: expected an integer >= 1, got -1$"):
        load_config(path, ["train.epochs=-1"])  # the bad value is the override's: no file named
    with pytest.raises(ConfigError, match=r"^config: unknown key 'train.epoch'"):
        load_config(write(tmp_path, "[train]\nepochs = 2\n"), ["train.epoch=3"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^config: file '.*nope\.toml' does not exist$"):
        load_config(tmp_path / "nope.toml")


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "[optim]\nlr = 0.1\nname = \n", name="broken.toml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "broken.toml" in message and "not valid TOML" in message and "line 3" in message


def test_overrides(tmp_path):
    path = write(tmp_path, '[optim]\nlr = 0.2\n[run]\nname = "from-file"\n')
    config = load_config(
        path,
        [
            "freeze.policy=autofreeze:percentile=50",  # '=' inside the value: split at the first '='
            "optim.lr=0.05",
            "train.precision=bf16",
            "optim.betas=[0.9,0.95]",
            "run.name=123",  # a string field keeps the text, not the TOML integer
            "data.augment=none",
            "train.epochs=3",
            "train.epochs=4",  # the last override wins
            'run.study="with space"',
        ],
    )
    assert config.freeze.policy == "autofreeze:percentile=50"
    assert config.optim.lr == 0.05
    assert config.train.precision == "bf16"
    assert config.optim.betas == (0.9, 0.95)
    assert config.run.name == "123"
    assert config.data.augment == Augment("none")
    assert config.train.epochs == 4
    assert config.run.study == "with space"
    assert config.run_group() == "autofreeze:percentile=50"
    assert load_config(None, ["run.group=g1", "freeze.policy=autofreeze:percentile=50"]).run_group() == "g1"


def test_weights_path_must_exist(tmp_path):
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"x")
    assert load_config(None, [f"model.weights={weights}"]).model.weights == str(weights)
    with pytest.raises(ConfigError, match="model.weights: .* is not a file"):
        load_config(None, [f"model.weights={tmp_path}"])
    # Reading a finished run elsewhere must not need the weights file.
    gone = str(tmp_path / "gone.pt")
    assert load_config(None, [f"model.weights={gone}"], check_files=False).model.weights == gone


def test_policy_is_checked_by_the_preflight_with_parse_policy():
    config = load_config(None, ["freeze.policy=nosuchpolicy"])  # structure only: torch-free
    with pytest.raises(ConfigError) as info:
        preflight(config)
    message = str(info.value)
    assert message.startswith("freeze.policy: ") and len(message.splitlines()) == 1
    assert "nosuchpolicy" in message and "autofreeze" in message  # names the accepted policies
    with pytest.raises(ConfigError, match="^freeze.policy: .*percentile"):
        preflight(load_config(None, ["freeze.policy=autofreeze:percentile=500"]))


def tricky_config() -> Config:
    config = load_config(None, ["freeze.policy=autofreeze:percentile=50"])
    return dataclasses.replace(
        config,
        run=dataclasses.replace(config.run, name="r-1", group='quote " back \\ tab\t nl\n é', seed=7),
        optim=OptimConfig(
            name="adamw",
            lr=0.1 + 0.2,
            momentum=1 / 3,
            weight_decay=5e-324,
            betas=(0.9, 1 - 1e-12),
            eps=1.2345678901234567e-8,
            grad_clip_norm=1e300,
        ),
        data=dataclasses.replace(config.data, download=True, val_size=0),
    )


def test_toml_round_trip_is_exact(tmp_path):
    config = tricky_config()
    text = config_to_toml(config)
    for section in SECTIONS:  # every key is written out
        assert f"[{section}]" in text
        for key in section_keys(section):
            assert f"\n{key} = " in text
    loaded = load_config(write(tmp_path, text))
    assert loaded == config
    assert loaded.optim.lr == 0.1 + 0.2 and loaded.optim.weight_decay == 5e-324
    assert loaded.run.group == config.run.group
    assert config_to_toml(loaded) == text
    assert load_config(write(tmp_path, config_to_toml(Config()), "d.toml")) == Config()


def test_dict_round_trip():
    config = tricky_config()
    data = config_to_dict(config)
    assert data["optim"]["betas"] == [0.9, 1 - 1e-12]  # plain lists: JSON and TOML friendly
    assert config_from_dict(data) == config
    with pytest.raises(ConfigError, match="unknown key 'train.epoch'"):
        config_from_dict({"train": {"epoch": 3}})


def test_an_override_changes_one_key_and_is_validated():
    # (was replace_key's test: sweeps never used it; they resolve overrides through load_config)
    changed = load_config(None, ["optim.lr=0.05"])
    assert changed.optim.lr == 0.05 and Config().optim.lr == 0.1
    assert load_config(None, ["run.seed=3"]).run.seed == 3
    assert load_config(None, ["optim.betas=[0.5, 0.6]"]).optim.betas == (0.5, 0.6)
    with pytest.raises(ConfigError, match=r"^optim.lr: expected a number > 0, got -1$"):
        load_config(None, ["optim.lr=-1"])
    with pytest.raises(ConfigError, match="unknown key 'optim.rate'"):
        load_config(None, ["optim.rate=0.1"])


def test_augment_is_parsed_where_the_config_is_read_and_written_back_as_its_spec(tmp_path):
    config = load_config(None, ["data.augment=views:4", "freeze.cache=disk", "freeze.cache_dtype=bf16"])
    assert (config.data.augment, config.freeze.cache, config.freeze.cache_dtype) == (
        Augment("views", 4),
        "disk",
        "bf16",
    )
    assert config.data.augment.finite and not load_config(None).data.augment.finite
    assert 'augment = "views:4"' in config_to_toml(config)
    assert load_config(write(tmp_path, config_to_toml(config))) == config


def test_the_old_boolean_augment_key_is_refused_in_one_line(tmp_path):
    # Converted once (python -m experiments.convert_runs), not read forever.
    with pytest.raises(
        ConfigError, match="^config .*: data.augment: true is not accepted .*convert_runs.*accepted: crop-flip"
    ):
        load_config(write(tmp_path, "[data]\naugment = true\n"))


@pytest.mark.processes
def test_reading_a_config_imports_neither_torch_nor_torchvision():
    # Every launcher, sweep expansion and report reads configs; the checks that need torch are the
    # preflight's (freeze.pipeline.preflight), run once by whatever starts runs.
    code = (
        "import sys; from freeze.pipeline.config import load_config; "
        "load_config('experiments/configs/smoke.toml', ['data.augment=views:4']); "
        "print(sorted(m for m in ('torch', 'torchvision', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
