"""Shared pytest setup: the CI machine has 2 cores shared by everything, so tests use one thread."""

import torch

torch.set_num_threads(1)
