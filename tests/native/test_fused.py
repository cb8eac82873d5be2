"""Fused quantize+pack and unpack+decode kernels against each method's compress/decompress on
the NumPy backend (the oracle), given the same random numbers.

CPU: every payload byte (codes and float32 scalars) and every decompressed value is identical.
CUDA: codes, packed bytes and decompressed values are identical; the per-tensor sums (norms,
means, L1 scale) are summed in another order, so they agree to float32 rounding, and QSGD's
codes are compared given the oracle's norms (and, with the GPU's own norms, all but a few).
"""
from __future__ import annotations

import numpy as np
import pytest

import grace
import grace.native as gn
from grace.core.compressor import Shape, TensorInfo
from tests.native.conftest import BIG, NX, SIZES, device, draws, gradient, host, on, same_bytes, torch  # noqa: F401

INFO = TensorInfo("layer.weight", 3, 1)


def shape_of(n):
    return Shape((n,), "float32")


def oracle(compressor, x: np.ndarray, u, monkeypatch):
    """(payload, decompressed) of the NumPy compressor, its draws replaced by ``u``."""
    if u is not None:
        monkeypatch.setattr(NX, "uniform", lambda n, seed, like=None: u[:n].copy())
    payload, ctx = compressor.compress(NX, x, INFO)
    return payload, compressor.decompress(NX, payload, ctx)


# method -> (factory, needs draws, native compress(x, u) -> payload, native decompress(payload, n))
METHODS = {
    "signsgd": (lambda: grace.signsgd().compressor, False,
                lambda x, u: (gn.signsgd_compress(x),), lambda p, n: gn.signsgd_decompress(p[0], n)),
    "efsignsgd": (lambda: grace.efsignsgd(0.1).compressor, False,
                  lambda x, u: gn.efsignsgd_compress(x), lambda p, n: gn.efsignsgd_decompress(p[0], p[1], n)),
    "onebit": (lambda: grace.onebit().compressor, False,
               lambda x, u: gn.onebit_compress(x), lambda p, n: gn.onebit_decompress(p[0], p[1], n)),
    "terngrad": (lambda: grace.terngrad().compressor, True,
                 lambda x, u: gn.terngrad_compress(x, u), lambda p, n: gn.terngrad_decompress(p[0], p[1], n)),
    "natural": (lambda: grace.natural().compressor, True,
                lambda x, u: gn.natural_compress(x, u), lambda p, n: gn.natural_decompress(p[0], p[1], n)),
}
for levels, bucket in [(1, 0), (3, 0), (4, 0), (15, 0), (31, 0), (63, 0), (127, 0), (127, 64), (5, 1000), (7, 4097)]:
    METHODS[f"qsgd{levels}_b{bucket}"] = (
        lambda levels=levels, bucket=bucket: grace.qsgd(levels, bucket_size=bucket).compressor, True,
        lambda x, u, levels=levels, bucket=bucket: gn.qsgd_compress(x, u, levels, bucket),
        lambda p, n, levels=levels, bucket=bucket: gn.qsgd_decompress(p[0], p[1], n, levels, bucket))

# payload entries that are sums (differ in the last bits on a GPU); codes are all the others
SUMS = {"efsignsgd": {1}, "onebit": {1}}
SUMS.update({name: {1} for name in METHODS if name.startswith("qsgd")})


def padded_draws(name, n):
    if not name.startswith("qsgd"):
        return draws(n)
    bucket = int(name.split("_b")[1]) or max(n, 1)
    return draws(-(-n // bucket) * bucket if n else 0)


@pytest.mark.parametrize("n", SIZES + [BIG])
@pytest.mark.parametrize("name", METHODS)
def test_cpu_payload_and_values_are_the_oracles_bytes(name, n, monkeypatch):
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    make, random, compress, decompress = METHODS[name]
    x = gradient(n, seed=n)
    u = padded_draws(name, n) if random else None
    want_payload, want_y = oracle(make(), x, u, monkeypatch)
    for kind in ("numpy", "torch"):  # both reach libgrace_cpu
        xi = x if kind == "numpy" else torch.from_numpy(x)
        ui = None if u is None else (u if kind == "numpy" else torch.from_numpy(u))
        payload = compress(xi, ui)
        assert len(payload) == len(want_payload)
        for j, (a, b) in enumerate(zip(want_payload, payload)):
            same_bytes(a, b, f"{kind} payload[{j}]")
        same_bytes(want_y.reshape(-1), decompress(payload, n), f"{kind} decompressed")


@pytest.mark.parametrize("specials", [[np.inf], [-np.inf], [np.nan], [np.inf, -np.inf, np.nan]], ids=str)
@pytest.mark.parametrize("name", [m for m in METHODS if m != "natural"])  # natural: test_natural_edge_values
def test_cpu_non_finite_gradients_give_the_oracles_bytes(name, specials, monkeypatch):
    """inf and NaN in a block's SIMD lanes and in its scalar tail: the lanes' comparisons and
    sums treat them as the scalar code does. Every byte is the oracle's but a NaN's sign bit,
    which IEEE arithmetic leaves unspecified (-scale against -1 * scale)."""
    make, random, compress, decompress = METHODS[name]
    n = 1001  # blocks of 128 and a tail of 1001 % 8 = 1 element
    x = gradient(n, seed=5)
    for k, v in enumerate(specials):
        x[[3 + 40 * k, 517 + k, n - 1 - k]] = v
    u = padded_draws(name, n) if random else None
    with np.errstate(invalid="ignore", over="ignore"):
        want_payload, want_y = oracle(make(), x, u, monkeypatch)
    payload = compress(torch.from_numpy(x), None if u is None else torch.from_numpy(u))

    def same_up_to_nan_sign(a, b, what):
        a, b = host(a).reshape(-1), host(b).reshape(-1)
        if a.dtype.kind == "f":
            assert np.array_equal(np.isnan(a), np.isnan(b)), what
            a, b = np.where(np.isnan(a), np.nan, a), np.where(np.isnan(b), np.nan, b)
        same_bytes(a, b, what)

    for j, (a, b) in enumerate(zip(want_payload, payload)):
        same_up_to_nan_sign(a, b, f"payload[{j}]")
    same_up_to_nan_sign(want_y, decompress(payload, n), "decompressed")


@pytest.mark.parametrize("n", [0, 1, 9, 1001, 4097, 2**16 + 3, BIG])
@pytest.mark.parametrize("name", METHODS)
def test_cuda_codes_and_values_equal_the_oracle(name, n, monkeypatch):
    if not (torch.cuda.is_available() and gn.available("cuda")):
        pytest.skip("no CUDA device or libgrace_cuda not built")
    make, random, compress, decompress = METHODS[name]
    x = gradient(n, seed=n)
    u = padded_draws(name, n) if random else None
    want_payload, want_y = oracle(make(), x, u, monkeypatch)
    xd, ud = on("cuda", x), (None if u is None else on("cuda", u))
    payload = compress(xd, ud)
    assert all(t.device.type == "cuda" for t in payload)
    sums = SUMS.get(name, set())
    for j, (a, b) in enumerate(zip(want_payload, payload)):
        if j in sums:
            np.testing.assert_allclose(host(b), a, rtol=2e-6, atol=0, err_msg=f"payload[{j}]")
        elif name.startswith("qsgd"):  # codes from the GPU's own norms: all but a few equal
            a8, b8 = np.unpackbits(a), np.unpackbits(host(b))
            assert (a8 != b8).sum() <= max(2, a8.size // 10**4)
        else:
            same_bytes(a, b, f"payload[{j}]")
    if name.startswith("qsgd"):  # codes given the same norms: identical
        levels, bucket = (int(v) for v in name[4:].split("_b"))
        packed, _ = gn.qsgd_compress(xd, ud, levels, bucket, norms=on("cuda", want_payload[1]))
        same_bytes(want_payload[0], packed, "codes given the oracle's norms")
    # decoding the oracle's payload on the GPU: identical values
    y = decompress(tuple(on("cuda", np.asarray(p)) for p in want_payload), n)
    assert y.device.type == "cuda"
    same_bytes(want_y.reshape(-1), y, "decompressed")


#: the bucket-at-once QSGD sums take (levels, bucket size) after the outputs
ARGUMENTS = {"qsgd1_b0": (1, 0), "qsgd127_b0": (127, 0), "qsgd127_b64": (127, 64), "qsgd5_b1000": (5, 1000),
             "qsgd7_b4097": (7, 4097)}
SUMMED = {"signsgd": gn.signsgd_decompress_sum, "efsignsgd": gn.efsignsgd_decompress_sum,
          "onebit": gn.onebit_decompress_sum, "terngrad": gn.terngrad_decompress_sum,
          "natural": gn.natural_decompress_sum,
          **{name: (lambda p, q, n, a=a: gn.qsgd_decompress_sum(p, q, n, *a)) for name, a in ARGUMENTS.items()}}


@pytest.mark.parametrize("ranks", [1, 2, 4, 5])
@pytest.mark.parametrize("n", [1, 7, 9, 1001, 2**16 + 3])
@pytest.mark.parametrize("name", SUMMED)
def test_decoded_sums_equal_the_oracles_sum_of_decompressions(device, name, n, ranks):
    """Every rank's payload of one tensor decoded and added row after row in one pass: the
    bytes of the NumPy decompressions added in order (signed zeros from an all-zero rank too)."""
    if device == "cuda" and (name in ARGUMENTS or name == "natural"):
        pytest.skip(f"{name}'s decoded sum is the CPU's")
    compressor = METHODS[name][0]()
    xs = [gradient(n, seed=n + r) for r in range(ranks)]
    xs[0][: n // 2] = 0.0  # a rank whose first half is zeros (its means and scale -0.0 or 0.0)
    if ranks > 2:
        xs[2][:] = -0.0
    payloads = [compressor.compress(NX, x, INFO)[0] for x in xs]
    want = compressor.decompress(NX, payloads[0], shape_of(n))
    for p in payloads[1:]:
        want = want + compressor.decompress(NX, p, shape_of(n))
    rows = [on(device, np.concatenate([np.asarray(p[i]).reshape(-1) for p in payloads]))
            for i in range(len(payloads[0]))]
    got = SUMMED[name](*rows, n)
    assert got.device.type == device
    same_bytes(np.asarray(want).reshape(-1), got, f"{name} over {ranks} ranks")


@pytest.mark.parametrize("method, parameters", [("signsgd", ()), ("terngrad", ()), ("natural", ()), ("qsgd", (127, 0)),
                                                ("qsgd", (5, 1000)), ("qsgd", (7, 4097)), ("qsgd", (1, 64))])
def test_a_buckets_payloads_in_one_call_equal_each_gradients(method, parameters):
    """compress_many (CPU): every gradient's payload, byte for byte the per-gradient kernel's
    (signsgd_compress; terngrad_, qsgd_, natural_compress_drawn with the gradient's own seed
    words): sizes across byte and bucket edges, specials included. Bad QSGD levels are refused."""
    sizes = [1, 9, 1001, 2**16 + 3, 5000]
    xs = [torch.from_numpy(gradient(n, seed=n)) for n in sizes]
    xs[2][:5] = torch.tensor([-0.0, float("inf"), float("nan"), float("-inf"), 3e38])
    xs[4][:] = 0.0  # an all-zero gradient: its scale and norms 0
    words = [(0x9E3779B9 * (s + 1) % 2**32, 12345 + s) for s in range(len(sizes))]
    got = gn.compress_many(method, xs, None if method == "signsgd" else words, *parameters)
    assert len(got) == len(sizes)
    for x, w, payload in zip(xs, words, got):
        want = gn.signsgd_compress(x) if method == "signsgd" else \
            getattr(gn, f"{method}_compress_drawn")(x, w, *parameters)
        want = want if isinstance(want, tuple) else (want,)
        assert len(payload) == len(want)
        for a, b in zip(want, payload):
            same_bytes(a, b, f"{method} {x.numel()}")
    if method == "qsgd":
        with pytest.raises(ValueError, match="levels=0"):
            gn.compress_many("qsgd", xs, words, 0, 0)


BUCKETS = {"small": [1, 9, 1001, 2**16 + 3], "streamed": [9, 2**21 + 5, 1001]}


@pytest.mark.parametrize("finish", [None, (False, (3, 0.1)), (False, (4, 2.0**-3)), (True, ())],
                         ids=["sum", "divided", "divided-by-powers-of-two", "sign"])
@pytest.mark.parametrize("name, ranks, sizes", [
    *(pytest.param(name, ranks, sizes, id=f"{name}-{ranks}-{kind}")
      for name in SUMMED for ranks in (3, 4) for kind, sizes in BUCKETS.items()),
    *(pytest.param(name, 6, BUCKETS["small"], id=f"{name}-6-small") for name in ("signsgd", "efsignsgd", "onebit"))])
def test_a_buckets_decoded_sums_in_one_call_equal_each_gradients(name, ranks, sizes, finish):
    """The CPU's bucket-at-once decoded sums (written into each gradient) equal the decoded
    sum of each gradient alone, byte for byte, then finished (Compressor.finish) as NumPy's
    operations would: its sign, or divided in turn (a power of two as a product, to the bit);
    with 4 ranks signSGD's votes tie (+0). A bucket of more than 8 MB streams its outputs (one
    gradient's output unaligned for it). The sign family's first four rows are summed by a
    table of their bits' combinations: all of the rows at 3 and 4 ranks, then two more at 6."""
    compressor = METHODS[name][0]()
    payloads = [[compressor.compress(NX, gradient(n, seed=n + r), INFO)[0] for r in range(ranks)] for n in sizes]
    outs = [torch.full((n,), 7.0) for n in sizes]
    if len(sizes) == 3:
        outs[2] = torch.full((sizes[2] + 1,), 7.0)[1:]  # 4 bytes past an aligned start
    into = getattr(gn, f"{'qsgd' if name in ARGUMENTS else name}_decompress_sum_into")
    assert into([[tuple(torch.from_numpy(np.asarray(t)) for t in p) for p in rows] for rows in payloads], outs,
                *ARGUMENTS.get(name, ()), finish=finish) is outs
    for n, rows, out in zip(sizes, payloads, outs):
        want = np.asarray(SUMMED[name](*(np.concatenate([np.asarray(p[i]).reshape(-1) for p in rows])
                                         for i in range(len(rows[0]))), n))
        vote, divisors = finish or (False, ())
        if vote:
            want = np.where(want > 0, np.float32(1), np.where(want < 0, np.float32(-1), want))
        for d in divisors:
            want = want / d
        same_bytes(want, out, f"{name}, {n} elements, {finish}")


HALF_SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 65504, 65519, 65520, -65520, 1e6, 6e-8,
                          2.9e-8, 3e-8, 5.96e-8, -1e-45, 6.1e-5, 6.1035e-5, 1.0, -3.0, 1 / 3], np.float32)


@pytest.fixture(params=[0, 2**40], ids=["cache 0", "cache 1 TB"])
def cache_bytes(request):
    """The last-level cache the kernels plan by: none (fp16's payloads of 8 MB and more streamed
    past it) or one that holds any payload (written through the caches)."""
    before = gn.set_cache_bytes(request.param)
    yield request.param
    gn.set_cache_bytes(before)


@pytest.mark.parametrize("held", [0, 2**41], ids=["these halves", "a step's 2 TB"])
@pytest.mark.parametrize("sizes", [BUCKETS["small"], [9, 2**22 + 5, 1001, 77]], ids=["small", "streamed"])
@pytest.mark.parametrize("world", [1, 3, 4, 6])
def test_a_buckets_half_precision_payloads_equal_the_oracles(world, sizes, cache_bytes, held):
    """fp16's bucket-at-once kernels (CPU): each gradient's payload x / n rounded to half as
    NumPy's cast rounds it (to nearest even; overflow to inf, subnormals, signed zeros, inf and
    NaN), and its averaged decompression (float(h) * n) / world, byte for byte; a power-of-two
    divisor is taken as a product, which must not change a bit. A bucket of more than 8 MB of
    output streams it (its outputs' heads up to a 32-byte boundary the scalar way: one payload
    and one result start 2 and 4 bytes past one); its payloads only where the last-level cache
    (``cache_bytes``) does not hold what the step writes before reading them back (``held``, or
    the bucket's own: small buckets' payloads streamed too)."""
    compressor = grace.fp16().compressor
    xs = [gradient(n, seed=n) * np.float32(scale) for n, scale in zip(sizes, [1, 1e-6, 1e4, 3e4])] + [HALF_SPECIALS]
    info = TensorInfo("w", 0, world)
    halves = [torch.full((x.size,), 7.0, dtype=torch.float16) for x in xs]
    halves[1] = torch.full((xs[1].size + 1,), 7.0, dtype=torch.float16)[1:]
    assert gn.fp16_compress_many_into([torch.from_numpy(x) for x in xs], world, halves, held) is halves
    outs = [torch.full((x.size,), 7.0) for x in xs]
    outs[1] = torch.full((xs[1].size + 1,), 7.0)[1:]
    assert gn.fp16_decompress_many_into(halves, world, world, outs) is outs
    for x, half, out in zip(xs, halves, outs):
        payload, ctx = compressor.compress(NX, x, info)
        same_bytes(payload[0], half, f"{x.size} elements over {world}")
        same_bytes(compressor.decompress(NX, payload, ctx) / np.float32(world), out, f"{x.size} elements")


def test_half_precision_kernels_refuse_what_they_cannot_write():
    x = torch.ones(10)
    with pytest.raises(gn.NativeUnavailable):
        gn.fp16_compress_many_into([x], 2, [torch.empty(10, dtype=torch.bfloat16)])
    with pytest.raises(gn.NativeUnavailable):
        gn.fp16_decompress_many_into([x], 2, 2, [torch.empty(10)])  # float32 payloads
    with pytest.raises(ValueError, match="same size"):
        gn.fp16_compress_many_into([x], 2, [torch.empty(9, dtype=torch.float16)])


@pytest.mark.parametrize("world", [1, 3, 4, 6])
def test_a_buckets_sums_divided_equal_torchs_division(world):
    """divide_many_into (a bucket's summed vectors averaged at once, CPU): each x / n as torch
    divides by a number, byte for byte (signed zeros, subnormals, inf and NaN), into other
    tensors or over the sums themselves; another dtype refused."""
    xs = [torch.from_numpy(gradient(n, seed=n) * np.float32(scale))
          for n, scale in zip([1, 7, 1001, 2**16 + 3], [1, 1e-38, 1e4, 3e37])] + [torch.from_numpy(HALF_SPECIALS)]
    outs = [torch.full_like(x, 7.0) for x in xs]
    assert gn.divide_many_into(xs, world, outs) is outs
    sums = [x.clone() for x in xs]
    gn.divide_many_into(sums, world, sums)
    for x, out, in_place in zip(xs, outs, sums):
        same_bytes(x / world, out, f"{x.numel()} elements over {world}")
        same_bytes(x / world, in_place, f"{x.numel()} elements over {world}, in place")
    with pytest.raises(gn.NativeUnavailable):
        gn.divide_many_into([xs[0].double()], world, [torch.empty(1)])


@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan], ids=["finite", "inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 2, 3], ids=["first", "third", "longest"])
def test_a_buckets_overflow_check_sets_the_flag_and_never_clears_it(bad, where):
    """flag_nonfinite_many (a bucket's overflow check in one call, CPU): the flag set to 1 where
    any tensor holds an inf or a NaN, wherever it lies in the tensor; a flag already set is left."""
    xs = [torch.from_numpy(gradient(n, seed=n)) for n in [1, 7, 1001, 2**16 + 3]]
    if bad is not None:
        xs[where][-1 if where else 0] = float(bad)
    flag = torch.zeros(1)
    assert gn.flag_nonfinite_many(xs, flag) is flag and flag.item() == (0.0 if bad is None else 1.0)
    flag = torch.ones(1)
    gn.flag_nonfinite_many(xs, flag)
    assert flag.item() == 1.0
    with pytest.raises(gn.NativeUnavailable):
        gn.flag_nonfinite_many([xs[0].double()], flag)


@pytest.mark.parametrize("in_place", [False, True], ids=["new", "in-place"])
@pytest.mark.parametrize("n", [1, 7, 9, 1001, 2**16 + 3])
@pytest.mark.parametrize("name", ["efsignsgd", "onebit"])
def test_residuals_of_sign_bits_equal_p_minus_the_decompression(name, n, in_place):
    """The CPU's one-pass feedback of the sign family: p - decompress(payload), into ``out``."""
    compressor = METHODS[name][0]()
    p = gradient(n, seed=n)
    p[: n // 3] = -0.0
    payload = compressor.compress(NX, p, INFO)[0]
    want = p - compressor.decompress(NX, payload, shape_of(n))
    tp = torch.from_numpy(p.copy())
    out = tp if in_place else torch.empty(n)
    got = getattr(gn, f"{name}_residual_into")(tp, *(torch.from_numpy(np.asarray(t)) for t in payload), out)
    assert got is out
    same_bytes(want, got, f"{name} residual")


def test_decoded_sums_refuse_rows_that_do_not_fit():
    with pytest.raises(ValueError, match="rows"):
        gn.signsgd_decompress_sum(np.zeros(4, np.uint8), 17)  # rows of 17 bits are 3 bytes
    with pytest.raises(ValueError, match="rows"):
        gn.efsignsgd_decompress_sum(np.zeros(6, np.uint8), np.ones(3, np.float32), 17)
    with pytest.raises(ValueError, match="rows"):  # 17 2-bit codes are 5 bytes
        gn.terngrad_decompress_sum(np.zeros(6, np.uint8), np.ones(2, np.float32), 17)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_inputs_are_read_as_float32(dtype, monkeypatch):
    x = gradient(1001, seed=5)
    t = torch.from_numpy(x).to(getattr(torch, dtype))
    xf = t.float().numpy()
    for name in ("signsgd", "onebit", "natural"):
        make, random, compress, _ = METHODS[name]
        u = draws(1001) if random else None
        want, _ = oracle(make(), xf, u, monkeypatch)
        got = compress(t, None if u is None else torch.from_numpy(u))
        for a, b in zip(want, got):
            same_bytes(a, b, name)


@pytest.mark.parametrize("huge", [False, True])
def test_natural_edge_values(huge, monkeypatch):
    """Powers of two and their neighbours, the smallest normals, subnormals, and (huge) the
    values whose upper power of two, 2^128, is not a float32. The formula reads codes off the
    float's bits, so the NumPy oracle is exact there too, as the kernels are."""
    f = np.float32
    vals = [0.0, -0.0, 1.0, -1.0, 2.0, 3.0, 0.75, f(2.0**-126), f(2.0**-127), f(2.0**-149),
            np.nextafter(f(1), f(0)), np.nextafter(f(2), f(3)), f(1.5 * 2.0**-130), f(2.0**125)]
    if huge:
        vals += [f(2.0**126), f(-3 * 2.0**125), f(2.0**127), -np.finfo(np.float32).max, np.nextafter(f(2.0**127), f(0))]
    x = np.array(vals * 3, dtype=np.float32)
    for u in (np.zeros(x.size, np.float32), np.full(x.size, 0.99999994, np.float32), draws(x.size, 9)):
        want, want_y = oracle(grace.natural().compressor, x, u, monkeypatch)
        got = gn.natural_compress(x, u)
        same_bytes(want[0], got[0], "signs")
        same_bytes(want[1], got[1], "codes")
        same_bytes(host(want_y), gn.natural_decompress(*got, x.size), "values")


def test_qsgd_all_zero_and_single_bucket_of_zeros(monkeypatch):
    x = np.zeros(100, np.float32)
    x[:50] = gradient(50, 3)
    u = draws(100)
    for bucket in (0, 10, 50):
        want, want_y = oracle(grace.qsgd(7, bucket_size=bucket).compressor, x, u, monkeypatch)
        got = gn.qsgd_compress(x, u, 7, bucket)
        same_bytes(want[0], got[0], "codes")
        same_bytes(want[1], got[1], "norms")
        same_bytes(want_y, gn.qsgd_decompress(*got, 100, 7, bucket), "values")


def test_qsgd_level_past_s_falls_back_to_s(monkeypatch):
    """A bucket's norm can come out below its largest magnitude (here the square of a tiny
    element loses bits as a subnormal), so |x| s / norm exceeds s and the draw may lift the
    level to s + 1: it falls back to s, as in the formula. 16-element buckets, one such element
    each, both signs."""
    f = np.float32
    tiny = np.geomspace(f(3.7448e-23), f(3.76e-23), 32).astype(f)
    x = np.zeros(32 * 16, f)
    x[np.arange(32) * 16 + np.arange(32) % 16] = tiny * np.where(np.arange(32) % 2, f(-1), f(1))
    for u in (np.zeros(x.size, f), draws(x.size, 4)):
        want, _ = oracle(grace.qsgd(127, bucket_size=16).compressor, x, u, monkeypatch)
        got = gn.qsgd_compress(x, u, 127, 16)
        same_bytes(want[0], got[0], "codes")
        same_bytes(want[1], got[1], "norms")
        if not u.any():  # every draw lifts: each element at level s, its code 2 s + (x < 0)
            codes = np.asarray(got[0])[x != 0]
            assert (codes == 254 + (x[x != 0] < 0)).all(), codes


@pytest.mark.parametrize("bucket", [0, 64, 1000])
def test_qsgd_norms_of_vanishing_gradients(bucket, monkeypatch):
    """A deep net's first layers have gradients of 1e-20 and below, whose squares fall below
    float32's normal range (rounded to its subnormal grid, or to zero). The kernel squares in
    float64 and rounds once (a float32 multiplication there costs a microcode assist on some
    CPUs): the same squares, so the norms and codes are NumPy's bit for bit, also where a
    bucket mixes such elements with normal ones."""
    f = np.float32
    rng = np.random.default_rng(5)
    x = (np.exp(rng.uniform(np.log(1e-30), np.log(1e-17), 5000)) * rng.choice([-1, 1], 5000)).astype(f)
    x[4000:4100] = rng.standard_normal(100).astype(f)  # a bucket of both
    x[4200:4210] = f(2.0**-75)  # squares exactly at the grid's half-way points: ties to even
    u = padded_draws(f"qsgd127_b{bucket}", x.size)
    want, want_y = oracle(grace.qsgd(127, bucket_size=bucket).compressor, x, u, monkeypatch)
    got = gn.qsgd_compress(x, u, 127, bucket)
    same_bytes(want[1], got[1], "norms")
    same_bytes(want[0], got[0], "codes")
    same_bytes(want_y.reshape(-1), gn.qsgd_decompress(*got, x.size, 127, bucket), "values")
    assert (np.asarray(got[1]) > 0).all()


@pytest.mark.parametrize("levels,bucket", [(127, 0), (15, 512), (3, 1000)])
def test_qsgd_large_tensor(levels, bucket, monkeypatch):
    """Past 8 MiB of output the decoder streams its stores; short buckets get their norms in the
    pass that makes their codes (1000: groups across buckets, two passes)."""
    n = 2**21 + 3
    x = gradient(n, seed=11)
    u = padded_draws(f"qsgd{levels}_b{bucket}", n)
    (want_codes, want_norms), want_y = oracle(grace.qsgd(levels, bucket_size=bucket).compressor, x, u, monkeypatch)
    codes, norms = gn.qsgd_compress(x, u, levels, bucket)
    same_bytes(want_codes, codes, "codes")
    same_bytes(want_norms, norms, "norms")
    same_bytes(want_y.reshape(-1), gn.qsgd_decompress(codes, norms, n, levels, bucket), "values")


@pytest.mark.parametrize("levels,bucket", [(127, 0), (64, 100), (63, 40), (32, 0), (31, 0), (100, 7)])
def test_qsgd_wide_codes_decode_as_the_table_says(levels, bucket):
    """Codes of 6 to 8 bits are decoded by arithmetic (the level times 1 / levels, corrected by
    an FMA step where needed), not looked up: every code, norms of every size, inf and NaN among
    them, decoded alone and summed over 3 ranks, give the NumPy decompression's bytes (a NaN's
    sign aside). 64 and 32 levels take the product alone, the others the FMA step."""
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    compressor = grace.qsgd(levels, bucket_size=bucket).compressor
    n, rng = 5003, np.random.default_rng(levels)
    rows = -(-n // bucket) if bucket else 1
    payloads = []
    for r in range(3):
        codes = rng.integers(0, 2 * levels + 2, n).astype(np.uint8)
        codes[:2 * levels + 2] = np.arange(2 * levels + 2)  # every code
        norms = (rng.standard_normal(rows) * 10.0 ** rng.integers(-30, 30, rows)).astype(np.float32)
        norms[r % rows] = [np.inf, np.nan, 0.0][r]
        payloads.append((np.asarray(grace.core.bits.pack(NX, codes, compressor.bits)), norms))
    with np.errstate(invalid="ignore"):  # 0 * inf
        want = [compressor.decompress(NX, p, shape_of(n)).reshape(-1) for p in payloads]

    def same(a, b, what):
        a, b = np.asarray(a).reshape(-1), host(b).reshape(-1)
        assert np.array_equal(np.isnan(a), np.isnan(b)), what
        same_bytes(np.where(np.isnan(a), np.nan, a), np.where(np.isnan(b), np.nan, b), what)

    for r, (packed, norms) in enumerate(payloads):
        same(want[r], gn.qsgd_decompress(packed, norms, n, levels, bucket), f"rank {r} decoded")
    got = gn.qsgd_decompress_sum(np.concatenate([p for p, _ in payloads]), np.concatenate([q for _, q in payloads]),
                                 n, levels, bucket)
    same(want[0] + want[1] + want[2], got, "summed")


@pytest.mark.parametrize("scale", [3.7, 1e35, 1e-35])
def test_terngrad_close_calls_are_decided_as_the_division(monkeypatch, scale):
    """The kernel decides u < |x| / s by a multiplication where that is safe: draws equal to the
    quotient, one ulp either side, tiny, subnormal and huge values, and a max |x| whose
    reciprocal is not a normal float must still give the oracle's codes."""
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(4096) * scale).astype(np.float32)
    x[:16] = [1e-38, -1e-39, 1e-45, 0.0, -0.0, 3e-30, 1.0, -1.0, 2.0, 0.5, 1e-20, -7e-40, 1e-30, 0.0, 1e-44, 4.0]
    s = np.max(np.abs(x)).astype(np.float32)
    quotient = (np.abs(x) / s).astype(np.float32)
    u = quotient.copy()
    u[1::4] = np.nextafter(quotient[1::4], np.float32(0))
    u[2::4] = np.nextafter(quotient[2::4], np.float32(1))
    u = np.clip(u, 0, np.nextafter(np.float32(1), np.float32(0))).astype(np.float32)
    (want_codes, want_scale), want_y = oracle(grace.terngrad().compressor, x, u, monkeypatch)
    codes, scale = gn.terngrad_compress(x, u)
    same_bytes(want_scale, scale, "scale")
    same_bytes(want_codes, codes, "codes")
    kept = gn.terngrad_decompress(codes, scale, x.size) != 0
    assert 0 < kept.sum() < x.size  # both outcomes occur among the close calls


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [37, 2**22 + 13], ids=["small", "streamed"])
def test_terngrad_pieces_decoded_into_their_outputs_are_the_decoding(n, threads):
    """terngrad_decompress_pieces (a shard's decoding written over the gradients it spans, CPU):
    each piece's elements of the decoding, byte for byte, whatever byte or 16-byte boundary a
    piece starts and ends on (empty pieces, pieces of a few elements, a piece past 8 MB of
    outputs that streams, an output 4 bytes past an alignment), and nothing outside them written;
    a piece past the codes' bytes refused."""
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    x = gradient(n, seed=3)
    codes, scale = gn.terngrad_compress(torch.from_numpy(x), torch.from_numpy(draws(n)))
    want = gn.terngrad_decompress(codes, scale, n).numpy()
    cuts = sorted({0, 1, 2, 3, 5, 6, 9, 10, 17, 18, n // 3, n // 3 + 1, n - 3, n})
    starts, lengths = cuts[:-1], [b - a for a, b in zip(cuts, cuts[1:])]
    starts, lengths = [0, 7] + starts, [0, 0] + lengths  # (empty pieces too)
    backing = [torch.full((m + 2,), 7.0) for m in lengths]  # (each out a view one element in: 4 bytes past)
    outs = [b[1:m + 1] for b, m in zip(backing, lengths)]
    gn.set_num_threads(threads)
    try:
        assert gn.terngrad_decompress_pieces(codes, scale, starts, lengths, outs) is outs
    finally:
        gn.set_num_threads(0)
    for start, m, out, b in zip(starts, lengths, outs, backing):
        same_bytes(want[start:start + m], out, f"elements {start}..{start + m}")
        assert b[0] == 7.0 and b[-1] == 7.0, "written outside the piece"
    with pytest.raises(ValueError, match="inside the codes"):
        gn.terngrad_decompress_pieces(codes, scale, [4 * codes.numel() - 2], [3], [torch.empty(3)])


def test_precomputed_scalars_are_used():
    x = gradient(1000, 4)
    u = draws(1000)
    packed, scale = gn.terngrad_compress(x, u)
    packed2, scale2 = gn.terngrad_compress(x, u, scale=scale)
    same_bytes(packed, packed2)
    packed3, norms = gn.qsgd_compress(x, u, 15)
    same_bytes(packed3, gn.qsgd_compress(x, u, 15, norms=norms)[0])


def test_wrong_inputs_raise():
    x = gradient(100)
    with pytest.raises(ValueError):
        gn.terngrad_compress(x, draws(50))
    with pytest.raises(TypeError):
        gn.signsgd_compress(x.astype(np.float64))
    with pytest.raises(ValueError):
        gn.unpack(np.zeros(3, np.uint8), 2, 100)


DRAWN = {  # kernel that makes its draws inside: (it given a tensor of the same draws, extra arguments)
    "natural": (gn.natural_compress_drawn, gn.natural_compress, ()),
    "terngrad": (gn.terngrad_compress_drawn, gn.terngrad_compress, ()),
    "qsgd": (gn.qsgd_compress_drawn, gn.qsgd_compress, (127, 0)),
    "qsgd 4-bit, buckets of 512": (gn.qsgd_compress_drawn, gn.qsgd_compress, (7, 512)),
    "qsgd 2-bit, buckets of 100": (gn.qsgd_compress_drawn, gn.qsgd_compress, (1, 100)),
}


@pytest.mark.parametrize("method", sorted(DRAWN))
@pytest.mark.parametrize("n", SIZES + [2047, 2048, 2049, 16383, BIG])
def test_a_compression_with_its_draws_made_inside_equals_it_given_them(method, n):
    """``*_compress_drawn`` (CPU): the counter-based draws made block by block inside the
    kernel give the payload that the same draws given as a tensor give, byte for byte."""
    from grace.core import draws

    drawn, given, args = DRAWN[method]
    seed = (0xABCDEF, 11)
    x = gradient(n, seed=n)
    x[: min(n, 3)] = np.array([np.inf, -3e38, 1e-40], np.float32)[: min(n, 3)]
    u = draws.uniform_numpy([n], [seed])
    want = given(torch.from_numpy(x), torch.from_numpy(u), *args)
    got = drawn(torch.from_numpy(x), draws.seed_words(seed), *args)
    for a, b in zip(want, got):
        same_bytes(a, b, f"{method}, {n} elements")
