"""experiments.cache_agreement: one row per boundary of ResNet-18, served against recomputed."""

from experiments import cache_agreement


def test_every_boundary_is_cached_and_a_batch_as_large_as_the_build_chunk_is_bitwise():
    rows = cache_agreement.max_differences("imagenet", keys=4, chunk=4, image_size=16, seed=0)
    assert [(k, level) for k, level, _ in rows] == [(k, k) for k in range(1, 10)]
    # the last column is a batch of every key, the build's own chunk: the same kernel, the same bits
    assert all(worst[-1] == 0.0 for _, _, worst in rows), rows
