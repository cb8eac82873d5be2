"""PowerSGD's products (grace.native.lowrank_project, lowrank_back, lowrank_expand; CPU) against
NumPy float32 code that sums in the kernels' documented order: equal bit for bit, whatever the
number of threads (and, through test_build's reruns, whatever the build). Subnormals are
flushed in the products only; the compensation and the residual stay exact."""
from __future__ import annotations

import numpy as np
import pytest

import grace.native as gn
from grace.native import NativeUnavailable
from tests.native.conftest import torch

F = np.float32
# (rows, cols, r): columns around the 8 and 32 lanes, rank 1 (PowerSGD's default) and more
SHAPES = [(1, 1, 1), (3, 7, 1), (5, 31, 2), (9, 32, 1), (4, 33, 3), (17, 100, 4), (64, 512, 1), (200, 77, 5)]


def project_order(m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """M q, each (i, k) as row_products sums it: 32 lanes over the columns below the last multiple
    of 32, lanes l, l + 8, l + 16, l + 24 as (a + b) + (c + d), then ((v0 + v1) + (v2 + v3)) + ((v4
    + v5) + (v6 + v7)), then the other columns in order; float32 throughout, no fused multiply-add."""
    rows, cols = m.shape
    c32 = cols - cols % 32
    out = np.empty((rows, q.shape[1]), F)
    for k in range(q.shape[1]):
        acc = np.zeros((rows, 32), F)
        for j in range(0, c32, 32):
            acc = acc + m[:, j:j + 32] * q[j:j + 32, k]
        v = (acc[:, 0:8] + acc[:, 8:16]) + (acc[:, 16:24] + acc[:, 24:32])
        s = ((v[:, 0] + v[:, 1]) + (v[:, 2] + v[:, 3])) + ((v[:, 4] + v[:, 5]) + (v[:, 6] + v[:, 7]))
        for j in range(c32, cols):
            s = s + m[:, j] * q[j, k]
        out[:, k] = s
    return out


def back_order(m: np.ndarray, p: np.ndarray) -> np.ndarray:
    """M^T p, each (j, k) summed over the rows in order from 0."""
    out = np.zeros((m.shape[1], p.shape[1]), F)
    for i in range(m.shape[0]):
        out = out + m[i][:, None] * p[i]
    return out


def expand_order(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """p q^T, each (i, j) over k in order from the first term."""
    out = p[:, 0:1] * q[:, 0]
    for k in range(1, p.shape[1]):
        out = out + p[:, k:k + 1] * q[:, k]
    return out


def data(rows, cols, r, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)).astype(F), rng.standard_normal((rows, cols)).astype(F),
            rng.standard_normal((cols, r)).astype(F), rng.standard_normal((rows, r)).astype(F))


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    gn.set_num_threads(request.param)
    yield request.param
    gn.set_num_threads(0)


@pytest.mark.parametrize("rows, cols, r", SHAPES)
def test_products_sum_in_the_documented_order(rows, cols, r, threads):
    g, e, q, p = data(rows, cols, r)
    got = gn.lowrank_project(t(g), t(q), rows, cols).numpy().reshape(rows, r)
    np.testing.assert_array_equal(got, project_order(g, q))
    np.testing.assert_allclose(got, g.astype(np.float64) @ q, rtol=1e-4, atol=1e-4)
    got = gn.lowrank_back(t(g), t(p), rows, cols).numpy().reshape(cols, r)
    np.testing.assert_array_equal(got, back_order(g, p))
    got = gn.lowrank_expand(t(p), t(q), rows, cols).numpy().reshape(rows, cols)
    np.testing.assert_array_equal(got, expand_order(p, q))


@pytest.mark.parametrize("rows, cols, r", SHAPES)
def test_compensation_and_residual_in_the_same_passes(rows, cols, r):
    """project with a residual: M = g + e written out and P = M q from it, the overflow flag
    untouched for finite g; expand with a residual: out = p q^T and e = M - out over M."""
    g, e, q, p = data(rows, cols, r, seed=1)
    m_out, flag = torch.empty(rows, cols), torch.zeros(1)
    got = gn.lowrank_project(t(g), t(q), rows, cols, residual=t(e), m_out=m_out, nonfinite=flag)
    m = g + e
    np.testing.assert_array_equal(m_out.numpy(), m)
    np.testing.assert_array_equal(got.numpy().reshape(rows, r), project_order(m, q))
    assert flag.item() == 0
    out, m_t = torch.empty(rows, cols), t(m.copy())
    assert gn.lowrank_expand(t(p), t(q), rows, cols, out=out, m=m_t, residual_out=m_t) is out
    np.testing.assert_array_equal(out.numpy(), expand_order(p, q))
    np.testing.assert_array_equal(m_t.numpy(), m - expand_order(p, q))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [0, 37, -1])
def test_the_overflow_flag_is_set_and_never_cleared(bad, where):
    rows, cols, r = 6, 45, 1
    g, e, q, _ = data(rows, cols, r, seed=2)
    flag = torch.zeros(1)
    gn.lowrank_project(t(g), t(q), rows, cols, residual=t(e), m_out=torch.empty(rows, cols), nonfinite=flag)
    gn.lowrank_project(t(g), t(q), rows, cols, nonfinite=flag)
    assert flag.item() == 0
    g.reshape(-1)[where] = bad
    gn.lowrank_project(t(g), t(q), rows, cols, residual=t(e), m_out=torch.empty(rows, cols), nonfinite=flag)
    assert flag.item() == 1
    flag.zero_()
    gn.lowrank_project(t(g), t(q), rows, cols, nonfinite=flag)
    assert flag.item() == 1
    g.reshape(-1)[where] = 0.0  # a finite gradient after: the flag a bucket shares stays set
    gn.lowrank_project(t(g), t(q), rows, cols, nonfinite=flag)
    assert flag.item() == 1


def test_subnormals_are_flushed_in_the_products_only():
    """Products below 1e-38 (a deep net's vanishing gradients times Q) would cost a microcode
    assist each: the products read and write subnormals as zero, while M = g + e and e = M - p
    q^T, which the memory keeps, stay exact."""
    rows, cols = 4, 40
    tiny = F(1e-39)  # subnormal
    g = np.full((rows, cols), tiny, F)
    e = np.full((rows, cols), tiny, F)
    q = np.ones((cols, 1), F)
    m_out = torch.empty(rows, cols)
    p = gn.lowrank_project(t(g), t(q), rows, cols, residual=t(e), m_out=m_out)
    np.testing.assert_array_equal(m_out.numpy(), g + e)  # 2e-39: exact
    assert (p.numpy() == 0).all()  # the products read M's subnormals as zero
    np.testing.assert_array_equal(gn.lowrank_back(t(g), t(np.ones((rows, 1), F)), rows, cols).numpy(), 0)
    out, m = torch.empty(rows, cols), t(g + e)
    gn.lowrank_expand(t(np.full((rows, 1), F(1e-20))), t(np.full((cols, 1), F(1e-20))), rows, cols, out=out,
                      m=m, residual_out=m)
    assert (out.numpy() == 0).all()  # 1e-40 flushed
    np.testing.assert_array_equal(m.numpy(), g + e)  # the residual keeps every subnormal


def test_refusals_name_the_problem():
    g, e, q, p = data(4, 8, 1)
    with pytest.raises(ValueError, match="4 x 9 matrix"):
        gn.lowrank_project(t(g), t(q), 4, 9)
    with pytest.raises(ValueError, match="8 x r factor"):
        gn.lowrank_project(t(g), t(q[:5]), 4, 8)
    with pytest.raises(NativeUnavailable, match="float32"):
        gn.lowrank_back(t(g.astype(np.float64)), t(p), 4, 8)
    with pytest.raises(ValueError, match="one float32 element"):
        gn.lowrank_project(t(g), t(q), 4, 8, nonfinite=torch.zeros(2))
    with pytest.raises(ValueError, match="elements"):
        gn.lowrank_expand(t(p), t(q), 4, 8, out=torch.empty(3, 8))
    if torch.cuda.is_available() and gn.available("cuda"):  # CPU kernels (a GPU has its BLAS)
        with pytest.raises(NativeUnavailable):
            gn.lowrank_back(t(g).cuda(), t(p).cuda(), 4, 8)
