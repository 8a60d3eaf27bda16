"""The cost model on hand-computed cases: every profile is written to a file by the test and read
back, so nothing here times anything."""

import json
import math

import pytest

from freeze.pipeline.costmodel import (
    CALIBRATION_FORMAT,
    PROBE_FORMAT,
    PROFILE_FORMAT,
    Calibration,
    CalibrationError,
    ClusterModel,
    Link,
    LinkError,
    ProfileError,
    bucket_sizes,
    fit_link,
    load_calibration,
    load_profile,
    predict_run,
    predict_step,
    read_probe,
    ring_allreduce_s,
    save_calibration,
)


def _block(name, param_bytes, forward_ms, frozen_ms, backward_ms, first_ms, cache_read_ms=None):
    return {
        "name": name,
        "param_bytes": param_bytes,
        "buffer_bytes": 0,
        "activation_bytes_per_sample": 64,
        "forward_ms": forward_ms,
        "forward_frozen_ms": frozen_ms,
        "backward_ms": backward_ms,
        "backward_first_ms": first_ms,
        "cache_read_ms": cache_read_ms,
    }


def write_profile(tmp_path, **overrides):
    """Two blocks. Block 1 (the last) has parameters of 600 and 400 bytes in registration order,
    block 0 one of 1000 bytes."""
    d = {
        "format": PROFILE_FORMAT,
        "model": "two-block",
        "batch_size": 8,
        "threads": 1,
        "nodes_per_core": 1,
        "optimizer": "sgd(momentum=0.9)",
        "forward_overhead_ms": 1.0,
        "after_backward_ms": [4.0, 2.0],
        "blocks": [
            _block("b0", [1000], forward_ms=5.0, frozen_ms=3.0, backward_ms=None, first_ms=30.0),
            _block(
                "b1", [600, 400], forward_ms=5.0, frozen_ms=None, backward_ms=20.0, first_ms=15.0, cache_read_ms=0.5
            ),
        ],
        "meta": {},
    }
    d.update(overrides)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    return load_profile(path)


# 1000 bytes over 2 nodes: 2(N-1)/N x S / B = 1000 / 1e5 s = 10 ms on the wire, no CPU, no latency.
WIRE_LINK = Link(alpha_s=0.0, bandwidth_bytes_per_s=1e5, gamma_s_per_byte=0.0)


def _cluster(link, share=0.5):
    # first bucket closes at 1000 bytes, every later one at 5000
    return ClusterModel(nodes=2, link=link, comm_cpu_share=share, bucket_cap_bytes=5000, first_bucket_bytes=1000)


def test_two_buckets_overlap_the_backward(tmp_path):
    profile = write_profile(tmp_path)
    step = predict_step(profile, _cluster(WIRE_LINK), k=0)
    # Ready order is reverse registration: b1's 400, b1's 600 (bucket 1 reaches 1000 >= 1000 and
    # closes), then b0's 1000 (bucket 2). Backward: b1 (with input grad) 0..20 ms, b0 (first
    # trainable, no input grad) 20..50 ms. Bucket 1 is ready at 20 (its last gradient, b1's 600,
    # ends b1's backward) and runs 20..30; bucket 2 is ready at 50 and runs 50..60.
    assert [b.nbytes for b in step.buckets] == [1000, 1000]
    assert [(b.ready_ms, b.start_ms, b.end_ms) for b in step.buckets] == [
        pytest.approx((20, 20, 30)),
        pytest.approx((50, 50, 60)),
    ]
    # forward: overhead 1 + 5 + 5 = 11; backward ends 50, comm 60; after_backward_ms[0] = 4.
    assert step.forward_ms == pytest.approx(11.0)
    assert step.backward_ms == pytest.approx(50.0)
    assert step.step_ms == pytest.approx(11 + 60 + 4)
    # exposed = 75 - 11 - 50 - 4: bucket 2's tail after the backward
    assert step.exposed_comm_ms == pytest.approx(10.0)
    assert step.allreduce_bytes == 2000


def test_first_step_after_rewrap_has_one_bucket(tmp_path):
    profile = write_profile(tmp_path)
    step = predict_step(profile, _cluster(WIRE_LINK), k=0, first_after_rewrap=True)
    # one bucket of 2000 bytes, ready at the end of the backward (50), 20 ms on the wire
    assert [(b.nbytes, b.start_ms, b.end_ms) for b in step.buckets] == [(2000, pytest.approx(50), pytest.approx(70))]
    assert step.step_ms == pytest.approx(11 + 70 + 4)


def test_frozen_prefix_and_cache(tmp_path):
    profile = write_profile(tmp_path)
    step = predict_step(profile, _cluster(WIRE_LINK), k=1)
    # b0 frozen: its no-grad forward 3; b1 is the first trainable block: backward_first 15; one
    # bucket of 1000 bytes ready at 15, done at 25; after_backward_ms[1] = 2.
    assert step.forward_ms == pytest.approx(1 + 3 + 5)
    assert step.step_ms == pytest.approx(9 + 25 + 2)
    cached = predict_step(profile, _cluster(WIRE_LINK), k=1, cache=True)
    # the cache read (0.5 ms) replaces b0's forward (3 ms)
    assert cached.forward_ms == pytest.approx(1 + 0.5 + 5)
    assert cached.step_ms == pytest.approx(step.step_ms - 2.5)
    # at k = 0 nothing is frozen: the cache changes nothing
    assert predict_step(profile, _cluster(WIRE_LINK), k=0, cache=True).step_ms == pytest.approx(75.0)


def test_cpu_bound_allreduce_shares_the_core_with_the_backward(tmp_path):
    profile = write_profile(
        tmp_path,
        blocks=[
            _block("b0", [1000], 5.0, 3.0, None, 30.0),
            _block("b1", [1000], 5.0, None, 20.0, 15.0),
        ],
    )
    # uncapped link, CPU-bound: (N-1)/N x 1000 B x gamma = 10 ms, so u = 1 and with share 0.5
    # the all-reduce runs at half speed and the backward at half speed while both run.
    link = Link(alpha_s=0.0, bandwidth_bytes_per_s=None, gamma_s_per_byte=2e-5)
    step = predict_step(profile, _cluster(link, share=0.5), k=0)
    # Bucket 1 (b1's 1000 B) ready at 20; 20..40 it does its 10 ms of work at half speed while the
    # backward does 10 ms of its remaining 30; the backward then ends alone at 40 + 20 = 60, bucket
    # 2 runs 60..70 at full speed.
    assert [(b.start_ms, b.end_ms) for b in step.buckets] == [pytest.approx((20, 40)), pytest.approx((60, 70))]
    assert step.step_ms == pytest.approx(11 + 70 + 4)
    # share 1: the all-reduce takes the whole core, the backward stops while it runs (20..30)
    whole = predict_step(profile, _cluster(link, share=1.0), k=0)
    assert [(b.start_ms, b.end_ms) for b in whole.buckets] == [pytest.approx((20, 30)), pytest.approx((60, 70))]


def test_bucket_sizes_follow_ddp_limits():
    # first limit 1 MiB closes after the second parameter; later limit 4 closes at >= 4
    assert bucket_sizes([1, 1 << 20, 2, 2, 3, 1], first_bucket_bytes=1 << 20, bucket_cap_bytes=4) == [2, 2, 2]
    assert bucket_sizes([], 10, 10) == []


def test_ring_allreduce_forms():
    link = Link(alpha_s=1e-3, bandwidth_bytes_per_s=1e6, gamma_s_per_byte=1e-6)
    # N = 4, S = 1e6: latency 2*3*1e-3 = 6 ms; wire 2*3/4*1 s = 1.5 s; CPU 3/4*1e6*1e-6 = 0.75 s
    assert ring_allreduce_s(1e6, 4, link) == pytest.approx(0.006 + 1.5)
    additive = Link(1e-3, 1e6, 1e-6, form="additive")
    assert ring_allreduce_s(1e6, 4, additive) == pytest.approx(0.006 + 1.5 + 0.75)
    assert ring_allreduce_s(1e6, 1, link) == 0.0


def test_predict_run_charges_one_rewrap_step_per_boundary_change(tmp_path):
    profile = write_profile(tmp_path)
    cluster = _cluster(WIRE_LINK)
    run = predict_run(profile, cluster, [(3, 0), (2, 1)])
    # k=0: one first-after-rewrap step (85 ms) + 2 normal (75); k=1: one rewrap step (one bucket of
    # 1000 B: same as normal, 36 ms) + one normal (36).
    assert run.wall_s == pytest.approx((85 + 2 * 75 + 2 * 36) / 1e3)
    assert run.steps == 5


def _probe(nodes, cap_bits, slope, alpha_total=0.002):
    sizes = [{"bytes": b, "median_s": alpha_total + slope * b} for b in (1 << 20, 8 << 20, 64 << 20)]
    return {
        "format": PROBE_FORMAT,
        "nodes": nodes,
        "bandwidth_bits_per_s": cap_bits,
        "host": {"load_avg_1min": [1.0, 1.0]},
        "latency_probe": {"seconds": [alpha_total] * 5},
        "sizes": sizes,
    }


def test_link_fitted_from_probes():
    uncapped = read_probe(_probe(2, None, 6e-9))
    capped = read_probe(_probe(2, 1e9, 9e-9))
    assert capped.alpha_s == pytest.approx(0.001)  # 2 ms over 2(N-1) = 2 ring steps
    link = fit_link(capped, uncapped)
    # gamma: slope x N/(N-1) = 1.2e-8; the capped slope 9e-9 exceeds the CPU's 6e-9, so the wire
    # sets it: B = 2(N-1)/N / 9e-9 = 1.111e8 B/s
    assert link.gamma_s_per_byte == pytest.approx(1.2e-8)
    assert link.bandwidth_bytes_per_s == pytest.approx(1 / 9e-9)
    assert fit_link(None, uncapped).bandwidth_bytes_per_s is None


def test_bad_probe_and_profile_name_the_field(tmp_path):
    with pytest.raises(LinkError, match="format"):
        read_probe({"format": "other"})
    with pytest.raises(LinkError, match="sizes"):
        read_probe({k: v for k, v in _probe(2, None, 1e-9).items() if k != "sizes"})
    # Fields of the wrong type or sizes of 0 bytes: one LinkError naming them, never a TypeError or
    # ZeroDivisionError out of the fit (found in review).
    broken = [
        {**_probe(2, None, 1e-9), "latency_probe": {"seconds": ["fast"] * 5}},
        {**_probe(2, None, 1e-9), "latency_probe": 3},
        {**_probe(2, None, 1e-9), "sizes": [{"bytes": 0, "median_s": 0.1}]},
        {**_probe(2, None, 1e-9), "sizes": [7]},
        {**_probe(2, None, 1e-9), "bandwidth_bits_per_s": "1gbit"},
    ]
    for result in broken:
        with pytest.raises(LinkError, match="must be numbers"):
            read_probe(result, "p.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": PROFILE_FORMAT, "model": "m"}))
    with pytest.raises(ProfileError, match="key .blocks. is missing"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="after_backward_ms"):
        write_profile(tmp_path, after_backward_ms=[1.0])
    with pytest.raises(ValueError, match="k=2"):
        predict_step(write_profile(tmp_path), _cluster(WIRE_LINK), k=2)
    assert math.isfinite(predict_step(write_profile(tmp_path), _cluster(WIRE_LINK), k=1).step_ms)


def test_cache_pays_is_the_caches_own_rule_on_predicted_numbers(tmp_path):
    from freeze.cache.config import pays
    from freeze.pipeline.costmodel import cache_pays

    profile = write_profile(tmp_path)
    cluster = _cluster(WIRE_LINK)
    # k = 1: the read (0.5 ms) replaces b0's frozen forward (3 ms): 2.5 ms saved per step of 8
    # samples. The build of 80 keys on 2 nodes: 40 rows per rank x 3/8 ms = 15 ms, and an all-gather
    # of 80 x 64 bytes: 1/2 x 5120 B / 1e5 B/s = 25.6 ms. 40.6 ms / 2.5 ms: break-even at 16.24 steps.
    verdict = cache_pays(profile, cluster, k=1, remaining_steps=100, samples=80)
    assert verdict.pays and verdict.saved_ms_per_step == pytest.approx(2.5)
    assert verdict.build_ms == pytest.approx(40.6)
    assert verdict.break_even_steps == pytest.approx(16.24)
    assert verdict.estimate.forwards_per_rank == 40 and verdict.store_bytes == 5120
    assert not cache_pays(profile, cluster, k=1, remaining_steps=16, samples=80).pays
    assert cache_pays(profile, cluster, k=1, remaining_steps=17, samples=80).pays
    # one rule: the verdict is what the cache's own auto rule says of the predicted estimate
    for steps in (1, 16, 17, 100):
        v = cache_pays(profile, cluster, k=1, remaining_steps=steps, samples=80)
        assert v.pays == pays(v.estimate)
    assert not cache_pays(profile, cluster, k=0, remaining_steps=100, samples=80).pays
    # 1000 samples x 64 bytes = 64000 bytes: over a 1000-byte budget
    tight = cache_pays(profile, cluster, k=1, remaining_steps=100, samples=1000, memory_budget_bytes=1000)
    assert not tight.pays and tight.store_bytes == 64000 and "budget" in tight.reason
    with pytest.raises(ValueError, match="samples=-1 is not accepted; accepted: an integer >= 0"):
        cache_pays(profile, cluster, k=1, remaining_steps=100, samples=-1)


def test_calibration_round_trips_and_is_never_overwritten(tmp_path):
    path = tmp_path / "calibration.json"
    fit = Calibration(0.12, {"nodes": 2, "bandwidth": "1gbit", "k": 0, "cache": "off"}, "python -m x")
    save_calibration(fit, path)
    assert load_calibration(path) == fit
    with pytest.raises(FileExistsError):
        save_calibration(fit, path)
    for body, field in (
        ({"format": "x"}, "format"),
        ({"format": CALIBRATION_FORMAT, "comm_cpu_share": True}, "comm_cpu_share"),
    ):
        path.write_text(json.dumps(body))
        with pytest.raises(CalibrationError, match=field):
            load_calibration(path)


def test_a_profile_too_noisy_to_rank_boundaries_says_so_in_one_line(tmp_path):
    """A newcomer's 3-step profile on a loaded machine priced one frozen block at 0.50x the step, with
    no spread and no warning (research note newcomer.md, F-C8)."""
    from freeze.pipeline.costmodel import noise_warnings
    from freeze.pipeline.costmodel.profile import step_spreads

    steady_step = {"low": 90.0, "q1": 97.0, "median": 100.0, "q3": 104.0, "high": 130.0}  # one slow outlier
    steady = {"steps": 5, "step_ms": [steady_step] * 2}
    assert noise_warnings(write_profile(tmp_path, meta=steady)) == []
    noisy_step = {"low": 80.0, "q1": 90.0, "median": 100.0, "q3": 140.0, "high": 160.0}
    profile = write_profile(tmp_path, meta={"steps": 3, "step_ms": [steady_step, noisy_step]})
    assert step_spreads(profile) == pytest.approx([0.07, 0.5])
    (line,) = noise_warnings(profile, "p.json")
    assert line.startswith("p.json: too noisy to rank boundaries: the step time at boundary 1 spread 50% ")
    (old,) = noise_warnings(write_profile(tmp_path, meta={}), "old.json")
    assert "records no spread" in old
