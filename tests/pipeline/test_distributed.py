"""The pipeline's collective helpers on two real gloo ranks."""

import torch

from freeze.pipeline.data import DataError
from freeze.pipeline.distributed import all_reduce_sum, run_and_agree
from tests.distributed_harness import run_distributed


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


def test_an_error_on_any_rank_stops_every_rank_with_the_same_line(tmp_path):
    # rank 1's error: broadcasting rank 0's outcome alone would have let rank 0 walk on.
    results = run_distributed(_agree, 2, tmp_path, 1)
    assert results == [{"error": "rank 1 cannot read the data"}] * 2


def test_without_errors_each_rank_keeps_its_result_and_sums_are_global(tmp_path):
    results = run_distributed(_agree, 2, tmp_path, None)
    assert [r["result"] for r in results] == ["data of rank 0", "data of rank 1"]
    assert [r["only_rank0"] for r in results] == ["loaded", None]
    assert [r["summed"] for r in results] == [[3.0, 2.0]] * 2


def test_single_process_needs_no_group():
    assert run_and_agree(lambda: 1, run_here=True, error_type=DataError) == 1
    total = torch.tensor([2.0])
    assert all_reduce_sum(total) is total
