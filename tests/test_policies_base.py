"""freeze.policies.base: the registry, spec strings, parameter checking (one line naming the accepted
values), progress and policy state."""

from __future__ import annotations

import json

import pytest

from freeze.policies import POLICIES, Progress, make_policy, parse_policy
from freeze.policies.rules import AutoFreeze, FreezeOut, StaticFreeze
from tests.policy_histories import NON_DEFAULT, PROGRESS, eta_history, one_line_error, sizes


def test_a_misspelt_policy_or_parameter_name_gets_a_did_you_mean():
    """As config keys do: the closest accepted name, in the one line that lists them all."""
    for call in (lambda: make_policy("autofreez"), lambda: parse_policy("autofreez:percentile=50")):
        message = one_line_error(call)
        assert "unknown policy 'autofreez' (did you mean 'autofreeze'?)" in message
        assert "accepted: none, static," in message
    message = one_line_error(parse_policy, "freezeout:t=0.5")
    assert "unknown parameter 't' (did you mean 't0'?)" in message
    assert "did you mean" not in one_line_error(make_policy, "qqqqqq")  # nothing close: no guess


def test_progress_fraction_by_steps_then_epochs_clipped():
    assert Progress(epochs_completed=0, epochs_total=4, steps_completed=250, steps_total=1000).fraction == 0.25
    assert Progress(epochs_completed=5, epochs_total=10, steps_completed=7, steps_total=0).fraction == 0.5
    # Mid-way through the first epoch without a step total: nothing is completed yet.
    assert Progress(epochs_completed=0, epochs_total=10, steps_completed=7, steps_total=0).fraction == 0.0
    assert Progress(epochs_completed=0, epochs_total=2, steps_completed=1500, steps_total=1000).fraction == 1.0
    with pytest.raises(ValueError, match="epochs_total"):
        Progress(epochs_completed=0, epochs_total=0, steps_completed=0, steps_total=0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_spec_round_trip(name):
    for params in ({}, NON_DEFAULT[name]):
        policy = make_policy(name, **params)
        assert parse_policy(policy.spec()) == policy
        assert parse_policy(policy.spec()).spec() == policy.spec()


def test_spec_strings():
    assert make_policy("autofreeze", percentile=50).spec() == "autofreeze:percentile=50.0,min_intervals=2,norm=l1"
    assert parse_policy("none").spec() == "none"
    assert parse_policy(" static : k = 4 ") == StaticFreeze(k=4)
    assert parse_policy("freezeout:t0=0.8,scale=cubic") == FreezeOut()
    assert parse_policy("geometric").alpha == 1.0 / 3.0
    # Strings and typed values give the same policy; an int for a float parameter becomes a float.
    assert parse_policy("autofreeze:percentile=50") == make_policy("autofreeze", percentile="50")
    assert isinstance(make_policy("autofreeze", percentile=50).percentile, float)


def test_make_policy_takes_a_spec_string_or_a_name_with_parameters():
    assert make_policy("static:k=2") == make_policy("static", k=2) == parse_policy("static:k=2")
    assert make_policy("freezeout:t0=0.5,scale=linear") == FreezeOut(t0=0.5, scale="linear")
    assert "not both" in one_line_error(make_policy, "static:k=2", k=3)
    # a misspelled name says that both calls take a name or a spec string
    assert "for make_policy and parse_policy" in one_line_error(make_policy, "statik:k=2")
    assert "for make_policy and parse_policy" in one_line_error(make_policy, "statik", k=2)


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("frezeout", "accepted: none, static, freezeout"),
        ("", "none, static, freezeout"),
        ("autofreeze:pct=50", "accepted: percentile, min_intervals, norm"),
        ("autofreeze:norm=l3", "accepted: one of l1, l2"),
        ("none:k=1", "accepted: no parameters"),
        ("autofreeze:percentile=abc", "accepted: float in [0, 100]"),
        ("autofreeze:percentile=150", "accepted: float in [0, 100]"),
        ("autofreeze:percentile=nan", "accepted: float in [0, 100]"),
        ("autofreeze:min_intervals=1", "accepted: int >= 2"),
        ("autofreeze:min_intervals=2.5", "accepted: int >= 2"),
        ("freezeout:scale=quartic", "accepted: one of linear, squared, cubic"),
        ("freezeout:t0=1.5", "accepted: float in [0, 1]"),
        ("linear:freeze_start=1", "accepted: float in [0, 1)"),
        ("geometric:alpha=0", "accepted: float in (0, 1]"),
        ("gradual-unfreeze:every_epochs=0", "accepted: int >= 1"),
        ("static:k", "accepted: param=value pairs"),
        ("static:k=1,k=2", "at most once"),
    ],
)
def test_parse_errors_are_one_line_naming_accepted_values(spec, needle):
    assert needle in one_line_error(parse_policy, spec)


def test_other_error_paths():
    assert "accepted: float in [0, 100]" in one_line_error(AutoFreeze, percentile=True)
    assert "'pct'" in one_line_error(make_policy, "autofreeze", pct=50)
    assert "accepted: 0..3" in one_line_error(AutoFreeze().decide, 4, [], PROGRESS, 4)
    assert "num_blocks" in one_line_error(FreezeOut().freeze_fractions, 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_spec_a_checkpoint_saves_restores_the_policy(name):
    # Freezer.state_dict saves the policy as its spec (decisions are pure: the parameters are the
    # whole state), and a resumed run rebuilds it from that string.
    original = make_policy(name, **NON_DEFAULT[name])
    restored = parse_policy(json.loads(json.dumps(original.spec())))  # checkpoint-safe plain data
    assert restored == original and restored.spec() == original.spec()
    history = eta_history([0.1, 0.2, 0.5, 0.05, 0.4, 0.3])
    extra = sizes(original, 6)
    assert restored.decide(1, history, PROGRESS, 6, **extra) == original.decide(1, history, PROGRESS, 6, **extra)


def test_a_policys_needs_are_one_declaration_read_from_its_flags_and_parameters():
    """The Freezer, its monitor and the pipeline ask a policy one question (needs()); a policy
    written with the class flags keeps working (issue 47)."""
    from freeze.policies.base import Needs

    assert make_policy("none").needs() == Needs()
    assert make_policy("autofreeze").needs() == Needs(gradient_norms=True, gradient_sums=True)
    assert make_policy("freezeout").needs() == Needs(run_length=True)
    payoff = make_policy("payoff").needs()
    assert payoff.block_bytes and payoff.gradient_sums and payoff.intervals_needed == 3
    horizon = make_policy("horizon")
    assert horizon.needs() == Needs(
        gradient_norms=True,
        descent_span=3,
        pricing=True,
        probe=True,
        run_length=True,
        intervals_needed=9,
        may_unfreeze=True,
    )
    assert not make_policy("horizon:probation=0").needs().probe  # a parameter changes what it needs
    assert make_policy("at:k=6,t=0.5,anneal=0.15").needs().block_lr
    assert not make_policy("at:k=6,t=0.5").needs().block_lr
    published = make_policy("freezeout:anneal=true,scale_lr=true").needs()
    assert published.block_lr and published.cosine_run and published.run_length


def test_decide_in_passes_a_policy_the_inputs_it_declares_and_no_others():
    from freeze.policies.base import DecisionContext

    history = eta_history([0.5, 0.1, 0.4, 0.3])
    ctx = DecisionContext(boundary=0, history=history, progress=PROGRESS, num_blocks=4, block_bytes=(1,) * 4)
    autofreeze = make_policy("autofreeze")  # takes no block_bytes: given them, its decide would raise
    assert autofreeze.decide_in(ctx) == autofreeze.decide(0, history, PROGRESS, 4)
    assert autofreeze.explain_in(ctx) == autofreeze.explain(0, history, PROGRESS, 4)
    payoff = make_policy("payoff")
    assert payoff.decide_in(ctx) == payoff.decide(0, history, PROGRESS, 4, **sizes(payoff, 4))
    assert payoff.explain_in(ctx) == payoff.explain(0, history, PROGRESS, 4, **sizes(payoff, 4))
