"""The policy interface, its registry and spec-string parsing (the rules live in rules.py).

A policy is a frozen dataclass whose fields are its parameters and nothing else: ``decide`` is a
pure function of its arguments, so every rank computes the same k from the same all-reduced
statistics, and a run restored from a checkpoint (boundary + monitor history) decides as the run
that wrote it did.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from freeze.checks import Range, did_you_mean, is_int, spell
from freeze.intervals import IntervalStats, relative_change, summed_norms
from freeze.names import split_policy_spec

# Schedule arithmetic in floats lands a hair off exact values (0.8 + 0.2 * 1/4 = 0.8500000000000001);
# without this slack a block due exactly at an evaluation would freeze one evaluation late.
SCHEDULE_EPS = 1e-9

_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


class PolicyError(ValueError):
    """A bad policy name, parameter, value or call; the message is one line naming the accepted values."""


@dataclass(frozen=True)
class Progress:
    """Where training stands when a policy is asked, as work COMPLETED.

    A policy evaluated every N steps is asked in the middle of an epoch: the running epoch is not
    completed, so an epoch schedule must read ``epochs_completed`` (0 throughout the first epoch),
    never "the current epoch + 1", or it fires one epoch early."""

    epochs_completed: int  # whole epochs finished (0 during the first epoch)
    epochs_total: int  # planned epochs (>= 1)
    steps_completed: int  # optimizer steps finished, skipped (fp16 overflow) steps included
    steps_total: int  # optimizer steps planned for the whole run; 0 if unknown

    def __post_init__(self) -> None:
        for name, low in (("epochs_completed", 0), ("epochs_total", 1), ("steps_completed", 0), ("steps_total", 0)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"Progress: {name} = {value!r}; accepted: int >= {low}")

    @property
    def fraction(self) -> float:
        """Fraction of training done: by steps when their total is known, else by whole epochs."""
        if self.steps_total:
            done = self.steps_completed / self.steps_total
        else:
            done = self.epochs_completed / self.epochs_total
        return min(max(done, 0.0), 1.0)


@dataclass(frozen=True)
class Needs:
    """What a policy needs beyond the boundary, history, progress and block count: the one
    declaration the Freezer, its monitor and the pipeline read (:meth:`Policy.needs`), so a new
    input is one field here and one reader, not a flag read in every place that builds a run."""

    gradient_norms: bool = False  # per-step gradient norms (IntervalStats.mean_step_grad_norm, the overflow mask)
    gradient_sums: bool = False  # the monitor sums each interval's gradients (eta, the gradient rules)
    descent_span: int = 0  # > 0: the monitor tracks each block's descent over this many intervals
    block_bytes: bool = False  # decide/explain take block_bytes= (each block's parameter bytes)
    pricing: bool = False  # decide/explain/wants_probe take pricing=; the run must supply one
    probe: bool = False  # may ask for the held-out loss (wants_probe); the run must supply probe=
    run_length: bool = False  # reads progress.fraction: the run's epochs (and steps) must be given
    intervals_needed: int = 0  # closed intervals before its first decision can freeze
    may_unfreeze: bool = False  # may return k < boundary
    block_lr: bool = False  # scales each block's learning rate through the optimizer (one group per block)
    cosine_run: bool = False  # its block factors assume the run's LR is a cosine to zero, no warm-up
    # freeze.signals.Signal subclasses the monitor runs for it: IntervalStats.signals[name] in history
    signals: tuple[type, ...] = ()


@dataclass(frozen=True)
class DecisionContext:
    """Everything a policy may read at one evaluation, built once by the Freezer;
    :meth:`Policy.decide_in` passes a policy the parts its :class:`Needs` ask for."""

    boundary: int
    history: Sequence[IntervalStats]
    progress: Progress
    num_blocks: int
    block_bytes: Sequence[int] | None = None
    pricing: Any = None
    # the policy's declaration, asked once by the Freezer; None: asked at each call
    needs: Needs | None = None

    def _call(self, method, policy: Policy):
        needs = self.needs if self.needs is not None else policy.needs()
        inputs: dict[str, Any] = {}
        if needs.block_bytes:
            inputs["block_bytes"] = self.block_bytes
        if needs.pricing:
            inputs["pricing"] = self.pricing
        return method(self.boundary, self.history, self.progress, self.num_blocks, **inputs)


def param(
    default: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A policy parameter: a dataclass field carrying its accepted values, checked on construction.

    Args:
        default: the value when a spec or a call does not give one.
        low: smallest accepted value (numbers), or None.
        high: largest accepted value (numbers), or None.
        low_open: exclude ``low`` itself.
        high_open: exclude ``high`` itself.
        choices: the accepted strings (string parameters), or None for any.
    """
    bounds = Range(
        ge=None if low_open else low,
        gt=low if low_open else None,
        le=None if high_open else high,
        lt=high if high_open else None,
    )
    return field(default=default, metadata={"range": bounds, "choices": choices})


class Policy(ABC):
    """Base of every policy. Concrete policies are ``@register_policy @dataclass(frozen=True)``."""

    name: ClassVar[str]
    uses_gradients: ClassVar[bool] = False  # decisions read the monitor history
    needs_run_length: ClassVar[bool] = False  # decisions read progress.fraction (the run length)
    may_unfreeze: ClassVar[bool] = False  # may return k < boundary
    uses_block_bytes: ClassVar[bool] = False  # decide/explain take block_bytes= (each block's parameter bytes)
    uses_pricing: ClassVar[bool] = False  # decide/explain/wants_probe take pricing= (freeze.policies.horizon.Pricing)
    uses_descent: ClassVar[bool] = False  # decisions read IntervalStats.descent (the monitor tracks it)
    uses_probe: ClassVar[bool] = False  # may ask for the held-out loss (wants_probe); the Freezer needs probe=

    def needs(self) -> Needs:
        """What this policy needs beyond the boundary, history, progress and block count. By default
        from its class flags (``uses_gradients``, ``uses_pricing``, ...), so a policy written with
        them keeps working; an instance method, so parameters can change it (``horizon:probation=0``
        needs no probe)."""
        return Needs(
            gradient_norms=self.uses_gradients,
            gradient_sums=self.uses_gradients and not self.uses_descent,
            descent_span=self.descent_span if self.uses_descent else 0,
            block_bytes=self.uses_block_bytes,
            pricing=self.uses_pricing,
            probe=self.uses_probe,
            run_length=self.needs_run_length,
            intervals_needed=self.intervals_needed,
            may_unfreeze=self.may_unfreeze,
            block_lr=self.sets_block_lr,
            cosine_run=self.assumes_cosine_run,
        )

    def decide_in(self, ctx: DecisionContext) -> int:
        """:meth:`decide` at ``ctx``, with the inputs :meth:`needs` declares (what the Freezer calls)."""
        return ctx._call(self.decide, self)

    def explain_in(self, ctx: DecisionContext) -> str:
        """:meth:`explain` at ``ctx``, with the inputs :meth:`needs` declares."""
        return ctx._call(self.explain, self)

    def wants_probe_in(self, ctx: DecisionContext) -> bool:
        """:meth:`wants_probe` at ``ctx``, with the inputs :meth:`needs` declares."""
        return bool(ctx._call(self.wants_probe, self))

    @property
    def intervals_needed(self) -> int:
        """Closed intervals the policy needs before its first decision can freeze anything; a run
        asked fewer times is refused before it starts (0: no minimum)."""
        return 0

    @property
    def descent_span(self) -> int:
        """Intervals one descent estimate spans, for a policy that reads ``IntervalStats.descent``."""
        return 1

    @property
    def sets_block_lr(self) -> bool:
        """Whether :meth:`block_lr_scales` may return a factor other than 1 (the Freezer then scales
        each block's optimizer group; it needs the optimizer, one group per block, and the run in steps).
        A property, not a flag: ``at:anneal=0`` is the hard clock and leaves the optimizer alone."""
        return False

    def __post_init__(self) -> None:
        # Coerce first so that Policy(percentile=50) and parse "percentile=50" are the same object.
        for f in _fields(self):
            object.__setattr__(self, f.name, _coerce(type(self), f, getattr(self, f.name)))

    def initial_boundary(self, num_blocks: int) -> int:
        """The boundary before the first step (0 unless a policy starts frozen).

        Args:
            num_blocks: number of blocks L of the model.
        """
        self._check_blocks(num_blocks)
        return 0

    @abstractmethod
    def decide(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> int:
        """The boundary to apply now, in [0, num_blocks - 1].

        Args:
            boundary: the boundary k in force now.
            history: the monitor's closed intervals, oldest first (all-reduced, so equal on every rank).
            progress: where training stands.
            num_blocks: number of blocks L; the last one (the head) is never frozen by a rule.
        """

    @property
    def assumes_cosine_run(self) -> bool:
        """Whether :meth:`block_lr_scales` is written for a run whose own LR follows a cosine to
        zero over the whole run, no warm-up (FreezeOut as published); a pipeline refuses another."""
        return False

    def block_lr_scales(self, progress: Progress, num_blocks: int) -> list[float]:
        """Per-block factor on the learning rate of the optimizer step taken at ``progress`` (its
        ``steps_completed`` steps done before it), on top of the run's own schedule; 1.0 everywhere
        unless :attr:`sets_block_lr`. A pure function of its arguments, so a resumed run scales as
        the run that wrote the checkpoint did.

        Args:
            progress: where training stands before the step.
            num_blocks: number of blocks L.
        """
        return [1.0] * num_blocks

    def wants_probe(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int, **inputs: Any
    ) -> bool:
        """Whether the Freezer should measure the held-out loss at this evaluation before asking
        :meth:`decide` (it lands in ``history[-1].held_out_loss``); only for ``uses_probe`` policies."""
        return False

    def threshold(self, eta: Sequence[float | None], boundary: int, num_blocks: int) -> float | None:
        """The value a gradient policy compares each block's eta with (None: it compares none)."""
        return None

    def explain(self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int) -> str:
        """One line: the signal a decision at this point reads (eta per block and the threshold, or
        the run's progress), for a reader asking why the policy did (not) freeze."""
        if not self.uses_gradients:
            return f"progress {progress.fraction:.3f} of the run (epoch {progress.epochs_completed}/{progress.epochs_total})"
        if len(history) < 2:
            return f"{len(history)} interval(s) closed; eta compares two"
        eta = self._last_etas(history, num_blocks, getattr(self, "norm", "l2"))
        shown = " ".join("-" if e is None else f"{e:.3g}" for e in eta)
        limit = self.threshold(eta, boundary, num_blocks)
        return f"eta per block [{shown}]" + ("" if limit is None else f", threshold {limit:.3g}")

    def spec(self) -> str:
        """Canonical config string with every parameter written out; parse_policy(p.spec()) == p."""
        params = ",".join(f"{f.name}={spell(getattr(self, f.name))}" for f in _fields(self))
        return f"{self.name}:{params}" if params else self.name

    # ---------------------------------------------------------------- shared checks
    def _check_blocks(self, num_blocks: int) -> None:
        if not is_int(num_blocks) or num_blocks < 1:
            raise PolicyError(f"policy '{self.name}': num_blocks = {num_blocks!r}; accepted: int >= 1")

    def _check_call(self, boundary: int, num_blocks: int) -> None:
        self._check_blocks(num_blocks)
        if not is_int(boundary) or not 0 <= boundary < num_blocks:
            raise PolicyError(
                f"policy '{self.name}': boundary = {boundary!r} with {num_blocks} blocks; accepted: 0..{num_blocks - 1}"
            )

    def _last_etas(self, history: Sequence[IntervalStats], num_blocks: int, norm: str = "l2") -> list[float | None]:
        """eta_l = |G_prev - G_cur| / G_prev per block between the last two intervals, G the
        ``norm`` of the summed gradient."""
        prev, cur = history[-2], history[-1]
        for stats in (prev, cur):
            width = len(summed_norms(stats, norm))
            if width != num_blocks:
                raise PolicyError(
                    f"policy '{self.name}': interval {stats.index} has {width} "
                    f"block statistics; accepted: exactly num_blocks = {num_blocks}"
                )
        return relative_change(prev, cur, norm)


# -------------------------------------------------------------------- registry and parsing
POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a frozen-dataclass policy reachable by its ``name``.

    Args:
        cls: a ``@dataclass(frozen=True)`` subclass of :class:`Policy` with a class attribute ``name``.

    Returns:
        ``cls`` itself.

    Raises:
        PolicyError: the name is empty, contains ``:,=`` or a space, or belongs to another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, Policy) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_policy: {cls!r} is not a dataclass subclass of Policy")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or any(c in name for c in ":,= "):
        raise PolicyError(f"register_policy: {cls.__name__}.name = {name!r}; accepted: a non-empty name without ':,= '")
    if name in POLICIES and POLICIES[name] is not cls:
        raise PolicyError(
            f"register_policy: policy '{name}' is already registered by {POLICIES[name].__name__}; accepted: a new name"
        )
    POLICIES[name] = cls
    return cls


def make_policy(name: str, **params: Any) -> Policy:
    """Build a registered policy from a name and parameters, or from a spec string.

    ``make_policy("static", k=2)`` and ``make_policy("static:k=2")`` are the same policy: a name
    holding a ``:`` is a spec and goes to :func:`parse_policy` (then no ``params`` may be given).

    Args:
        name: a registered policy name (see ``POLICIES``), or a spec ``"name:param=value,..."``.
        **params: the policy's parameters; values are converted to the field types and checked.

    Raises:
        PolicyError: unknown name or parameter, a value outside the accepted ones, or a spec
            string together with parameters.
    """
    if isinstance(name, str) and ":" in name:
        if params:
            raise PolicyError(
                f"make_policy({name!r}, {', '.join(params)}=...): a spec string and parameters, not both; "
                "accepted: a spec alone (make_policy('static:k=2')) or a name with parameters "
                "(make_policy('static', k=2))"
            )
        return parse_policy(name)
    cls = _policy_class(name)
    accepted = [f.name for f in _fields(cls)]
    for key in params:
        if key not in accepted:
            raise PolicyError(
                f"policy '{name}': unknown parameter '{key}'{did_you_mean(key, accepted)}; "
                f"accepted: {', '.join(accepted) or 'no parameters'}"
            )
    return cls(**params)


def parse_policy(spec: str) -> Policy:
    """``"name"`` or ``"name:param=value,param=value"`` -> policy.

    Args:
        spec: the policy spec, as in configs (``"autofreeze:percentile=50"``).

    Raises:
        PolicyError: a malformed spec, or what :func:`make_policy` rejects.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(
            f"empty policy spec {spec!r}; accepted: a policy name ({', '.join(POLICIES)}) "
            "optionally followed by ':param=value,...'"
        )
    name, items = split_policy_spec(spec)
    cls = _policy_class(name)
    accepted = ", ".join(f.name for f in _fields(cls)) or "no parameters"
    params: dict[str, str] = {}
    for key, value in items:
        if value is None or not key:
            item = key if value is None else f"{key}={value}"
            raise PolicyError(
                f"policy '{name}': malformed parameter {item!r} in {spec!r}; "
                f"accepted: param=value pairs separated by ',' with param in {accepted}"
            )
        if key in params:
            raise PolicyError(
                f"policy '{name}': parameter '{key}' given twice in {spec!r}; accepted: each of {accepted} at most once"
            )
        params[key] = value
    return make_policy(name, **params)


def _policy_class(name: str) -> type[Policy]:
    # The built-in rules are registered by freeze/policies/__init__.py, which Python runs before
    # this module (a submodule import runs its package first): no import is deferred here.
    if name not in POLICIES:
        raise PolicyError(
            f"unknown policy {name!r}{did_you_mean(name, POLICIES)}; accepted: {', '.join(POLICIES)} (as a name, or as a spec "
            "'name:param=value,...' for make_policy and parse_policy)"
        )
    return POLICIES[name]


def _fields(policy: Policy | type[Policy]) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(policy)  # type: ignore[arg-type]


@functools.cache
def _param_types(cls: type[Policy]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _accepted(f: dataclasses.Field, typ: type) -> str:
    if f.metadata.get("choices"):
        return "one of " + ", ".join(f.metadata["choices"])
    bounds = f.metadata["range"].describe()
    return f"{typ.__name__} {bounds}" if bounds else typ.__name__


def _convert(typ: type, value: Any) -> Any:
    """``value`` (typed, or a string from a spec) as ``typ``; None when it is not one."""
    if isinstance(value, str):
        text = value.strip()
        if typ is str:
            return text
        if typ is bool:
            return _BOOL_WORDS.get(text.lower())
        try:
            return typ(text)
        except ValueError:
            return None
    if isinstance(value, bool):  # bool is an int subclass: True must not pass as k=1
        return value if typ is bool else None
    if typ is int and isinstance(value, numbers.Integral):
        return int(value)
    if typ is float and isinstance(value, numbers.Real):
        return float(value)
    return None


def _coerce(cls: type[Policy], f: dataclasses.Field, value: Any) -> Any:
    """Convert a parameter value to the field's type and check it against the accepted values."""
    typ = _param_types(cls)[f.name]
    if typ not in (int, float, str, bool):
        raise TypeError(f"policy '{cls.name}': parameter '{f.name}' has unsupported type {typ!r}")
    accepted = _accepted(f, typ)

    def bad(why: str) -> PolicyError:
        return PolicyError(f"policy '{cls.name}': parameter '{f.name}' = {value!r} {why}; accepted: {accepted}")

    out = _convert(typ, value)
    if out is None or (typ is float and not math.isfinite(out)):
        raise bad(f"is not a valid {typ.__name__}")
    meta = f.metadata
    if meta.get("choices") and out not in meta["choices"]:
        raise bad("is not accepted")
    if typ in (int, float) and not meta["range"].contains(out):
        raise bad("is out of range")
    return out


def same_policy(saved_spec: object, policy: Policy) -> bool:
    """Whether a spec written by an earlier run (a checkpoint's) names ``policy``: equal as policies,
    not as strings, so a spec written before a parameter existed (``at:k=9,t=0.5``) still names the
    policy whose new parameter is at its default (``at:k=9,t=0.5,anneal=0``)."""
    if saved_spec == policy.spec():
        return True
    try:
        return isinstance(saved_spec, str) and parse_policy(saved_spec) == policy
    except PolicyError:
        return False


def cosine_to_zero(fraction: float) -> float:
    """0.5 (1 + cos(pi x)) for x clipped to [0, 1]: 1 at the start, 0 at the end."""
    return 0.5 * (1.0 + math.cos(math.pi * min(max(fraction, 0.0), 1.0)))


def floor_with_slack(x: float) -> int:
    return math.floor(x + SCHEDULE_EPS)
