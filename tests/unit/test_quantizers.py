"""The quantizers' promises: unbiasedness, bounded error, exact decodings, packed sizes."""
from __future__ import annotations

import math

import numpy as np
import pytest

import grace
from grace.backends import get_backend
from grace.core import bits
from grace.core.compressor import TensorInfo
from tests.unit.conftest import to_backend

numpy_xp = get_backend("numpy")


def draws(compressor, x, steps, rank=0):
    """Decompressions of ``x`` over ``steps`` steps, each with fresh random numbers."""
    for step in range(steps):
        payload, ctx = compressor.compress(numpy_xp, x, TensorInfo("w", step, 4, rank))
        yield compressor.decompress(numpy_xp, payload, ctx).astype(np.float64)


@pytest.mark.parametrize("make", [
    lambda: grace.qsgd(4).compressor,
    lambda: grace.qsgd(2, bucket_size=16).compressor,
    lambda: grace.terngrad().compressor,
    lambda: grace.natural().compressor,
])
@pytest.mark.parametrize("rounding", ["stochastic", "always down"])
def test_unbiased_methods_average_to_the_input(make, rounding, monkeypatch):
    if rounding == "always down":  # a biased implementation must fail the same bound
        monkeypatch.setattr(numpy_xp, "uniform", lambda n, seed, like=None: np.full(n, 0.9999, np.float32))
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    steps = 3000
    mean = sum(draws(make(), x, steps)) / steps
    # one draw errs by at most ||x|| / s (qsgd), max|x| (terngrad) or |x| (natural) per element:
    # a 6-sigma bound
    bound = 6 * np.linalg.norm(x) / 2 / math.sqrt(steps)
    error = np.abs(mean - x).max()
    assert (error < bound) == (rounding == "stochastic"), (error, bound)


@pytest.mark.parametrize("levels", [1, 4, 127])
def test_qsgd_levels_are_within_one_step_of_the_input(levels):
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    step = np.linalg.norm(x) / levels
    for y in draws(grace.qsgd(levels).compressor, x, 5):
        assert np.all(np.abs(y - x) <= step * (1 + 1e-5))
        assert np.all((np.sign(y) == np.sign(x)) | (y == 0))


def test_terngrad_sends_three_values():
    x = np.random.default_rng(2).standard_normal(500).astype(np.float32)
    y = next(draws(grace.terngrad().compressor, x, 1))
    assert set(np.unique(np.abs(y))) <= {0.0, float(np.abs(x).max())}
    assert np.all((np.sign(y) == np.sign(x)) | (y == 0))


def test_onebit_decodes_to_the_two_means(xp):
    x = np.random.default_rng(3).standard_normal((30, 7))
    compressor = grace.onebit().compressor
    payload, ctx = compressor.compress(xp, to_backend(xp, x), TensorInfo("w", 0, 1))
    y = xp.to_numpy(compressor.decompress(xp, payload, ctx))
    want = np.where(x >= 0, x[x >= 0].mean(), x[x < 0].mean())
    np.testing.assert_allclose(y, want, rtol=1e-5)


def test_signsgd_majority_vote(xp):
    rng = np.random.default_rng(4)
    ranks = [rng.standard_normal(101) for _ in range(3)]
    compressor = grace.signsgd().compressor
    payloads = []
    for x in ranks:
        payload, ctx = compressor.compress(xp, to_backend(xp, x), TensorInfo("w", 0, 3))
        payloads.append(payload)
    vote = xp.to_numpy(compressor.aggregate(xp, payloads, ctx))
    np.testing.assert_array_equal(vote, np.sign(sum(np.where(x >= 0, 1.0, -1.0) for x in ranks)))
    mean = xp.to_numpy(grace.signsgd("mean").compressor.aggregate(xp, payloads, ctx))
    np.testing.assert_allclose(mean, sum(np.where(x >= 0, 1.0, -1.0) for x in ranks) / 3)


@pytest.mark.parametrize("method, per_element_bits, header_bytes", [
    (lambda: grace.signsgd(), 1, 0),
    (lambda: grace.onebit(), 1, 8),
    (lambda: grace.terngrad(), 2, 4),
    (lambda: grace.qsgd(1), 2, 4),
    (lambda: grace.qsgd(4), 4, 4),
    (lambda: grace.qsgd(127), 8, 4),
])
@pytest.mark.parametrize("d", [1, 9, 1 << 20])
def test_payloads_are_bit_packed(xp, method, per_element_bits, header_bytes, d):
    compressor = method().compressor
    payload, _ = compressor.compress(xp, to_backend(xp, np.linspace(-1, 1, d)), TensorInfo("w", 0, 2))
    assert sum(xp.nbytes(t) for t in payload) == math.ceil(d * per_element_bits / 8) + header_bytes


@pytest.mark.parametrize("width", bits.WIDTHS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_bit_packing_round_trips_with_identical_bytes_on_every_backend(width, n):
    codes = np.random.default_rng(n).integers(0, 2 ** width, n).astype(np.uint8)
    packed = {}
    for name in ("numpy", "torch"):
        xp = get_backend(name)
        p = bits.pack(xp, xp.asarray(codes), width)
        assert xp.numel(p) == bits.packed_size(n, width)
        np.testing.assert_array_equal(xp.to_numpy(bits.unpack(xp, p, width, n)), codes)
        packed[name] = xp.to_numpy(p).tobytes()
    assert packed["numpy"] == packed["torch"]


def test_invalid_quantizer_arguments():
    for call, message in [(lambda: grace.qsgd(0), "levels must be an integer in"),
                          (lambda: grace.qsgd(4, bucket_size=-1), "bucket_size must be"),
                          (lambda: grace.signsgd("vote"), "aggregate must be 'majority' or 'mean'")]:
        with pytest.raises(ValueError, match=message):
            call()
