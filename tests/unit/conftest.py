"""Fixtures for single-process tests: backends, inputs, every method.

GRACE_TEST_DEVICE=cuda puts the torch backend's test tensors on that device (run there when
a GPU is at hand: every op must then stay on the device)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from grace.backends import get_backend
from grace.core import registry
from tests.fixtures.own_collective import pinned_all
from tests.fixtures.round_trip import run_local
import tests.fixtures.methods  # noqa: F401  (registers the fixture methods)

BACKENDS = ["numpy", "torch"]
TORCH_DEVICE = os.environ.get("GRACE_TEST_DEVICE", "cpu")

# label -> factory: every example of every registered method (grace/core/registry.py), test
# fixtures (tests/fixtures/methods) included, on its own collective
METHODS = pinned_all(registry.examples())


def roundtrip(xp, compressor, x, info):
    """(payload, decompressed) of one rank alone (multi-round methods: all rounds' payloads)."""
    payload, x_hat, _ = run_local(compressor, xp, x, info)
    return payload, x_hat


@pytest.fixture(params=BACKENDS)
def xp(request):
    if request.param == "torch":
        pytest.importorskip("torch")
    return get_backend(request.param)


def to_backend(xp, array: np.ndarray, dtype: str = "float32"):
    """``array`` as a tensor of backend ``xp`` with ``dtype``."""
    if xp.name == "torch":
        import torch

        return torch.from_numpy(np.array(array, dtype=np.float64)).to(TORCH_DEVICE, getattr(torch, dtype))
    return xp.cast(np.asarray(array, dtype=np.float64), dtype)

