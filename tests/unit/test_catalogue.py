"""The promises of the methods beyond the basic quantizers and sparsifiers (docs/methods.md)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import grace
from grace import Exchange
from grace.backends import get_backend
from grace.core.communicator import LocalCommunicator
from grace.core.compressor import TensorInfo
from tests.unit.conftest import roundtrip, to_backend

numpy_xp = get_backend("numpy")
INFO = TensorInfo("w", 0, 1)


def decode(xp, compressor, x, info=INFO):
    return xp.to_numpy(roundtrip(xp, compressor, to_backend(xp, x), info)[1]).astype(np.float64)


def test_natural_rounds_to_a_neighbouring_power_of_two(xp):
    x = np.concatenate([np.random.default_rng(0).standard_normal(997) * 10.0 ** np.arange(-3, 4).repeat(143)[:997],
                        [0.0, 1.0, -2.0, 0.75, 1e-40]])
    y = decode(xp, grace.natural().compressor, x)
    with np.errstate(divide="ignore"):  # log2(0)
        a = np.exp2(np.floor(np.log2(np.abs(x[:-2]))))
    assert np.all((np.abs(y[:-2]) == a) | (np.abs(y[:-2]) == 2 * a))
    assert np.all(np.sign(y) == np.sign(x) * (y != 0))
    np.testing.assert_array_equal(y[-5:-1], [0.0, 1.0, -2.0] + [y[-2]])  # powers of two are exact
    assert abs(y[-2]) in (0.5, 1.0) and y[-1] in (0.0, 2.0**-126)


def test_u8bit_decodes_to_the_nearest_of_its_256_values(xp):
    compressor = grace.u8bit().compressor
    x = np.random.default_rng(1).standard_normal(5000) * np.exp(np.random.default_rng(2).uniform(-8, 0, 5000))
    x[0] = -np.abs(x).max() * 1.01  # the largest magnitude is exact
    payload, y = roundtrip(xp, compressor, to_backend(xp, x), INFO)
    scale = float(xp.to_numpy(payload[1])[0])
    book = compressor.decompress(numpy_xp, (np.arange(256, dtype=np.uint8), np.float32([scale])),
                                 type("Ctx", (), {"numel": 256, "shape": (256,), "dtype": "float32"})())
    book = np.sort(book.astype(np.float64))
    nearest = book[np.abs(x[:, None].astype(np.float32) - book[None, :]).argmin(axis=1)]
    y = xp.to_numpy(y).astype(np.float64)
    assert y[0] == np.float32(x[0])
    err, best = np.abs(y - x.astype(np.float32)), np.abs(nearest - x.astype(np.float32))
    assert np.all(err <= best * (1 + 1e-6) + 1e-12 * scale)
    assert len(np.unique(book)) == 255  # +0 and -0 coincide


@pytest.mark.parametrize("bound", [1e-4, 1e-2, 0.5])
def test_inceptionn_stays_within_the_bound_with_the_fewest_bits(xp, bound):
    x = np.random.default_rng(3).standard_normal(3000) * np.exp(np.random.default_rng(4).uniform(-9, 2, 3000))
    compressor = grace.inceptionn(bound).compressor
    payload, y = roundtrip(xp, compressor, to_backend(xp, x), INFO)
    x32 = x.astype(np.float32).astype(np.float64)
    assert np.all(np.abs(xp.to_numpy(y) - x32) <= bound)
    # the fewest bits: no element could have used a shorter representation
    step = np.float32(2 * bound)
    q = np.round(x32 / step)
    fits = [np.abs(x32) <= bound, (np.abs(q) <= 127) & (np.abs(x32 - q * step) <= bound),
            np.abs(x32 - x32.astype(np.float16)) <= bound, np.ones(x.size, bool)]
    want_counts = np.bincount(np.argmax(np.stack(fits), axis=0), minlength=4)
    assert [xp.numel(t) for t in payload[1:]] == want_counts[1:].tolist()


def test_signum_sends_the_sign_of_its_momentum(xp):
    compressor, beta = grace.signum(0.5).compressor, 0.5
    rng = np.random.default_rng(5)
    g1, g2 = rng.standard_normal(100), rng.standard_normal(100)
    m, state = 0.0, compressor.init_state(xp, to_backend(xp, g1, "float64"), INFO)
    for step, g in enumerate((g1, g2)):
        payload, ctx, state = compressor.step(xp, to_backend(xp, g, "float64"), TensorInfo("w", step, 1), state)
        m = beta * m + (1 - beta) * g
        np.testing.assert_allclose(xp.to_numpy(state), m)
        np.testing.assert_array_equal(xp.to_numpy(compressor.decompress(xp, payload, ctx)), np.where(m >= 0, 1, -1))


def test_efsignsgd_is_a_scaled_sign_in_model_units(xp):
    lr = 0.1
    exchange = Exchange(grace.efsignsgd(lr), LocalCommunicator())
    g = np.random.default_rng(6).standard_normal(64)
    out = exchange.exchange({"w": to_backend(xp, g, "float64")})["w"]
    p = lr * g
    np.testing.assert_allclose(xp.to_numpy(out), np.abs(p).mean() * np.sign(p) / lr, rtol=1e-6)
    np.testing.assert_allclose(xp.to_numpy(exchange.memory["w"]), p - np.abs(p).mean() * np.sign(p), rtol=1e-5)
    with pytest.raises(ValueError, match="memory must be 'efsignsgd'"):
        grace.efsignsgd(lr, memory=grace.ResidualMemory())


def test_dgc_warm_up_raises_the_sparsity_exponentially(xp):
    compressor = grace.dgc(0.001, sparsity_warmup_steps=3).compressor
    ratios = [round(float(compressor.ratio_at(xp, t)), 6) for t in range(5)]
    assert ratios == [0.177828, 0.031623, 0.005623, 0.001, 0.001]


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_dgc_sends_at_most_k_of_the_largest(xp, ratio):
    x = np.random.default_rng(7).standard_normal(20000)
    k = math.ceil(ratio * x.size)
    (values, indices), _ = grace.dgc(ratio).compressor.compress(xp, to_backend(xp, x), INFO)
    kept = xp.to_numpy(indices).astype(np.int64)
    assert 0.5 * k <= len(kept) <= k  # a 1% sample estimates the threshold to within a factor 2
    assert np.abs(x[kept]).min() >= np.sort(np.abs(x))[-k]  # the largest ones
    exact = grace.dgc(ratio, sample_ratio=1.0).compressor.compress(xp, to_backend(xp, x), INFO)[0][1]
    np.testing.assert_array_equal(np.sort(xp.to_numpy(exact)), np.sort(np.argsort(-np.abs(x))[:k]))


def test_dgc_memory_corrects_momentum_and_masks_what_was_sent(xp):
    momentum = 0.9
    exchange = Exchange(grace.dgc(0.1, momentum=momentum, sample_ratio=1.0), LocalCommunicator())
    rng = np.random.default_rng(8)
    u = v = np.zeros(50)
    for step in range(3):
        g = rng.standard_normal(50)
        out = xp.to_numpy(exchange.exchange({"w": to_backend(xp, g, "float64")})["w"])
        u = momentum * u + g
        v = v + u
        sent = np.zeros(50, bool)
        sent[np.argsort(-np.abs(v))[:5]] = True
        np.testing.assert_allclose(out, np.where(sent, v, 0), rtol=1e-12)
        u, v = np.where(sent, 0, u), np.where(sent, 0, v)
        got_u, got_v = (xp.to_numpy(t) for t in exchange.memory["w"])
        np.testing.assert_allclose(got_u, u, atol=1e-12)
        np.testing.assert_allclose(got_v, v, atol=1e-12)


def test_dgc_clips_the_gradient_norm():
    exchange = Exchange(grace.dgc(1.0, clip_norm=1.0, momentum=0.0), LocalCommunicator())
    out = exchange.exchange({"w": np.full(4, 3.0)})["w"]
    np.testing.assert_allclose(out, np.full(4, 0.5))


def test_adaq_decodes_each_sign_to_the_mean_of_its_largest(xp):
    x = np.random.default_rng(9).standard_normal(1000)
    y = decode(xp, grace.adaq(0.1).compressor, x)
    pos, neg = np.flatnonzero(x > 0), np.flatnonzero(x < 0)
    top_pos = pos[np.argsort(-x[pos])[:math.ceil(0.1 * len(pos))]]
    top_neg = neg[np.argsort(x[neg])[:math.ceil(0.1 * len(neg))]]
    want = np.zeros_like(x)
    want[top_pos], want[top_neg] = x[top_pos].mean(), x[top_neg].mean()
    np.testing.assert_allclose(y, want, rtol=1e-5)


def test_sketchml_buckets_hold_equal_counts_and_decode_to_their_means(xp):
    x = np.random.default_rng(10).standard_normal(1000)
    x[::7] = 0.0  # zeros stay zero and are not coded
    y = decode(xp, grace.sketchml(16).compressor, x)
    assert np.all(y[::7] == 0) and np.all(y[x != 0] != 0)
    nz = x != 0
    levels, counts = np.unique(y[nz], return_counts=True)
    assert len(levels) == 16 and counts.max() - counts.min() <= 1
    for level in levels:  # each level is the mean of its bucket, and buckets are intervals
        members = x[nz][y[nz] == level]
        np.testing.assert_allclose(level, members.mean(), rtol=1e-5)
    order = np.argsort(x[nz])
    assert np.all(np.diff(y[nz][order]) >= 0)


@pytest.mark.parametrize("rank", [1, 3])
def test_powersgd_reproduces_a_rank_r_matrix_exactly(xp, rank):
    rng = np.random.default_rng(11)
    m = rng.standard_normal((40, rank)) @ rng.standard_normal((rank, 30))
    y = decode(xp, grace.powersgd(rank).compressor, m)
    np.testing.assert_allclose(y, m, atol=1e-4 * np.abs(m).max())


@pytest.mark.parametrize("warm_start", [True, False])
def test_powersgd_warm_starts_q_and_sends_vectors_whole(xp, warm_start):
    """The same matrix every step: with Q kept, the power iteration converges to the best
    rank-2 approximation; redrawing Q (GRACE's bug) would not."""
    exchange = Exchange(grace.powersgd(2, memory="none"), LocalCommunicator())
    m = np.random.default_rng(12).standard_normal((30, 20))
    best = np.sqrt(np.sum(np.linalg.svd(m, compute_uv=False)[2:] ** 2))
    for _ in range(30):
        if not warm_start:
            exchange.state.clear()
        out = exchange.exchange({"w": to_backend(xp, m), "b": to_backend(xp, np.arange(5.0))})
        np.testing.assert_array_equal(xp.to_numpy(out["b"]), np.arange(5.0))
    error = np.linalg.norm(xp.to_numpy(out["w"]) - m)
    assert (error < 1.01 * best) == warm_start, (error, best)
    assert exchange.stats.last_step_bytes == 4 * ((30 + 20) * 2 + 5 + 1)  # P, Q, the vector, the overflow flag


def test_powersgd_memory_keeps_matrices_residual_only(xp):
    exchange = Exchange(grace.powersgd(1), LocalCommunicator())
    m = np.random.default_rng(13).standard_normal((8, 6))
    out = exchange.exchange({"w": to_backend(xp, m), "b": to_backend(xp, np.ones(3))})
    assert set(exchange.memory) == {"w"}
    np.testing.assert_allclose(xp.to_numpy(exchange.memory["w"]), m - xp.to_numpy(out["w"]), atol=1e-5)


def test_powersgd_runs_only_with_allreduce():
    with pytest.raises(ValueError, match="only with communicator='allreduce'"):
        grace.powersgd(communicator="allgather")
