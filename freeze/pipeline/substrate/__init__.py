"""The offline substrate (docs/substrate.md): the FDSL-32 generator (fdsl), cached-feature probes
(probe), the diagnostics of a source -> target pair (diagnose), the committed pretrained weights
(weights) and the gates a substrate must pass (gates); one command, ``python -m experiments.substrate``."""
