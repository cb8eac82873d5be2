"""Every method on every backend: shapes, dtypes, edge sizes and each method's promise."""
from __future__ import annotations

import math

import numpy as np
import pytest

import grace
from grace.backends import get_backend
from grace.core.compressor import TensorInfo, index_dtype
from tests.unit.conftest import METHODS, TORCH_DEVICE, roundtrip as run_method, to_backend

SHAPES = [(), (1,), (0,), (7,), (3, 5), (2, 3, 4), (300,), (40000,)]
INFO = TensorInfo(name="layer.weight", step=3, world_size=4)


def roundtrip(xp, method, x):
    return run_method(xp, METHODS[method]().compressor, x, INFO)


def sample(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_decompress_restores_shape_and_dtype(xp, method, shape):
    for dtype in ["float32", "float64", "float16"] + (["bfloat16"] if xp.name == "torch" else []):
        x = to_backend(xp, sample(shape), dtype)
        _, y = roundtrip(xp, method, x)
        assert xp.shape(y) == shape and xp.dtype(y) == dtype, (method, dtype)


@pytest.mark.parametrize("ratio", [1e-9, 0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("d", [1, 2, 99, 1000])
def test_topk_keeps_exactly_the_k_largest_magnitudes(xp, d, ratio):
    x = sample(d, seed=d)
    k = max(1, math.ceil(ratio * d))
    compressor = grace.topk(ratio).compressor
    (values, indices), ctx = compressor.compress(xp, to_backend(xp, x), INFO)
    y = compressor.decompress(xp, (values, indices), ctx)
    kept = np.sort(xp.to_numpy(indices).astype(np.int64))
    assert len(kept) == k
    np.testing.assert_array_equal(kept, np.sort(np.argsort(-np.abs(x))[:k]))
    np.testing.assert_array_equal(xp.to_numpy(values), x.astype(np.float32)[kept])
    assert xp.dtype(indices) == index_dtype(d)
    dense = np.zeros(d, np.float32)
    dense[kept] = x[kept]
    np.testing.assert_array_equal(xp.to_numpy(y), dense)


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.5, 100.0])
def test_threshold_keeps_exactly_the_elements_at_or_above_it(xp, threshold):
    x = sample(500)
    x[7] = threshold  # |x| >= lambda: kept
    compressor = grace.threshold(threshold).compressor
    (values, indices), ctx = compressor.compress(xp, to_backend(xp, x, "float64"), INFO)
    want = np.flatnonzero(np.abs(x) >= threshold)
    np.testing.assert_array_equal(xp.to_numpy(indices).astype(np.int64), want)
    np.testing.assert_array_equal(xp.to_numpy(values), x[want])
    y = xp.to_numpy(compressor.decompress(xp, (values, indices), ctx))
    np.testing.assert_array_equal(y, np.where(np.abs(x) >= threshold, x, 0))


def test_threshold_may_keep_nothing(xp):
    compressor = grace.threshold(10.0).compressor
    payload, ctx = compressor.compress(xp, to_backend(xp, sample((4, 4))), INFO)
    assert [xp.numel(t) for t in payload] == [0, 0]
    assert not xp.to_numpy(compressor.decompress(xp, payload, ctx)).any()
    agg = compressor.aggregate(xp, [payload, payload], ctx)
    assert xp.shape(agg) == (4, 4) and not xp.to_numpy(agg).any()


def test_randomk_indices_depend_only_on_tensor_name_and_step(xp):
    compressor = grace.randomk(0.05).compressor
    rank_a, rank_b = to_backend(xp, sample(1000, 1)), to_backend(xp, sample(1000, 2))
    (_, a), (_, b) = (compressor.compress(xp, x, INFO)[1] for x in (rank_a, rank_b))
    np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(b))  # ranks agree, whatever the data
    assert len(np.unique(xp.to_numpy(a))) == 50  # without replacement
    next_step = TensorInfo(INFO.name, INFO.step + 1, INFO.world_size)
    other_name = TensorInfo("layer.bias", INFO.step, INFO.world_size)
    for info in (next_step, other_name):
        (_, c) = compressor.compress(xp, rank_a, info)[1]
        assert not np.array_equal(xp.to_numpy(a), xp.to_numpy(c))


def test_randomk_scaled_is_unbiased():
    """Mean over many steps (fresh indices each) converges to the input; unscaled does not."""
    xp = get_backend("numpy")
    x = sample(200).astype(np.float32)
    for scale, should_match in ((True, True), (False, False)):
        compressor = grace.randomk(0.1, scale=scale).compressor
        total = np.zeros_like(x, dtype=np.float64)
        steps = 4000
        for step in range(steps):
            payload, ctx = compressor.compress(xp, x, TensorInfo("w", step, 1))
            total += compressor.decompress(xp, payload, ctx)
        error = np.abs(total / steps - x).max()
        # std of one coordinate's mean ~ |x| * sqrt((d/k - 1) / steps) ~ 0.05 * |x|
        assert (error < 0.25 * np.abs(x).max()) == should_match, (scale, error)


@pytest.mark.parametrize("method", METHODS)
def test_numpy_and_torch_backends_agree(method, monkeypatch):
    torch = pytest.importorskip("torch")
    numpy_xp, torch_xp = get_backend("numpy"), get_backend("torch")
    rtol = 1e-6
    if TORCH_DEVICE != "cpu":  # a GPU draws its own random numbers: give it NumPy's, on the device
        monkeypatch.setattr(torch_xp, "uniform", lambda n, seed, like=None: torch.from_numpy(
            numpy_xp.uniform(n, seed)).to(TORCH_DEVICE))
        monkeypatch.setattr(torch_xp, "random_indices", lambda n, k, seed, like=None: torch.from_numpy(
            numpy_xp.random_indices(n, k, seed)).to(TORCH_DEVICE))
        rtol = 1e-5 if method != "powersgd" else 1e-4  # other summation orders, another QR
    for shape in [(3, 5), (1000,), (1,)]:
        x = sample(shape, seed=7)
        p_np, y_np = roundtrip(numpy_xp, method, to_backend(numpy_xp, x))
        p_t, y_t = roundtrip(torch_xp, method, to_backend(torch_xp, x))
        assert len(p_np) == len(p_t)
        for a, b in zip(p_np, p_t):
            dtype = numpy_xp.dtype(a)
            assert dtype == torch_xp.dtype(b)
            a, b = np.asarray(numpy_xp.to_numpy(a), dtype=np.float64), torch_xp.to_numpy(b).astype(np.float64)
            if dtype.startswith(("uint", "int")) or method in ("topk", "randomk", "threshold", "none"):
                np.testing.assert_array_equal(a, b)  # codes, indices: identical bytes
            else:  # per-tensor scalars: reductions may sum in another order
                np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(a).max(initial=0))
        y_np = np.asarray(y_np, dtype=np.float32)
        np.testing.assert_allclose(y_np, torch_xp.to_numpy(y_t), rtol=rtol, atol=max(1e-7, rtol * np.abs(y_np).max()))


@pytest.mark.parametrize("method", ["topk", "randomk", "threshold"])
def test_sparse_payload_bytes(xp, method):
    d = 100_000
    payload, _ = roundtrip(xp, method, to_backend(xp, sample(d)))
    k = xp.numel(payload[0])
    per_element = {"topk": 4 + 4, "randomk": 4, "threshold": 4 + 4}[method]  # int32 indices
    assert sum(xp.nbytes(t) for t in payload) == k * per_element
    if method != "threshold":
        assert k == math.ceil(0.1 * d)


def test_without_native_kernels_torch_top_k_takes_the_first_ties_as_numpy_does():
    """grace.native's rule for ties (the first ones; NaN ranks as inf) holds without it too."""
    torch = pytest.importorskip("torch")
    import grace.native as gn

    numpy_xp, torch_xp = get_backend("numpy"), get_backend("torch")
    x = np.array([1, 3, 3, np.nan, np.inf, 3, 2, np.inf, -np.inf, 3], np.float32)
    with gn.disabled():
        for k in range(1, x.size):
            got = torch_xp.topk_indices(torch.from_numpy(x), k)
            assert sorted(got.tolist()) == numpy_xp.topk_indices(x, k).tolist(), k


def test_backend_max_is_the_maximum_and_zero_when_empty(xp):
    assert float(xp.max(to_backend(xp, np.array([-3.0, -2.0])))) == -2.0
    assert float(xp.max(to_backend(xp, np.zeros(0)))) == 0.0


def reduced_qr(x: np.ndarray) -> np.ndarray:
    """Q of x's reduced QR with a non-negative diagonal of R, in float64."""
    q, r = np.linalg.qr(x.astype(np.float64))
    return q * np.where(np.diagonal(r) < 0, -1, 1)


@pytest.mark.parametrize("accelerator", [False, True], ids=["here", "accelerator"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_orthonormalize_of_one_column_is_qr_without_the_factorization(xp, dtype, accelerator, monkeypatch):
    # PowerSGD(1)'s P: x / |x| with the norm in float64, so that a vanishing gradient's P
    # (squares below float32's range) still gets a unit vector; zero gives QR's first unit vector
    # (on an accelerator every column of a bucket at once: orthonormalize_many)
    if accelerator:
        monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    rng = np.random.default_rng(7)
    columns = [rng.standard_normal((300, 1)), -rng.random((5, 1)), np.full((9, 1), 3e-30), np.full((4, 1), 1e30),
               np.zeros((6, 1)), np.array([[-2.0]])]
    together = xp.orthonormalize_many([to_backend(xp, x, dtype) for x in columns])
    for x, many in zip(columns, together):
        q = xp.to_numpy(xp.orthonormalize(to_backend(xp, x, dtype)))
        assert q.dtype == dtype and q.shape == x.shape
        np.testing.assert_allclose(q, reduced_qr(x.astype(dtype)), rtol=0, atol=1e-6 if dtype == "float32" else 1e-14)
        assert abs(np.linalg.norm(q.astype(np.float64)) - 1) < 1e-6
        np.testing.assert_array_equal(xp.to_numpy(many), q)  # alone or among others: the same
    nan = xp.to_numpy(xp.orthonormalize(to_backend(xp, np.array([[np.nan], [1.0]]), dtype)))
    assert np.isnan(nan).all()  # (the overflow check skips such a step: nothing to hide)
    several = rng.standard_normal((30, 3))
    np.testing.assert_allclose(xp.to_numpy(xp.orthonormalize(to_backend(xp, several, dtype))),
                               reduced_qr(several.astype(dtype)), atol=1e-5)


@pytest.mark.parametrize("accelerator", [False, True], ids=["here", "accelerator"])
@pytest.mark.parametrize("rank", [1, 2])
def test_powersgds_batched_rounds_equal_each_tensors_rounds_side_by_side(xp, rank, accelerator, monkeypatch):
    """PowerSGD's ``rounds_many`` (one native call per product for a bucket's matrices, on a
    CPU; on an accelerator tensor ops, single columns orthonormalised all at once) against
    ``MethodKernels.rounds_many``'s default, each tensor's ``rounds`` side by side: every result,
    approximation and new Q the same, bit for bit, in a world of 3 equal ranks."""
    from grace.core.plans.kernels import MethodKernels, kernels_of

    if accelerator:  # (with GRACE_TEST_DEVICE=cuda the tensors really are there)
        monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
        monkeypatch.setattr(type(xp), "native", lambda self, *args: None)

    compressor = grace.powersgd(rank).compressor
    shapes = [(6, 5), (7,), (4, 3, 2), (1,), (10, 10), (2, 40)]
    xs = [to_backend(xp, sample(shape, seed=i)) for i, shape in enumerate(shapes)]
    infos = [TensorInfo(name=f"layer{i}", step=0, world_size=3) for i in range(len(shapes))]
    states = [compressor.init_state(xp, x, info) for x, info in zip(xs, infos)]

    def run(rounds):
        payloads, sent = next(rounds), 0
        try:
            while True:
                sent += 1
                payloads = rounds.send([tuple(t * 3 for t in payload) for payload in payloads])
        except StopIteration as done:
            return done.value, sent

    (batched, rounds), (alone, rounds_alone) = run(kernels_of(compressor).rounds_many(xp, xs, infos, states)), \
        run(MethodKernels(compressor).rounds_many(xp, xs, infos, states))
    assert rounds == rounds_alone == 2
    for shape, want, got in zip(shapes, alone, batched):
        for w, g in zip(want, got):
            if w is None:
                assert g is None and len(shape) < 2  # a vector's state
                continue
            np.testing.assert_array_equal(xp.to_numpy(g), xp.to_numpy(w), err_msg=str(shape))
        assert xp.shape(got[0]) == shape
