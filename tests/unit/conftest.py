"""Fixtures for single-process tests: backends, inputs, every method.

GRACE_TEST_DEVICE=cuda puts the torch backend's test tensors on that device (run there when
a GPU is at hand: every op must then stay on the device)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import grace
from grace.backends import get_backend
from grace.core.wire import run_local

BACKENDS = ["numpy", "torch"]
TORCH_DEVICE = os.environ.get("GRACE_TEST_DEVICE", "cpu")

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
    "natural": lambda: grace.natural(),
    "u8bit": lambda: grace.u8bit(),
    "inceptionn": lambda: grace.inceptionn(0.01),
    "signum": lambda: grace.signum(),
    "efsignsgd": lambda: grace.efsignsgd(0.1),
    "dgc": lambda: grace.dgc(0.1),
    "dgc_warmup": lambda: grace.dgc(0.01, warmup_steps=5, sample_ratio=0.1),
    "adaq": lambda: grace.adaq(0.1),
    "sketchml": lambda: grace.sketchml(16),
    "powersgd": lambda: grace.powersgd(2),
}


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

