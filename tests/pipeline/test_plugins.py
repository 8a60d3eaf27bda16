"""Your own policy and model in the pipeline (freeze.pipeline.plugins): docs/policies.md's example,
run as written in the pipeline; a module that cannot be imported refused in one line (issue 47: a
newcomer's policy worked in their loop and the pipeline said "unknown policy 'halfway'")."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from freeze.pipeline.config import ConfigError, load_config
from freeze.pipeline.data import DATASETS, DataError, ImageArrays, load_dataset, register_dataset
from freeze.pipeline.models import MODELS, build_model
from freeze.pipeline.plugins import load_plugins
from freeze.pipeline.preflight import preflight
from freeze.policies import POLICIES
from tests.processes import REPO, run_python

SMOKE = REPO / "experiments" / "configs" / "smoke.toml"
PAGE = REPO / "docs" / "policies.md"


def doc_file(name: str) -> str:
    """The docs page's python block that opens with ``# <name>``: the file as the page shows it."""
    (block,) = [
        b for b in re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M) if b.startswith(f"# {name}")
    ]
    return block


MODULES = ("my_policies", "my_models", "my_data", "my_signals")  # the page's modules


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """The page's modules in a folder on sys.path; the registries and sys.modules as they were after."""
    for name in MODULES:
        (tmp_path / f"{name}.py").write_text(doc_file(f"{name}.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    policies, models, datasets = dict(POLICIES), dict(MODELS), dict(DATASETS)
    yield tmp_path
    for registry, before in ((POLICIES, policies), (MODELS, models), (DATASETS, datasets)):
        registry.clear()
        registry.update(before)
    for name in MODULES:
        sys.modules.pop(name, None)


def config(tmp_path, *overrides: str):
    return load_config(SMOKE, [f"run.out_dir={tmp_path / 'runs'}", *overrides], check_files=False)


def test_a_policy_named_by_a_plugin_module_is_accepted_and_a_missing_module_refused(plugin_dir):
    with pytest.raises(ConfigError, match="unknown policy 'halfway'"):
        preflight(config(plugin_dir, "freeze.policy=halfway:at=0.5"))
    preflight(config(plugin_dir, "plugins.modules=my_policies", "freeze.policy=halfway:at=0.5"))
    assert "halfway" in POLICIES
    with pytest.raises(ConfigError, match=r"halfway.*'at'.*is out of range"):
        preflight(config(plugin_dir, "plugins.modules=my_policies", "freeze.policy=halfway:at=2"))
    with pytest.raises(ConfigError) as err:
        load_plugins(config(plugin_dir, "plugins.modules=my_polices"))
    assert str(err.value).startswith("plugins.modules: 'my_polices' cannot be imported (ModuleNotFoundError")
    assert "\n" not in str(err.value)


def test_a_model_registered_by_a_plugin_is_a_model_arch(plugin_dir):
    preflight(config(plugin_dir, "plugins.modules=my_models", "model.arch=tiny-mlp"))
    model = build_model("tiny-mlp", num_classes=7)
    assert model[-1].out_features == 7
    from freeze.pipeline.models import ModelError

    with pytest.raises(ModelError, match="model.stem=cifar and model.weights=imagenet are for torchvision's"):
        build_model("tiny-mlp", num_classes=7, stem="cifar")


@pytest.mark.processes
def test_the_page_s_pipeline_command_runs_its_policy(tmp_path):
    """docs/policies.md's command, from a folder holding my_policies.py, on a tiny smoke run."""
    (tmp_path / "my_policies.py").write_text(doc_file("my_policies.py"))
    (command,) = re.findall(r"^python -m experiments\.run .*plugins\.modules=my_policies.*$", PAGE.read_text(), re.M)
    args = command.split()[1:]  # the page's arguments, then a tiny run of them
    args[args.index("experiments/configs/smoke.toml")] = str(SMOKE)
    tiny = ["train.epochs=2", "data.train_size=256", "train.batch_size=32", f"run.out_dir={tmp_path / 'runs'}"]
    proc = run_python([*args, *tiny, f"data.root={tmp_path / 'data'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (manifest,) = (tmp_path / "runs").glob("*/*/manifest.json")
    assert json.loads(manifest.read_text())["policy"] == "halfway:at=0.5"
    metrics = [json.loads(line) for line in (manifest.parent / "metrics.jsonl").read_text().splitlines()]
    head = len(json.loads(manifest.read_text())["block_names"]) - 1
    assert [m["boundary"] for m in metrics] == [head, head]  # frozen at the end of epoch 1 of 2: half the run


def test_a_dataset_registered_by_a_plugin_is_a_data_dataset(plugin_dir):
    with pytest.raises(ConfigError) as unknown:
        preflight(config(plugin_dir, "data.dataset=stripes"))  # the module not named: refused before any run
    assert str(unknown.value).startswith("data.dataset: 'stripes' is not accepted; accepted: cifar10, synthetic-")
    preflight(config(plugin_dir, "plugins.modules=my_data", "data.dataset=stripes"))
    arrays = load_dataset("stripes", plugin_dir / "data")
    assert arrays.train_x.shape == (500, 3, 32, 32) and arrays.classes == ("plain", "striped")
    assert arrays.train_y.dtype == torch.int64 and not arrays.synthetic


@pytest.mark.parametrize(
    "images, labels, expected",
    [
        (torch.zeros(4, 3, 8, 8), torch.zeros(4, dtype=torch.long), "train set: images must be a uint8 tensor"),
        (torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.full((4,), 2), "labels must be integers in 0..1"),
        (torch.zeros(4, 1, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.long), "[N, 3, H, W]"),
    ],
)
def test_a_builders_wrong_arrays_are_one_line_naming_the_dataset(plugin_dir, images, labels, expected):
    @register_dataset("broken-for-test")
    def broken(root):
        return ImageArrays(images, labels, images, labels, classes=("a", "b"))

    with pytest.raises(DataError) as refused:
        load_dataset("broken-for-test", plugin_dir)
    assert expected in str(refused.value) and "'broken-for-test'" in str(refused.value)
    assert "\n" not in str(refused.value)
    with pytest.raises(DataError, match="already registered"):
        register_dataset("broken-for-test")(lambda root: None)
    with pytest.raises(DataError, match="one of this pipeline's datasets"):
        register_dataset("cifar10")(lambda root: None)


@pytest.mark.processes
def test_the_page_s_data_command_trains_on_the_registered_dataset(tmp_path):
    (tmp_path / "my_data.py").write_text(doc_file("my_data.py"))
    text = " ".join(PAGE.read_text().split())  # the command wraps over two lines of the page
    (command,) = re.findall(r"`(python -m experiments\.run [^`]*plugins\.modules=my_data[^`]*)`", text)
    args = command.split()[1:]
    args[args.index("experiments/configs/smoke.toml")] = str(SMOKE)
    tiny = ["train.epochs=1", "dist.nproc=1", f"run.out_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}"]
    proc = run_python([*args, *tiny], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (manifest,) = (tmp_path / "runs").glob("*/*/manifest.json")
    recorded = json.loads(manifest.read_text())
    assert (recorded["status"], recorded["num_classes"], recorded["test_images"]) == ("complete", 2, 100)


PAGE_MODULES = MODULES
# The page's model and data, tiny: 400 training and 100 test images of "stripes", an MLP
OWN_RUN = [
    f"plugins.modules={','.join(PAGE_MODULES)}",
    "model.arch=tiny-mlp",
    "data.dataset=stripes",
    "data.val_size=100",
    "data.train_size=0",
    "data.test_size=0",
    "train.epochs=2",
    "train.batch_size=100",
    "dist.nproc=1",
]


def _page_modules(folder) -> None:
    for name in PAGE_MODULES:
        (folder / f"{name}.py").write_text(doc_file(f"{name}.py"))


def _toml_list(items) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


@pytest.mark.processes
def test_a_sweep_and_a_study_of_your_own_policies_model_and_data_run_from_the_page(tmp_path):
    """Issue 47's done-when: a policy, a signal, a model and a dataset written outside the package
    (the page's four modules, as written) run in a sweep and in a study, from the folder that holds
    them, as a new user would run them."""
    _page_modules(tmp_path)
    data = [f"data.root={tmp_path / 'data'}"]
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(
        f'[sweep]\nbase = "{SMOKE}"\nstudy = "mine"\noverrides = {_toml_list([*OWN_RUN, *data])}\n'
        '[grid]\n"freeze.policy" = ["none", "halfway:at=0.5", "settled:below=0.5"]\n'
    )
    swept = run_python(
        ["-m", "experiments.sweep", "--sweep", str(sweep), "--out-dir", str(tmp_path / "runs")], cwd=tmp_path
    )
    assert swept.returncode == 0, swept.stderr[-3000:]
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "mine").glob("*/manifest.json")]
    assert sorted(m["policy"] for m in manifests) == ["halfway:at=0.5", "none", "settled:below=0.5"]
    assert {m["status"] for m in manifests} == {"complete"}

    study = tmp_path / "study.toml"
    study.write_text(
        f'[study]\nname = "own"\nfinetune = "{SMOKE}"\nseeds = [0, 1]\n'
        f"overrides = {_toml_list([*OWN_RUN, *data])}\n"
        '[arms]\nnone = []\nhalfway = ["freeze.policy=halfway:at=0.5"]\nsettled = ["freeze.policy=settled:below=0.5"]\n'
    )
    studied = run_python(
        ["-m", "experiments.study", "--config", str(study), "--out-dir", str(tmp_path / "runs")], cwd=tmp_path
    )
    assert studied.returncode == 0, studied.stderr[-3000:]
    assert len(list((tmp_path / "runs" / "own").glob("*/manifest.json"))) == 6
    table = (tmp_path / "runs" / "own-report" / "main.md").read_text()
    assert "halfway:at=0.5" in table and "settled:below=0.5" in table


def test_a_typo_in_your_own_policys_parameters_is_refused_before_the_sweeps_first_run(plugin_dir):
    from freeze.pipeline.sweep import SweepError, expand, read_sweep

    sweep = plugin_dir / "sweep.toml"
    sweep.write_text(
        f'[sweep]\nbase = "{SMOKE}"\nstudy = "mine"\noverrides = {_toml_list(OWN_RUN)}\n'
        '[grid]\n"freeze.policy" = ["halfway:at=0.5", "halfway:att=0.5"]\n'
    )
    with pytest.raises((SweepError, ConfigError)) as err:
        read = read_sweep(sweep)
        expand(read["base"], read["study"], read["grid"], read["overrides"], str(plugin_dir / "runs"))
    assert "att" in str(err.value) and "\n" not in str(err.value)
