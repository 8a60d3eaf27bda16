"""freeze.fingerprint: equal bits give equal fingerprints; a changed bit, a swap or a dtype view does not."""

import torch

from freeze.fingerprint import fingerprint, module_state


def test_equal_bits_equal_fingerprints_and_any_change_shows():
    a = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fingerprint([a]), fingerprint([a.clone()]))
    nudged = a.clone()
    nudged[500] = torch.nextafter(nudged[500], torch.tensor(float("inf")))  # one bit
    swapped = a.clone()
    swapped[[3, 7]] = swapped[[7, 3]]  # the same values in another order
    for other in (nudged, swapped):
        assert not torch.equal(fingerprint([a]), fingerprint([other]))
    assert not torch.equal(fingerprint([a[:500], a[500:]]), fingerprint([a[500:], a[:500]]))


def test_every_dtype_and_large_tensors_in_chunks():
    for t in (torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.int8)):
        assert fingerprint([t]).dtype == torch.int64
    big = torch.zeros((1 << 22) + 5)
    big[-1] = 1.0
    assert fingerprint([big])[1] != fingerprint([torch.zeros_like(big)])[1]
    assert torch.equal(fingerprint([]), torch.zeros(2, dtype=torch.int64))


def test_module_state_lists_each_tied_tensor_once():
    lin = torch.nn.Linear(2, 2)
    bn = torch.nn.BatchNorm1d(2)
    assert len(module_state([lin, bn, lin])) == 2 + 5
