"""The README's example for a user's own loop runs as written: in one process, under torchrun and
resumed; every code block of README.md and docs/*.md runs or names only modules and files that exist."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from experiments.repeat_readme_example import readme_example
from freeze.pipeline import markdown
from freeze.testing import local_torchrun_command
from tests.processes import run_command, run_python

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", page.read_text(), re.S | re.M)


@pytest.mark.processes
def test_readme_example_runs_in_one_process(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    proc = run_python([str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["0", "1", "2", "3"]
    assert all(line.split()[-1] == "0" for line in lines)  # no process group: nothing sent
    assert all("held-out loss" in line for line in lines)  # it evaluates held-out data every epoch
    assert int(lines[-1].split()[1]) > 0  # the policy froze blocks, so the cache served


@pytest.mark.processes
def test_readme_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "example.py"
    example = readme_example()
    # rank 0 alone prints (no interleaved lines); the test has rank 1 print its own view too, so that
    # the ranks' boundary, held-out loss and bytes can be compared
    line = 'print(epoch, freezer.boundary, f"held-out loss {held_out_loss:.4f} acc {accuracy:.3f}", sent)'
    assert example.count(line) == 1
    script.write_text(
        example.replace(
            "    if comm.rank() == 0:  # one line",
            f"    if comm.rank() == 1:\n        {line}\n    if comm.rank() == 0:  # one line",
            1,
        )
    )
    cmd = local_torchrun_command(script, tmp_path / "logs")  # one stdout file per rank
    proc = run_command(cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted((tmp_path / "logs").glob("**/stdout.log"))
    assert len(logs) == 2
    per_rank = [log.read_text().strip().splitlines() for log in logs]
    assert [len(lines) for lines in per_rank] == [4, 4]  # 4 epochs on each rank
    assert per_rank[0] == per_rank[1]  # same boundary, held-out loss and bytes: the ranks agree
    resnet18_fp32_grad_bytes = 11_181_642 * 4
    boundaries = [int(line.split()[1]) for line in per_rank[0]]  # after each epoch's end_epoch
    for line, boundary_during_epoch in zip(per_rank[0], [0, *boundaries[:-1]]):
        sent = int(line.split()[-1])  # the epoch's last step, at the boundary the epoch trained with
        assert 0 < sent <= resnet18_fp32_grad_bytes
        assert (sent == resnet18_fp32_grad_bytes) == (boundary_during_epoch == 0)


# Kills the run right after the checkpoint of epoch 1 is in place, as a Ctrl-C there would.
_STOP_AFTER_EPOCH_1 = """import os as _os, torch as _torch
_replace = _os.replace
def _replace_then_stop(src, dst):
    _replace(src, dst)
    if _torch.load(dst, weights_only=True)["epoch"] == 1:
        _os._exit(0)
_os.replace = _replace_then_stop
"""


@pytest.mark.processes
def test_readme_example_resumed_after_epoch_1_ends_with_the_bits_of_an_uninterrupted_run(tmp_path):
    """The example's checkpoint and per-epoch data order make a resume exact: the same printed
    epochs, boundary and held-out loss, and bitwise the same final model and optimizer state."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir(), resumed.mkdir()
    (whole / "example.py").write_text(readme_example())
    (resumed / "stopped.py").write_text(_STOP_AFTER_EPOCH_1 + readme_example())
    (resumed / "example.py").write_text(readme_example())
    proc = run_python(["example.py"], cwd=whole)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = run_python(["stopped.py"], cwd=resumed)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert [line.split()[0] for line in stopped.stdout.splitlines()] == ["0", "1"]
    again = run_python(["example.py"], cwd=resumed)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == proc.stdout.splitlines()[2:]  # epochs 2 and 3, line for line
    a = torch.load(whole / "checkpoint.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 3 and a["freezer"]["boundary"] == b["freezer"]["boundary"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for i, entry in a["optimizer"]["state"].items():
        assert torch.equal(entry["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"]), i
    finished = run_python(["example.py"], cwd=whole)  # run again once done: it says so (it said nothing)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stdout.strip() == "checkpoint.pt holds all 4 epochs: nothing to train (delete it to train again)"


def test_readme_example_follows_the_order_rules_it_states():
    """The rules listed under the example are the ones the example itself follows."""
    text = (REPO / "README.md").read_text()
    example = readme_example()
    rules = text.split(markdown.markers("example")[1], 1)[1].split("\n## ", 1)[0]
    assert "Build the Freezer last" in rules and "bare model" in rules
    assert example.index("init_process_group") < example.index("freezer = Freezer(")
    assert example.index("model.load_state_dict") < example.index("freezer = Freezer(")
    assert "freezer.module.no_sync()" in example and "freezer.training_state_dict()" in example
    assert "freezer.load_training_state_dict(state)" in example and "weights_only=True" in example
    assert "manual_seed(seed + epoch)" in example
    assert example.index("freezer.eval()") < example.index("freezer.sync_buffers()") < example.index("torch.no_grad()")
    assert "freezer.module(held_out_images)" in example  # evaluation through the one module, never the cache


def test_readme_is_a_front_page_that_links_every_docs_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 260, "README.md is the front page: move long topics to docs/"
    # issue 47: what it is, the answer in brief and the two commands before the first line of API; the
    # findings of three studies once stood there as one 477-word paragraph, 920 words before the API
    top = text[: text.index("## Use it in your own training loop")]
    prose = re.sub(r"```.*?```", "", top, flags=re.S)
    assert len(prose.split()) <= 400, f"README.md: {len(prose.split())} words before the own-loop example"
    assert "## The answer in brief" in top and "make test" in top and "make study" in top
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in text, f"README.md does not link docs/{page.name}"


def test_every_relative_link_of_the_readme_docs_and_report_resolves():
    for page in [*PAGES, *sorted((REPO / "report").rglob("*.md"))]:  # a report page moved keeps its links
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


@pytest.mark.processes
@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "README.md"], ids=lambda p: p.name)
def test_every_python_block_of_the_docs_runs(page, tmp_path):
    for i, block in enumerate(_blocks(page, "python")):
        # A block that opens with "# <name>.py" is that file, which later blocks import (docs/policies.md)
        named = re.match(r"# (\w+\.py)\n", block)
        script = tmp_path / (named.group(1) if named else f"block{i}.py")
        script.write_text(block)
        proc = run_python([str(script)], cwd=tmp_path)
        assert proc.returncode == 0, f"{page.name} python block {i}: {proc.stderr[-2000:]}"


def test_every_command_in_the_readme_and_docs_names_a_module_and_target_that_exist():
    """Shell blocks need root, a cluster or an hour to run; what a typo breaks is the module or make
    target they name, so those are checked (config paths: the test below)."""
    makefile = (REPO / "Makefile").read_text()
    commands = 0
    for page in PAGES:
        for block in _blocks(page, "bash") + _blocks(page, "") + _blocks(page, "console"):
            for module in re.findall(r"python -m (\w+(?:\.\w+)*)(?![.\w*])", block):
                commands += 1
                assert importlib.util.find_spec(module) is not None, f"{page.name}: no module {module}"
            for target in re.findall(r"^\$? ?make ([\w-]+)", block, re.M):
                commands += 1
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{page.name}: no make target {target}"
    assert commands >= 15


def test_architecture_page_lists_the_library_and_the_application_apart():
    text = (REPO / "docs" / "architecture.md").read_text()
    layout = text.split("```", 2)[1]
    library, application = layout.split("\nfreeze/pipeline/", 1)
    application = application.split("\nexperiments/", 1)[0]

    def modules(folder: Path) -> set[str]:
        return {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}

    for name in modules(REPO / "freeze") | modules(REPO / "freeze" / "policies") | modules(REPO / "freeze" / "freezer"):
        assert re.search(rf"\b{re.escape(name)}", library), f"{name} missing from the library list"
    for name in modules(REPO / "freeze" / "pipeline"):
        assert re.search(rf"\b{re.escape(name)}", application), f"{name} missing from the application list"
        assert not re.search(rf"\s{re.escape(name)}", library), f"{name} is listed as library"


@pytest.mark.processes
def test_the_sweep_example_is_the_file_and_its_dry_run_prints_what_the_page_shows():
    text = (REPO / "docs" / "experiments.md").read_text()
    span = markdown.read(text, "sweep-example", "docs/experiments.md")
    block = re.fullmatch(r"\s*```toml\n(.*?)```\s*```console\n\$ (.*?)\n(.*?)```\s*", span, re.S)
    assert block, "docs/experiments.md lost its sweep example"
    toml_text, command, shown = block.groups()
    # the learnable ablation, not the smoke sweep (a pipeline check whose runs sit at chance: issue 32)
    assert toml_text == (REPO / "experiments" / "configs" / "sweep_ablation.toml").read_text()
    assert command.startswith("python -m experiments.sweep ")
    proc = run_python(command.split()[1:], timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown


def test_every_config_file_the_readme_and_docstrings_name_exists():
    """A newcomer copies these paths; each one must be a file of the repository."""
    sources = [*PAGES, *REPO.glob("freeze/**/*.py"), *REPO.glob("experiments/**/*.py")]
    sources += list(REPO.glob("experiments/configs/*.toml"))
    named = {}
    for source in sources:
        text = source.read_text()
        paths = re.findall(r"experiments/configs/[\w.-]+\.toml", text)
        paths += re.findall(r"--(?:config|sweep)[ =]+([\w./-]+\.toml)", text)  # commands to copy
        for path in paths:
            named.setdefault(path, source.relative_to(REPO))
    assert len(named) >= 5  # the pattern still finds the README's configs
    missing = {path: str(where) for path, where in named.items() if not (REPO / path).is_file()}
    assert not missing, f"named but missing: {missing}"


@pytest.mark.processes
@pytest.mark.parametrize("module", ["experiments.run", "experiments.sweep", "experiments.study", "report"])
def test_help_texts_point_to_docs_sections_that_exist(module):
    """`experiments.sweep --help` sent users to README, "Sweeps", a section that lives in
    docs/experiments.md (issue 32): every page and section a --help names must be there."""
    proc = run_python(["-m", module, "--help"], timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    pointers = re.findall(r'(docs/[\w/]+\.md)(?:, "([^"]+)")?', text)
    assert pointers, f"{module} --help names no docs page"
    for page, section in pointers:
        assert (REPO / page).is_file(), f"{module} --help: no {page}"
        if section:
            headings = re.findall(r"^#+ (.+)$", (REPO / page).read_text(), re.M)
            assert any(h.startswith(section) for h in headings), f"{module} --help: {page} has no section {section!r}"
