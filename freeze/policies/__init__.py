"""Freeze policies: the interface and registry (:mod:`freeze.policies.base`) and the rules of the
field (:mod:`freeze.policies.rules`). Importing this package registers every built-in rule."""

from freeze.policies import rules as _rules  # noqa: F401  (registers the built-in policies)
from freeze.policies.base import (
    POLICIES,
    Policy,
    PolicyError,
    Progress,
    make_policy,
    param,
    parse_policy,
    register_policy,
)

__all__ = ["POLICIES", "Policy", "PolicyError", "Progress", "make_policy", "param", "parse_policy", "register_policy"]
