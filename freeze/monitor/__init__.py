"""The per-block gradient monitor (:class:`GradNormMonitor`) and the trackers it is made of: the
step norms (:mod:`freeze.monitor.step_norms`) and the summed gradient (:mod:`freeze.monitor.grad_sums`),
each made only when a policy's needs ask for it."""

from freeze.intervals import NORMS, IntervalStats, relative_change, summed_norms
from freeze.monitor.monitor import GradNormMonitor

__all__ = ["NORMS", "GradNormMonitor", "IntervalStats", "relative_change", "summed_norms"]
