"""experiments/install_footprint.py: the dependency closure it reads off the installed
distributions, and its refusals (the import timing itself is a measurement, not a test)."""

from __future__ import annotations

import pytest

from experiments import install_footprint as fp


def test_closure_follows_requirements_and_counts_installed_bytes():
    numpy_only = fp.closure(("numpy",))
    assert set(numpy_only) == {"numpy"} and numpy_only["numpy"] > 1_000_000
    study = fp.closure(("pandas",))
    # pandas requires numpy and python-dateutil, which requires six: the closure follows them
    assert {"pandas", "numpy", "python-dateutil"} <= set(study)
    assert fp.closure(("no-such-distribution",)) == {}


def test_requirement_names_skip_extras_and_read_the_name():
    assert fp._requirement_name("typing_extensions>=4.10.0") == "typing-extensions"
    assert fp._requirement_name("pytest; extra == 'test'") is None
    assert fp._requirement_name("Jinja2 (>=3.0)") == "jinja2"


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fp.main(["--repeats", "0"])
    assert "--repeats: expected an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fp.main(["--compare", str(tmp_path)])
    assert "is not a checkout of this repository" in capsys.readouterr().err
