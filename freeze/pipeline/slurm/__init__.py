"""SLURM, the scheduler research clusters run: the allocation a job runs in (:mod:`.allocation`),
what a user asks of it (:mod:`.options`), the sbatch script a stage of runs becomes (:mod:`.script`),
the commands that submit and watch it (:mod:`.client`), and the rendezvous store a run over several
nodes meets at (:mod:`.store`, the one part that imports torch). No dependency beyond SLURM's own
commands; sweeps and studies use it through :mod:`freeze.pipeline.sweep.executors`."""

from freeze.pipeline.slurm.allocation import Allocation, SlurmEnvError, current_allocation, srun_rank_env
from freeze.pipeline.slurm.client import SlurmError
from freeze.pipeline.slurm.options import SlurmOptions, SlurmOptionsError, parse_slurm_options

__all__ = [
    "Allocation",
    "SlurmEnvError",
    "SlurmError",
    "SlurmOptions",
    "SlurmOptionsError",
    "current_allocation",
    "parse_slurm_options",
    "srun_rank_env",
]
