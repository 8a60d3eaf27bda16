"""An emulated N-node cluster on one Linux machine: network namespaces, veth pairs, a bridge and
tc, driving the real launcher (one torchrun agent per node, c10d rendezvous on node 0's address).

    python -m experiments.cluster --nodes 2 --bandwidth 1gbit -- --config experiments/configs/smoke.toml
    python -m experiments.cluster probe --nodes 2 --bandwidth 1gbit --out runs/probe-2x1gbit.json

Modules: ``spec`` (settings, CPU split), ``net`` (namespaces, links, tc, clean-up), ``launch``
(agents), ``jobs`` (a config's run on a cluster), ``probe`` (all-reduce link probe).
Needs root, iproute2 (``ip``, ``tc``) and util-linux (``unshare``).
"""

from freeze.pipeline.cluster.net import Cluster, ClusterError, ClusterUnavailable, check_host, cleanup_stale
from freeze.pipeline.cluster.spec import ClusterSpec, ClusterSpecError, plan_cpus

__all__ = [
    "Cluster",
    "ClusterError",
    "ClusterSpec",
    "ClusterSpecError",
    "ClusterUnavailable",
    "check_host",
    "cleanup_stale",
    "plan_cpus",
]
