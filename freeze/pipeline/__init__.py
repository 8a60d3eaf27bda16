"""The application behind ``experiments/`` and ``report/``: configs, data, models, the training loop,
run directories, sweeps, studies and the report. Not API: free to change between versions.

The library a user builds on is the rest of :mod:`freeze` (blocks, monitor, policies, Freezer, comm);
nothing in it imports this package.
"""
