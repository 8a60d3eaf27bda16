"""How far a Freezer's training is (epochs and optimizer steps), and when its policy is asked."""

from __future__ import annotations

from dataclasses import dataclass

from freeze.checks import is_int
from freeze.names import split_policy_spec
from freeze.policies import Progress
from freeze.policies.base import Needs


@dataclass
class RunClock:
    """``epochs``/``steps_per_epoch``: the planned run (None: not given); ``interval_steps``: ask
    the policy every N optimizer steps, 0: once per epoch. The optimizer-step count itself is the
    Freezer's ``counters.steps``; this clock keeps the epoch it belongs to."""

    epochs: int | None
    steps_per_epoch: int | None
    interval_steps: int
    epochs_completed: int = 0
    epoch_start_step: int = 0  # counters.steps when the running epoch began

    def __post_init__(self) -> None:
        # Refused when the Freezer is built, not at the first end_epoch (epochs=-3 failed there).
        if not is_int(self.interval_steps) or self.interval_steps < 0:
            raise ValueError(
                f"Freezer: interval_steps must be >= 0 (0 = once per epoch), got {self.interval_steps!r}; "
                "accepted: an integer"
            )
        for name in ("epochs", "steps_per_epoch"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(
                    f"Freezer: {name} must be >= 0 (0 or None: not given), got {value!r}; accepted: an integer"
                )
        # Python ints from here on: a numpy integer would reach Progress and the saved state.
        self.interval_steps = int(self.interval_steps)
        self.epochs = None if self.epochs is None else int(self.epochs)
        self.steps_per_epoch = None if self.steps_per_epoch is None else int(self.steps_per_epoch)

    def check_needs(self, needs: Needs, spec: str) -> None:
        """Refuse a run-length policy (``spec``, its ``needs``) the run length was not given for."""
        name = split_policy_spec(spec)[0]
        if needs.run_length and not self.epochs:
            raise ValueError(f"Freezer: policy '{name}' needs the run length: pass epochs=N")
        if needs.run_length and self.interval_steps and not self.steps_per_epoch:
            # Between epoch ends only steps say how far training is; an epoch count would put the
            # whole running epoch in the past or in the future.
            raise ValueError(
                f"Freezer: policy '{name}' evaluated every interval_steps={self.interval_steps} steps "
                "needs the run length in steps: pass steps_per_epoch=N"
            )

    def evaluations(self) -> int | None:
        """How many times the policy is asked over the planned run (None: the run length in steps
        was not given and the policy evaluates by steps)."""
        if not self.interval_steps:
            return self.epochs
        if not (self.epochs and self.steps_per_epoch):
            return None
        return self.epochs * self.steps_per_epoch // self.interval_steps

    def check_evaluations(self, needs: Needs, spec: str) -> None:
        """Refuse a run asked fewer times than ``needs.intervals_needed`` before the first decision of
        the policy ``spec``: it would never decide. Called by the Freezer, and by the pipeline before
        a run starts."""
        needed, evaluations = needs.intervals_needed, self.evaluations()
        if not needed or evaluations is None or evaluations >= needed:
            return
        run_steps = (self.epochs or 0) * (self.steps_per_epoch or 0)
        raise ValueError(
            f"Freezer: policy '{spec}' needs {needed} evaluations before its first decision and this run "
            f"has {evaluations}; accepted: interval_steps small enough for {needed} or more (e.g. "
            f"{max(run_steps // (2 * needed), 1)}), or a smaller window/span"
        )

    def end_epoch(self, epoch: int, steps: int) -> int:
        """Close ``epoch`` at optimizer step ``steps``; returns the steps it took."""
        if epoch != self.epochs_completed and self.epochs_completed == 0 and is_int(epoch) and epoch > 0:
            # the usual cause: a resumed loop restored the model and optimizer, not the Freezer
            raise ValueError(
                f"Freezer.end_epoch({epoch}): this Freezer has ended no epoch yet; a loop resumed from a checkpoint "
                "must restore the Freezer too: save freezer.training_state_dict() and load it with "
                "freezer.load_training_state_dict(state) (model, Freezer and optimizer, in that order)"
            )
        if epoch != self.epochs_completed:
            raise ValueError(
                f"Freezer.end_epoch({epoch}): the epoch that just ended is {self.epochs_completed}; call end_epoch "
                "once per epoch, after its last step, with 0-based epoch numbers (a repeated or skipped call feeds "
                "the policy empty or missing intervals)"
            )
        taken = steps - self.epoch_start_step
        self.epochs_completed = epoch + 1
        self.epoch_start_step = steps
        return taken

    def progress(self, steps: int) -> Progress:
        steps_total = self.epochs * self.steps_per_epoch if (self.epochs and self.steps_per_epoch) else 0
        return Progress(
            epochs_completed=self.epochs_completed,
            epochs_total=self.epochs or max(self.epochs_completed, 1),
            steps_completed=steps,
            steps_total=steps_total,
        )

    def epoch_done_fraction(self, steps: int) -> float:
        """Share of the running epoch done at optimizer step ``steps`` (0 when its length is unknown)."""
        if not self.steps_per_epoch:
            return 0.0
        return (steps - self.epoch_start_step) / self.steps_per_epoch
