"""Native kernels against the pure tensor-op code (the oracle): helpers and device fixtures.

Tests run on the CPU always and on CUDA when a GPU and libgrace_cuda are there (otherwise the
CUDA cases are skipped, which is not a pass). GRACE_NATIVE=0 turns the kernels off; then
every test here that needs them is skipped.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import grace.native as gn
from grace.backends import get_backend

torch = pytest.importorskip("torch")

NX = get_backend("numpy")
TX = get_backend("torch")

# odd sizes around the packing widths (8 codes), NumPy's pairwise blocks (8, 128), the
# kernels' thread grain (2**15) and CUDA tiles (4096)
SIZES = [0, 1, 7, 8, 9, 63, 127, 128, 129, 1001, 4097, 2**16 + 3]
BIG = 2**20 + 7


@pytest.fixture(autouse=True)
def _needs_the_cpu_library(request):
    """Every test here but test_build's needs libgrace_cpu: skipped (not passed) without it."""
    if request.module.__name__.endswith("test_build"):
        return
    if not gn.available("cpu"):
        pytest.skip(f"libgrace_cpu not available: {gn.load_error('cpu') or 'GRACE_NATIVE=0'}")


def _cuda_ok() -> bool:
    return torch.cuda.is_available() and gn.available("cuda")


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if not gn.available("cpu"):
        pytest.skip(f"libgrace_cpu not loaded: {gn.load_error('cpu')}")
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device or libgrace_cuda not built")
    return request.param


def on(device, a):
    """NumPy array ``a`` as a torch tensor on ``device`` (same dtype)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def host(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.detach().cpu().numpy()


def same_bytes(a, b, what=""):
    a, b = host(a), host(b)
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if a.tobytes() != b.tobytes():
        bad = np.flatnonzero(a.reshape(-1).view(np.uint8) != b.reshape(-1).view(np.uint8))
        pytest.fail(f"{what}: {bad.size} bytes differ, first at byte {bad[0]}: "
                    f"{a.reshape(-1)[:8]} vs {b.reshape(-1)[:8]}")


def gradient(n: int, seed: int = 0) -> np.ndarray:
    """float32 with a wide range of magnitudes, exact zeros, -0.0 and tiny values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 2)).astype(np.float32)
    if n > 10:
        x[rng.integers(0, n, max(1, n // 50))] = 0.0
        x[rng.integers(0, n, max(1, n // 100))] = -0.0
        x[rng.integers(0, n, max(1, n // 100))] *= np.float32(1e-38)  # subnormals
    return x


def draws(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random(n, dtype=np.float32)


def count_calls(monkeypatch, name: str) -> list:
    """A list that each call of the fused kernel ``name`` (grace.native.KERNELS) appends to."""
    calls, kernel = [], gn.KERNELS[name]
    monkeypatch.setitem(gn.KERNELS, name, dataclasses.replace(
        kernel, function=lambda *a, **k: calls.append(1) or kernel.function(*a, **k)))
    return calls
