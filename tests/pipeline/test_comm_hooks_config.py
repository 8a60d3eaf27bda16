"""freeze.comm_hook in a run config: the PowerSGD hooks are accepted, an unknown hook or rank is one
line naming the key and the accepted values, and the cost model leaves PowerSGD runs out with that
reason instead of predicting them as full-precision all-reduce."""

import pytest

from freeze.names import COMM_HOOKS
from freeze.pipeline.config import ConfigError, config_to_toml, load_config
from freeze.pipeline.study import predict as stage
from tests.pipeline.test_study_predict import _config, _no_measuring, _write_run


@pytest.mark.parametrize("hook", ["powersgd1", "powersgd4"])
def test_a_powersgd_hook_is_accepted_and_written_back(hook, tmp_path):
    config = load_config(None, [f"freeze.comm_hook={hook}"])
    assert config.freeze.comm_hook == hook
    (tmp_path / "config.toml").write_text(config_to_toml(config))
    assert load_config(tmp_path / "config.toml").freeze.comm_hook == hook


@pytest.mark.parametrize("hook", ["powersgd2", "powersgd", "fp16"])
def test_an_unknown_hook_or_rank_is_one_line_naming_the_key_and_the_accepted_values(hook):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"freeze.comm_hook={hook}"])
    message = str(err.value)
    assert "\n" not in message and "freeze.comm_hook" in message and f"'{hook}'" in message
    assert f"accepted: {', '.join(COMM_HOOKS)}" in message


def test_the_cost_model_leaves_a_powersgd_run_out_with_the_reason(tmp_path):
    study_dir = tmp_path / "runs" / "s"
    _write_run(_config(study_dir, "none", 0, "single", "dist.nproc=1", "freeze.comm_hook=powersgd4"), [(10, 0, 1.0)])
    table = stage.predict_study(study_dir, tmp_path, measure=_no_measuring)
    assert table.data.empty
    assert "left out 1 run(s): freeze.comm_hook = powersgd4" in table.notes
