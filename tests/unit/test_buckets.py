"""Buckets: the per-tensor exchange is the oracle, bit for bit; plans, frames and arguments."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import grace
from grace import native
from grace.backends import backend_for, get_backend
from grace.core import bucket as frames
from grace.core.communicator import ReplicaCommunicator
from grace.kernels.dgc import DGCFeedback
from tests.unit.conftest import METHODS, TORCH_DEVICE, to_backend

# a model's worth of shapes: matrices, vectors, a scalar, an empty one, one larger tensor
SHAPES = {"conv.weight": (4, 3, 3, 3), "conv.bias": (4,), "fc.weight": (10, 36), "fc.bias": (10,),
          "scale": (), "unused": (0,), "embed": (300, 8), "head": (1,)}
STEPS = 3


def gradients(xp, step: int) -> dict:
    rng = np.random.default_rng(step)
    return {name: to_backend(xp, rng.standard_normal(shape)) for name, shape in reversed(SHAPES.items())}


def run(xp, compression, steps=STEPS, exchange=None, first_step=0):
    exchange = exchange or grace.Exchange(compression, ReplicaCommunicator(3))
    outs = [exchange.exchange(gradients(xp, first_step + s)) for s in range(steps)]
    return exchange, outs


def with_buckets(make, bucket_mb):
    method = make()
    return grace.GradientCompression(method.compressor, method.memory, method.collective, bucket_mb=bucket_mb)


def assert_same(xp, a, b, what):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            assert_same(xp, x, y, what)
        return
    if hasattr(a, "shape") and not isinstance(a, np.ndarray):
        a, b = xp.to_numpy(a), xp.to_numpy(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)


@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["one-bucket", "several-buckets"])
@pytest.mark.parametrize("method", METHODS)
def test_bucketed_equals_per_tensor_bit_for_bit(xp, method, bucket_mb):
    reference, want = run(xp, with_buckets(METHODS[method], 0))
    bucketed, got = run(xp, with_buckets(METHODS[method], bucket_mb))
    if bucket_mb < 1:
        assert len(bucketed._buckets) > 2  # 2 kB: the embedding alone, the rest in several
    for step, (w, g) in enumerate(zip(want, got)):
        assert list(w) == list(g)
        for name in w:
            assert_same(xp, w[name], g[name], f"{method} step {step} {name}")
    for table in ("memory", "state", "steps"):
        mine, theirs = reference.state_dict()[table], bucketed.state_dict()[table]
        assert sorted(mine) == sorted(theirs), table
        for name in mine:
            assert_same(xp, mine[name], theirs[name], f"{method} {table} {name}")


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["one-bucket", "several-buckets"])
def test_powersgd_on_an_accelerator_is_bucketed_as_per_tensor_bit_for_bit(xp, rank, bucket_mb, monkeypatch):
    """PowerSGD's tensor ops on an accelerator (a bucket's compensations, divisions, updates and
    single-column orthonormalisations each as one multi-tensor operation), forced here with the
    native kernels off: every result and memory is each gradient's alone."""
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    monkeypatch.setattr(type(xp), "native", lambda self, *args: None)
    monkeypatch.setitem(METHODS, "powersgd", lambda: grace.powersgd(rank))
    test_bucketed_equals_per_tensor_bit_for_bit(xp, "powersgd", bucket_mb)


@pytest.mark.parametrize("average", [True, False], ids=["average", "sum"])
@pytest.mark.parametrize("bucket_mb", [25, 0.002, 0], ids=["one-bucket", "several-buckets", "per-tensor"])
@pytest.mark.parametrize("method", METHODS)
def test_results_written_over_the_gradients_are_the_new_results_bit_for_bit(xp, method, bucket_mb, average):
    """``in_place``: on a CPU each result is written over the gradient handed over (no new
    gradient-sized tensor per step), with the very values of new results."""
    compression = with_buckets(METHODS[method], bucket_mb)
    fresh = grace.Exchange(compression, ReplicaCommunicator(3), average=average)
    overwriting = grace.Exchange(compression, ReplicaCommunicator(3), average=average, in_place=True)
    on_cpu = TORCH_DEVICE == "cpu" or xp.name != "torch"
    for step in range(STEPS):
        want = fresh.exchange(gradients(xp, step))
        grads = gradients(xp, step)
        got = overwriting.exchange(grads)
        assert list(got) == list(want)
        for name in want:
            assert_same(xp, want[name], got[name], f"{method} step {step} {name}")
            if on_cpu and xp.numel(grads[name]):
                assert got[name] is grads[name], name
    for table in ("memory", "state", "steps"):
        mine, theirs = fresh.state_dict()[table], overwriting.state_dict()[table]
        for name in mine:
            assert_same(xp, mine[name], theirs[name], f"{method} {table} {name}")


@pytest.mark.parametrize("method", ["none", "fp16", "bf16", "signsgd", "signsgd_mean"])
def test_elementwise_methods_compress_whole_buckets_on_an_accelerator_alike(xp, method, monkeypatch):
    """On a GPU these compress each bucket as one flat tensor (here the backend is told it is
    on one): the same results as per tensor; on a CPU they go tensor by tensor."""
    reference, want = run(xp, with_buckets(METHODS[method], 0))
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    bucketed, got = run(xp, with_buckets(METHODS[method], 0.002))
    assert {plan.flat_memory for plan in bucketed.bucket_plans().values()} == {True}
    for w, g in zip(want, got):
        for name in w:
            assert_same(xp, w[name], g[name], f"{method} {name}")
    assert bucketed.state_dict()["steps"] == reference.state_dict()["steps"]
    monkeypatch.undo()
    unpatched, _ = run(xp, with_buckets(METHODS[method], 0.002), steps=1)
    on_gpu = xp.name == "torch" and TORCH_DEVICE != "cpu"  # (GRACE_TEST_DEVICE=cuda)
    assert {plan.flat_memory for plan in unpatched.bucket_plans().values()} == {on_gpu}


@pytest.mark.parametrize("method", ["topk", "dgc", "randomk", "powersgd", "signum", "efsignsgd"])
@pytest.mark.parametrize("before, after", [(25, 0), (0, 25), (25, 0.002)])
def test_checkpoints_load_under_another_bucket_size(xp, method, before, after):
    _, straight = run(xp, with_buckets(METHODS[method], before), steps=4)
    first, _ = run(xp, with_buckets(METHODS[method], before), steps=2)
    second = grace.Exchange(with_buckets(METHODS[method], after), ReplicaCommunicator(3))
    second.load_state_dict(first.state_dict())
    _, resumed = run(xp, None, steps=2, exchange=second, first_step=2)
    for w, g in zip(straight[2:], resumed):
        for name in w:
            assert_same(xp, w[name], g[name], f"{method} {before} -> {after}: {name}")


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("method", ["topk", "threshold", "randomk", "qsgd", "signsgd", "dgc", "powersgd", "inceptionn"])
def test_tensorflow_bucketed_equals_per_tensor_bit_for_bit(method, traced):
    tf = pytest.importorskip("tensorflow")
    from grace.tensorflow.state import VariableStore, VariableWireStats

    xp = get_backend("tensorflow")
    results = []
    for bucket_mb in (0, 25):
        exchange = grace.Exchange(with_buckets(METHODS[method], bucket_mb), ReplicaCommunicator(3),
                                  store=VariableStore(), stats=VariableWireStats())
        step = tf.function(exchange.exchange) if traced else exchange.exchange
        results.append([step(gradients(xp, s)) for s in range(STEPS)])
        results[-1].append(exchange.memory)
    for want, got in zip(*results):
        for name in want:
            if traced and method == "powersgd":
                # Traced, the bucketed graph's PowerSGD differs from the per-tensor graph's by
                # float32 rounding (the orthonormalisation spreads a last-bit difference over
                # the matrix): the multi-process tolerance. Eager is bit for bit.
                np.testing.assert_allclose(xp.to_numpy(got[name]), xp.to_numpy(want[name]), rtol=1e-5,
                                           atol=1e-5, err_msg=f"{method} {name}")
            else:
                assert_same(xp, want[name], got[name], f"{method} {name}")


def test_a_state_dict_is_a_copy_of_the_reused_buffers(xp):
    exchange, _ = run(xp, grace.topk(0.1), steps=1)
    saved = exchange.state_dict()
    kept = {name: np.array(xp.to_numpy(value)) for name, value in saved["memory"].items()}
    run(xp, None, steps=3, exchange=exchange, first_step=1)
    for name, value in saved["memory"].items():
        np.testing.assert_array_equal(xp.to_numpy(value), kept[name])


class NamingReplica(ReplicaCommunicator):
    """A world of ranks that all send what this one sends; the names of its allgathers and
    allreduces (the first-step check)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.names = []

    def allreduce_async(self, tensor, name):
        self.names.append(name)
        return super().allreduce_async(tensor, name)

    def allgather_async(self, tensor, name):
        self.names.append(name)
        return super().allgather_async(tensor, name)


def test_one_collective_per_bucket():
    comm = NamingReplica(2)
    counts = comm.names
    exchange = grace.Exchange(grace.topk(0.1, communicator="allgather", bucket_mb=0.002), comm)
    exchange.exchange(gradients(get_backend("numpy"), 0))
    assert counts.pop(0) == "grace.agreement"  # the ranks' first-step check, once
    assert len(counts) == len(exchange._buckets) == len(set(counts))
    counts.clear()
    exchange.exchange(gradients(get_backend("numpy"), 1))
    assert len(counts) == len(exchange._buckets) == len(set(counts))


def test_scope_bucket_selects_over_the_whole_bucket():
    """One global top-k: a bucket of a large and a tiny tensor sends only the large one's values."""
    grads = {"large": np.full(90, 10.0, np.float32), "tiny": np.full(10, 0.1, np.float32)}
    out = grace.Exchange(grace.topk(0.1, scope="bucket", memory="none"), ReplicaCommunicator(1)).exchange(grads)
    assert np.count_nonzero(out["large"]) == 10 and np.count_nonzero(out["tiny"]) == 0
    per_tensor = grace.Exchange(grace.topk(0.1, memory="none"), ReplicaCommunicator(1)).exchange(grads)
    assert np.count_nonzero(per_tensor["large"]) == 9 and np.count_nonzero(per_tensor["tiny"]) == 1


def test_an_encoding_larger_than_dense_is_sent_dense_with_the_memory_emptied():
    grads = {"w": np.linspace(-1, 1, 100).astype(np.float32)}
    exchange = grace.Exchange(grace.threshold(1e-6), ReplicaCommunicator(1))
    out = exchange.exchange(grads)
    np.testing.assert_array_equal(out["w"], grads["w"])
    # an 8-byte count per payload tensor (values, indices), the 100 dense values, the overflow
    # flag byte, padding to 8 bytes
    assert exchange.stats.last_step_bytes == 8 * 2 + 4 * 100 + 8
    assert not np.any(exchange.memory["w"])


# --- plans -------------------------------------------------------------------------------
def test_plan_fills_buckets_in_backward_order_per_dtype_and_device():
    tensors = [("a", (100,), "float32", "cpu"), ("b", (100,), "float16", "cpu"), ("c", (100,), "float32", "cpu"),
               ("big", (1000,), "float32", "cpu"), ("d", (100,), "float32", "cuda:0"), ("e", (0,), "float32", "cpu"),
               ("f", (50,), "float32", "cpu")]
    buckets = frames.plan(tensors, cap_bytes=1000)
    assert [b.names for b in buckets] == [("a", "c"), ("b",), ("big",), ("d",), ("f",)]
    assert [b.dtype for b in buckets] == ["float32", "float16", "float32", "float32", "float32"]
    assert buckets[0].segments[1].offset == 100 and buckets[0].numel == 200
    assert len({b.key for b in buckets}) == len(buckets)
    assert frames.plan(tensors, cap_bytes=1000) == buckets  # every rank plans the same
    # each bucket knows the step's bytes, every bucket's (what is compressed before any is read back)
    assert {b.step_bytes for b in buckets} == {4 * 100 + 2 * 100 + 4 * 100 + 4 * 1000 + 4 * 100 + 4 * 50}


def test_plan_refuses_non_float_gradients_by_name():
    with pytest.raises(TypeError, match="'layer.weight' has dtype complex64"):
        frames.plan([("layer.weight", (3,), "complex64", "cpu")], 2**20)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_frames_round_trip_every_dtype_aligned(backend):
    xp = get_backend(backend)
    pieces = [to_backend(xp, np.arange(n), dtype) for n, dtype in
              [(3, "uint8"), (5, "float32"), (2, "int64"), (7, "float16"), (1, "int16")]]
    dtypes, counts = [xp.dtype(p) for p in pieces], [xp.numel(p) for p in pieces]
    for variable in (False, True):
        for flag in (None, 0, 1):  # unguarded; a rank's overflow flag, down or up
            flagged = flag is not None
            flag_tensor = to_backend(xp, np.asarray([flag]), "float32") if flagged else None
            frame = frames.frame(xp, pieces, variable, pieces[1], flag_tensor)
            assert xp.numel(frame) % 8 == 0
            assert xp.numel(frame) == frames.frame_size(counts, dtypes, variable, flagged)
            data = xp.concat([frame, frame])  # two ranks' frames, as allgather returns them
            first, flag1, end = frames.read_frame(xp, data, 0, dtypes, counts, variable, 0, "float32", flagged)
            second, flag2, _ = frames.read_frame(xp, data, end, dtypes, counts, variable, 0, "float32", flagged)
            for got, got_flag in ((first, flag1), (second, flag2)):
                assert (got_flag is None) if not flagged else xp.to_numpy(got_flag).tolist() == [flag]
                for p, q in zip(pieces, got):
                    assert xp.dtype(q) == xp.dtype(p)
                    np.testing.assert_array_equal(xp.to_numpy(q), xp.to_numpy(p))
            # where the layout says the pieces and the flag lie
            placed, flag_at, size = frames.layout(dtypes, counts, variable, flagged)
            raw = xp.to_numpy(frame)
            assert size == raw.size and (flag_at is None) == (not flagged)
            if flagged:
                assert raw[flag_at] == flag
            for p, (offset, count, dtype) in zip(pieces, placed):
                assert (count, dtype) == (xp.numel(p), xp.dtype(p))
                np.testing.assert_array_equal(raw[offset:offset + count * frames.ITEMSIZE[dtype]],
                                              xp.to_numpy(p).view(np.uint8).ravel())


@pytest.mark.parametrize("flagged", [True, False])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_variable_frames_are_read_from_their_headers_into_frame_rows(backend, flagged):
    """``grace.native.variable_rows`` reads each rank's variable-length frame (another length per
    rank; ``frames.frame``'s format, which ``frames.layout`` states) from its header: field j's
    pointers land on every rank's piece j of each unit, in (unit, rank) order, with its count,
    and the set overflow flags are counted; a rank that sent its dense bucket is left to the
    caller (NativeUnavailable), and headers that do not add up to the bytes received, or a frame
    cut short, are refused."""
    import ctypes

    import grace.native as gn

    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    xp = get_backend(backend)
    dtypes = ["float32", "int16", "float32", "uint8"]
    ranks = [[np.arange(5 - r, dtype=np.float32) + r, np.arange(r + 2, dtype=np.int16) * (r + 1),
              np.arange(2 * r, dtype=np.float32), np.arange(r + 3, dtype=np.uint8)] for r in range(3)]
    flags = [0, 1, 1]
    sent = [frames.frame(xp, [xp.asarray(a) for a in row], True, None,
                         flag=xp.asarray(np.array([f], np.uint8)) if flagged else None)
            for row, f in zip(ranks, flags)]
    data = xp.concat(sent)
    rows, flags_set = gn.variable_rows(data, 3, dtypes, [2, 2], flagged)
    assert flags_set == (2 if flagged else 0)
    starts = np.cumsum([0] + [xp.numel(f) for f in sent[:-1]])
    base = xp.to_numpy(data).ctypes.data  # (the same memory on a CPU)
    for j in (0, 1):
        field = rows.field(j)
        assert field.dtypes == [dtypes[j], dtypes[2 + j]]
        for u in range(2):
            for r in range(3):
                want = ranks[r][2 * u + j]
                offset = frames.layout(dtypes, [a.size for a in ranks[r]], True, flagged)[0][2 * u + j][0]
                assert field.pointers[u * 3 + r] == base + int(starts[r]) + offset
                assert field.piece_counts[u * 3 + r] == want.size
                got = np.frombuffer((ctypes.c_char * want.nbytes).from_address(field.pointers[u * 3 + r]), want.dtype)
                np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="without a field 2"):
        rows.field(2)
    dense = frames.dense_frame(xp, xp.asarray(np.ones(4, np.float32)), len(dtypes), None)
    with pytest.raises(gn.NativeUnavailable, match="dense"):
        gn.variable_rows(xp.concat([sent[0], dense]), 2, dtypes, [2, 2])
    for cut in (data[:-8], data[:5], xp.concat([data, data[:8]])):
        with pytest.raises(RuntimeError, match="do not add up"):
            gn.variable_rows(cut, 3, dtypes, [2, 2], flagged)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_frame_rows_point_at_every_ranks_pieces_unit_by_unit(backend):
    """``grace.native.FrameRows``: frames of one layout, two units' payloads of two pieces and
    one piece each: field j's pointers in (unit, rank) order land on each rank's piece, with
    each unit's count and dtype; a unit without field j, or a piece past the end, is refused.
    (The sums fed from it: ``test_bucketed_equals_per_tensor_bit_for_bit``.)"""
    import ctypes

    import grace.native as gn

    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    xp = get_backend(backend)
    ranks = [[np.arange(5, dtype=np.float32) + r, np.arange(4, dtype=np.int16) * (r + 1),
              np.arange(3, dtype=np.uint8) + 7 * r] for r in range(3)]
    sent = [frames.frame(xp, [xp.asarray(a) for a in row], False, None) for row in ranks]
    data, size = xp.concat(sent), xp.numel(sent[0])
    layout = frames.layout(["float32", "int16", "uint8"], [5, 4, 3], False)[0]
    rows = gn.FrameRows(data, [0, size, 2 * size], layout, [2, 1])
    assert (rows.ranks, rows.units) == (3, 2)
    for j, units in ((0, (0, 2)), (1, (1,))):
        if j == 1:
            with pytest.raises(ValueError, match="without a field 1"):
                rows.field(j)
            continue
        field = rows.field(j)
        pointers, counts, dtypes = field.pointers, field.counts, field.dtypes
        assert counts == [ranks[0][i].size for i in units] and dtypes == [str(ranks[0][i].dtype) for i in units]
        for u, piece in enumerate(units):
            for r in range(3):
                want = ranks[r][piece]
                got = np.frombuffer((ctypes.c_char * want.nbytes).from_address(pointers[u * 3 + r]), want.dtype)
                np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="past the end"):
        gn.FrameRows(data, [0, size, 2 * size + 8], layout, [2, 1])


# --- arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(bucket_mb=-1), "bucket_mb must be a finite number >= 0"),
    (dict(bucket_mb="25"), "bucket_mb must be a finite number >= 0"),
    (dict(bucket_mb=float("nan")), "bucket_mb must be a finite number >= 0"),
    (dict(scope="layer"), "scope must be one of 'tensor', 'bucket'"),
    (dict(scope="bucket", bucket_mb=0), "scope='bucket' compresses whole buckets: it needs bucket_mb > 0"),
])
def test_bad_bucket_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        grace.topk(0.01, **kwargs)


def test_powersgd_cannot_compress_whole_buckets():
    with pytest.raises(ValueError, match="scope='bucket' cannot be used with PowerSGD"):
        grace.powersgd(1, scope="bucket")


def test_bucket_arguments_come_through_the_grace_parameter_dictionary():
    compression = grace.from_params({"compressor": "topk", "compress_ratio": 0.01, "bucket_mb": 4,
                                     "scope": "bucket"})
    assert (compression.bucket_mb, compression.scope) == (4.0, "bucket")
    assert grace.topk(0.01).bucket_mb == 25.0 and "bucket_mb=25" in repr(grace.topk(0.01))


def test_powersgd_writes_its_approximations_straight_over_the_gradients(xp, monkeypatch):
    """In place on a CPU, a bucket's PowerSGD rounds write each matrix's P Q^T over its gradient
    with the product itself (no copy after): the results of a new-tensor exchange, bit for bit."""
    if TORCH_DEVICE != "cpu" and xp.name == "torch":
        pytest.skip("results are new tensors on a GPU")
    written = []
    real = type(xp).matmul_into
    monkeypatch.setattr(type(xp), "matmul_into", lambda self, a, b, out: written.append(out) or real(self, a, b, out))
    expand = native.KERNELS["lowrank_expand_many"]  # (the products on a CPU where grace.native is built)

    def expand_recorded(ps, qs, shapes, outs, *args, **kwargs):
        written.extend(out for out in outs if out is not None)
        return expand.function(ps, qs, shapes, outs, *args, **kwargs)
    monkeypatch.setitem(native.KERNELS, "lowrank_expand_many", dataclasses.replace(expand, function=expand_recorded))
    compression = with_buckets(METHODS["powersgd"], 25)
    fresh = grace.Exchange(compression, ReplicaCommunicator(3))
    overwriting = grace.Exchange(compression, ReplicaCommunicator(3), in_place=True)
    for step in range(STEPS):
        want = fresh.exchange(gradients(xp, step))
        grads = gradients(xp, step)
        written.clear()
        got = overwriting.exchange(grads)
        matrices = [name for name, g in grads.items() if len(xp.shape(g)) >= 2]
        assert matrices and sorted(map(id, written)) == sorted(id(grads[name]) for name in matrices)
        for name in want:
            assert got[name] is grads[name]
            assert_same(xp, want[name], got[name], f"step {step} {name}")


@pytest.mark.parametrize("method", ["dgc", "dgc_warmup"])
def test_dgc_memory_steps_in_place_as_its_formula(xp, method, monkeypatch):
    """Bucketed on a CPU, DGC's memory writes the new (u, v) into spare buffers and changes
    only the sent elements after selecting (a gradient at a time, or the whole bucket in one
    native call): the same outputs and memories as its formula."""
    taken = []

    def spy(fused):
        def spied(self, *args, **kwargs):
            result = fused(self, *args, **kwargs)
            taken.append(result is not None)
            return result
        return spied

    monkeypatch.setattr(DGCFeedback, "fused_step", spy(DGCFeedback.fused_step))
    monkeypatch.setattr(DGCFeedback, "fused_steps", spy(DGCFeedback.fused_steps))
    in_place = run(xp, with_buckets(METHODS[method], 25), steps=4)
    assert any(taken), "the in-place step was not taken"
    if xp.name == "torch" and TORCH_DEVICE == "cpu" and grace.native.available():
        assert all(taken), "the bucket's native step was not taken"
    monkeypatch.setattr(DGCFeedback, "fused_step", lambda *args, **kwargs: None)
    monkeypatch.setattr(DGCFeedback, "fused_steps", lambda *args, **kwargs: None)
    formula = run(xp, with_buckets(METHODS[method], 25), steps=4)
    for a, b in zip(formula[1], in_place[1]):
        for name in a:
            assert_same(xp, a[name], b[name], name)
    for name, state in formula[0].memory.items():
        assert_same(xp, state, in_place[0].memory[name], name)


@pytest.mark.parametrize("method", ["topk", "randomk", "dgc"])
def test_a_loaded_state_is_never_written_by_later_steps(xp, method):
    """Memory buffers are reused as spares; a state handed to load_state_dict stays the
    caller's (Horovod's elastic state, for one, restores the same dict again)."""
    exchange, _ = run(xp, with_buckets(METHODS[method], 25), steps=2)
    saved = exchange.state_dict()
    kept = {name: [np.array(xp.to_numpy(t)) for t in (v if isinstance(v, tuple) else (v,))]
            for name, v in saved["memory"].items()}
    for _ in range(3):
        exchange.load_state_dict(saved)
        run(xp, None, steps=3, exchange=exchange, first_step=2)
    for name, value in saved["memory"].items():
        for t, k in zip(value if isinstance(value, tuple) else (value,), kept[name]):
            np.testing.assert_array_equal(xp.to_numpy(t), k, err_msg=name)


class SummingInPlace(ReplicaCommunicator):
    """Replicas whose allreduce sums into the tensor it is given, as torch.distributed does
    (which has no grouped allreduce: every bucket's payloads are joined into one buffer)."""

    def grouped_allreduce(self, dtype):
        return False

    def allreduce_async(self, tensor, name):
        backend_for(tensor).multiply_into(tensor, self.size, tensor)
        return lambda: tensor


@pytest.mark.parametrize("method", ["none", "fp16", "randomk"])
def test_averages_are_never_views_of_buffers_the_exchange_reuses(xp, method):
    """A bucket's sums are averaged in place only in a collective's new output: where the
    collective summed the exchange's own send buffer, a step's results survive the next."""
    make = lambda communicator: grace.Exchange(with_buckets(METHODS[method], 25), communicator)  # noqa: E731
    first = make(SummingInPlace(3)).exchange(gradients(xp, 0))
    kept = {name: np.array(xp.to_numpy(t)) for name, t in first.items()}
    exchange = make(SummingInPlace(3))
    out = exchange.exchange(gradients(xp, 0))
    exchange.exchange(gradients(xp, 1))
    for name, value in out.items():
        np.testing.assert_array_equal(xp.to_numpy(value), kept[name], err_msg=name)


class SummingIntoNewTensors(ReplicaCommunicator):
    """Replicas that never sum in place: every sum is a new tensor."""

    def sums_in_place(self, tensor):
        return False


@pytest.mark.parametrize("communicator", [ReplicaCommunicator, SummingIntoNewTensors], ids=["in-place", "new-sums"])
def test_payloads_a_kernel_wrote_into_one_buffer_are_averaged_as_their_sums_come(communicator):
    """fp16 on a CPU: a bucket's payloads written by one native call into the kept buffer that is
    sent. Summed in place, the payloads are the sums' views; summed into a new tensor, the sums
    are cut from it; both give the per-tensor results, step after step (the views kept)."""
    pytest.importorskip("torch")
    xp = get_backend("torch")
    if not native.available("cpu"):
        pytest.skip("grace's CPU library is not built")
    reference = grace.Exchange(with_buckets(METHODS["fp16"], 0), ReplicaCommunicator(3))
    exchange = grace.Exchange(with_buckets(METHODS["fp16"], 25), communicator(3), in_place=True)
    for step in range(STEPS):
        want, got = reference.exchange(gradients(xp, step)), exchange.exchange(gradients(xp, step))
        for name in want:
            assert_same(xp, want[name], got[name], f"step {step} {name}")
    assert any(name.endswith(".payload") for name in exchange.buffers.flat)  # (the one-buffer path ran)


@pytest.mark.parametrize("method", ["topk", "threshold", "signsgd", "efsignsgd", "none"])
def test_results_are_written_over_gradients_that_are_not_contiguous(method):
    """A transposed gradient cannot take a kernel's output in place: it gets the result by
    a copy, with the same values."""
    torch = pytest.importorskip("torch")
    xp = get_backend("torch")

    def grads(step):
        rng = np.random.default_rng(step)
        return {"w": torch.from_numpy(rng.standard_normal((40, 30)).astype(np.float32)).t(),
                "b": torch.from_numpy(rng.standard_normal(30).astype(np.float32))}

    compression = with_buckets(METHODS[method], 25)
    fresh = grace.Exchange(compression, ReplicaCommunicator(3))
    overwriting = grace.Exchange(compression, ReplicaCommunicator(3), in_place=True)
    for step in range(STEPS):
        given = grads(step)
        want, got = fresh.exchange(grads(step)), overwriting.exchange(given)
        for name in want:
            assert got[name] is given[name]
            assert_same(xp, want[name], got[name], f"{method} step {step} {name}")


@pytest.mark.parametrize("method", [m for m in METHODS if METHODS[m]().compressor.traits.new_payload])
def test_new_payloads_never_share_memory_with_the_input(method):
    """``Traits.new_payload`` lets the exchange compensate into a buffer it overwrites with
    the new memory before the payload is framed: it must hold for every path of compress."""
    compressor = METHODS[method]().compressor
    if compressor.traits.multi_round:
        pytest.skip("multi-round methods compress in rounds")
    xp = get_backend("numpy")
    x = np.random.default_rng(0).standard_normal((30, 20)).astype(np.float32)
    info = grace.core.compressor.TensorInfo("w", 1, 2)
    state = compressor.init_state(xp, x, info)
    payload, _, _ = compressor.step(xp, x, info, state)
    for t in payload:
        assert not np.shares_memory(np.asarray(t), x), method


def test_dgc_with_clipping_takes_one_native_call_per_bucket_with_the_per_tensor_results(xp, monkeypatch):
    """DGC's clipping: on a CPU a bucket's step stays one native call, each gradient's factor
    clip_norm / max(|g|, clip_norm) computed first (its norm, as per tensor) and applied where
    the call reads g; results, memories and steps as per tensor, bit for bit, with gradients
    clipped (norms 10-50) and not (norms below 3) in one bucket."""
    scales = []
    step_many = native.KERNELS["dgc_step_many"]

    def recorded(*args, **kwargs):
        done = step_many.function(*args, **kwargs)
        scales.append((kwargs.get("scales"), done is not None))
        return done
    monkeypatch.setitem(native.KERNELS, "dgc_step_many", dataclasses.replace(step_many, function=recorded))
    make = lambda: grace.dgc(0.1, clip_norm=3.0)  # noqa: E731
    reference, want = run(xp, with_buckets(make, 0))
    bucketed, got = run(xp, with_buckets(make, 25))
    for step, (w, g) in enumerate(zip(want, got)):
        for name in w:
            assert_same(xp, w[name], g[name], f"step {step} {name}")
    for table in ("memory", "steps"):
        a, b = reference.state_dict()[table], bucketed.state_dict()[table]
        for name in a:
            assert_same(xp, a[name], b[name], f"{table} {name}")
    if xp.name == "torch" and TORCH_DEVICE == "cpu" and native.available("cpu"):  # (where the call runs)
        assert scales and all(ran for _, ran in scales)
        clipped = [s for s in scales[0][0] if s != 1.0]
        assert 0 < len(clipped) < len(scales[0][0]) and all(0 < s < 1 for s in clipped)
