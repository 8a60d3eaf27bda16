"""Freeze policies: turn (boundary, monitor history, progress) into the next boundary k.

Blocks ``0 .. k-1`` are frozen. The last block (the head) never is, so every policy returns k in
``[0, L-1]``, and only a policy with ``may_unfreeze`` ever returns k below the current boundary.

A policy is a frozen dataclass whose fields are its parameters and nothing else: ``decide`` is a
pure function of its arguments, so every rank computes the same k from the same all-reduced
statistics, and a run restored from a checkpoint (boundary + monitor history) decides as the run
that wrote it did.

Spec strings name a policy and its parameters, e.g. ``"none"``, ``"static:k=4"``,
``"autofreeze:percentile=50"``, ``"freezeout:t0=0.8,scale=cubic"``. The rules and where they come
from are in shared/design/algorithms.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np

from freeze.monitor import IntervalStats, relative_change

# Schedule arithmetic in floats lands a hair off exact values (0.8 + 0.2 * 1/4 = 0.8500000000000001);
# without this slack a block due exactly at an evaluation would freeze one evaluation late.
_EPS = 1e-9

_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


class PolicyError(ValueError):
    """A bad policy name, parameter, value or call; the message is one line naming the accepted values."""


@dataclass(frozen=True)
class Progress:
    """Where training stands when a policy is asked."""

    epoch: int  # 0-based epoch that just ended (or is running, for step-level evaluation)
    epochs_total: int  # planned epochs (>= 1)
    step: int  # optimizer steps completed so far
    steps_total: int  # optimizer steps in the whole run; 0 if unknown

    def __post_init__(self) -> None:
        for name, low in (("epoch", 0), ("epochs_total", 1), ("step", 0), ("steps_total", 0)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"Progress: {name} = {value!r}; accepted: int >= {low}")

    @property
    def fraction(self) -> float:
        """Fraction of training done: by steps when their total is known, else by epochs."""
        if self.steps_total:
            done = self.step / self.steps_total
        else:
            done = (self.epoch + 1) / self.epochs_total
        return min(max(done, 0.0), 1.0)


def param(
    default: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A policy parameter: a dataclass field carrying its accepted values, checked on construction."""
    limits = {"low": low, "high": high, "low_open": low_open, "high_open": high_open}
    return field(default=default, metadata={**limits, "choices": choices})


class Policy(ABC):
    """Base of every policy. Concrete policies are ``@register_policy @dataclass(frozen=True)``."""

    name: ClassVar[str]
    uses_gradients: ClassVar[bool] = False  # decisions read the monitor history
    needs_run_length: ClassVar[bool] = False  # decisions read progress.fraction
    may_unfreeze: ClassVar[bool] = False  # may return k < boundary

    def __post_init__(self) -> None:
        # Coerce first so that Policy(percentile=50) and parse "percentile=50" are the same object.
        for f in _fields(self):
            object.__setattr__(self, f.name, _coerce(type(self), f, getattr(self, f.name)))

    def initial_boundary(self, num_blocks: int) -> int:
        self._check_blocks(num_blocks)
        return 0

    @abstractmethod
    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        """The boundary to apply now, in [0, num_blocks - 1]."""

    def spec(self) -> str:
        """Canonical config string with every parameter written out; parse_policy(p.spec()) == p."""
        params = ",".join(f"{f.name}={_format(getattr(self, f.name))}" for f in _fields(self))
        return f"{self.name}:{params}" if params else self.name

    def state_dict(self) -> dict:
        # Decisions are pure, so the parameters are the whole state.
        return {"policy": self.name, "params": {f.name: getattr(self, f.name) for f in _fields(self)}}

    def load_state_dict(self, state: dict) -> None:
        """Take the checkpoint's parameters, so a resumed run decides as the run that wrote it."""
        found = state.get("policy") if isinstance(state, dict) else None
        if found != self.name or not isinstance(state.get("params"), dict):
            raise PolicyError(
                f"policy '{self.name}': state_dict is for policy {found!r}; "
                f"accepted: a state_dict written by policy '{self.name}'"
            )
        restored = make_policy(self.name, **state["params"])
        for f in _fields(self):
            object.__setattr__(self, f.name, getattr(restored, f.name))

    # ---------------------------------------------------------------- shared checks
    def _check_blocks(self, num_blocks: int) -> None:
        if not _is_int(num_blocks) or num_blocks < 1:
            raise PolicyError(f"policy '{self.name}': num_blocks = {num_blocks!r}; accepted: int >= 1")

    def _check_call(self, boundary: int, num_blocks: int) -> None:
        self._check_blocks(num_blocks)
        if not _is_int(boundary) or not 0 <= boundary < num_blocks:
            raise PolicyError(
                f"policy '{self.name}': boundary = {boundary!r} with {num_blocks} blocks; "
                f"accepted: 0..{num_blocks - 1}"
            )

    def _last_etas(self, history: Sequence[IntervalStats], num_blocks: int) -> list[float | None]:
        """eta_l = |G_prev - G_cur| / G_prev per block between the last two intervals."""
        prev, cur = history[-2], history[-1]
        for stats in (prev, cur):
            if len(stats.summed_grad_norm) != num_blocks:
                raise PolicyError(
                    f"policy '{self.name}': interval {stats.index} has {len(stats.summed_grad_norm)} "
                    f"block statistics; accepted: exactly num_blocks = {num_blocks}"
                )
        return relative_change(prev, cur)


# -------------------------------------------------------------------- registry and parsing
POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a frozen-dataclass policy reachable by its ``name``."""
    if not (isinstance(cls, type) and issubclass(cls, Policy) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_policy: {cls!r} is not a dataclass subclass of Policy")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or any(c in name for c in ":,= "):
        raise PolicyError(
            f"register_policy: {cls.__name__}.name = {name!r}; accepted: a non-empty name without ':,= '"
        )
    if name in POLICIES and POLICIES[name] is not cls:
        raise PolicyError(
            f"register_policy: policy '{name}' is already registered by {POLICIES[name].__name__}; "
            "accepted: a new name"
        )
    POLICIES[name] = cls
    return cls


def make_policy(name: str, **params: Any) -> Policy:
    """Build a registered policy; parameter values may be typed or strings."""
    cls = _policy_class(name)
    accepted = [f.name for f in _fields(cls)]
    for key in params:
        if key not in accepted:
            raise PolicyError(
                f"policy '{name}': unknown parameter '{key}'; "
                f"accepted: {', '.join(accepted) or 'no parameters'}"
            )
    return cls(**params)


def parse_policy(spec: str) -> Policy:
    """``"name"`` or ``"name:param=value,param=value"`` -> policy."""
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(
            f"empty policy spec {spec!r}; accepted: a policy name ({', '.join(POLICIES)}) "
            "optionally followed by ':param=value,...'"
        )
    name, colon, rest = spec.strip().partition(":")
    name = name.strip()
    cls = _policy_class(name)
    accepted = ", ".join(f.name for f in _fields(cls)) or "no parameters"
    params: dict[str, str] = {}
    if colon:
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise PolicyError(
                    f"policy '{name}': malformed parameter {item!r} in {spec!r}; "
                    f"accepted: param=value pairs separated by ',' with param in {accepted}"
                )
            if key in params:
                raise PolicyError(
                    f"policy '{name}': parameter '{key}' given twice in {spec!r}; "
                    f"accepted: each of {accepted} at most once"
                )
            params[key] = value
    return make_policy(name, **params)


def _policy_class(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; accepted: {', '.join(POLICIES)}")
    return POLICIES[name]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _fields(policy: Policy | type[Policy]) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(policy)  # type: ignore[arg-type]


@functools.cache
def _param_types(cls: type[Policy]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _accepted(f: dataclasses.Field, typ: type) -> str:
    meta = f.metadata
    if meta.get("choices"):
        return "one of " + ", ".join(meta["choices"])
    low, high = meta.get("low"), meta.get("high")
    if low is not None and high is not None:
        left, right = "(" if meta["low_open"] else "[", ")" if meta["high_open"] else "]"
        return f"{typ.__name__} in {left}{low:g}, {high:g}{right}"
    if low is not None:
        return f"{typ.__name__} {'>' if meta['low_open'] else '>='} {low:g}"
    if high is not None:
        return f"{typ.__name__} {'<' if meta['high_open'] else '<='} {high:g}"
    return typ.__name__


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
        return PolicyError(
            f"policy '{cls.name}': parameter '{f.name}' = {value!r} {why}; accepted: {accepted}"
        )

    out = _convert(typ, value)
    if out is None or (typ is float and not math.isfinite(out)):
        raise bad(f"is not a valid {typ.__name__}")
    meta = f.metadata
    if meta.get("choices") and out not in meta["choices"]:
        raise bad("is not accepted")
    low, high = meta.get("low"), meta.get("high")
    if low is not None and (out < low or (meta["low_open"] and out == low)):
        raise bad("is out of range")
    if high is not None and (out > high or (meta["high_open"] and out == high)):
        raise bad("is out of range")
    return out


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest string that parses back to the same float
    return str(value)


def _floor(x: float) -> int:
    return math.floor(x + _EPS)


# -------------------------------------------------------------------- the policies
@register_policy
@dataclass(frozen=True)
class NoFreezing(Policy):
    """Full fine-tuning baseline: nothing is ever frozen."""

    name: ClassVar[str] = "none"

    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        self._check_call(boundary, num_blocks)
        return boundary  # 0 from initial_boundary, and never moved


@register_policy
@dataclass(frozen=True)
class StaticFreeze(Policy):
    """Blocks 0..k-1 frozen from the first step (transfer learning, the reference study's sweep)."""

    name: ClassVar[str] = "static"
    k: int = param(0, low=0)

    def initial_boundary(self, num_blocks: int) -> int:
        self._check_blocks(num_blocks)
        return min(self.k, num_blocks - 1)

    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        self._check_call(boundary, num_blocks)
        return max(boundary, min(self.k, num_blocks - 1))


@register_policy
@dataclass(frozen=True)
class FreezeOut(Policy):
    """FreezeOut (Brock et al. 2017): block i freezes at fraction t_i of training, then scaled."""

    name: ClassVar[str] = "freezeout"
    needs_run_length: ClassVar[bool] = True
    t0: float = param(0.8, low=0.0, high=1.0)
    scale: str = param("cubic", choices=("linear", "squared", "cubic"))

    def freeze_fractions(self, num_blocks: int) -> list[float]:
        """t_i per block; the head's is 1.0, i.e. the end of training."""
        self._check_blocks(num_blocks)
        if num_blocks == 1:
            return [1.0]
        power = {"linear": 1, "squared": 2, "cubic": 3}[self.scale]
        return [(self.t0 + (1.0 - self.t0) * i / (num_blocks - 1)) ** power for i in range(num_blocks)]

    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        self._check_call(boundary, num_blocks)
        done = progress.fraction
        k = 0
        for t in self.freeze_fractions(num_blocks)[:-1]:  # the head is never frozen
            if t > done + _EPS:
                break
            k += 1
        return max(boundary, k)


@register_policy
@dataclass(frozen=True)
class LinearFreeze(Policy):
    """Composer LayerFreezing: the frozen fraction grows linearly from freeze_start to the end."""

    name: ClassVar[str] = "linear"
    needs_run_length: ClassVar[bool] = True
    freeze_start: float = param(0.5, low=0.0, high=1.0, high_open=True)
    freeze_level: float = param(1.0, low=0.0, high=1.0)

    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        self._check_call(boundary, num_blocks)
        ramp = (progress.fraction - self.freeze_start) / (1.0 - self.freeze_start)
        frozen_fraction = min(max(ramp, 0.0), 1.0) * self.freeze_level
        return max(boundary, min(_floor(frozen_fraction * num_blocks), num_blocks - 1))


@register_policy
@dataclass(frozen=True)
class GeometricFreeze(Policy):
    """PipeTransformer's hand-crafted schedule: floor(L * (1 - (1 - alpha)^e)) after e epochs."""

    name: ClassVar[str] = "geometric"
    alpha: float = param(1.0 / 3.0, low=0.0, low_open=True, high=1.0)

    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        self._check_call(boundary, num_blocks)
        epochs_done = progress.epoch + 1
        k = _floor(num_blocks * (1.0 - (1.0 - self.alpha) ** epochs_done))
        return max(boundary, min(k, num_blocks - 1))


@register_policy
@dataclass(frozen=True)
class AutoFreeze(Policy):
    """AutoFreeze (Liu et al. 2021): freeze the leading active blocks whose gradient-norm change
    eta is below the percentile of eta over the active blocks."""

    name: ClassVar[str] = "autofreeze"
    uses_gradients: ClassVar[bool] = True
    percentile: float = param(50.0, low=0.0, high=100.0)
    min_intervals: int = param(2, low=2)  # eta compares two intervals

    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        self._check_call(boundary, num_blocks)
        if len(history) < self.min_intervals:
            return boundary
        eta = self._last_etas(history, num_blocks)
        defined = [e for e in eta[boundary:] if e is not None]
        if not defined:
            return boundary
        threshold = float(np.percentile(defined, self.percentile, method="linear"))
        k = boundary
        # Only a leading run can freeze: a slow block behind a fast one stays active.
        while k < num_blocks - 1 and eta[k] is not None and eta[k] < threshold:
            k += 1
        return k


@register_policy
@dataclass(frozen=True)
class CS744Freeze(Policy):
    """The reference study's Algorithm 1: freeze the first active block only when its eta is the
    smallest among the active blocks; at most one block per evaluation."""

    name: ClassVar[str] = "cs744"
    uses_gradients: ClassVar[bool] = True

    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        self._check_call(boundary, num_blocks)
        if len(history) < 2 or boundary >= num_blocks - 1:
            return boundary
        eta = self._last_etas(history, num_blocks)
        first = eta[boundary]
        if first is None:
            return boundary
        smallest = min(e for e in eta[boundary:] if e is not None)
        return boundary + 1 if first <= smallest else boundary  # a tie freezes


@register_policy
@dataclass(frozen=True)
class GradualUnfreeze(Policy):
    """ULMFiT / BackboneFinetuning: start with all but the head frozen and unfreeze one block from
    the top after every ``every_epochs`` completed epochs."""

    name: ClassVar[str] = "gradual-unfreeze"
    may_unfreeze: ClassVar[bool] = True
    every_epochs: int = param(1, low=1)

    def initial_boundary(self, num_blocks: int) -> int:
        self._check_blocks(num_blocks)
        return num_blocks - 1

    def decide(
        self, boundary: int, history: Sequence[IntervalStats], progress: Progress, num_blocks: int
    ) -> int:
        self._check_call(boundary, num_blocks)
        scheduled = max(num_blocks - 1 - (progress.epoch + 1) // self.every_epochs, 0)
        # Moves only towards unfreezing: a block once unfrozen is never frozen again.
        return min(boundary, scheduled)
