"""Native ops against the tensor-op code: packing, selection, scatter-add (CPU and CUDA)."""
from __future__ import annotations

import numpy as np
import pytest

import grace.native as gn
from grace.core import bits
from tests.native.conftest import BIG, NX, SIZES, device, gradient, host, on, same_bytes, torch  # noqa: F401


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("n", SIZES)
def test_pack_and_unpack_equal_bits_py(device, width, n):
    codes = np.random.default_rng(n + width).integers(0, 1 << width, n).astype(np.uint8)
    want = bits.pack(NX, codes, width)
    packed = gn.pack(on(device, codes), width)
    assert packed.device.type == device
    same_bytes(want, packed, "packed")
    same_bytes(bits.unpack(NX, want, width, n), gn.unpack(packed, width, n), "unpacked")


@pytest.mark.parametrize("n", [9, 1001, BIG])
def test_pack_takes_bool_masks(device, n):
    mask = gradient(n) >= 0
    same_bytes(bits.pack(NX, mask, 1), gn.pack(on(device, mask), 1))


def test_numpy_arrays_reach_the_same_kernels():
    codes = np.random.default_rng(0).integers(0, 8, 1001).astype(np.uint8)
    same_bytes(bits.pack(NX, codes, 3), gn.pack(codes, 3))


def reference_topk(x: np.ndarray, k: int, by_abs: bool) -> np.ndarray:
    """The k largest (|x| when by_abs), ties to the lowest index, ascending."""
    key = np.abs(x) if by_abs else x
    order = np.lexsort((np.arange(x.size), -key.astype(np.float64)))
    return np.sort(order[:k])


@pytest.mark.parametrize("n", SIZES + [BIG])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 1.0])
def test_topk_indices_are_the_k_largest(device, n, ratio):
    x = gradient(n, seed=n)
    k = min(n, max(1, int(np.ceil(ratio * n)))) if n else 0
    got = gn.topk_indices(on(device, x), k, by_abs=True)
    assert got.device.type == device and got.dtype == torch.int64
    want = reference_topk(x, k, True)
    np.testing.assert_array_equal(host(got), want)
    if n:  # the same set as torch.topk (no ties among random magnitudes here)
        t = torch.topk(torch.from_numpy(np.abs(x)), k).indices.numpy()
        np.testing.assert_array_equal(np.sort(t), want)


@pytest.mark.parametrize("n", [1, 9, 1001, 2**16 + 3])
def test_topk_signed_and_float64(device, n):
    x = gradient(n, seed=2)
    k = max(1, n // 10)
    np.testing.assert_array_equal(host(gn.topk_indices(on(device, x), k)), reference_topk(x, k, False))
    if device == "cpu":
        x64 = x.astype(np.float64) * 1.0000001
        np.testing.assert_array_equal(host(gn.topk_indices(torch.from_numpy(x64), k)), reference_topk(x64, k, False))


@pytest.mark.parametrize("n", [1001, 2**16 + 3, BIG])
def test_topk_over_magnitudes_of_many_octaves(device, n):
    """The k-th largest found by radix selection level after level (keys that differ in their
    top bits and, within the bin found, only in their last ones), float32 and float64."""
    rng = np.random.default_rng(n)
    x = (rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-60, 60, n))).astype(np.float32)
    x[: n // 4] = x[n // 2: n // 2 + n // 4]  # and pairs of equal magnitudes
    x[n // 8: n // 8 + 64] = np.nextafter(np.float32(1.0), np.float32(2.0)) * np.arange(1, 65, dtype=np.float32)
    for k in (1, 7, n // 100 + 1, n // 3, n - 1):
        np.testing.assert_array_equal(host(gn.topk_indices(on(device, x), k, by_abs=True)), reference_topk(x, k, True))
        if device == "cpu":
            x64 = x.astype(np.float64)
            got = host(gn.topk_indices(torch.from_numpy(x64), k))
            np.testing.assert_array_equal(got, reference_topk(x64, k, False))


@pytest.mark.parametrize("n", [10, 1001, 2**16 + 3])
def test_topk_ties_go_to_the_lowest_indices(device, n):
    rng = np.random.default_rng(n)
    x = rng.integers(-3, 4, n).astype(np.float32)  # few distinct values: ties everywhere
    for k in (1, n // 3, n // 2 + 1, n - 1):
        got = host(gn.topk_indices(on(device, x), k, by_abs=True))
        np.testing.assert_array_equal(got, reference_topk(x, k, True))
    zeros = np.zeros(n, np.float32)
    np.testing.assert_array_equal(host(gn.topk_indices(on(device, zeros), 5, by_abs=True)), np.arange(5))


def test_topk_compress_payload(device):
    x = gradient(50_000, 3)
    values, idx = gn.topk_compress(on(device, x), 500)
    want = reference_topk(x, 500, True)
    assert idx.dtype == torch.int32
    np.testing.assert_array_equal(host(idx), want)
    same_bytes(x[want], values)


@pytest.mark.parametrize("n", SIZES + [BIG])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 3.0, 1e30])
def test_threshold_indices_equal_nonzero_of_the_mask(device, n, threshold):
    x = gradient(n, seed=n + 1)
    want = NX.nonzero(NX.abs(x) >= threshold)
    got = gn.threshold_indices(on(device, x), threshold)
    assert got.device.type == device
    np.testing.assert_array_equal(host(got), want)
    values, idx = gn.threshold_compress(on(device, x), threshold)
    np.testing.assert_array_equal(host(idx).astype(np.int64), want)
    same_bytes(x[want], values)


@pytest.mark.parametrize("n", SIZES + [BIG])
def test_nonzero_of_masks(device, n):
    x = gradient(n, seed=n + 2)
    for mask in (x > 0, x > 2, np.zeros(n, bool), np.ones(n, bool)):
        got = gn.nonzero(on(device, mask))
        np.testing.assert_array_equal(host(got), np.flatnonzero(mask))
        same_bytes(TX_nonzero(mask), got)


def TX_nonzero(mask):
    return torch.nonzero(torch.from_numpy(mask), as_tuple=True)[0]


@pytest.mark.parametrize("idx_dtype", ["uint8", "int16", "int32", "int64"])
@pytest.mark.parametrize("ranks", [1, 3, 8])
def test_scatter_add_many_is_the_scatter_of_the_concatenation(device, idx_dtype, ranks):
    numel = {"uint8": 256, "int16": 2**15, "int32": 100_003, "int64": 100_003}[idx_dtype]
    rng = np.random.default_rng(ranks)
    payloads = []
    for r in range(ranks):
        k = rng.integers(0, numel // 10 + 2)
        idx = np.sort(rng.choice(numel, size=k, replace=False)).astype(idx_dtype)
        payloads.append((gradient(int(k), seed=r), idx))
    values = np.concatenate([p[0] for p in payloads])
    indices = np.concatenate([p[1].astype(np.int64) for p in payloads])
    want = NX.scatter_add(indices, values, numel)
    got = gn.scatter_add_many([(on(device, v), on(device, i)) for v, i in payloads], numel)
    assert got.device.type == device
    same_bytes(want, got)  # each rank's indices are distinct: the same order of additions
    if device == "cpu":  # one concatenated payload: in order as well (CUDA: atomics, any order)
        same_bytes(want, gn.scatter_add(on(device, indices), on(device, values), numel))


def test_scatter_add_with_repeated_indices(device):
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 1000, 300_000)
    values = gradient(300_000, 6)
    want = NX.scatter_add(idx, values, 1000)
    got = gn.scatter_add(on(device, idx), on(device, values), 1000)
    if device == "cpu":
        same_bytes(want, got)  # in order, as np.add.at
    else:  # atomics: the order of the additions varies, as torch's index_add_
        np.testing.assert_allclose(host(got), want, rtol=1e-4, atol=1e-3)
    f64 = gn.scatter_add(on(device, idx), on(device, values.astype(np.float64)), 1000)
    np.testing.assert_allclose(host(f64), NX.scatter_add(idx, values.astype(np.float64), 1000), rtol=1e-12)


def test_scatter_add_refuses_out_of_range_indices():
    with pytest.raises(IndexError):
        gn.scatter_add(np.array([0, 5]), np.ones(2, np.float32), 5)
    with pytest.raises(IndexError):
        gn.scatter_add(np.array([-1]), np.ones(1, np.float32), 5)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_buckets_elementwise_chunks_are_dealt_to_the_threads(threads):
    """fp16's bucket calls deal every gradient's chunks to the threads in one parallel region
    (small gradients whole, large ones cut): each element as one thread makes it."""
    sizes = [5, 2**18 + 3, 9, 2**19, 1, 2**18 + 64, 300]
    xs = [torch.from_numpy(gradient(n, seed=n)) for n in sizes]
    words = [(s, 3) for s in range(len(sizes))]
    runs = []
    try:
        for t in (1, threads):
            gn.set_num_threads(t)
            halves = gn.fp16_compress_many_into(xs, 3.0, [torch.empty(n, dtype=torch.float16) for n in sizes])
            runs.append((halves, gn.fp16_decompress_many_into(halves, 2.0, 3.0, [torch.empty(n) for n in sizes])))
    finally:
        gn.set_num_threads(0)
    for (h1, d1), (h2, d2) in zip(*[list(zip(*run)) for run in runs]):
        same_bytes(h1, h2)
        same_bytes(d1, d2)
    same_bytes((xs[1].numpy() / np.float32(3)).astype(np.float16), runs[1][0][1])


def _rows_added(rows):
    """Decoded rows added row after row in float32, as a decoded sum adds them."""
    total = rows[0].numpy().copy()
    for row in rows[1:]:
        total += row.numpy()
    return total


@pytest.mark.parametrize("threads", [2, 3])
def test_element_by_element_bucket_calls_deal_their_chunks_to_the_threads(threads):
    """signSGD's payloads and the decoded sums of the sign family, TernGrad, natural compression
    and QSGD over a bucket deal every gradient's chunks to the threads in one parallel region
    (small gradients whole, large ones cut, the last few elements where a byte or a vector is not
    full): the bytes one thread makes, and the one-gradient kernels' or each rank decoded and
    added (an inf in a cut gradient's last byte raises the flag). Natural compression's bucket
    payloads (gradient by gradient: its draws bind it, not memory) are its one-gradient kernel's."""
    sizes = [5, 2**18 + 3, 9, 2**19 + 77, 1, 2**18 + 64, 300]
    xs = [torch.from_numpy(gradient(n, seed=n)) for n in sizes]
    xs[3][-2] = float("inf")
    rows = [[torch.from_numpy(gradient(n, seed=n + r) >= 0) for r in range(3)] for n in sizes]
    bits_of = [[gn.pack(m, 1) for m in ms] for ms in rows]
    codes = [[gn.pack(torch.from_numpy(np.random.default_rng(n + r).integers(0, 4, n).astype(np.uint8)), 2)
              for r in range(3)] for n in sizes]
    scale = [torch.tensor([0.5 + r]) for r in range(3)]
    means = [torch.tensor([-0.25 * r, 1.5]) for r in range(3)]
    natural = [[gn.natural_compress_drawn(torch.from_numpy(gradient(n, seed=n + r)), (r, 7)) for r in range(3)]
               for n in sizes]
    quantized = [[gn.qsgd_compress_drawn(torch.from_numpy(gradient(n, seed=n + r)), (r, 7), 127, 512)
                  for r in range(3)] for n in sizes]
    cases = {  # name: (bucket call, its payloads, the one-gradient sum of gradient s)
        "signsgd": (gn.signsgd_decompress_sum_into, [[(b,) for b in bs] for bs in bits_of],
                    lambda s: gn.signsgd_decompress_sum(torch.cat(bits_of[s]), sizes[s])),
        "efsignsgd": (gn.efsignsgd_decompress_sum_into, [list(zip(bs, scale)) for bs in bits_of],
                      lambda s: gn.efsignsgd_decompress_sum(torch.cat(bits_of[s]), torch.cat(scale), sizes[s])),
        "onebit": (gn.onebit_decompress_sum_into, [list(zip(bs, means)) for bs in bits_of],
                   lambda s: gn.onebit_decompress_sum(torch.cat(bits_of[s]), torch.cat(means), sizes[s])),
        "terngrad": (gn.terngrad_decompress_sum_into, [list(zip(cs, scale)) for cs in codes],
                     lambda s: gn.terngrad_decompress_sum(torch.cat(codes[s]), torch.cat(scale), sizes[s])),
        "natural": (gn.natural_decompress_sum_into, natural,
                    lambda s: _rows_added([gn.natural_decompress(*p, sizes[s]) for p in natural[s]])),
        "qsgd": (lambda payloads, outs: gn.qsgd_decompress_sum_into(payloads, outs, 127, 512), quantized,
                 lambda s: _rows_added([gn.qsgd_decompress(*p, sizes[s], 127, 512) for p in quantized[s]])),
    }
    words = [(s, 3) for s in range(len(sizes))]
    runs = []
    try:
        for t in (1, threads):
            gn.set_num_threads(t)
            flag = torch.zeros(1)
            run = {"bits": [b for (b,) in gn.compress_many("signsgd", xs, nonfinite=flag)], "flag": flag,
                   "natural flag": torch.zeros(1)}
            run["natural payloads"] = gn.compress_many("natural", xs, words, nonfinite=run["natural flag"])
            for name, (into, payloads, _) in cases.items():
                run[name] = into(payloads, [torch.full((n,), 7.0) for n in sizes])
            runs.append(run)
        gn.set_num_threads(1)
        alone = {name: [one(s) for s in range(len(sizes))] for name, (_, _, one) in cases.items()}
    finally:
        gn.set_num_threads(0)
    one_thread, dealt = runs
    assert all(run[flag].item() == 1 for run in runs for flag in ("flag", "natural flag"))
    for s, x in enumerate(xs):
        same_bytes(bits.pack(NX, x.numpy() >= 0, 1), dealt["bits"][s])
        same_bytes(one_thread["bits"][s], dealt["bits"][s])
        for want, got in zip(gn.natural_compress_drawn(x, words[s]), dealt["natural payloads"][s]):
            same_bytes(want, got)
        for name in cases:
            same_bytes(alone[name][s], one_thread[name][s], f"{name} {sizes[s]}")
            same_bytes(one_thread[name][s], dealt[name][s], f"{name} {sizes[s]}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_buckets_indices_are_checked_across_the_threads(threads):
    """scatter_add_segments_into checks every payload's indices in one pass shared among the
    threads: an index out of range anywhere is refused with nothing written, and a payload whose
    indices descend once, where two threads' shares meet, is summed in its own order (not as an
    ascending one, whose sums go block by block)."""
    numel, long = 400_000, 300_000
    ascending = np.sort(np.random.default_rng(1).choice(numel, long, replace=False))
    values = np.round(gradient(long, 2) * 8).astype(np.float32)  # (sums exact in any order)
    short = [tuple(map(torch.from_numpy, (np.ones(3, np.float32), np.array([0, 5, 5]))))] * 2
    # the first share's end: the bucket's pairs (two long payloads, two short) in 64-pair units
    total = 2 * long + 6
    shares = max(1, min(threads, total // 2**17))
    meet = -(-(-(-total // 64)) // shares) * 64
    at = meet if meet < long else meet - long  # (in the first payload, or the second)
    descending_once = np.concatenate([ascending[long - at:], ascending[:long - at]])  # descends at `at`

    def bucket(first, second):
        return [[(torch.from_numpy(values), torch.from_numpy(first)), (torch.from_numpy(values),
                 torch.from_numpy(second))], short]

    gn.set_num_threads(threads)
    try:
        for first, second in ((ascending, ascending), (descending_once, ascending), (ascending, descending_once)):
            dense = [torch.full((numel,), 7.0), torch.full((9,), 7.0)]
            gn.scatter_add_segments_into(bucket(first, second), dense, 2)
            want = NX.scatter_add(np.concatenate([first, second]), np.concatenate([values, values]) / 2, numel)
            same_bytes(want, dense[0])
            same_bytes(np.array([1, 0, 0, 0, 0, 2, 0, 0, 0], np.float32), dense[1])
        bad = ascending.copy()
        bad[-5] = numel  # one past the end, in the last share
        dense = [torch.full((numel,), 7.0), torch.full((9,), 7.0)]
        with pytest.raises(IndexError, match="out of range"):
            gn.scatter_add_segments_into(bucket(ascending, bad), dense, 2)
        assert all((d == 7).all() for d in dense)  # nothing written
    finally:
        gn.set_num_threads(0)


def test_empty_inputs(device):
    e = on(device, np.zeros(0, np.float32))
    assert gn.topk_indices(e, 0).numel() == 0
    assert gn.threshold_indices(e, 0.1).numel() == 0
    assert gn.nonzero(on(device, np.zeros(0, bool))).numel() == 0
    assert gn.pack(on(device, np.zeros(0, np.uint8)), 3).numel() == 0
    out = gn.scatter_add(on(device, np.zeros(0, np.int64)), e, 7)
    same_bytes(np.zeros(7, np.float32), out)


@pytest.mark.parametrize("n", SIZES + [BIG])
def test_norm_is_numpys_bit_for_bit(n):
    """grace.native.norm (CPU): NumPy's pairwise sum of squares, then its root, the same float
    (what the torch backend's norm of a float32 CPU tensor returns), also for a vanishing
    gradient whose squares fall below float32's normal range."""
    from grace.backends import get_backend

    for x in (gradient(n), gradient(n) * np.float32(1e-21)):
        want = NX.norm(x)
        same_bytes(np.asarray(want, np.float32).reshape(1), gn.norm(torch.from_numpy(x)), f"norm of {n}")
        got = get_backend("torch").norm(torch.from_numpy(x))
        assert got.shape == () and got.dtype == torch.float32
        same_bytes(np.asarray(want, np.float32).reshape(1), got.reshape(1), f"torch backend's norm of {n}")


def test_norm_refuses_what_it_does_not_take():
    with pytest.raises(gn.NativeUnavailable):
        gn.norm(torch.zeros(4, dtype=torch.float64))
    assert np.isnan(float(gn.norm(torch.tensor([1.0, np.nan])))) and float(gn.norm(torch.tensor([np.inf]))) == np.inf
