"""A link between data-parallel nodes: what a ring all-reduce of S bytes over N nodes costs, and how
the three numbers of that cost are fitted from a link probe (``freeze-cluster-probe/1`` JSON).

The textbook ring all-reduce (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009) sends
2(N-1)/N x S bytes per node in 2(N-1) steps and reduces (N-1)/N x S bytes on the CPU::

    additive:   2(N-1) alpha + 2(N-1)/N S/B + (N-1)/N S gamma
    pipelined:  2(N-1) alpha + max(2(N-1)/N S/B, (N-1)/N S gamma)        (the default)

Why the default is ``pipelined``: gloo's CPU all-reduce is a segmented ring, so a node reduces one
segment while the next is on the wire, and the slower of the two sets the rate. Measured on the
emulated cluster (2 nodes, 2 cores under load, probes in report/cluster/): uncapped links carried
1304 Mbit/s (the CPU's limit), 1 Gbit/s links 889. The additive form can only explain 889 with
B = 2.8 Gbit/s on a 1 Gbit/s link; the pipelined form predicts min(0.87 x 1000, 1304) = 870
(0.87: what the 100 Mbit/s probe achieved of its cap).

Units: seconds and bytes. ``bandwidth_bytes_per_s`` is the payload rate each way of one node's link
(None: no cap, so only the CPU limits the rate); ``gamma_s_per_byte`` is CPU time per byte of
(N-1)/N x S, which includes the kernel's copies and, on an emulated cluster, the forwarding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from freeze.pipeline.cluster.probe import PROBE_FORMAT

LINK_FORMS = ("pipelined", "additive")


class LinkError(ValueError):
    """A probe file or link setting that cannot be used; the message is one line naming the field."""


@dataclass(frozen=True)
class Link:
    """alpha_s: latency of one ring step. bandwidth_bytes_per_s: payload bytes/s each way (None =
    uncapped). gamma_s_per_byte: CPU seconds per byte of (N-1)/N x S. form: pipelined | additive."""

    alpha_s: float
    bandwidth_bytes_per_s: float | None
    gamma_s_per_byte: float
    form: str = "pipelined"

    def __post_init__(self) -> None:
        if self.form not in LINK_FORMS:
            raise LinkError(f"link form: '{self.form}' is not accepted; accepted: {', '.join(LINK_FORMS)}")
        for name in ("alpha_s", "gamma_s_per_byte"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise LinkError(f"link {name}: expected a finite number >= 0, got {value!r}")
        bw = self.bandwidth_bytes_per_s
        if bw is not None and not (isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0):
            raise LinkError(f"link bandwidth_bytes_per_s: expected a number > 0 or None (uncapped), got {bw!r}")

    def with_bandwidth(self, bandwidth_bytes_per_s: float | None) -> Link:
        """The same latency and CPU cost on a link of another rate.

        Args:
            bandwidth_bytes_per_s: payload bytes/s each way, or None for no cap.
        """
        return Link(self.alpha_s, bandwidth_bytes_per_s, self.gamma_s_per_byte, self.form)


def wire_s(nbytes: float, nodes: int, link: Link) -> float:
    """Time on the wire of a ring all-reduce: 2(N-1)/N x S / B (0 when uncapped)."""
    if nodes < 2 or link.bandwidth_bytes_per_s is None:
        return 0.0
    return 2 * (nodes - 1) / nodes * nbytes / link.bandwidth_bytes_per_s


def reduce_cpu_s(nbytes: float, nodes: int, link: Link) -> float:
    """CPU time of a ring all-reduce: (N-1)/N x S x gamma."""
    if nodes < 2:
        return 0.0
    return (nodes - 1) / nodes * nbytes * link.gamma_s_per_byte


def ring_allreduce_s(nbytes: float, nodes: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``nodes`` nodes on otherwise idle CPUs
    (module docstring: pipelined or additive form). One node: 0.

    Args:
        nbytes: size of the all-reduced tensor.
        nodes: ring size N.
        link: alpha, bandwidth, gamma and form.
    """
    if nodes < 2 or nbytes <= 0:
        return 0.0
    latency = 2 * (nodes - 1) * link.alpha_s
    wire, cpu = wire_s(nbytes, nodes, link), reduce_cpu_s(nbytes, nodes, link)
    return latency + (wire + cpu if link.form == "additive" else max(wire, cpu))


def allgather_s(nbytes: float, nodes: int, link: Link) -> float:
    """Seconds for a ring all-gather that leaves every node with all ``nbytes`` (each node starts
    with 1/N of them): (N-1) x alpha + (N-1)/N x S / B; no reduction, so no CPU term. One node: 0."""
    if nodes < 2 or nbytes <= 0:
        return 0.0
    wire = 0.0 if link.bandwidth_bytes_per_s is None else (nodes - 1) / nodes * nbytes / link.bandwidth_bytes_per_s
    return (nodes - 1) * link.alpha_s + wire


def broadcast_s(nbytes: float, nodes: int, link: Link) -> float:
    """Seconds for DDP's per-forward buffer broadcast from rank 0, taken as rank 0 sending the
    buffers to each of the N-1 others over its own link: alpha + (N-1) x S/B (an upper bound for a
    tree; for ResNet-18 the buffers are at most 38 KB, a few ms at 100 Mbit/s)."""
    if nodes < 2 or nbytes <= 0:
        return 0.0
    per_copy = 0.0 if link.bandwidth_bytes_per_s is None else nbytes / link.bandwidth_bytes_per_s
    return link.alpha_s + (nodes - 1) * per_copy


# ----------------------------------------------------------------------------------- probe fitting
@dataclass(frozen=True)
class ProbeFit:
    """What one probe file says: its setting and the per-byte slope of all-reduce time."""

    nodes: int
    cap_bits_per_s: float | None
    alpha_s: float  # tiny all-reduce median / 2(N-1)
    slope_s_per_byte: float  # d(time)/d(S) over the probed sizes, with the latency term fixed
    load_avg: float
    path: str = ""


def _field(d: dict, key: str, where: str):
    if key not in d:
        raise LinkError(f"{where}: key '{key}' is missing (expected a {PROBE_FORMAT} result)")
    return d[key]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def read_probe(result: dict, where: str = "probe") -> ProbeFit:
    """Fit one probe result: alpha from the tiny all-reduce's median (what a step sees on a shared
    machine, where the minimum is the idle latency), then the least-squares slope through the
    sizes' median times with that intercept fixed.

    Args:
        result: the parsed JSON of ``python -m experiments.cluster probe``.
        where: a name for error messages (the file).
    """
    if not isinstance(result, dict) or result.get("format") != PROBE_FORMAT:
        got = result.get("format") if isinstance(result, dict) else type(result).__name__
        raise LinkError(f"{where}: format {got!r}, expected {PROBE_FORMAT!r}")
    nodes = _field(result, "nodes", where)
    if not isinstance(nodes, int) or nodes < 2:
        raise LinkError(f"{where}: nodes must be an integer >= 2, got {nodes!r}")
    try:
        tiny = _field(_field(result, "latency_probe", where), "seconds", where)
        sizes = _field(result, "sizes", where)
        if not tiny or not sizes:
            raise LinkError(f"{where}: latency_probe.seconds and sizes must be non-empty")
        alpha = _median(tiny) / (2 * (nodes - 1))
        intercept = 2 * (nodes - 1) * alpha
        xs = [float(_field(s, "bytes", where)) for s in sizes]
        ys = [float(_field(s, "median_s", where)) - intercept for s in sizes]
        slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        cap = result.get("bandwidth_bits_per_s")
        cap = None if cap is None else float(cap)
        load = float(result.get("host", {}).get("load_avg_1min", [float("nan")])[0])
    except LinkError:
        raise
    except (TypeError, ValueError, ZeroDivisionError) as e:  # a field of the wrong type, or every size 0 bytes
        raise LinkError(
            f"{where}: latency_probe.seconds, sizes[].bytes/median_s, bandwidth_bits_per_s and host.load_avg_1min "
            f"must be numbers, bytes > 0 ({e})"
        ) from None
    if slope <= 0:
        raise LinkError(f"{where}: all-reduce time does not grow with size (slope {slope:.3g} s/B): not a usable probe")
    return ProbeFit(nodes, cap, alpha, slope, load, where)


def fit_link(capped: ProbeFit | None, uncapped: ProbeFit | None, form: str = "pipelined") -> Link:
    """A link from a capped probe, an uncapped one, or both at the same node count.

    gamma comes from the uncapped probe, where only the CPU limits the rate (slope = (N-1)/N gamma).
    B comes from the capped probe: pipelined, slope = max(wire, cpu) per byte, so B = 2(N-1)/N /
    slope when the wire is the slower side (else the cap cannot be seen and B = the cap); additive,
    the CPU part is subtracted first. Without an uncapped probe gamma = 0 and B is the capped
    probe's effective rate; without a capped one B is None.

    Args:
        capped: a probe fitted by :func:`read_probe` on capped links, or None.
        uncapped: the same on uncapped links, or None.
        form: pipelined | additive (module docstring).
    """
    if capped is None and uncapped is None:
        raise LinkError("fit_link: give a capped probe, an uncapped one, or both")
    if capped is not None and capped.cap_bits_per_s is None:
        raise LinkError(f"fit_link: {capped.path or 'the capped probe'} has no cap (bandwidth_bits_per_s null)")
    if uncapped is not None and uncapped.cap_bits_per_s is not None:
        raise LinkError(f"fit_link: {uncapped.path or 'the uncapped probe'} has a cap; expected an uncapped one")
    if capped is not None and uncapped is not None and capped.nodes != uncapped.nodes:
        raise LinkError(f"fit_link: probes of {capped.nodes} and {uncapped.nodes} nodes; fit one node count at a time")
    nodes = (capped or uncapped).nodes
    gamma = 0.0 if uncapped is None else uncapped.slope_s_per_byte * nodes / (nodes - 1)
    if capped is None:
        return Link(uncapped.alpha_s, None, gamma, form)
    ring = 2 * (nodes - 1) / nodes
    cpu_slope = (nodes - 1) / nodes * gamma
    wire_slope = capped.slope_s_per_byte - cpu_slope if form == "additive" else capped.slope_s_per_byte
    if wire_slope <= 0 or (form == "pipelined" and capped.slope_s_per_byte <= cpu_slope):
        bandwidth = capped.cap_bits_per_s / 8  # the CPU is the slower side: the cap is not visible
    else:
        bandwidth = ring / wire_slope
    return Link(capped.alpha_s, bandwidth, gamma, form)


def link_efficiency(capped: ProbeFit, link: Link) -> float:
    """Payload rate a fitted link reached as a share of its cap (e.g. 0.87 at 100 Mbit/s): what
    :func:`scaled_link` applies to a cap that was not probed.

    Args:
        capped: the capped probe the link was fitted from.
        link: the fitted link.
    """
    if capped.cap_bits_per_s is None or link.bandwidth_bytes_per_s is None:
        raise LinkError("link_efficiency: needs a capped probe and a link with a bandwidth")
    return link.bandwidth_bytes_per_s * 8 / capped.cap_bits_per_s


def scaled_link(base: Link, cap_bits_per_s: float | None, efficiency: float) -> Link:
    """``base``'s latency and CPU cost on a link capped at ``cap_bits_per_s`` (None: uncapped),
    carrying ``efficiency`` of the cap as payload.

    Args:
        base: a fitted link (its alpha and gamma are kept).
        cap_bits_per_s: the new cap in bit/s, or None.
        efficiency: payload share of the cap, in (0, 1].
    """
    if not 0 < efficiency <= 1:
        raise LinkError(f"scaled_link: efficiency must be in (0, 1], got {efficiency!r}")
    return base.with_bandwidth(None if cap_bits_per_s is None else cap_bits_per_s / 8 * efficiency)


def link_from_probes(paths: Sequence[str | Path], form: str = "pipelined") -> tuple[Link, float]:
    """The link fitted (:func:`fit_link`) from one uncapped and/or one capped probe file at the same
    node count, and the payload share of its cap (:func:`link_efficiency`, at most 1; 1 without a
    capped probe): what :func:`scaled_link` needs to put the fit on another cap.

    Args:
        paths: probe result files (``freeze-cluster-probe/1``, ``python -m experiments.cluster probe``).
        form: pipelined | additive (module docstring).

    Raises:
        LinkError: a file that cannot be read or fitted, or no file.
    """
    fits: dict[bool, ProbeFit] = {}  # capped? -> the fit; of two probes of one kind the last is used
    for path in paths:
        try:
            result = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise LinkError(f"probe {path}: not a readable JSON file ({e})") from None
        fit = read_probe(result, str(path))
        fits[fit.cap_bits_per_s is not None] = fit
    link = fit_link(fits.get(True), fits.get(False), form)
    capped = fits.get(True)
    efficiency = 1.0 if capped is None or link.bandwidth_bytes_per_s is None else link_efficiency(capped, link)
    return link, min(efficiency, 1.0)
