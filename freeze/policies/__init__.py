"""Freeze policies: the interface and registry (:mod:`freeze.policies.base`), the rules of the
field (:mod:`freeze.policies.rules`) and the project's own (:mod:`freeze.policies.payoff`,
:mod:`freeze.policies.horizon`).
Importing this package registers every built-in rule."""

import importlib

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

# Registered in this order, which every list of accepted policies shows: the field's rules, then ours.
for _module in ("rules", "payoff", "horizon"):
    importlib.import_module(f"freeze.policies.{_module}")

from freeze.policies.horizon import Pricing  # noqa: E402  (after the loop: its registration comes last)

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
