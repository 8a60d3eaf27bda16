"""The step-time benchmark, ``python -m experiments.bench`` (the command: :mod:`.cli`), one module
per thing it measures or writes:

- :mod:`.config`: what one run measures (:class:`~.config.BenchConfig`), its defaults per model;
- :mod:`.rows`: the workers' samples (:mod:`experiments.bench_workers`) as one CSV row per
  (approach, k), ``bench.csv``, and the bootstrap behind every interval;
- :mod:`.targets`: the engine against the static limit, find-unused and per-parameter, the
  monitor's and the re-wrap's cost, each a target with a verdict;
- :mod:`.engine_report`: BENCH.md's main part (main table, targets, overheads, phase split);
- :mod:`.cache_report`: the image models' cache rows beside the engine;
- :mod:`.text_report`: the BERT rows, BENCH.md's ``bert-bench`` span;
- :mod:`.sections`: the spans other commands splice into BENCH.md, kept across rewrites;
- :mod:`.labels`: the names, sizes and verdict words the reports share.
"""
