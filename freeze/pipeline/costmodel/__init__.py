"""A cost model of data-parallel training with a frozen prefix: predicted step and run time for any
node count, link, boundary and cache setting, from a profile measured once on one node and a link
fitted from a probe. The model is pure (:mod:`freeze.pipeline.costmodel.model`, every assumption in its
docstring); :mod:`freeze.pipeline.costmodel.profiler` measures the profile.

    from freeze.pipeline.costmodel import ClusterModel, Link, cache_pays, load_profile, predict_step
    profile = load_profile("profile.json")
    link = Link(alpha_s=50e-6, bandwidth_bytes_per_s=1e9 / 8 * 0.87, gamma_s_per_byte=6e-9)
    step = predict_step(profile, ClusterModel(nodes=16, link=link), k=5)
    print(step.step_ms, step.compute_ms, step.exposed_comm_ms, step.optimizer_ms)
    # cache = "auto": does a cache at k pay for the steps left at k?
    verdict = cache_pays(profile, ClusterModel(nodes=16, link=link), k=5, remaining_steps=3000, samples=50000)
    print(verdict.pays, verdict.reason)
"""

from freeze.pipeline.costmodel.cache import CacheVerdict, cache_pays
from freeze.pipeline.costmodel.calibration import (
    CALIBRATION_FILE,
    CALIBRATION_FORMAT,
    Calibration,
    CalibrationError,
    load_calibration,
    save_calibration,
)
from freeze.pipeline.costmodel.link import (
    PROBE_FORMAT,
    Link,
    LinkError,
    ProbeFit,
    allgather_s,
    broadcast_s,
    fit_link,
    link_from_probes,
    read_probe,
    ring_allreduce_s,
    scaled_link,
)
from freeze.pipeline.costmodel.model import (
    BucketTiming,
    ClusterModel,
    RunPrediction,
    StepPrediction,
    bucket_sizes,
    fit_comm_cpu_share,
    predict_run,
    predict_step,
)
from freeze.pipeline.costmodel.profile import (
    PROFILE_FORMAT,
    BlockCost,
    Profile,
    ProfileError,
    load_profile,
    noise_warnings,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)

__all__ = [
    "noise_warnings",
    "CALIBRATION_FILE",
    "CALIBRATION_FORMAT",
    "Calibration",
    "CalibrationError",
    "load_calibration",
    "save_calibration",
    "PROBE_FORMAT",
    "PROFILE_FORMAT",
    "BlockCost",
    "BucketTiming",
    "CacheVerdict",
    "ClusterModel",
    "Link",
    "LinkError",
    "ProbeFit",
    "Profile",
    "ProfileError",
    "RunPrediction",
    "StepPrediction",
    "allgather_s",
    "broadcast_s",
    "bucket_sizes",
    "cache_pays",
    "fit_comm_cpu_share",
    "fit_link",
    "link_from_probes",
    "load_profile",
    "predict_run",
    "predict_step",
    "profile_from_dict",
    "profile_to_dict",
    "read_probe",
    "ring_allreduce_s",
    "save_profile",
    "scaled_link",
]
