"""TorchBackend and grace.core.bits dispatch to the native kernels: every method gives the
same payload bytes and decompressed values with them as without them (GRACE_NATIVE=0)."""
from __future__ import annotations

import numpy as np
import pytest

import grace.native as gn
from grace.core import bits
from grace.core.compressor import TensorInfo
from tests.fixtures.round_trip import run_local
from tests.native.conftest import TX, device, gradient, host, on, same_bytes, torch  # noqa: F401
from tests.unit.conftest import METHODS

INFO = TensorInfo("layer.weight", 2, 1)
FUSED_SUMS = {"onebit", "efsignsgd", "qsgd", "qsgd_bucketed", "powersgd"}


def roundtrip(method, x):
    compressor = METHODS[method]().compressor
    payload, y, _ = run_local(compressor, TX, x, INFO)
    return payload, y


@pytest.mark.parametrize("shape", [(1,), (3, 5), (1001,), (2**16 + 3,)])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_the_same_with_and_without_native(device, method, shape):
    x = on(device, gradient(int(np.prod(shape)), seed=11).reshape(shape))
    with gn.disabled():
        want_payload, want_y = roundtrip(method, x)
    payload, y = roundtrip(method, x)
    assert len(payload) == len(want_payload)
    # sketchml sums repeated indices (its bucket means): on a GPU with atomics, in any order,
    # as torch's own index_add_ there. The fused quantizers sum their scalars (means, scale,
    # norms) as NumPy does, torch's own sum in another order, and PowerSGD's products sum in
    # their own order, BLAS in another: equal to float32 rounding.
    atomics = (device == "cuda" and method == "sketchml") or method in FUSED_SUMS
    for j, (a, b) in enumerate(zip(want_payload, payload)):
        if atomics and a.dtype.is_floating_point:
            np.testing.assert_allclose(host(b), host(a), rtol=1e-5, atol=2.0**-126)
        else:
            same_bytes(a, b, f"payload[{j}]")
    if atomics:
        np.testing.assert_allclose(host(y), host(want_y), rtol=1e-5, atol=2.0**-126)
    elif device == "cuda":
        same_bytes(unflushed(want_y, y), y, "decompressed")
    else:
        same_bytes(want_y, y, "decompressed")


def unflushed(want, got):
    """torch's index_add_ on a GPU adds with atomicAdd, which flushes subnormal floats to zero;
    the native scatter-add keeps them (as the CPU). Where ``want`` has such a zero and ``got``
    a subnormal, take ``got``'s value: every other byte must agree."""
    want, got = host(want).copy(), host(got)
    if want.dtype.kind == "f":
        tiny = np.finfo(want.dtype).tiny
        flushed = (want == 0) & (got != 0) & (np.abs(got) < tiny)
        want[flushed] = got[flushed]
    return want


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8])
def test_bits_pack_dispatches_for_torch(device, width):
    codes = on(device, np.random.default_rng(width).integers(0, 1 << width, 1001).astype(np.uint8))
    with gn.disabled():
        want = bits.pack(TX, codes, width)
        want_codes = bits.unpack(TX, want, width, 1001)
    got = bits.pack(TX, codes, width)
    same_bytes(want, got)
    same_bytes(want_codes, bits.unpack(TX, got, width, 1001))


def test_backend_ops_dispatch(device):
    x = on(device, gradient(10_000, 3))
    with gn.disabled():
        want_topk = torch.sort(TX.topk_indices(TX.abs(x), 100)).values
        want_nz = TX.nonzero(x > 1)
        want_sc = TX.scatter_add(want_nz, x[want_nz], 10_000)
    got_topk = TX.topk_indices(TX.abs(x), 100)
    same_bytes(want_topk, got_topk)  # native: already ascending
    same_bytes(want_nz, TX.nonzero(x > 1))
    same_bytes(want_sc, TX.scatter_add(want_nz, x[want_nz], 10_000))
    # what the native path does not take goes to torch: 2-d, requires_grad, other dtypes
    assert TX.nonzero(on(device, np.ones((2, 3), bool))).tolist() == [0, 0, 0, 1, 1, 1]
    w = x.clone().requires_grad_(True)
    assert TX.topk_indices(w.abs(), 3).numel() == 3
    ints = on(device, np.arange(10, dtype=np.int32))
    same_bytes(TX.scatter_add(ints, ints, 10), on(device, np.arange(10, dtype=np.int32)))


def test_rows_scattered_row_after_row_with_and_without_native(device):
    """scatter_add_rows: each row's values added at its distinct indices, row after row (rows
    collide with each other), bit for bit NumPy's additions in that order, natively or not."""
    rng = np.random.default_rng(5)
    rows = [np.sort(rng.choice(3000, 700, replace=False)) for _ in range(4)]
    values = [(rng.standard_normal(700) * 10.0 ** rng.integers(-3, 4, 700)).astype(np.float32) for _ in rows]
    want = np.zeros(3000, np.float32)
    for idx, v in zip(rows, values):
        np.add.at(want, idx, v)
    args = ([on(device, i) for i in rows], [on(device, v) for v in values], 3000)
    with gn.disabled():
        same_bytes(TX.scatter_add_rows(*args), want)
    same_bytes(TX.scatter_add_rows(*args), want)


def test_out_of_range_index_still_raises_through_the_fallback():
    with pytest.raises((IndexError, RuntimeError)):
        TX.scatter_add(torch.tensor([0, 7]), torch.ones(2), 5)
