"""The overrides that make the smoke config's run tiny for the tests that start real runs on several
nodes (the emulated cluster, SLURM): 1 worker, 2 epochs of 4 steps, a policy evaluation every step."""

TINY_RUN = [
    "train.epochs=2",
    "data.train_size=128",
    "data.val_size=32",
    "data.test_size=64",
    "train.batch_size=32",
    "dist.nproc=1",
    "freeze.interval_steps=1",
]
