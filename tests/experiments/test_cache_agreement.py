"""experiments.cache_agreement: one row per boundary of ResNet-18, served against recomputed."""

from experiments import cache_agreement


def test_every_boundary_is_cached_and_a_batch_as_large_as_the_build_chunk_is_bitwise():
    rows = cache_agreement.max_differences("imagenet", keys=4, chunk=4, image_size=16, seed=0)
    assert [(k, level) for k, level, _ in rows] == [(k, k) for k in range(1, 10)]
    # the last column is a batch of every key, the build's own chunk: the same kernel, the same bits
    assert all(worst[-1] == 0.0 for _, _, worst in rows), rows


def test_printed_table_bytes(monkeypatch, capsys):
    """The table's text, pinned as it was when it was written by hand (before freeze.pipeline.markdown)."""
    monkeypatch.setattr(cache_agreement, "max_differences", lambda *a: [(1, 1, [0.0, 1.2e-7]), (3, 2, [2.5e-6, 1.0])])
    monkeypatch.setattr(cache_agreement, "BATCH_SIZES", (8,))
    cache_agreement.main(["--keys", "16"])
    assert capsys.readouterr().out == (
        "resnet18, imagenet stem, 32x32, 1 thread(s), 16 keys\n"
        "| boundary | cut | max abs diff, batch 8 | max abs diff, batch 16 |\n"
        "|---|---|---|---|\n"
        "| 1 | 1 | 0 | 1.2e-07 |\n"
        "| 3 | 2 | 2.5e-06 | 1 |\n"
    )
