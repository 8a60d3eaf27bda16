"""The stages a study runs, shared with the substrate's drivers (gates, scores): the pretraining
stage (or the committed weights, checked) and running one stage of runs with its summary."""

from __future__ import annotations

from freeze.pipeline.datasets.weights import WeightsError, verify
from freeze.pipeline.runs import RunDir
from freeze.pipeline.study.plan import StudyFile
from freeze.pipeline.sweep import RunSpec, SweepError, WorkEta, expand, run_specs
from freeze.pipeline.sweep.executors import Executor, SerialExecutor


def pretrain_stage(study: StudyFile, out_dir: str) -> tuple[list[RunSpec], tuple[str, ...]]:
    """The pretraining run (if any) and the override that makes its checkpoint the model weights;
    with ``weights`` (committed weights), no run: the file's sha256 is checked and it is the weights."""
    if study.weights:
        try:
            verify(study.weights)
        except WeightsError as e:
            raise SweepError(f"study file {study.path}: weights: {e}") from None
        return [], (f"model.weights={study.weights}",)
    if not study.pretrain:
        return [], ()
    try:
        specs = expand(study.pretrain, f"{study.name}-pretrain", {}, [], out_dir)
    except SweepError as e:  # its run config names itself; say which study pointed at it
        raise SweepError(f"study file {study.path}: pretrain: {e}") from None
    return specs, (f"model.weights={RunDir(specs[0].config.run_dir()).model_path}",)  # its final weights


def run_stage(
    title: str,
    specs: list[RunSpec],
    eta: WorkEta | None = None,
    executor: Executor | None = None,
    stage: str = "runs",
) -> bool:
    """Run one stage (``stage``: its short name, which names its scheduler folder and jobs) with
    ``executor`` (default: one run after another here); ``eta``: the whole study's, so each run's eta
    line covers every stage still to come."""
    print(f"== {title}: {len(specs)} runs", flush=True)
    if executor is None or isinstance(executor, SerialExecutor):  # here, one after another
        summary = run_specs(specs, eta=eta)
    else:
        summary = executor.run(stage, specs, eta=eta)
    for line in summary.lines():
        print(line)
    return summary.ok  # a run left to another writer (busy) or to a script not yet submitted is not complete either
