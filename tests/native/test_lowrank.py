"""PowerSGD's products (grace.native.lowrank_project_many, lowrank_back_many,
lowrank_expand_many, and their one-matrix forms; CPU) against NumPy float32 code that sums in
the kernels' documented order: equal bit for bit, whatever the number of threads (and, through
test_build's reruns, whatever the build), and a bucket's matrices in one call each as alone.
Subnormals are flushed in the products only; the compensation and the residual stay exact."""
from __future__ import annotations

import numpy as np
import pytest

import grace.native as gn
from grace.core.buffers import Pieces
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


@pytest.mark.parametrize("rows, cols, r", SHAPES)
def test_a_deferred_residual_is_subtracted_in_the_compensating_pass(rows, cols, r, threads):
    """project with a residual e = m - p' q'^T left unmade (``deferred``): M = g + (m - p' q'^T)
    written out, bit for bit the M of e made by expand first (p' q'^T as expand makes it,
    subnormal products flushed: p' holds tiny values), and P = M q from it."""
    g, m, q, _ = data(rows, cols, r, seed=2)
    _, _, dq, dp = data(rows, cols, r, seed=3)
    dp[::2] *= F(1e-30)  # (their products with dq are subnormal: flushed to zero)
    e = torch.empty(rows, cols)
    gn.lowrank_expand(t(dp), t(dq), rows, cols, m=t(m), residual_out=e)
    made = torch.empty(rows, cols)
    want = gn.lowrank_project(t(g), t(q), rows, cols, residual=e, m_out=made)
    m_out, flag = torch.empty(rows, cols), torch.zeros(1)
    got = gn.lowrank_project(t(g), t(q), rows, cols, residual=t(m), m_out=m_out, nonfinite=flag,
                             deferred=(t(dp), t(dq)))
    assert torch.equal(m_out, made) and torch.equal(got, want) and flag.item() == 0
    normal = np.abs(expand_order(dp, dq)) >= np.finfo(F).tiny
    np.testing.assert_array_equal(m_out.numpy()[normal], (g + (m - expand_order(dp, dq)))[normal])
    in_place = t(m.copy())  # (M may be written over the residual it is made from)
    gn.lowrank_project(t(g), t(q), rows, cols, residual=in_place, m_out=in_place, deferred=(t(dp), t(dq)))
    assert torch.equal(in_place, made)


@pytest.mark.parametrize("r", [1, 3])
@pytest.mark.parametrize("q_kind", ["normal", "subnormal", "large"])
def test_a_deferred_residual_made_in_the_pass_is_flushed_as_expand_flushes_it(r, q_kind, threads):
    """The pass makes p' q'^T itself, without the flush, where no product nor sum of them can be
    subnormal, and apart, flushed, elsewhere: rows of p' whose products with q' straddle the
    smallest normal float, rows holding a subnormal (its products normal where q' is large), q'
    holding one, the gradient holding subnormals (kept exact in M): M and P bit for bit those of
    the residual made by expand first."""
    rows, cols = 12, 70
    g, m, q, _ = data(rows, cols, r, seed=4)
    _, _, dq, dp = data(rows, cols, r, seed=5)

    def tiny_row(i, scale):  # (g's and m's rows i scaled alike)
        g[i] *= F(scale)
        m[i] *= F(scale)

    dp[1::4] *= F(1e-37)  # products from about 1e-39 (subnormal) to 1e-37, in rows as small
    tiny_row(slice(1, None, 4), 1e-37)
    dp[2::4] *= F(1e-31)  # products near 2^-102: normal, and made apart where below it
    dp[3, 0] = F(3e-39)  # a subnormal factor
    g[::3, 5:9] = F(2e-39)
    tiny_row(0, 1e-37)
    if q_kind == "subnormal":  # 1e30 times it: 1e-9 where it is not read as zero
        dq[7, 0] = F(-1e-39)
        dp[6], dp[6, 0] = 0, F(1e30)
        tiny_row(6, 1e-8)
    elif q_kind == "large":  # a subnormal p' times 1e12: 3e-27 where it is not read as zero
        dq *= F(1e12)
        dp[8], dp[8, 0] = 0, F(3e-39)
        tiny_row(8, 1e-31)
    if r > 1:  # normal products whose sum cancels to a subnormal (2^-110 - 2^-110 (1 + 2^-23))
        dp[5] = 0
        dp[5, :2] = (2.0 ** -55, -2.0 ** -55)
        dq[:3, 0], dq[:3, 1] = 2.0 ** -55, F(2.0 ** -55) * F(1 + 2.0 ** -23)
        tiny_row(5, 1e-38)
    e, made = torch.empty(rows, cols), torch.empty(rows, cols)
    gn.lowrank_expand(t(dp), t(dq), rows, cols, m=t(m), residual_out=e)
    assert (e.numpy() != m - expand_order(dp, dq)).any()  # (some products flushed by expand)
    want = gn.lowrank_project(t(g), t(q), rows, cols, residual=e, m_out=made)
    m_out = t(m.copy())
    got = gn.lowrank_project(t(g), t(q), rows, cols, residual=m_out, m_out=m_out, deferred=(t(dp), t(dq)))
    assert torch.equal(m_out, made) and torch.equal(got, want)


@pytest.mark.parametrize("rows, cols", [(12, 70), (6, 64), (4, 7)])
@pytest.mark.parametrize("q_kind", ["normal", "tiny", "large", "subnormal", "cancelling"])
def test_products_made_in_the_compensating_pass_are_flushed_as_made_apart(rows, cols, q_kind, threads):
    """project with a residual makes M q from the registers that store M where no product nor sum
    can be subnormal, and from M read back, flushed, elsewhere: rows of normal values, of
    subnormals, of values whose products with q straddle the smallest normal float; q normal, tiny
    (1e-6: the bound grows), large (1e9 and more: the bound is the smallest normal float, and a
    subnormal m times q is normal), holding a subnormal (read as zero, also against an inf), or
    making two normal products of a row cancel to a subnormal. P bit for bit that of project over
    M alone."""
    g, e, q, _ = data(rows, cols, 1, seed=6)
    scale = np.ones((rows, 1), F)
    scale[1::3] = F(1e-33)  # products with q near 1e-33 .. 1e-39
    scale[2::3] = F(1e-38)  # subnormal sums
    g, e = g * scale, e * scale
    col = min(3, cols - 1)
    if q_kind == "tiny":
        q *= F(1e-6)
    elif q_kind == "large":  # (a row of one subnormal m: 2e-30 where it is not read as zero)
        q = (np.sign(q) * (np.abs(q) + 1) * F(1e9)).astype(F)
        g[0], e[0], g[0, col] = 0, 0, F(2e-39)
    elif q_kind == "subnormal":  # (a row whose one term meets it, large: 1e-9 unless it reads as zero)
        q[col, 0] = F(1e-39)
        g[0], e[0], g[0, col] = 0, 0, F(1e30)
        g[1], e[1], g[1, col] = 0, 0, np.inf  # (NaN where it reads as zero)
    elif q_kind == "cancelling":  # 2^-110 - 2^-110 (1 + 2^-23) in one lane (or the tail's sum)
        j, k = (0, 32) if cols >= 64 else (0, 1)
        q[j, 0], q[k, 0] = 2.0 ** -55, F(2.0 ** -55) * F(1 + 2.0 ** -23)
        g[0], e[0] = 0, 0
        g[0, j], g[0, k] = 2.0 ** -55, -2.0 ** -55
    m_out = torch.empty(rows, cols)
    got = gn.lowrank_project(t(g), t(q), rows, cols, residual=t(e), m_out=m_out)
    np.testing.assert_array_equal(m_out.numpy(), g + e)
    np.testing.assert_array_equal(got.numpy(), gn.lowrank_project(m_out, t(q), rows, cols).numpy())


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
    with pytest.raises(ValueError, match="must be 4 x 1 and 8 x 1"):
        gn.lowrank_project(t(g), t(q), 4, 8, residual=t(e), m_out=torch.empty(4, 8), deferred=(t(p), t(q[:4])))
    with pytest.raises(ValueError, match="need the residual"):
        gn.lowrank_project_many([t(g)], [t(q)], [(4, 8)], [None], [None], deferred=[(t(p), t(q))])
    with pytest.raises(ValueError, match="need the residual"):
        gn.lowrank_project(t(g), t(q), 4, 8, deferred=(t(p), t(q)))
    if torch.cuda.is_available() and gn.available("cuda"):  # CPU kernels (a GPU has its BLAS)
        with pytest.raises(NativeUnavailable):
            gn.lowrank_back(t(g).cuda(), t(p).cuda(), 4, 8)


def unit_order(p: np.ndarray) -> np.ndarray:
    """p / |p| as lowrank_back's ``unit`` makes it: the squares summed in float64 in order, each
    quotient rounded once to float32; the first unit vector where p is zero."""
    squares = 0.0
    for v in p.reshape(-1):
        squares += float(v) * float(v)
    norm = np.sqrt(squares)
    return np.eye(len(p), 1, dtype=F) if norm == 0 else (p.astype(np.float64) / norm).astype(F)


def test_a_buckets_matrices_in_one_call_each_as_alone(threads):
    """Every shape at once, some with a residual and some without, in one call per product (the
    small matrices one per thread, side by side; a large one with its rows shared): each
    matrix's results are its one-matrix call's, bit for bit; a NaN in one small matrix raises the
    bucket's flag."""
    every = SHAPES + [(600, 500, 2)]
    made = [data(rows, cols, r, seed=i) for i, (rows, cols, r) in enumerate(every)]
    shapes = [(rows, cols) for rows, cols, _ in every]
    with_residual = [i % 2 == 0 for i in range(len(every))]
    m_outs = [torch.empty(rows, cols) for rows, cols in shapes]
    flag = torch.zeros(1)
    ps = gn.lowrank_project_many([t(g) for g, _, _, _ in made], [t(q) for _, _, q, _ in made], shapes,
                                 [t(e) if w else None for (_, e, _, _), w in zip(made, with_residual)],
                                 [o if w else None for o, w in zip(m_outs, with_residual)], flag)
    assert flag.item() == 0
    for (g, e, q, _), (rows, cols), w, p, m_out in zip(made, shapes, with_residual, ps, m_outs):
        m = g + e if w else g
        if w:
            np.testing.assert_array_equal(m_out.numpy(), m)
        np.testing.assert_array_equal(p.numpy().reshape(rows, -1), project_order(m, q))
    qs = gn.lowrank_back_many([t(g) for g, _, _, _ in made], [t(p) for _, _, _, p in made], shapes)
    for (g, _, _, p), (rows, cols), q in zip(made, shapes, qs):
        np.testing.assert_array_equal(q.numpy().reshape(cols, -1), back_order(g, p))
    outs = [torch.empty(rows, cols) if w else None for (rows, cols), w in zip(shapes, with_residual)]
    residuals = [t(g.copy()) for g, _, _, _ in made]
    qs = [t(q) for _, _, q, _ in made]
    got, divided = gn.lowrank_expand_many([t(p) for _, _, _, p in made], qs, shapes, outs, 3.0, residuals,
                                          [r if w else None for r, w in zip(residuals, with_residual)])
    for (g, _, q, p), w, out, approx, q_after, residual in zip(made, with_residual, outs, got, divided, residuals):
        assert approx is out if w else out is None
        np.testing.assert_array_equal(q_after.numpy().reshape(q.shape), q / F(3.0))  # the state kept
        want = expand_order(p, q / F(3.0))
        np.testing.assert_array_equal(approx.numpy().reshape(want.shape), want)
        np.testing.assert_array_equal(residual.numpy(), g - want if w else g)
    made[3][0][1, 2] = np.nan
    gn.lowrank_project_many([t(g) for g, _, _, _ in made], [t(q) for _, _, q, _ in made], shapes, nonfinite=flag)
    assert flag.item() == 1


def test_kept_lists_give_each_call_their_own_buffers():
    """Lists an exchange keeps (``Pieces``: their buffers, checks and C arrays derived once, kept
    with them) give what plain lists give, call after call with new values written into the same
    tensors, and a new kept list of other tensors its own, not the first one's."""
    shapes = [(4, 8), (5, 3), (6, 33)]

    def products(gs, es, qs, ps, pairs, outs, as_given):
        m_outs, p_into, q_into, approx_outs = (as_given(x) for x in outs)
        first = gn.lowrank_project_many(as_given(gs), as_given(qs), shapes, as_given(es), m_outs,
                                        deferred=as_given(pairs), p_into=p_into)
        back = gn.lowrank_back_many(m_outs, as_given(ps), shapes, q_into=q_into)
        approx, _ = gn.lowrank_expand_many(as_given(ps), q_into, shapes, approx_outs, 2.0)
        return [x.numpy().copy() for x in (*m_outs, *first, *back, *approx)]

    def outputs():
        return ([torch.empty(rows, cols) for rows, cols in shapes], [torch.empty(rows, 1) for rows, _ in shapes],
                [torch.empty(cols, 1) for _, cols in shapes], [torch.empty(rows, cols) for rows, cols in shapes])

    for seed in (0, 10):  # (a new kept list: its own buffers)
        made = [data(rows, cols, 1, seed=seed + i) for i, (rows, cols) in enumerate(shapes)]
        gs, es, qs, ps = ([t(d[k]) for d in made] for k in range(4))
        pairs, kept = list(zip(ps, qs)), {}

        def keep(xs):  # (the same Pieces for the same list, step after step)
            return kept.setdefault(tuple(map(id, xs)), Pieces(xs))

        kept_outs, plain_outs = outputs(), outputs()
        for step in range(3):  # (the same kept tensors, new values)
            for x in gs + es:
                x.mul_(1.5)
            want = products(gs, es, qs, ps, pairs, plain_outs, list)
            for got, w in zip(products(gs, es, qs, ps, pairs, kept_outs, keep), want):
                np.testing.assert_array_equal(got, w)


def test_an_expand_past_the_caches_writes_the_same_rows(threads):
    """A bucket whose outputs pass the kernels' streaming size (kStreamBytes, 8 MB) writes them
    with streaming stores where a row starts 16-byte aligned (odd column counts: rows of both
    kinds), with and without a residual: the same values as the order they are summed in."""
    shapes = [(1024, 1031, 1), (1040, 1026, 2)]
    assert 4 * sum(rows * cols for rows, cols, _ in shapes) >= 8 << 20
    made = [data(rows, cols, r, seed=i) for i, (rows, cols, r) in enumerate(shapes)]
    outs = [torch.full((rows, cols), np.nan) for rows, cols, _ in shapes]
    residuals = [t(g.copy()) for g, _, _, _ in made]
    with_residual = [False, True]
    gn.lowrank_expand_many([t(p) for _, _, _, p in made], [t(q) for _, _, q, _ in made],
                           [(rows, cols) for rows, cols, _ in shapes], outs, 1.0, residuals,
                           [r if w else None for r, w in zip(residuals, with_residual)])
    for (g, _, q, p), out, residual, w in zip(made, outs, residuals, with_residual):
        want = expand_order(p, q)
        np.testing.assert_array_equal(out.numpy(), want)
        np.testing.assert_array_equal(residual.numpy(), g - want if w else g)


def test_a_first_product_past_the_caches_streams_the_same_m(threads):
    """A bucket whose Ms pass the streaming size (8 MB) writes them with streaming stores where
    the product is made in the same pass (rank 1, rows 16-byte aligned), small matrices too: M and
    P bit for bit those of each matrix alone (below that size, stored), with deferred residuals
    (made in the pass, and first where a factor is subnormal), rows whose columns are not a
    multiple of 4, rows of subnormal sums (their products made again, from their sums made again:
    a streamed M is not read back) and an M written over its residual."""
    shapes = [(1024, 1028), (1030, 1027), (1000, 1100), (64, 512)]
    assert 4 * sum(rows * cols for rows, cols in shapes) >= 8 << 20 > 4 * max(rows * cols for rows, cols in shapes)
    made = [data(rows, cols, 1, seed=10 + i) for i, (rows, cols) in enumerate(shapes)]
    made[0][0][5], made[0][1][5] = F(1e-39), F(0.0)  # (M's row 5 subnormal)
    small, small_dq = made[3], made[3][2] * F(0.5)
    small[0][[5, 7]], small[1][[5, 7]], small[3][5] = F(1e-39), F(0.0), F(0.0)  # (M's rows 5 and 7 subnormal,
    small[3][7] = F(3e-39)  # row 7's deferred factor too: its approximation made first, flushed)
    small[0][9, 0], small[1][9, 0], small_dq[0] = F(1e-39), F(0.0), F(0.0)  # (row 9: one subnormal, the rest
    deferred = [None, None, (t(made[2][3]), t(made[2][2] * F(0.5))), (t(small[3]), t(small_dq))]  # less p' q'^T)
    in_place = [False, False, True, False]

    def run(indices):
        ms = [t(made[i][1].copy()) if in_place[i] else torch.full(shapes[i], np.nan) for i in indices]
        residuals = [m if in_place[i] else t(made[i][1]) for m, i in zip(ms, indices)]
        ps = gn.lowrank_project_many([t(made[i][0]) for i in indices], [t(made[i][2]) for i in indices],
                                     [shapes[i] for i in indices], residuals, ms, None,
                                     [deferred[i] for i in indices] if any(deferred[i] for i in indices) else None)
        return ms, ps

    together = run(range(len(shapes)))
    alone = [run([i]) for i in range(len(shapes))]
    for i, (g, e, q, _) in enumerate(made):
        assert torch.equal(together[0][i], alone[i][0][0]) and torch.equal(together[1][i], alone[i][1][0])
        if deferred[i] is None:
            np.testing.assert_array_equal(together[0][i].numpy(), g + e)
        normal = ~np.isin(np.arange(shapes[i][0]), {0: [5], 3: [5, 7, 9]}.get(i, []))  # (flushed: as alone, above)
        np.testing.assert_array_equal(together[1][i].numpy()[normal], project_order(together[0][i].numpy(), q)[normal])


@pytest.mark.parametrize("column", ["normal", "zero", "tiny", "huge", "one"])
def test_back_makes_one_column_a_unit_vector_first(column):
    """``unit``: a P of one column becomes p / |p| in place before Q = M^T p (the squares in
    float64, so a vanishing gradient's P, whose float32 squares underflow, keeps its direction);
    zero gives the first unit vector, as QR does. Several columns are left to the caller."""
    rows, cols = (1, 5) if column == "one" else (40, 9)
    g, _, _, p = data(rows, cols, 1, seed=3)
    p = {"normal": p, "zero": np.zeros_like(p), "tiny": p * F(1e-25), "huge": p * F(1e30), "one": -p}[column]
    got = t(p.copy())
    q = gn.lowrank_back(t(g), got, rows, cols, unit=True)
    want = unit_order(p)
    np.testing.assert_array_equal(got.numpy(), want)
    assert abs(np.linalg.norm(want.astype(np.float64)) - 1) < 1e-6
    np.testing.assert_array_equal(q.numpy().reshape(cols, 1), back_order(g, want))
    several = t(data(rows, cols, 2, seed=4)[3])
    kept = several.clone()
    gn.lowrank_back(t(g), several, rows, cols, unit=True)
    assert torch.equal(several, kept)
