"""The pipeline's collective helpers on two real gloo ranks: one 2-rank job records every case."""

import socket
from pathlib import Path

import pytest
import torch

from freeze.pipeline.data import DataError
from freeze.pipeline.distributed import all_reduce_sum, run_and_agree
from tests.distributed_harness import run_distributed
from tests.processes import REPO

SMOKE = REPO / "experiments" / "configs" / "smoke.toml"


def _agree(rank: int, world_size: int, failing_rank: int | None) -> dict:
    def work() -> str:
        if rank == failing_rank:
            raise DataError(f"rank {rank} cannot read the data")
        return f"data of rank {rank}"

    try:
        # Every rank tries here: the error of any one of them must reach all.
        result = run_and_agree(work, run_here=True, error_type=DataError)
    except DataError as e:
        return {"error": str(e)}
    only_rank0 = run_and_agree(lambda: "loaded", run_here=rank == 0, error_type=DataError)
    summed = all_reduce_sum(torch.tensor([float(rank + 1), 1.0], dtype=torch.float64))
    return {"result": result, "only_rank0": only_rank0, "summed": summed.tolist()}


def _announce(rank: int, world_size: int, out_dir: str) -> str:
    """Each rank as the only worker of its own machine (local rank 0), as on 2 nodes."""
    import contextlib
    import io

    from freeze.pipeline.config import load_config
    from freeze.pipeline.distributed import WorkerContext
    from freeze.pipeline.log import get_logger
    from freeze.pipeline.runs import RunDir
    from freeze.pipeline.train import announce_start

    cfg = load_config(SMOKE, [f"run.out_dir={out_dir}"], check_files=False)
    ctx = WorkerContext(rank, world_size, 0, 1, torch.device("cpu"), "gloo", threads=2, cores=2)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        announce_start(cfg, ctx, RunDir(cfg.run_dir()), get_logger(rank))
    return printed.getvalue()


def _every_case(rank: int, world_size: int, out_dir: str) -> dict:
    # One job for every case: the refused agreement is a completed all_gather on both ranks, so the
    # group is in step for the next case.
    return {
        "rank1_fails": _agree(rank, world_size, 1),
        "no_errors": _agree(rank, world_size, None),
        "announced": _announce(rank, world_size, out_dir),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    tmp_path = tmp_path_factory.mktemp("distributed")
    return run_distributed(_every_case, 2, tmp_path, str(tmp_path / "runs")), tmp_path


@pytest.mark.processes
def test_an_error_on_any_rank_stops_every_rank_with_the_same_line(ranks):
    # rank 1's error: broadcasting rank 0's outcome alone would have let rank 0 walk on.
    results = [r["rank1_fails"] for r in ranks[0]]
    assert results == [{"error": "rank 1 cannot read the data"}] * 2


@pytest.mark.processes
def test_without_errors_each_rank_keeps_its_result_and_sums_are_global(ranks):
    results = [r["no_errors"] for r in ranks[0]]
    assert [r["result"] for r in results] == ["data of rank 0", "data of rank 1"]
    assert [r["only_rank0"] for r in results] == ["loaded", None]
    assert [r["summed"] for r in results] == [[3.0, 2.0]] * 2


def test_single_process_needs_no_group():
    assert run_and_agree(lambda: 1, run_here=True, error_type=DataError) == 1
    total = torch.tensor([2.0])
    assert all_reduce_sum(total) is total


def test_worker_threads_share_the_cores_among_this_machines_workers():
    from freeze.pipeline.distributed import worker_threads

    assert worker_threads(0, cores=8, local_world_size=1) == 8
    assert worker_threads(0, cores=8, local_world_size=4) == 2
    assert worker_threads(0, cores=8, local_world_size=3) == 2  # floor: never more threads than cores
    assert worker_threads(0, cores=2, local_world_size=4) == 1  # at least one
    assert worker_threads(3, cores=2, local_world_size=4) == 3  # dist.threads_per_worker wins


@pytest.mark.processes
def test_every_machine_prints_where_rank_0_writes_the_results(ranks):
    results, tmp_path = ranks
    rank0, rank1 = (r["announced"] for r in results)
    run_dir = tmp_path.resolve() / "runs" / "smoke" / "smoke"
    host = socket.gethostname()
    assert "2 torch threads per worker (2 cores / 1 local workers)" in rank0
    assert f"results go to {run_dir} on {host} (rank 0's machine)" in rank0
    assert rank1 == f"{host}: rank 0 runs on {host}; results go to {run_dir} there\n"
