"""Freeze policies: the interface and registry (:mod:`freeze.policies.base`), the rules of the
field (:mod:`freeze.policies.rules`) and the project's own (:mod:`freeze.policies.payoff`,
:mod:`freeze.policies.horizon`).
Importing this package registers every built-in rule."""

from freeze.policies import horizon as _horizon  # noqa: F401  (registers the project's rules; payoff first)
from freeze.policies import payoff as _payoff  # noqa: F401  (registers the project's own rule)
from freeze.policies import rules as _rules  # noqa: F401  (imported by payoff first: the field's rules list first)
from freeze.policies.base import (
    POLICIES,
    DecisionContext,
    Needs,
    Policy,
    PolicyError,
    Progress,
    make_policy,
    param,
    parse_policy,
    register_policy,
)
from freeze.policies.horizon import Pricing

__all__ = [
    "POLICIES",
    "DecisionContext",
    "Needs",
    "Policy",
    "PolicyError",
    "Pricing",
    "Progress",
    "make_policy",
    "param",
    "parse_policy",
    "register_policy",
]
