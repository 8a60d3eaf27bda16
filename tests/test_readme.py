"""The README's example for a user's own loop runs as written: in one process and under torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

from experiments.repeat_readme_example import readme_example
from freeze.testing import local_torchrun_command

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_readme_example_runs_in_one_process(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    proc = _run([sys.executable, str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["0", "1", "2", "3"]
    assert all(line.split()[-1] == "0" for line in lines)  # no process group: nothing sent


def test_readme_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    cmd = local_torchrun_command(script, tmp_path / "logs")  # one stdout file per rank
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted((tmp_path / "logs").glob("**/stdout.log"))
    assert len(logs) == 2
    lines = [line for log in logs for line in log.read_text().strip().splitlines()]
    assert len(lines) == 8  # 4 epochs x 2 ranks
    resnet18_fp32_grad_bytes = 11_181_642 * 4
    for line in lines:
        boundary, sent = int(line.split()[1]), int(line.split()[-1])
        assert 0 < sent <= resnet18_fp32_grad_bytes
        assert (sent == resnet18_fp32_grad_bytes) == (boundary == 0)


def test_readme_layout_lists_the_library_and_the_application_apart():
    text = (REPO / "README.md").read_text()
    layout = text.split("## Layout", 1)[1].split("```", 2)[1]
    library, application = layout.split("\nfreeze/pipeline/", 1)
    application = application.split("\nexperiments/", 1)[0]

    def modules(folder: Path) -> set[str]:
        return {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}

    for name in modules(REPO / "freeze") | modules(REPO / "freeze" / "policies"):
        assert re.search(rf"\b{re.escape(name)}", library), f"{name} missing from the library list"
    for name in modules(REPO / "freeze" / "pipeline"):
        assert re.search(rf"\b{re.escape(name)}", application), f"{name} missing from the application list"
        assert not re.search(rf"\s{re.escape(name)}", library), f"{name} is listed as library"


def test_readme_sweep_example_is_the_file_and_its_dry_run_prints_what_the_readme_shows():
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- sweep-example:start -->\s*```toml\n(.*?)```\s*```console\n\$ (.*?)\n(.*?)```", text, re.S)
    assert block, "README.md lost its sweep example"
    toml_text, command, shown = block.groups()
    assert toml_text == (REPO / "experiments" / "configs" / "sweep_smoke.toml").read_text()
    assert command.startswith("python -m experiments.sweep ")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, *command.split()[1:]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown


def test_every_config_file_the_readme_and_docstrings_name_exists():
    """A newcomer copies these paths; each one must be a file of the repository."""
    sources = [REPO / "README.md", *REPO.glob("freeze/**/*.py"), *REPO.glob("experiments/**/*.py")]
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
