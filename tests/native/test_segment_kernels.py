"""A bucket's segments in one call (grace.native's *_segments: on a GPU one launch per kernel
for all segments, in batches of 64) against each segment through the per-tensor function on the
same device: the same bytes, the reductions (scales, norms, means) included."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import grace.native as gn
from grace.core import draws

from .conftest import gradient, host, on, same_bytes

# 70 segments (two batches), sizes around the packing widths, the 2048-element reduction
# blocks and QSGD's 4096-element rows
SIZES = [1, 7, 8, 9, 63, 129, 1001, 2048, 2049, 4096, 4097, 9000, 2**16 + 3] * 5 + [5, 3, 4100, 17, 2**15]


def _layout(sizes, gap=3):
    """Segment starts in a flat buffer, with gaps between segments (the kernels must use them)."""
    starts = list(itertools.accumulate([0] + [n + gap for n in sizes[:-1]]))
    return starts, starts[-1] + sizes[-1] + gap


def _rows(n, bucket):
    return -(-n // (bucket or n))


@pytest.mark.parametrize("method, levels, bucket", [
    ("terngrad", 0, 0), ("natural", 0, 0), ("qsgd", 127, 0), ("qsgd", 1, 0), ("qsgd", 7, 512), ("qsgd", 5, 5000),
    ("efsignsgd", 0, 0), ("onebit", 0, 0)])
def test_segments_in_one_call_equal_each_segment_alone(device, method, levels, bucket):
    sizes = SIZES
    starts, total = _layout(sizes)
    x = on(device, gradient(total, seed=3))
    drawn = [(_rows(n, bucket) * (bucket or n)) if method == "qsgd" else n for n in sizes]
    seeds = [(4, s) for s in range(len(sizes))]  # (each segment's draws made in the call from its seed words)
    u = on(device, draws.uniform_numpy(drawn, seeds))
    draw_starts = list(itertools.accumulate([0] + drawn[:-1]))
    extra = {"qsgd": (levels, bucket)}.get(method, ())
    if method in ("efsignsgd", "onebit"):
        fields = getattr(gn, f"{method}_compress_segments")(x, starts, sizes)
        alone = [getattr(gn, f"{method}_compress")(x[s:s + n]) for s, n in zip(starts, sizes)]
    else:
        words = [draws.seed_words(seed) for seed in seeds]
        fields = getattr(gn, f"{method}_compress_segments")(x, starts, sizes, words, *extra)
        alone = [getattr(gn, f"{method}_compress")(x[s:s + n], u[d:d + m], *extra)
                 for s, n, d, m in zip(starts, sizes, draw_starts, drawn)]
    for j, field in enumerate(fields):
        same_bytes(field, np.concatenate([host(a[j]).reshape(-1) for a in alone]), f"{method} field {j}")
    decoded = getattr(gn, f"{method}_decompress_segments")(*fields, sizes, *extra)
    want = [getattr(gn, f"{method}_decompress")(*a, n, *extra) for a, n in zip(alone, sizes)]
    same_bytes(decoded, np.concatenate([host(w).reshape(-1) for w in want]), f"{method} decoded")


def test_sign_bits_without_scales_decode_as_signsgd(device):
    """decode_segments' sign mode without scales is signSGD's +-1 (the GPU path)."""
    sizes = SIZES[:20]
    starts, total = _layout(sizes, gap=0)
    x = on(device, gradient(total, seed=5))
    packed, _ = gn.efsignsgd_compress_segments(x, starts, sizes)
    got = [gn.signsgd_decompress(packed[a:a + -(-n // 8)], n)
           for a, n in zip(itertools.accumulate([0] + [-(-n // 8) for n in sizes[:-1]]), sizes)]
    same_bytes(np.concatenate([host(g) for g in got]), np.where(host(x) >= 0, 1, -1).astype(np.float32), "signs")


def test_counter_draws_of_many_segments_equal_numpys(device):
    counts = [0, 1, 255, 256, 257, 70000] + [3] * 70
    seeds = [(7, s) for s in range(len(counts))]
    words = [draws.seed_words(seed) for seed in seeds]
    out = on(device, np.zeros(sum(counts), np.float32))
    same_bytes(gn.uniform_segments(counts, words, out), draws.uniform_numpy(counts, seeds), "uniform draws")
    if device == "cpu":
        with pytest.raises(gn.NativeUnavailable):
            gn.hash_keys_segments(counts, words, on(device, np.zeros(sum(counts), np.int64)))
        return
    keys = gn.hash_keys_segments(counts, words, on(device, np.zeros(sum(counts), np.int64)))
    want = np.concatenate([(np.int64(s) << 32) | draws.draw_hashes(np.arange(c, dtype=np.int64), w)
                           for s, (c, w) in enumerate(zip(counts, words))])
    same_bytes(keys, want.astype(np.int64), "hash keys")


def test_segment_calls_refuse_what_does_not_fit(device):
    x = on(device, np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        gn.terngrad_compress_segments(x, [0, 90], [50, 20], [(1, 2), (3, 4)])
    with pytest.raises(ValueError, match="seeds for"):
        gn.terngrad_compress_segments(x, [0, 50], [50, 20], [(1, 2)])
    with pytest.raises(ValueError, match="32-bit"):
        gn.uniform_segments([2**32 + 1], [(0, 0)], on(device, np.zeros(1, np.float32)))
    with pytest.raises(ValueError, match="packed bytes"):
        gn.qsgd_decompress_segments(on(device, np.zeros(3, np.uint8)), on(device, np.zeros(1, np.float32)), [100],
                                    127)


@pytest.mark.parametrize("ratio, beta, gamma", [(0.01, 1.0, 1.0), (0.3, 0.9, 1.0), (1.0, 1.0, 0.5)])
def test_top_k_steps_of_many_segments_equal_each_segments_step(device, ratio, beta, gamma):
    """topk_ef_step_segments against topk_ef_step per segment: values, indices (ties to the
    lowest index: magnitudes repeat here) and new residuals; k = 0 and k = n segments too."""
    sizes = SIZES
    starts, total = _layout(sizes)
    rng = np.random.default_rng(6)
    g = gradient(total, seed=7)
    g[rng.integers(0, total, total // 3)] = np.float32(0.5)  # many ties, often at the cut
    r = rng.standard_normal(total).astype(np.float32)
    ks = [min(n, max(1, int(np.ceil(ratio * n)))) for n in sizes]
    ks[3], ks[4] = 0, sizes[4]
    values, idx, new_r = gn.topk_ef_step_segments(on(device, g), on(device, r), starts, sizes, ks, beta, gamma)
    at = 0
    for s, (start, n, k) in enumerate(zip(starts, sizes, ks)):
        want_v, want_i, want_r = gn.topk_ef_step(on(device, g[start:start + n]), on(device, r[start:start + n]), k,
                                                 beta, gamma)
        same_bytes(values[at:at + k], want_v, f"values of segment {s}")
        same_bytes(idx[at:at + k], host(want_i).astype(np.int64), f"indices of segment {s}")
        same_bytes(new_r[start:start + n], want_r, f"new residual of segment {s}")
        at += k


@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
def test_top_k_of_many_segments_equals_each_segments_top_k(device, ratio):
    """topk_compress_segments (on a GPU the bucket's kernels with no residual: p is g) against
    topk_compress per segment: values (-0.0 kept), indices (ties to the lowest index); k = 0 and
    k = n segments too."""
    sizes = SIZES
    starts, total = _layout(sizes)
    rng = np.random.default_rng(8)
    g = gradient(total, seed=9)
    g[rng.integers(0, total, total // 3)] = np.float32(0.5)  # many ties, often at the cut
    g[rng.integers(0, total, total // 50)] = np.float32(-0.0)
    ks = [min(n, max(1, int(np.ceil(ratio * n)))) for n in sizes]
    ks[3], ks[4] = 0, sizes[4]
    values, idx = gn.topk_compress_segments(on(device, g), starts, sizes, ks)
    at = 0
    for s, (start, n, k) in enumerate(zip(starts, sizes, ks)):
        want_v, want_i = gn.topk_compress(on(device, g[start:start + n]), k)
        same_bytes(values[at:at + k], want_v, f"values of segment {s}")
        same_bytes(idx[at:at + k], host(want_i).astype(np.int64), f"indices of segment {s}")
        at += k


def _signs_decoded(packed, sizes):
    """signsgd_decompress of every segment's bits (each from a byte boundary), in a row."""
    from tests.native.conftest import torch

    at = itertools.accumulate([0] + [-(-n // 8) for n in sizes[:-1]])
    return torch.cat([gn.signsgd_decompress(packed[a:a + -(-n // 8)], n) for a, n in zip(at, sizes)])


def _fields_of_ranks(device, method, sizes, starts, total, ranks, extra):
    """Each of ``ranks`` ranks' fields of the segments (its own gradient and draws), and all
    ranks' fields in a row (as a received frame holds them)."""
    per_rank = []
    for r in range(ranks):
        x = on(device, gradient(total, seed=20 + r))
        if method == "signsgd":  # (the bits of EF-signSGD's segments, without their scales)
            per_rank.append(gn.efsignsgd_compress_segments(x, starts, sizes)[:1])
        elif method in ("efsignsgd", "onebit"):
            per_rank.append(getattr(gn, f"{method}_compress_segments")(x, starts, sizes))
        else:
            words = [draws.seed_words((r, s)) for s in range(len(sizes))]
            per_rank.append(getattr(gn, f"{method}_compress_segments")(x, starts, sizes, words, *extra))
    return per_rank, [on(device, np.concatenate([host(f[j]).reshape(-1) for f in per_rank]))
                      for j in range(len(per_rank[0]))]


@pytest.mark.parametrize("method, levels, bucket, finish", [
    ("terngrad", 0, 0, (False, (3,))), ("natural", 0, 0, (False, (3,))), ("qsgd", 127, 0, (False, (3,))),
    ("qsgd", 7, 512, (False, (3,))), ("efsignsgd", 0, 0, (False, (3, 0.1))), ("onebit", 0, 0, (False, (3,))),
    ("signsgd", 0, 0, (True, ())), ("signsgd", 0, 0, (False, (3,)))])
def test_a_buckets_mean_in_one_call_equals_each_ranks_decoding_added(device, method, levels, bucket, finish):
    """*_mean_segments against each rank's decompress_segments, added rank after rank and finished
    by tensor ops on the same device (a vote's sign; a GPU divides by a number as times its
    reciprocal); every element NaN where the overflow count is positive, untouched where it is 0."""
    from tests.native.conftest import torch

    sizes, ranks = SIZES, 3
    starts, total = _layout(sizes)
    extra = {"qsgd": (levels, bucket)}.get(method, ())
    vote, divisors = finish
    per_rank, fields = _fields_of_ranks(device, method, sizes, starts, total, ranks, extra)
    decoded = [_signs_decoded(f[0], sizes) if method == "signsgd" else
               getattr(gn, f"{method}_decompress_segments")(*f, sizes, *extra) for f in per_rank]
    want = decoded[0]
    for d in decoded[1:]:
        want = want + d
    if vote:
        want = torch.sign(want)
    for d in divisors:
        want = want / d
    mean = getattr(gn, f"{method}_mean_segments")
    for count in (None, 0):
        overflow = None if count is None else on(device, np.array([count], np.int64))
        same_bytes(mean(*fields, sizes, ranks, finish, overflow, *extra), want, f"{method} mean")
    poisoned = mean(*fields, sizes, ranks, finish, on(device, np.array([2], np.int64)), *extra)
    assert bool(torch.isnan(poisoned).all())
    with pytest.raises(ValueError, match="ranks"):
        mean(*[f[:-1] if j == 0 else f for j, f in enumerate(fields)], sizes, ranks, finish, None, *extra)


@pytest.mark.parametrize("method", ["efsignsgd", "onebit"])
@pytest.mark.parametrize("beta, gamma", [(1.0, 1.0), (1.0, 0.1), (0.9, 1.0)])
def test_sign_residual_steps_of_many_segments_equal_compensate_compress_and_update(device, method, beta, gamma):
    """*_ef_step_segments against residual memory's step by tensor ops and the segment calls:
    p = g * gamma + r * beta, its fields, and p minus their decoding."""
    sizes = SIZES
    starts, total = _layout(sizes)
    g, r = on(device, gradient(total, seed=8)), on(device, gradient(total, seed=9))
    p = (g if gamma == 1.0 else g * gamma) + (r if beta == 1.0 else r * beta)
    packed, scalars, new_r = getattr(gn, f"{method}_ef_step_segments")(g, r, starts, sizes, beta, gamma)
    want = getattr(gn, f"{method}_compress_segments")(p, starts, sizes)
    same_bytes(packed, want[0], "bits")
    same_bytes(scalars, want[1], "scalars")
    decoded = getattr(gn, f"{method}_decompress_segments")(*want, sizes)
    for s, (start, n, at) in enumerate(zip(starts, sizes, itertools.accumulate([0] + sizes[:-1]))):
        same_bytes(new_r[start:start + n], p[start:start + n] - decoded[at:at + n], f"new residual of segment {s}")
