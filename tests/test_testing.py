"""freeze.testing, the parts that run in one process: where payloads go, an atomic payload write,
and the torchrun command. (spawn_and_collect and run_gloo_rank run under every multi-rank test.)"""

import pickle
import sys

from freeze.testing import local_torchrun_command, payload_path, write_payload


def test_a_payload_is_written_whole_where_the_parent_reads_it(tmp_path):
    assert payload_path(tmp_path, 3) == tmp_path / "rank3.pkl"
    assert payload_path(str(tmp_path), 0) == tmp_path / "rank0.pkl"
    write_payload(tmp_path, 1, {"ok": True, "result": [1, 2]})
    write_payload(tmp_path, 1, {"ok": False, "error": "trace"})  # a second write replaces the first
    with open(payload_path(tmp_path, 1), "rb") as f:
        assert pickle.load(f) == {"ok": False, "error": "trace"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.pkl"]  # no temp file left


def test_the_torchrun_command_runs_two_local_ranks_with_a_log_folder_each(tmp_path):
    cmd = local_torchrun_command(tmp_path / "train.py", tmp_path / "logs", "--epochs", "2")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc-per-node=2" in cmd and f"--log-dir={tmp_path / 'logs'}" in cmd
    assert cmd[-3:] == [str(tmp_path / "train.py"), "--epochs", "2"] and "--redirects=1" in cmd
    assert "--redirects=3" in local_torchrun_command("s.py", "logs", redirects=3)
