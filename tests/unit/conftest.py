"""Fixtures for single-process tests: backends, inputs, and a one-rank communicator."""
from __future__ import annotations

import numpy as np
import pytest

import grace
from grace.backends import get_backend
from grace.core.communicator import Communicator

BACKENDS = ["numpy", "torch"]

# label -> factory; every registered method appears at least once
METHODS = {
    "none": lambda: grace.none(),
    "fp16": lambda: grace.fp16(),
    "bf16": lambda: grace.fp16("bfloat16"),
    "topk": lambda: grace.topk(0.1),
    "randomk": lambda: grace.randomk(0.1),
    "randomk_scaled": lambda: grace.randomk(0.1, scale=True),
    "threshold": lambda: grace.threshold(0.5),
    "signsgd": lambda: grace.signsgd(),
    "signsgd_mean": lambda: grace.signsgd("mean"),
    "onebit": lambda: grace.onebit(),
    "qsgd": lambda: grace.qsgd(4),
    "qsgd_bucketed": lambda: grace.qsgd(127, bucket_size=64),
    "terngrad": lambda: grace.terngrad(),
}


@pytest.fixture(params=BACKENDS)
def xp(request):
    if request.param == "torch":
        pytest.importorskip("torch")
    return get_backend(request.param)


def to_backend(xp, array: np.ndarray, dtype: str = "float32"):
    """``array`` as a tensor of backend ``xp`` with ``dtype``."""
    if xp.name == "torch":
        import torch

        return torch.from_numpy(np.array(array, dtype=np.float64)).to(getattr(torch, dtype))
    return xp.cast(np.asarray(array, dtype=np.float64), dtype)


class SingleRank(Communicator):
    """A world of one: every collective hands back this rank's own tensor."""

    rank, size = 0, 1

    def allreduce_async(self, tensor, name):
        return lambda: tensor

    allgather_async = allreduce_async

    def broadcast_async(self, tensor, root, name):
        return lambda: tensor
