"""The fused error-feedback steps against the pipeline they replace, on the NumPy backend:

    p = ResidualMemory.compensate(g, e); payload = compress(p); e' = p - decompress(payload)
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import grace
import grace.native as gn
from grace.backends import get_backend
from grace.core import bucket as frames
from grace.core.buffers import Pieces
from grace.core.compressor import TensorInfo
from grace.core.plans.kernels import kernels_of
from tests.native.conftest import BIG, NX, SIZES, device, gradient, host, on, same_bytes, torch  # noqa: F401

INFO = TensorInfo("w", 0, 1)
MEMORIES = [(1.0, 1.0), (0.9, 1.0), (1.0, 0.1), (0.5, 3.0)]


def pipeline(compression, g, e):
    memory, compressor = compression.memory, compression.compressor
    p = memory.compensate(NX, g, e)
    payload, ctx = compressor.compress(NX, p, INFO)
    return payload, memory.update(NX, p, compressor.decompress(NX, payload, ctx), e)


def residual_memory(beta, gamma):
    return grace.ResidualMemory(beta=beta, gamma=gamma)


@pytest.mark.parametrize("n", SIZES + [BIG])
@pytest.mark.parametrize("beta,gamma", MEMORIES)
def test_topk_ef_step_equals_memory_and_topk(device, n, beta, gamma):
    g, e = gradient(n, seed=n), gradient(n, seed=n + 7) * np.float32(0.3)
    ratio = 0.01
    compression = grace.topk(ratio, memory=residual_memory(beta, gamma))
    (want_values, want_idx), want_e = pipeline(compression, g, e)
    k = min(n, max(1, math.ceil(ratio * n)))
    values, idx, new_e = gn.topk_ef_step(on(device, g), on(device, e), k, beta=beta, gamma=gamma)
    assert new_e.device.type == device
    same_bytes(want_idx, idx, "indices")
    same_bytes(want_values, values, "values")
    same_bytes(want_e, new_e, "new residual")


@pytest.mark.parametrize("n", SIZES + [BIG])
@pytest.mark.parametrize("beta,gamma", MEMORIES)
def test_threshold_ef_step_equals_memory_and_threshold(device, n, beta, gamma):
    g, e = gradient(n, seed=n), gradient(n, seed=n + 7) * np.float32(0.3)
    compression = grace.threshold(1.5, memory=residual_memory(beta, gamma))
    (want_values, want_idx), want_e = pipeline(compression, g, e)
    values, idx, new_e = gn.threshold_ef_step(on(device, g), on(device, e), 1.5, beta=beta, gamma=gamma)
    same_bytes(want_idx, idx, "indices")
    same_bytes(want_values, values, "values")
    same_bytes(want_e, new_e, "new residual")


def test_ef_step_in_place(device):
    g, e = gradient(5000, 1), gradient(5000, 2)
    want = gn.topk_ef_step(on(device, g), on(device, e), 50)
    r = on(device, e.copy())
    got = gn.topk_ef_step(on(device, g), r, 50, out=r)
    assert got[2].data_ptr() == r.data_ptr()
    for a, b in zip(want, got):
        same_bytes(a, b)
    r = on(device, e.copy())
    got = gn.threshold_ef_step(on(device, g), r, 1.0, out=r)
    for a, b in zip(gn.threshold_ef_step(on(device, g), on(device, e), 1.0), got):
        same_bytes(a, b)


def test_ef_step_keeps_negative_zero_as_the_pipeline(device):
    g = np.array([-0.0, 0.0, -0.0, 5.0, -0.0, -2.0, 1.0], np.float32)
    e = np.array([-0.0, -0.0, 0.0, 0.0, -0.0, -0.0, 0.0], np.float32)
    for k in (1, 3, 7):  # no ties at the boundary (the pure path breaks them in any order)
        (want_v, want_i), want_e = pipeline(grace.topk(k / 7), g, e)
        v, i, new_e = gn.topk_ef_step(on(device, g), on(device, e), k)
        same_bytes(want_i, i)
        same_bytes(want_v, v)
        same_bytes(want_e, new_e)


def _topk_ef_reference(g, e, k, beta=1.0, gamma=1.0):
    """p = gamma g + beta e; the k largest |p|, ties to the lowest index, ascending; p with them
    zeroed."""
    p = (g if gamma == 1 else g * np.float32(gamma)) + (e if beta == 1 else e * np.float32(beta))
    key = np.abs(p).view(np.uint32) & np.uint32(0x7FFFFFFF)  # NaN above every number, as the kernel orders
    idx = np.sort(np.lexsort((np.arange(p.size), -key.astype(np.int64)))[:k])
    new_e = p.copy()
    new_e[idx] = p[idx] - (np.float32(0) + p[idx])
    return p[idx], idx, new_e


def _misleading_samples(n):
    """Gradients on which a sample of whole cache lines (one in 17) misjudges the k-th largest."""
    rng = np.random.default_rng(3)
    sampled = (np.arange(n) // 16) % 17 == 0  # the lines the kernel samples
    noise = rng.standard_normal(n).astype(np.float32)
    big_where_sampled = np.where(sampled, 100 * noise, noise * 1e-3).astype(np.float32)
    big_elsewhere = np.where(sampled, noise * 1e-3, 100 * noise).astype(np.float32)
    sparse = np.zeros(n, np.float32)
    sparse[rng.choice(n, 40, replace=False)] = rng.standard_normal(40)
    ties = np.round(noise * 4).astype(np.float32)  # few magnitudes: long ties at the boundary
    with_nan = noise.copy()
    with_nan[[5, n // 3, n - 1]] = np.nan
    # rows of 512 (a multiple of 16 lines) where a few columns carry the large values: a
    # sample at a fixed offset in each run of 16 lines would see the same columns in every row
    columns = noise * np.float32(1e-3)
    columns[np.arange(n) % 512 % 61 == 7] *= 1e5
    return {"big where sampled": big_where_sampled, "big elsewhere": big_elsewhere, "sparse": sparse,
            "ties": ties, "nan": with_nan, "gaussian": noise, "columns": columns}


@pytest.mark.parametrize("case", list(_misleading_samples(256)))
@pytest.mark.parametrize("in_place", [False, True], ids=["new", "in-place"])
def test_topk_ef_step_is_exact_where_a_sample_misleads(case, in_place):
    """The CPU kernel bounds the k-th largest from a sample; wherever the sample misleads, the
    result is still exactly the k largest, ties to the lowest index (and in place too)."""
    n = 2**16 + 3
    g = _misleading_samples(n)[case]
    e = np.random.default_rng(9).standard_normal(n).astype(np.float32) * np.float32(1e-4)
    for k in (1, 656, 5000):
        want = _topk_ef_reference(g, e, k)
        r = e.copy()
        got = gn.topk_ef_step(g, r, k, out=r if in_place else None)
        if in_place:
            assert np.shares_memory(got[2], r)
        for what, a, b in zip(("values", "indices", "new residual"), want, got):
            np.testing.assert_array_equal(np.asarray(a).astype(np.asarray(b).dtype), b, err_msg=f"{case} k={k} {what}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_topk_ef_step_is_exact_whatever_the_threads(threads):
    """The sampled path on several threads: each samples its share of the lines, collects its
    chunk's candidates and writes its own of the k largest; the ties at the boundary taken
    chunk after chunk. Exactly the k largest, ties to the lowest index, on any number."""
    n = 2**19 + 3  # (three chunks of the kernel's least per thread)
    cases = _misleading_samples(n)
    e = np.random.default_rng(9).standard_normal(n).astype(np.float32) * np.float32(1e-4)
    gn.set_num_threads(threads)
    try:
        for case in ("gaussian", "ties", "nan"):
            for k in (1, 9000, 40000):
                want = _topk_ef_reference(cases[case], e, k)
                got = gn.topk_ef_step(cases[case], e.copy(), k)
                for what, a, b in zip(("values", "indices", "new residual"), want, got):
                    np.testing.assert_array_equal(np.asarray(a).astype(np.asarray(b).dtype), b,
                                                  err_msg=f"{case} k={k} {what}")
    finally:
        gn.set_num_threads(0)


@pytest.mark.parametrize("beta,gamma", [(0.9, 1.0), (1.0, 0.5), (0.9, 0.5)])
def test_topk_ef_step_scales_both_terms_on_every_path(beta, gamma):
    """p = gamma g + beta e on the sampled path (large tensors) and the exact one (small)."""
    for n in (5000, 2**16 + 3):
        g = _misleading_samples(n)["gaussian"]
        e = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        for k in (1, n // 100):
            want = _topk_ef_reference(g, e, k, beta, gamma)
            got = gn.topk_ef_step(g, e, k, beta=beta, gamma=gamma)
            for what, a, b in zip(("values", "indices", "new residual"), want, got):
                np.testing.assert_array_equal(np.asarray(a).astype(np.asarray(b).dtype), b,
                                              err_msg=f"n={n} k={k} {what}")


def test_a_bucket_in_one_call_equals_each_gradient_alone():
    """The CPU's bucket-at-once entry points: topk_ef_step_many and threshold_ef_step_many are
    topk_ef_step and threshold_ef_step on each gradient (new residuals written into the given
    outputs; threshold's counts differ per gradient: the int16 indices of 300 and the int32
    ones of the rest in their own buffers), scatter_add_segments_into is
    each gradient's scatter_add_many of the values divided by the number of ranks."""
    sizes = [1, 9, 300, 40000, 2**16 + 3]
    gs = [torch.from_numpy(gradient(n, seed=n)) for n in sizes]
    rs = [torch.from_numpy(gradient(n, seed=n + 1)) * 0.3 for n in sizes]
    ks = [max(1, n // 100) for n in sizes]
    outs = [torch.empty(n) for n in sizes]
    values, indices, new = gn.topk_ef_step_many(gs, rs, ks, beta=0.9, outs=outs)
    for g, r, k, v, i, e, o in zip(gs, rs, ks, values, indices, new, outs):
        want = gn.topk_ef_step(g, r, k, beta=0.9)
        assert e.data_ptr() == o.data_ptr()
        for a, b in zip(want, (v, i, e)):
            same_bytes(a, b)
    outs = [torch.empty(n) for n in sizes]
    values_t, indices_t, new_t = gn.threshold_ef_step_many(gs, rs, [0.8] * len(sizes), beta=0.9, outs=outs)
    for g, r, v, i, e, o in zip(gs, rs, values_t, indices_t, new_t, outs):
        want = gn.threshold_ef_step(g, r, 0.8, beta=0.9)
        assert e.data_ptr() == o.data_ptr()
        for a, b in zip(want, (v, i, e)):
            same_bytes(a, b)
    ranks = 3
    payloads = [[(values[s] * (r + 1), indices[s]) for r in range(ranks)] for s in range(len(sizes))]
    dense = [torch.full((n,), 7.0) for n in sizes]
    assert gn.scatter_add_segments_into(payloads, dense, ranks) is dense
    for rows, d, n in zip(payloads, dense, sizes):
        same_bytes(gn.scatter_add_many([(v / ranks, i) for v, i in rows], n), d)


VARIABLE_SIZES = [1, 300, 40000, 2**16 + 3]


def _variable_bucket_call(method, into):
    """A variable-length bucket call (threshold's or DGC's) over VARIABLE_SIZES, from the same
    gradients and memories each time: its (values, indices)."""
    sizes = VARIABLE_SIZES
    gs = [torch.from_numpy(gradient(n, seed=n)) for n in sizes]
    e = [torch.from_numpy(gradient(n, seed=n + 1)) * 0.3 for n in sizes]
    if method == "threshold":
        return gn.threshold_ef_step_many(gs, e, [0.8] * len(sizes), beta=0.9, into=into)[:2]
    v = [t.clone() for t in e]
    return gn.dgc_step_many(gs, e, v, 0.9, 0.05, 0.1, [(s, 3) for s in range(len(sizes))], e, v, into=into)


@pytest.mark.parametrize("method", ["threshold", "dgc"])
def test_a_bucket_calls_pieces_copied_where_into_lays_them_are_its_views_bytes(method):
    """A variable-length bucket call with ``into`` (the exchange's frame): ``into`` is asked once,
    with each gradient's (values, indices) dtypes and the counts the call made; every piece is
    copied to the offset it names (here in reverse order, aligned, with gaps), as the bytes of
    the views the same call hands back without ``into``; nothing else is written, and the
    payloads are Nones."""
    sizes = VARIABLE_SIZES
    run = functools.partial(_variable_bucket_call, method)
    values, indices = run(None)
    pieces = [t for pair in zip(values, indices) for t in pair]
    sizes_in_bytes = [t.numel() * t.element_size() for t in pieces]
    slots = [n + 8 + -n % 8 for n in sizes_in_bytes]  # (gaps of 8 bytes or more, each piece aligned)
    offsets = list(np.cumsum([0] + slots[::-1])[:-1][::-1])
    frame = torch.full((sum(slots),), 0xAB, dtype=torch.uint8)
    asked = []

    def into(dtypes, counts):
        asked.append((list(dtypes), list(counts)))
        return frame, [int(o) for o in offsets], {}

    assert run(into) == ([None] * len(sizes), [None] * len(sizes))
    assert asked == [([str(t.dtype).removeprefix("torch.") for t in pieces], [t.numel() for t in pieces])]
    assert min(t.numel() for t in values) > 0  # (each gradient sends some)
    written = torch.zeros_like(frame, dtype=torch.bool)
    for t, at, n in zip(pieces, offsets, sizes_in_bytes):
        same_bytes(t.view(torch.uint8), frame[at:at + n])
        written[at:at + n] = True
    assert bool((frame[~written] == 0xAB).all())


def test_dgc_rooms_kept_with_kept_outputs_are_made_again_for_another_k():
    """The pair rooms a DGC bucket call keeps with a kept list of outputs (an exchange's spares,
    where ``into`` copies the pairs out) serve the calls of one layout and are made again where k
    changes, grown included (a warm-up's ratio; a checkpoint of an earlier step restored): the
    pieces copied into ``into`` are byte for byte those of a call with plain lists (new rooms)."""
    sizes = VARIABLE_SIZES
    gs = [torch.from_numpy(gradient(n, seed=n)) for n in sizes]
    e = [torch.from_numpy(gradient(n, seed=n + 1)) * 0.3 for n in sizes]
    kept_u, kept_v = Pieces([t.clone() for t in e]), Pieces([t.clone() for t in e])

    def framed(u, v, ratio):  # (the memories start from e at each call; the pairs end to end, 8-byte aligned)
        for out, start in zip([*u, *v], e + e):
            out.copy_(start)
        frame = torch.zeros(8 * sum(sizes) + 8 * 2 * len(sizes), dtype=torch.uint8)

        def into(dtypes, counts):
            ends = np.cumsum([-(-c * frames.ITEMSIZE[d] // 8) * 8 for d, c in zip(dtypes, counts)])
            return frame, [0, *map(int, ends[:-1])], {}
        gn.dgc_step_many(gs, u, v, 0.9, ratio, 0.1, [(s, 3) for s in range(len(sizes))], u, v, into=into)
        return frame

    rooms = []
    for ratio in (0.01, 0.01, 0.2, 0.05, 0.3):
        same_bytes(framed(kept_u, kept_v, ratio), framed([t.clone() for t in e], [t.clone() for t in e], ratio))
        rooms.append(kept_u.derived["rooms"])
    assert rooms[0] is rooms[1] and len({id(r) for r in rooms[1:]}) == 4


@pytest.mark.parametrize("flagged", [False, True], ids=["unflagged", "flagged"])
@pytest.mark.parametrize("method", ["threshold", "dgc"])
def test_a_variable_frame_is_written_whole_as_the_exchange_frames_the_views(method, flagged):
    """Where ``into`` is a ``FrameRoom`` (a variable-length frame's), the call writes the whole
    frame into the buffer the room places: byte for byte the frame the exchange makes of the views
    the same call hands back without it (``frames.frame``: header of counts, pieces widest first,
    the flag's byte, zeros to its end; the flag zero until the exchange writes it). The room is
    told the pieces' dtypes and counts, where they end and the frame's size; a buffer of another
    size is refused before anything is written."""
    run = functools.partial(_variable_bucket_call, method)
    values, indices = run(None)
    pieces = [t for pair in zip(values, indices) for t in pair]
    want = frames.frame(get_backend("torch"), pieces, True, pieces[0], torch.zeros(1) if flagged else None)
    placed = []

    def place(dtypes, counts, end, size):
        placed.append((list(dtypes), list(counts), end, size))
        return buffer[:size]

    buffer = torch.full((want.numel() + 16,), 0xAB, dtype=torch.uint8)
    assert run(gn.FrameRoom(flagged, place)) == ([None] * len(VARIABLE_SIZES), [None] * len(VARIABLE_SIZES))
    assert placed == [([str(t.dtype).removeprefix("torch.") for t in pieces], [t.numel() for t in pieces],
                       8 * len(pieces) + sum(t.numel() * t.element_size() for t in pieces), want.numel())]
    same_bytes(want, buffer[:want.numel()])
    assert bool((buffer[want.numel():] == 0xAB).all())
    cramped = torch.full((want.numel(),), 0xAB, dtype=torch.uint8)
    with pytest.raises(ValueError, match="placed in"):
        run(gn.FrameRoom(flagged, lambda dtypes, counts, end, size: cramped[:size - 8]))
    assert bool((cramped == 0xAB).all())


@pytest.mark.parametrize("order", ["ascending", "repeats", "unordered"])
def test_a_sparse_aggregate_beyond_the_caches_adds_rank_after_rank(order):
    """scatter_add_segments_into over a bucket of more than 8 MB (its blocks summed in the cache
    and streamed out where each rank's indices ascend, repeats included; zeroed and scattered
    otherwise) is NumPy's in-order additions of each rank's values over the ranks: 0 + v first,
    so a -0.0 lands as +0.0; a misaligned output and a one-element gradient alike."""
    rng = np.random.default_rng(11)
    sizes, ranks = [3_000_001, 1, 70_000], 4
    payloads, dense, want = [], [], []
    for n in sizes:
        rows, total = [], np.zeros(n, np.float32)
        for r in range(ranks):
            k = max(1, n // 50)
            idx = rng.integers(0, n, k) if order != "ascending" else rng.choice(n, size=k, replace=False)
            idx = idx if order == "unordered" else np.sort(idx)
            v = gradient(k, seed=r)
            v[::7] = -0.0
            rows.append((torch.from_numpy(v), torch.from_numpy(idx.astype(np.int64 if r % 2 else np.int32))))
            np.add.at(total, idx, v / np.float32(ranks))
        payloads.append(rows)
        want.append(total)
        dense.append(torch.full((n + 1,), 5.0)[1:])  # (4 bytes past an aligned start: not streamed)
    dense[0] = torch.full((sizes[0],), 5.0)
    assert gn.scatter_add_segments_into(payloads, dense, ranks) is dense
    for w, d in zip(want, dense):
        same_bytes(w, d)


@pytest.mark.parametrize("in_place", [False, True], ids=["new", "in-place"])
def test_the_residual_steps_of_a_bucket_beyond_the_caches_stream_alike(in_place):
    """A bucket of more than 8 MB streams its new residuals (threshold's and random-k's bucket
    steps, with the sent elements' p - (0 + v) made before the store): bit for bit ResidualMemory
    + Threshold and + RandomK on NumPy, gradient by gradient; also where a gradient's residual is
    not aligned for streaming, and where random-k's indices do not ascend (stored as before)."""
    from grace.core import draws

    sizes = [2**21 + 5, 9, 1001, 40000]
    gs = [gradient(n, seed=n) for n in sizes]
    gs[1][:4] = [-0.0, 3e38, 2.0, -2.0]
    es = [gradient(n, seed=n + 1) * np.float32(0.3) for n in sizes]

    def residuals():
        rs = [torch.from_numpy(e.copy()) for e in es]
        rs[2] = torch.cat([torch.zeros(1), rs[2]])[1:]  # 4 bytes past an aligned start
        return rs

    rs = residuals()
    outs = rs if in_place else residuals()
    values, indices, news = gn.threshold_ef_step_many([torch.from_numpy(g) for g in gs], rs, [1.5] * len(sizes),
                                                      beta=0.9, outs=outs)
    compression = grace.threshold(1.5, memory=residual_memory(0.9, 1.0))
    for g, e, v, i, new, out in zip(gs, es, values, indices, news, outs):
        (want_v, want_i), want_e = pipeline(compression, g, e)
        same_bytes(want_i, i, "threshold indices")
        same_bytes(want_v, v, "threshold values")
        same_bytes(want_e, new, "threshold residual")
        assert new.data_ptr() == out.data_ptr()

    compression = grace.randomk(0.01, scale=True, memory=residual_memory(1.0, 0.5))
    infos = [TensorInfo(f"w{s}", 3, 1) for s in range(len(sizes))]
    ks = [max(1, math.ceil(0.01 * n)) for n in sizes]
    idx = [torch.from_numpy(draws.random_indices_host([n], [k], [info.seed()])) for n, k, info in zip(sizes, ks, infos)]
    idx[3] = idx[3].flip(0)  # descending: the values follow the indices' order
    rs = residuals()
    outs = rs if in_place else residuals()
    values, news = gn.randomk_ef_step_many([torch.from_numpy(g) for g in gs], rs, idx, 1.0, 0.5,
                                           [n / k for n, k in zip(sizes, ks)], outs=outs)
    for g, e, info, i, v, new in zip(gs, es, infos, idx, values, news):
        p = compression.memory.compensate(NX, g, e)
        (want_v,), (_, want_i) = compression.compressor.compress(NX, p, info)
        order = np.argsort(host(i))
        same_bytes(want_v, host(v)[order], "random-k values")
        want_e = p.copy()
        kernels_of(compression.compressor).residual_into(NX, p, (want_v,), (None, want_i), want_e)
        same_bytes(want_e, new, "random-k residual")


@pytest.mark.parametrize("beta, gamma", MEMORIES)
@pytest.mark.parametrize("scale", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("in_place", [False, True], ids=["new", "in-place"])
def test_random_k_residual_steps_of_a_bucket_equal_the_pipeline(beta, gamma, scale, in_place):
    """randomk_ef_step_many (CPU) against ResidualMemory + RandomK on NumPy, gradient by
    gradient, at the indices each gradient draws from its seed: the same values (times d / k
    where scaled) and new memories (p, with p - (0 + v) at the sent indices), bit for bit;
    negative zeros, infs and NaNs included, and the new memories written over the old where
    asked. An index out of range is refused with nothing written."""
    from grace.core import draws

    sizes = [1, 9, 300, 40000, 2**16 + 3]
    compression = grace.randomk(0.01, scale=scale, memory=residual_memory(beta, gamma))
    gs = [gradient(n, seed=n) for n in sizes]
    gs[2][:4] = [-0.0, np.inf, np.nan, -np.inf]
    es = [gradient(n, seed=n + 1) * np.float32(0.3) for n in sizes]
    infos = [TensorInfo(f"w{s}", 5, 1) for s in range(len(sizes))]
    ks = [max(1, math.ceil(0.01 * n)) for n in sizes]
    rs = [torch.from_numpy(e.copy()) for e in es]
    outs = rs if in_place else [torch.empty(n) for n in sizes]
    indices = [torch.from_numpy(draws.random_indices_host([n], [k], [info.seed()]))
               for n, k, info in zip(sizes, ks, infos)]
    values, new = gn.randomk_ef_step_many([torch.from_numpy(g) for g in gs], rs, indices, beta, gamma,
                                          [n / k for n, k in zip(sizes, ks)] if scale else None, outs=outs)
    for g, e, info, v, i, e_new, out in zip(gs, es, infos, values, indices, new, outs):
        memory, compressor = compression.memory, compression.compressor
        p = memory.compensate(NX, g, e)
        (want_v,), (_, want_i) = compressor.compress(NX, p, info)
        want_e = p.copy()
        kernels_of(compressor).residual_into(NX, p, (want_v,), (None, want_i), want_e)
        np.testing.assert_array_equal(host(i), want_i)
        same_bytes(want_v, v)
        same_bytes(want_e, e_new)
        assert e_new.data_ptr() == out.data_ptr()
    before = [o.clone() for o in outs]
    with pytest.raises(IndexError, match="out of range"):
        gn.randomk_ef_step_many([torch.from_numpy(g) for g in gs], rs, [*indices[:-1], indices[-1] + sizes[-1]],
                                beta, gamma, None, outs=outs)
    for a, b in zip(before, outs):
        same_bytes(a, b)  # (nothing written)


@pytest.mark.parametrize("method", ["efsignsgd", "onebit"])
@pytest.mark.parametrize("beta, gamma", MEMORIES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sign_family_residual_steps_of_a_bucket_equal_each_gradients_kernels(method, beta, gamma, threads):
    """efsignsgd_ef_step_many and onebit_ef_step_many (CPU): compensation, the payload and the
    new residual of every gradient, bit for bit those of ResidualMemory.compensate, the
    method's compress kernel and its residual kernel, gradient by gradient (specials too), on
    any number of threads (the bucket's sums and residuals dealt to them, a large gradient's cut)."""
    sizes = [1, 9, 300, 40000, 2**16 + 3, 2**19 + 77]
    many = getattr(gn, f"{method}_ef_step_many")
    compress, residual = getattr(gn, f"{method}_compress"), getattr(gn, f"{method}_residual_into")
    gs = [gradient(n, seed=n) for n in sizes]
    gs[2][:4] = [-0.0, np.inf, np.nan, 3e38]
    es = [gradient(n, seed=n + 1) * np.float32(0.3) for n in sizes]
    outs = [torch.empty(n) for n in sizes]
    gn.set_num_threads(threads)
    try:
        payloads, news = many([torch.from_numpy(g) for g in gs], [torch.from_numpy(e) for e in es], beta, gamma,
                              outs)
    finally:
        gn.set_num_threads(0)
    for g, e, payload, new, out in zip(gs, es, payloads, news, outs):
        with np.errstate(over="ignore"):  # (3e38 * gamma)
            p = torch.from_numpy(residual_memory(beta, gamma).compensate(NX, g, e))
        want = compress(p)
        for a, b in zip(want, payload):
            same_bytes(a, b)
        same_bytes(residual(p, *want, p.clone()), new)
        bit = np.unpackbits(want[0].numpy(), bitorder="little")[:len(g)].astype(bool)
        scalars = want[1].numpy()
        if method == "efsignsgd":
            lo, hi = np.float32(-1.0) * scalars[0], np.float32(1.0) * scalars[0]
        else:  # (1-bit SGD's two means, decoded as mu0 + bit * (mu1 - mu0))
            lo, hi = scalars[0] + np.float32(0.0) * (scalars[1] - scalars[0]), scalars[0] + (scalars[1] - scalars[0])
        with np.errstate(invalid="ignore"):  # (not the residual kernel alone; NaNs as NaNs, whatever their bits)
            np.testing.assert_array_equal(p.numpy() - np.where(bit, hi, lo), new.numpy())
        assert new.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("method", ["efsignsgd", "onebit"])
@pytest.mark.parametrize("beta, gamma", MEMORIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_deferred_sign_residual_is_subtracted_in_the_next_steps_pass(method, beta, gamma, threads):
    """``keep``: the call leaves p in its outputs and keeps the payload's codes (SignCodes); the
    next call, given them as ``deferred`` with those p's, subtracts their decoded values in its
    pass: over three steps the payloads are the plain steps' bit for bit, and each kept p less
    its kept codes' decoding is the plain step's residual (odd sizes: whole bytes and a tail)."""
    sizes = [1, 9, 300, 2**16 + 3, 2**19 + 77]
    many, residual = getattr(gn, f"{method}_ef_step_many"), getattr(gn, f"{method}_residual_into")
    plain = [torch.from_numpy(gradient(n, seed=n + 1) * np.float32(0.3)) for n in sizes]
    kept, codes = [e.clone() for e in plain], None
    gn.set_num_threads(threads)
    try:
        for step in range(3):
            gs = [torch.from_numpy(gradient(n, seed=10 * n + step)) for n in sizes]
            want, plain = many(gs, plain, beta, gamma, [torch.empty(n) for n in sizes])
            got, kept, codes = many(gs, kept, beta, gamma, [torch.empty(n) for n in sizes], deferred=codes,
                                    keep=True)
            for a, b in zip(want, got):
                same_bytes(a[0], b[0])
                same_bytes(a[1], b[1])
            for i, (p, e) in enumerate(zip(kept, plain)):
                bits, scalars = codes.payload(i)
                same_bytes(got[i][0], bits)
                same_bytes(got[i][1], scalars)
                same_bytes(residual(p, bits, scalars, p.clone()), e)
    finally:
        gn.set_num_threads(0)
    with pytest.raises(ValueError, match="deferred codes of 5 gradients"):
        many(gs[:2], kept[:2], beta, gamma, None, deferred=codes)


def test_a_bucket_in_one_call_refuses_what_it_cannot_write():
    g = torch.zeros(40)
    with pytest.raises(gn.NativeUnavailable, match="in place"):
        gn.topk_ef_step_many([g], [g], [2], outs=[torch.zeros(80)[::2]])
    dense = [torch.full((5,), 7.0), torch.full((3,), 7.0)]
    bad = [[(torch.ones(1), torch.tensor([4]))], [(torch.ones(1), torch.tensor([3]))]]  # 3 is out of range for 3
    with pytest.raises(IndexError, match="out of range"):
        gn.scatter_add_segments_into(bad, dense, 1)
    assert all((d == 7).all() for d in dense)  # nothing written


@pytest.mark.parametrize("sample_ratio", [0.02, 1.0])
def test_dgc_steps_do_not_depend_on_the_number_of_threads(sample_ratio):
    """DGC's step on one thread and on several (the sample drawn and read, the pass's chunks, the
    selected ones written, each shared among them): the same values, indices, u and v, a cut to
    k included (few distinct magnitudes)."""
    n = 2**20 + 3
    g = np.round(gradient(n, seed=1) * 4).astype(np.float32) / 4
    u, v = gradient(n, seed=2) * np.float32(0.3), gradient(n, seed=3)
    runs = []
    try:
        for threads in (1, 2, 3):
            gn.set_num_threads(threads)
            tu, tv = torch.from_numpy(u.copy()), torch.from_numpy(v.copy())
            values, indices = gn.dgc_step_many([torch.from_numpy(g)], [tu], [tv], 0.9, 0.01, sample_ratio, [(5, 6)],
                                               [tu], [tv])
            runs.append((values[0], indices[0], tu, tv))
    finally:
        gn.set_num_threads(0)
    assert len(runs[0][1]) == math.ceil(0.01 * n)  # (cut to k)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            same_bytes(a, b)


# gradients above two threads' grain (2 * 2**17 elements) that the buckets below run side by side
# on two threads (each within a thread's share of the bucket)
MIDDLING = [2**18 + 11 * j for j in range(16)]
# a gradient larger than a thread's share of the buckets below (with two threads or three): run in
# turn, its chunks shared by the threads
LARGE = [2**23 + 9]


@pytest.mark.parametrize("sample_ratio", [0.02, 1.0])
def test_dgc_bucket_steps_do_not_depend_on_the_number_of_threads(sample_ratio):
    """DGC's step over a bucket on one thread and on several: its small gradients and middling ones
    (above two threads' grain, within a thread's share) run one per thread side by side, its large
    one in turn with its chunks shared, each gradient's values, indices, u and v the same (cuts to
    k included: few distinct magnitudes)."""
    sizes = [3, 70_000, 2**19 + 5, 1000, 9000, 2**18 + 1, 40_000, 1] + [150_000 + 7 * j for j in range(8)] \
        + MIDDLING + LARGE
    gs = [np.round(gradient(n, seed=n) * 4).astype(np.float32) / 4 for n in sizes]
    us = [gradient(n, seed=n + 1) * np.float32(0.3) for n in sizes]
    vs = [gradient(n, seed=n + 2) for n in sizes]
    runs = []
    try:
        for threads in (1, 2, 3):
            gn.set_num_threads(threads)
            tu, tv = [torch.from_numpy(u.copy()) for u in us], [torch.from_numpy(v.copy()) for v in vs]
            values, indices = gn.dgc_step_many([torch.from_numpy(g) for g in gs], tu, tv, 0.9, 0.01, sample_ratio,
                                               [(s, 6) for s in range(len(sizes))], tu, tv)
            runs.append([values, indices, tu, tv])
    finally:
        gn.set_num_threads(0)
    assert len(runs[0][1][2]) == math.ceil(0.01 * sizes[2])  # (cut to k)
    for run in runs[1:]:
        for field, first in zip(run, runs[0]):
            for a, b in zip(first, field):
                same_bytes(a, b)


BUCKET_STEPS = {  # a bucket call on its gradients, residuals and outputs: every tensor it returns
    "topk": lambda gs, es, outs: gn.topk_ef_step_many(gs, es, [max(1, len(g) // 100) for g in gs], outs=outs),
    "threshold": lambda gs, es, outs: gn.threshold_ef_step_many(gs, es, [1.5] * len(gs), outs=outs),
    "randomk": lambda gs, es, outs: gn.randomk_ef_step_many(
        gs, es, [torch.from_numpy(np.arange(0, len(g), 97)) for g in gs], outs=outs),
    "terngrad": lambda gs, es, outs: gn.compress_many("terngrad", gs, [(s, 1) for s in range(len(gs))]),
    "qsgd": lambda gs, es, outs: gn.compress_many("qsgd", gs, [(s, 1) for s in range(len(gs))], 127, 512),
    "natural": lambda gs, es, outs: gn.compress_many("natural", gs, [(s, 1) for s in range(len(gs))]),
}


@pytest.mark.parametrize("method", sorted(BUCKET_STEPS))
def test_bucket_steps_do_not_depend_on_the_number_of_threads(method):
    """A bucket's steps run its small and middling gradients one per thread, side by side, the
    large ones in turn with their chunks shared: on one thread and on several, the same bytes."""
    sizes = [3, 70_000, 2**19 + 5, 1000, 9000, 40_000, 1] + [150_000 + 7 * j for j in range(8)] + MIDDLING + LARGE
    gs = [torch.from_numpy(gradient(n, seed=n)) for n in sizes]
    es = [torch.from_numpy(gradient(n, seed=n + 1) * np.float32(0.3)) for n in sizes]
    runs = []
    try:
        for threads in (1, 2, 3):
            gn.set_num_threads(threads)
            outs = [torch.empty(n) for n in sizes]
            flat = []
            for field in BUCKET_STEPS[method](gs, es, outs):
                flat.extend(t for item in field for t in (item if isinstance(item, tuple) else (item,)))
            runs.append(flat)
    finally:
        gn.set_num_threads(0)
    assert len(runs[0]) >= len(sizes)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            same_bytes(a, b)


@pytest.mark.parametrize("n", [1, 9, 1001, 2**16 + 3])
@pytest.mark.parametrize("aliased", [False, True], ids=["new", "in-place"])
def test_dgc_compensation_equals_the_tensor_ops(n, aliased):
    """DGC's momentum correction in one pass: p = v + (m u + g) and u = p - v, each rounding as
    NumPy's float32 operations make it (and written over the inputs too)."""
    u, v, g = (gradient(n, seed=n + i) for i in range(3))
    u[: n // 4], v[n // 4: n // 2] = -0.0, np.float32(3e38)  # signed zeros; sums that overflow
    want_p = v + (u * np.float32(0.9) + g)
    want_u = want_p - v
    tu, tv, tg = (torch.from_numpy(t.copy()) for t in (u, v, g))
    u_out, v_out = (tu, tv) if aliased else (torch.empty(n), torch.empty(n))
    got_u, got_p = gn.dgc_compensate_into(tu, tv, tg, 0.9, u_out, v_out)
    assert got_u is u_out and got_p is v_out
    same_bytes(want_p, got_p, "p")
    same_bytes(want_u, got_u, "u")


@pytest.mark.parametrize("ratio, sample_ratio", [(0.01, 0.01), (0.3, 0.05), (0.1, 1.0), (1.0, 0.5)])
@pytest.mark.parametrize("aliased", [False, True], ids=["new", "in-place"])
def test_dgc_steps_of_a_bucket_equal_the_memory_and_selection_on_numpy(ratio, sample_ratio, aliased):
    """dgc_step_many (CPU) against DGCMemory.fused_step with DGC's selection on NumPy, gradient
    by gradient, each with its own rank seed: values, indices (in index_dtype), new u and v, bit
    for bit. Sampled thresholds that select more than k (cut to the k largest, ties to the
    lowest index: a gradient of few distinct magnitudes) or fewer; the whole tensor as the
    sample (sample_ratio 1); signed zeros, infs, NaNs and overflowing sums."""
    from grace.compressors.dgc import DGC
    from grace.core import draws
    from grace.kernels.dgc import DGCFeedback
    from grace.memories import DGCMemory

    sizes = [1, 2, 9, 300, 40000, 2**16 + 3]
    gs = [gradient(n, seed=n) for n in sizes]
    gs[3][:5] = [-0.0, np.inf, np.nan, -np.inf, 3e38]
    gs[4] = np.round(gs[4] * 2).astype(np.float32) / 2  # few distinct magnitudes: ties at the cut
    us = [gradient(n, seed=n + 1) * np.float32(0.3) for n in sizes]
    vs = [gradient(n, seed=n + 2) for n in sizes]
    vs[3][5] = np.float32(3e38)
    infos = [TensorInfo(f"layer{s}.weight", 7, 4, rank=2) for s in range(len(sizes))]
    memory, compressor = DGCMemory(0.9), DGC(ratio, sample_ratio, seed=3)
    tus, tvs = [torch.from_numpy(u.copy()) for u in us], [torch.from_numpy(v.copy()) for v in vs]
    u_outs, v_outs = (tus, tvs) if aliased else ([torch.empty(n) for n in sizes], [torch.empty(n) for n in sizes])
    values, indices = gn.dgc_step_many([torch.from_numpy(g) for g in gs], tus, tvs, 0.9, ratio, sample_ratio,
                                       [draws.seed_words(info.rank_seed(3)) for info in infos], u_outs, v_outs)
    cut = 0
    for g, u, v, info, got_v, got_i, u_out, v_out in zip(gs, us, vs, infos, values, indices, u_outs, v_outs):
        with np.errstate(over="ignore", invalid="ignore"):
            (want_v, want_i), _, (want_u, want_p) = DGCFeedback(memory).fused_step(
                NX, kernels_of(compressor), g, (u, v), info, out=(np.empty_like(u), np.empty_like(v)))
        same_bytes(want_v, got_v, "values")
        same_bytes(want_i, got_i, "indices")
        same_bytes(want_u, u_out, "u")
        same_bytes(want_p, v_out, "v")
        cut += len(want_i) == min(len(g), max(1, math.ceil(ratio * len(g)))) < len(g)
    assert cut or ratio == 1, "no gradient had its selection cut to k"
    with pytest.raises(ValueError, match="ratio"):
        gn.dgc_step_many([torch.ones(3)], [torch.ones(3)], [torch.ones(3)], 0.9, 0.0, 0.1, [(1, 2)],
                         [torch.ones(3)], [torch.ones(3)])


def test_dgc_selection_past_a_sample_of_zeros_equals_the_tensor_ops_on_numpy():
    """A mostly zero tensor (an owner's sum of the ranks' selections, an embedding's gradient)
    whose sample holds fewer nonzeros than it needs, so its threshold is 0, though the tensor
    has more than k of them: dgc_select and a bucket's DGC step (dgc_step_many) pick the k
    largest as the tensor ops do, bit for bit (ties at the cut: few distinct magnitudes)."""
    from grace.compressors.dgc import DGC
    from grace.core import draws
    from grace.kernels.dgc import DGCFeedback
    from grace.memories import DGCMemory

    n, compressor = 50_000, DGC(0.04, 0.01, seed=3)  # k = 2000 of 2500 nonzeros; a sample of 500 needs 20
    x = np.zeros(n, np.float32)
    rng = np.random.default_rng(11)
    x[rng.choice(n, 2500, replace=False)] = np.round(rng.standard_normal(2500) * 4).astype(np.float32) / 4 + 0.5
    x[[5, 6]] = [np.nan, -0.0]
    found = 0
    for j in range(60):  # rank seeds whose sample underestimates: its threshold 0
        info = TensorInfo(f"layer{j}.weight", 2, 4, rank=1)
        drawn = np.floor(NX.uniform(500, info.rank_seed(3), like=x) * n).astype(np.int64)
        if np.count_nonzero(np.abs(x[drawn]) > 0) >= 20:
            continue
        found += 1
        with np.errstate(invalid="ignore"):
            want = compressor.select(NX, x, info)
        same_bytes(want, compressor.select(get_backend("torch"), torch.from_numpy(x.copy()), info), f"seed {j}")
        assert len(want) == 2000
        zeros = np.zeros(n, np.float32)
        with np.errstate(invalid="ignore"):
            (want_v, want_i), _, (want_u, want_p) = DGCFeedback(DGCMemory(0.0)).fused_step(
                NX, kernels_of(compressor), x, (zeros, zeros), info, out=(np.empty_like(x), np.empty_like(x)))
        u, v = torch.zeros(n), torch.zeros(n)
        values, indices = gn.dgc_step_many([torch.from_numpy(x.copy())], [u], [v], 0.0, 0.04, 0.01,
                                           [draws.seed_words(info.rank_seed(3))], [u], [v])
        for a, b, what in ((want_v, values[0], "values"), (want_i, indices[0], "indices"), (want_u, u, "u"),
                           (want_p, v, "v")):
            same_bytes(a, b, f"seed {j} {what}")
    assert found >= 2, "no sample of the mostly zero tensor had a threshold of 0"


@pytest.mark.parametrize("ratio, sample_ratio, warmup", [(0.01, 0.01, 0), (0.04, 0.01, 0), (0.3, 0.05, 0),
                                                         (0.1, 1.0, 0), (1.0, 0.5, 0), (0.01, 0.1, 5)])
def test_dgc_selection_in_one_call_equals_the_tensor_ops_on_numpy(ratio, sample_ratio, warmup, monkeypatch):
    """DGC.select of a CPU torch tensor (one native call, dgc_select) against DGC.select on
    NumPy (the tensor ops), bit for bit: thresholds that select more than k (cut to the k largest,
    ties to the lowest index: few distinct magnitudes; a mostly zero tensor, whose threshold is
    0: its nonzeros and the first zeros) or fewer; the whole tensor as the sample; signed zeros,
    infs and NaNs; an empty tensor; a step of the sparsity warm-up."""
    import grace.native.dgc as native_dgc
    from grace.backends.torch_backend import TorchBackend
    from grace.compressors.dgc import DGC

    calls = []
    call = native_dgc.call
    monkeypatch.setattr(native_dgc, "call", lambda kind, name, *args: calls.append(name) or call(kind, name, *args))
    sizes = [0, 1, 2, 9, 300, 40000, 2**16 + 3, 50000]
    xs = [gradient(n, seed=n) for n in sizes]
    xs[4][:6] = [-0.0, np.inf, np.nan, -np.inf, 3e38, -3e38]
    xs[5] = np.round(xs[5] * 2).astype(np.float32) / 2  # few distinct magnitudes: ties at the cut
    xs[7][np.random.default_rng(7).random(50000) < 0.97] = 0.0  # mostly zeros: a threshold of 0
    xs[7][[3, 40, 41, 9000]] = [np.nan, -0.0, np.nan, -0.0]  # (NaNs never selected; -0.0 a zero)
    compressor, cut = DGC(ratio, sample_ratio, warmup, seed=3), 0
    for x in xs:
        info = TensorInfo(f"layer{x.size}.weight", 2, 4, rank=1)
        with np.errstate(invalid="ignore"):
            want = compressor.select(NX, x, info)
        got = compressor.select(TorchBackend(), torch.from_numpy(x.copy()), info)
        same_bytes(want, got, f"indices of {x.size}")
        cut += len(want) == min(x.size, max(1, math.ceil(compressor.ratio_at(NX, 2) * x.size))) < x.size
    assert calls.count("dgc_select") == len(sizes) - 1  # (not the empty tensor)
    assert cut or ratio == 1, "no selection was cut to k"
    with pytest.raises(ValueError, match="need"):
        gn.dgc_select(torch.ones(4), 2, 3, 1, (1, 2))


@pytest.mark.parametrize("method", ["topk", "threshold", "randomk"])
def test_residual_bucket_steps_on_kept_lists_equal_those_on_plain_lists(method):
    """Kept lists (``Pieces``: an exchange's residuals and outputs, whose sizes and C arrays of
    pointers a bucket call derives once) give the bytes plain lists give: at a later call with
    new values in the same tensors, and with other kept lists (their own pointers, made again);
    a kept list of another size is refused, as a plain one is."""
    sizes = [3, 1000, 9000, 40_000, 1]
    step = BUCKET_STEPS[method]
    kept_es, kept_outs = Pieces([torch.zeros(n) for n in sizes]), Pieces([torch.zeros(n) for n in sizes])
    other_es, other_outs = Pieces([torch.zeros(n) for n in sizes]), Pieces([torch.zeros(n) for n in sizes])
    for seed, es, outs in ((0, kept_es, kept_outs), (1, kept_es, kept_outs), (2, other_es, other_outs)):
        gs = [torch.from_numpy(gradient(n, seed=n + seed)) for n in sizes]
        for e, n in zip(es, sizes):
            e.copy_(torch.from_numpy(gradient(n, seed=n + seed + 1) * np.float32(0.3)))
        want = step(gs, [e.clone() for e in es], [torch.empty(n) for n in sizes])
        got = step(gs, es, outs)
        for field_want, field_got in zip(want, got):
            for a, b in zip(field_want, field_got):
                same_bytes(a, b)
        assert all(o is b for o, b in zip(outs, got[-1]))  # (the new residuals written into the kept outputs)
    with pytest.raises(ValueError):
        step([torch.zeros(n + 1) for n in sizes], kept_es, kept_outs)
