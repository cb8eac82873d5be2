"""Segment-wise buckets (grace.core.segments): on an accelerator a segmented method compresses a
bucket's gradients in one pass, and the per-tensor exchange stays the oracle, bit for bit.

Here the backend is told it is on an accelerator; with GRACE_TEST_DEVICE=cuda the torch
tensors really are."""
from __future__ import annotations

import numpy as np
import pytest

import grace
import grace.native as gn
from grace.core import bits, segment_packing, segments, sparse_frames
from grace.core.communicator import ReplicaCommunicator
from grace.core.compressor import TensorInfo
from grace.core.plans.kernels import MethodKernels, kernels_of
from tests.unit.conftest import METHODS, to_backend
from tests.unit import test_buckets
from tests.unit.test_buckets import assert_same, with_buckets

# every size of index on the wire (uint8, int16, int32), a scalar, an empty tensor, ties
SHAPES = {"head": (10, 12), "bias": (10,), "scale": (), "unused": (0,), "embed": (300, 8), "wide": (3, 11000),
          "tied": (50,), "one": (1,)}
SEGMENTED = [label for label, make in METHODS.items() if kernels_of(make().compressor).segmented]


def gradients(xp, step: int, bad=None) -> dict:
    rng = np.random.default_rng(step)
    grads = {name: rng.standard_normal(shape) for name, shape in reversed(SHAPES.items())}
    grads["tied"][:] = 0.25  # every element ties with the k-th largest
    grads["embed"][:200] = 0.0  # unused rows
    if bad is not None:
        grads["head"].flat[7] = bad
    return {name: to_backend(xp, g) for name, g in grads.items()}


@pytest.fixture(autouse=True)
def _index_draws_by_device(monkeypatch):
    """Random indices by the tensors' device, whichever path the backend is told it is on: these
    tests compare plans, not the two rules of drawing indices (test_draws does)."""
    try:
        from grace.backends import torch_backend
    except ImportError:
        return
    monkeypatch.setattr(torch_backend, "_counter_indices", lambda backend, like: like is not None and
                        like.device.type != "cpu")


@pytest.fixture
def accelerator(xp, monkeypatch):
    """The backend told that its tensors are on an accelerator."""
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    return xp


def run(xp, compression, steps=3, exchange=None, first_step=0, bad_step=None):
    exchange = exchange or grace.Exchange(compression, ReplicaCommunicator(3))
    outs = [exchange.exchange(gradients(xp, s, np.inf if s == bad_step else None))
            for s in range(first_step, first_step + steps)]
    return exchange, outs


def segmented_plans(exchange) -> list:
    """The plans of an exchange's buckets that went segment-wise."""
    return [plan for plan in exchange.bucket_plans().values() if plan.name == "segmented"]


def last_step_layout(xp, exchange, plan):
    """The frame layout of a fixed-k segmented bucket's latest step: its own, or that of the
    step's k during a warm-up (DGC)."""
    steps, name = exchange.state_dict()["steps"], plan.bucket.names[0]  # (kept by gradient name)
    step = int(np.asarray(steps[name])) - 1 if name in steps else 0  # (unguarded: every step is step 0)
    ks = exchange.compression.compressor._layout(xp, plan.table, step, plan.table.start)[1].ks
    return plan._layout_of(xp, None if ks == plan.services.kernels._ks(plan.table) else ks, plan.table.start)


def assert_runs_equal(xp, want, got, what):
    (a, a_outs), (b, b_outs) = want, got
    for w, g in zip(a_outs, b_outs):
        for name in w:
            assert_same(xp, w[name], g[name], f"{what}: {name}")
    for table in ("memory", "steps"):
        state_a, state_b = a.state_dict()[table], b.state_dict()[table]
        assert sorted(state_a) == sorted(state_b), f"{what}: {table}"
        for name in state_a:
            assert_same(xp, state_a[name], state_b[name], f"{what}: {table} {name}")
    plans = segmented_plans(b)
    if b.compression.compressor.traits.variable_length and plans and not any(plan.variable for plan in plans):
        # k slots per segment (DGC; its k at the step during a warm-up): its frames' sizes
        assert b.stats.last_step_bytes == sum(last_step_layout(xp, b, plan).size for plan in plans), what
        assert b.stats.bytes_sent < 1.2 * a.stats.bytes_sent, (what, a.stats.bytes_sent, b.stats.bytes_sent)
    else:
        assert a.stats.bytes_sent == b.stats.bytes_sent, what


def test_the_catalogue_has_segmented_methods():
    assert "topk" in SEGMENTED


# each method on its own collective, and the allgather ones also by broadcasts
COLLECTIVES = [(label, METHODS[label]().collective.value) for label in SEGMENTED] + [
    (label, "broadcast") for label in SEGMENTED if METHODS[label]().collective.value != "allreduce"]


@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["one-bucket", "several-buckets"])
@pytest.mark.parametrize("method, communicator", COLLECTIVES)
def test_segmented_equals_per_tensor_bit_for_bit(xp, method, communicator, bucket_mb, monkeypatch):
    make = lambda mb: grace.GradientCompression(  # noqa: E731
        METHODS[method]().compressor, METHODS[method]().memory, communicator, bucket_mb=mb)
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: False)
    units = run(xp, make(bucket_mb))  # gradient by gradient (also the dense fallback)
    per_tensor = run(xp, make(0))
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    segmented = run(xp, make(bucket_mb))
    assert not segmented_plans(units[0])
    plans = segmented[0].bucket_plans().values()
    assert segmented_plans(segmented[0]) and {plan.flat_memory for plan in plans} == {True}
    assert_runs_equal(xp, units, segmented, f"{method} {communicator}")
    fixed = all(isinstance(plan.own_layout, segments.SegmentedFrame) for plan in segmented_plans(segmented[0]))
    if fixed and not any(plan.own_layout.size > 4 * plan.table.numel + 8 for plan in segmented_plans(segmented[0])):
        # nothing went dense: the per-tensor exchange's results, with its bytes less the padding
        # (variable lengths: each rank decides per step; the bucketed results above are the oracle)
        for w, g in zip(per_tensor[1], segmented[1]):
            for name in w:
                assert_same(xp, w[name], g[name], f"{method}: {name}")


@pytest.mark.parametrize("ratio", [0.01, 0.2, 0.6, 1.0])
def test_segmented_top_k_follows_the_native_rule_for_ties(xp, ratio):
    """The k largest magnitudes of each segment; among those equal to the k-th, the first ones
    (the rule of grace.native's selection), checked against a stable sort."""
    rng = np.random.default_rng(1)
    numels = [1, 7, 50, 256, 257, 1000, 40000]
    values = rng.choice(np.float32([0, 0.5, -0.5, 1, 2, -2, np.inf]), sum(numels)).astype(np.float32)
    values[: 300] = rng.standard_normal(300)
    x = to_backend(xp, values)
    table = segments.SegmentTable.build(xp, numels, x)
    k = [min(d, max(1, int(np.ceil(ratio * d)))) for d in numels]
    mask = xp.to_numpy(segments.top_mask(xp, segments.magnitude_keys(xp, x), table, k))
    for start, d, kk in zip(table.starts, numels, k):
        part = np.abs(values[start:start + d])
        want = np.zeros(d, bool)
        want[np.argsort(-part, kind="stable")[:kk]] = True
        np.testing.assert_array_equal(mask[start:start + d], want, err_msg=f"segment of {d}, k={kk}")


@pytest.mark.parametrize("method", SEGMENTED)
def test_an_overflow_costs_one_segmented_step(accelerator, method, monkeypatch):
    """An inf in one step: NaN gradients in its bucket that step and every state as before it,
    as gradient by gradient."""
    xp = accelerator
    segmented = run(xp, with_buckets(METHODS[method], 0.002), steps=4, bad_step=1)
    assert segmented_plans(segmented[0])
    assert np.isnan(xp.to_numpy(segmented[1][1]["head"])).all()
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: False)  # (a real GPU too)
    units = run(xp, with_buckets(METHODS[method], 0.002), steps=4, bad_step=1)
    assert not segmented_plans(units[0])
    assert_runs_equal(xp, units, segmented, method)


@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["one-bucket", "several-buckets"])
def test_an_overflow_costs_powersgd_one_step_with_its_count_left_on_the_accelerator(accelerator, bucket_mb,
                                                                                    monkeypatch):
    """PowerSGD's buckets on an accelerator leave the count of flagged ranks on the device until
    the step ends (its results poisoned by one multi-tensor division): NaN gradients in its bucket
    that step, every state as before it, and otherwise the results bit for bit as on a CPU."""
    xp = accelerator
    make = lambda: with_buckets(METHODS["powersgd"], bucket_mb)  # noqa: E731
    reads, read = [], type(xp).host_ints
    monkeypatch.setattr(type(xp), "host_ints", lambda self, x, count: reads.append(count) or read(self, x, count))
    on_device = run(xp, make(), steps=4, bad_step=1)
    plans = on_device[0].bucket_plans().values()
    assert {plan.name for plan in plans} == {"multi-round"}
    assert reads.count(1) == 4  # the overflow count: one read a step, however many buckets
    assert np.isnan(xp.to_numpy(on_device[1][1]["head"])).all()
    assert {xp.dtype(g) for g in on_device[1][1].values()} == {"float32"}
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: False)
    here = run(xp, make(), steps=4, bad_step=1)
    assert_runs_equal(xp, here, on_device, "powersgd")


@pytest.mark.parametrize("before, after", [(25, 0), (0, 25), (25, 0.002)])
@pytest.mark.parametrize("method", SEGMENTED)
def test_segmented_checkpoints_load_under_another_bucket_size(accelerator, method, before, after):
    """The per-gradient test, with segment-wise buckets: their flat memory saved per name."""
    test_buckets.test_checkpoints_load_under_another_bucket_size(accelerator, method, before, after)


def test_one_collective_per_segmented_bucket(accelerator):
    comm = test_buckets.NamingReplica(2)
    names = comm.names
    exchange = grace.Exchange(grace.topk(0.1, communicator="allgather", bucket_mb=0.002), comm)
    for step in range(2):
        names.clear()
        exchange.exchange(gradients(accelerator, step))
        sent = [n for n in names if n != "grace.agreement"]
        assert len(sent) == len(exchange._buckets) == len(segmented_plans(exchange)) == len(set(sent))


def test_float16_buckets_go_gradient_by_gradient(accelerator):
    """Segment-wise compression reads float32 keys; other dtypes keep the per-gradient path."""
    grads = {name: accelerator.cast(g, "float16") for name, g in gradients(accelerator, 0).items()}
    exchange = grace.Exchange(grace.topk(0.1, communicator="allgather"), ReplicaCommunicator(2))
    exchange.exchange(grads)
    assert not segmented_plans(exchange)


def test_a_flat_bucket_buffer_as_ddp_hands_it(accelerator):
    """DDP gives the bucket as one flat buffer with the gradients as views of it."""
    xp = accelerator
    by_exchange = grace.Exchange(grace.topk(0.1, communicator="allgather"), ReplicaCommunicator(2))
    by_buffer = grace.Exchange(grace.topk(0.1, communicator="allgather"), ReplicaCommunicator(2))
    for step in range(3):
        grads = {n: g for n, g in gradients(xp, step).items() if xp.numel(g)}
        want = by_exchange.exchange(grads)
        (bucket,) = by_buffer.bucket_layout([(n, xp.shape(g), xp.dtype(g), xp.device(g)) for n, g in grads.items()])
        flat = xp.concat([xp.flatten(grads[n]) for n in bucket.names])
        views = [xp.reshape(flat[s.offset:s.offset + s.numel], s.shape) for s in bucket.segments]
        got = by_buffer.finish_bucket(by_buffer.start_bucket(bucket, views, flat=flat))
        by_buffer.end_step()
        assert segmented_plans(by_buffer)
        for name, value in zip(bucket.names, got):
            assert_same(xp, want[name], value, f"step {step}: {name}")


def test_the_segmented_ops_run_on_tensorflow_too():
    """TensorFlow buckets go gradient by gradient (its tensors cannot be written in place), but
    its backend has the segmented ops: the selection and the frames agree with NumPy's."""
    pytest.importorskip("tensorflow")
    from grace.backends import get_backend

    results, sums = [], []
    for name in ("numpy", "tensorflow"):
        xp = get_backend(name)
        values = np.random.default_rng(3).standard_normal(3000).astype(np.float32)
        x = xp.cast(values, "float32")
        table = segments.SegmentTable.build(xp, [100, 900, 2000], x)
        mask = segments.top_mask(xp, segments.magnitude_keys(xp, x), table, [3, 9, 20])
        layout = segments.SegmentedFrame(xp, kernels_of(grace.topk(0.01).compressor).segment_fields(table.numels, "float32"),
                                         True, x)
        fields, _, _ = kernels_of(grace.topk(0.01).compressor).compress_segments(xp, x, table, [None] * 3)
        frame = layout.write(xp, fields, xp.zeros(1, "uint8", like=x))
        read, flags = layout.read(xp, xp.concat([frame, frame]), 2)
        odd = segments.SegmentTable.build(xp, [0, 7, 993, 0, 2000], x)  # (empty segments too)
        sums.append(xp.to_numpy(xp.segment_sum(x, odd.counts)))
        results.append([xp.to_numpy(t) for t in (mask, frame, *read, flags, xp.segment_max(xp.abs(x), odd.counts))])
    for want, got in zip(*results):
        np.testing.assert_array_equal(want, got)
    np.testing.assert_allclose(*sums, rtol=1e-6)  # (NumPy's pairwise float32 sums, TensorFlow's in float64)


@pytest.mark.parametrize("memory", ["none", "residual"])
def test_segmented_top_k_with_and_without_memory(xp, memory, monkeypatch):
    """With residual memory a bucket runs the fused error-feedback kernel segment by segment,
    without it the selection alone (or, with no native library, the sorted selection here)."""
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: False)
    per_tensor = run(xp, grace.topk(0.05, memory=memory, bucket_mb=0))
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    segmented = run(xp, grace.topk(0.05, memory=memory, communicator="allgather", bucket_mb=0.002))
    assert segmented_plans(segmented[0])
    for w, g in zip(per_tensor[1], segmented[1]):
        for name in w:
            assert_same(xp, w[name], g[name], f"{memory}: {name}")


def test_native_segment_calls_refuse_segments_outside_their_buffers():
    """The native loops write through pointers: segments that do not fit are an error, not a
    write past the end."""
    torch = pytest.importorskip("torch")
    import grace.native as gn

    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    x = torch.randn(100)
    with pytest.raises(ValueError, match="do not fit in 100 elements"):
        gn.onebit_compress_segments(x, [0, 60], [60, 41])
    with pytest.raises(ValueError, match="2 seeds for 3 segments"):
        gn.terngrad_compress_segments(x, [0, 50, 80], [50, 30, 20], [(1, 2), (3, 4)])
    with pytest.raises(ValueError, match="do not fit"):
        gn.topk_ef_step_segments(x, torch.zeros(100), [0, 90], [90, 20], [1, 1])
    packed, scale = gn.efsignsgd_compress_segments(x, [0, 50], [50, 50])
    with pytest.raises(ValueError):
        gn.efsignsgd_decompress_segments(packed[:-1], scale, [50, 50])
    # a bucket's layout comes as tuples, checked once per layout and buffer size: a layout
    # that fit one buffer is still refused for a shorter one
    gn.onebit_compress_segments(x, (0, 60), (60, 40))
    with pytest.raises(ValueError, match="do not fit in 90 elements"):
        gn.onebit_compress_segments(x[:90], (0, 60), (60, 40))
    with pytest.raises(ValueError, match="do not fit in 100 elements"):
        gn.onebit_compress_segments(x, (0, 60), (60, 41))
    with pytest.raises(ValueError):
        gn.efsignsgd_decompress_segments(packed[:-1], scale, (50, 50))


def test_sparse_frames_mean_reads_the_frames_in_place_and_refuses_stray_indices():
    """``grace.native.sparse_frames_mean`` (top-k's and DGC's aggregate on an accelerator, from
    the received frames as they lie): bit for bit the fields read and scattered rank after
    rank, every width of index; NaN everywhere where a rank flagged an overflow, and the
    flagging ranks counted; an index outside the bucket refused, not written."""
    torch = pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend

    xp, rng = get_backend("torch"), np.random.default_rng(5)
    like = torch.zeros(1)
    table = segments.SegmentTable.build(xp, [100, 900, 40000], like)  # uint8, int16 and int32 indices
    kernels = kernels_of(grace.topk(0.01).compressor)
    layout = segments.SegmentedFrame(xp, kernels.segment_fields(table.numels, "float32"), True, like)

    def frames(flags):
        sent = []
        for flag in flags:
            fields, ctx, _ = kernels.compress_segments(xp, torch.from_numpy(rng.standard_normal(41000, np.float32)),
                                                       table, [None] * 3)
            sent.append(layout.write(xp, fields, torch.tensor([flag], dtype=torch.uint8)))
        return torch.cat(sent), ctx

    received, ctx = frames([0, 0, 0])
    want = kernels.aggregate_segments(xp, layout.read(xp, received, 3)[0], ctx, table, 3)
    got, flags = kernels.frames_mean(xp, received, layout, table, 3)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)) and flags.tolist() == [0.0]
    flagged, _ = frames([0, 1, 1])
    poisoned, flags = kernels.frames_mean(xp, flagged, layout, table, 3)
    assert torch.isnan(poisoned).all() and flags.tolist() == [2.0]
    slots, _ = layout.pair_slots(xp, table.starts)
    at, width = int(slots[1, -1]), int(slots[2, -1])  # the last pair's index: 4 bytes
    stray = received.clone()
    stray[2 * layout.size + at:2 * layout.size + at + width] = 0x7F
    with pytest.raises(IndexError, match="out of range"):
        kernels.frames_mean(xp, stray, layout, table, 3)


def test_sparse_sum_mean_is_the_decompressed_sum_divided_and_poisoned_by_the_summed_flag():
    """``grace.native.sparse_sum_mean`` (random-k's allreduced mean on an accelerator): bit for
    bit the summed values decompressed, then divided (-0.0 and subnormal values included); NaN
    everywhere where the summed flag is above 0; an index outside the bucket refused."""
    torch = pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend

    xp, rng = get_backend("torch"), np.random.default_rng(6)
    table = segments.SegmentTable.build(xp, [100, 900, 40000], torch.zeros(1))
    kernels = kernels_of(grace.randomk(0.05).compressor)
    (values,), indices, _ = kernels.compress_segments(xp, torch.from_numpy(rng.standard_normal(41000, np.float32)),
                                                      table, [TensorInfo(f"g{s}", 0, 3) for s in range(3)])
    values[:3] = torch.tensor([-0.0, 1e-40, -3e-39])
    want = kernels.decompress_segments(xp, (values,), indices, table) / 3
    for flag in (None, torch.zeros(1)):
        got = kernels.summed_mean(xp, (values,), indices, table, 3, flag)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isnan(kernels.summed_mean(xp, (values,), indices, table, 3, torch.ones(1))).all()
    assert kernels.summed_mean(xp, (values,), indices, table, 3, 1) is None  # (a count read back: poisoned after)
    stray = indices.clone()
    stray[-1] = table.numel
    with pytest.raises(IndexError, match="out of range"):
        kernels.summed_mean(xp, (values,), stray, table, 3, None)


@pytest.mark.parametrize("method", ["randomk", "randomk_scaled"])
def test_random_k_segments_rank_the_draws_as_a_gpus_sort_takes_them(method, monkeypatch):
    """On an accelerator random-k's indices are the k smallest hashes of the draws (a stable sort
    by segment and hash, gradient by gradient). The segment kernels that rank the draws instead
    (``grace.native.randomk_ef_step_segments``, no sort) send the same values and keep the same
    memory, bit for bit, over steps with an overflow."""
    pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend, torch_backend

    xp = get_backend("torch")
    monkeypatch.setattr(torch_backend, "_counter_indices", lambda backend, like: like is not None)
    units = run(xp, with_buckets(METHODS[method], 25), steps=4, bad_step=1)  # gradient by gradient, sorted
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    sorted_draws = type(xp).random_indices_segments
    with monkeypatch.context() as m:  # (the bucket's draws come from the kernel, not a sort)
        m.setattr(type(xp), "random_indices_segments", lambda *a, **k: pytest.fail("drawn by a sort"))
        segmented = run(xp, with_buckets(METHODS[method], 25), steps=4, bad_step=1)
    assert type(xp).random_indices_segments is sorted_draws
    assert segmented_plans(segmented[0]) and not segmented_plans(units[0])
    assert_runs_equal(xp, units, segmented, method)


# methods with a whole-bucket tensor-op form: what runs where grace.native is not built
WHOLE_BUCKET = [label for label in SEGMENTED
                if type(kernels_of(METHODS[label]().compressor)).encode_segments is not MethodKernels.encode_segments]


def test_the_sign_family_and_the_quantizers_have_whole_bucket_forms():
    assert {"terngrad", "natural", "qsgd", "qsgd_bucketed", "efsignsgd", "onebit"} <= set(WHOLE_BUCKET)


@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["one-bucket", "several-buckets"])
@pytest.mark.parametrize("method", SEGMENTED)
def test_without_native_kernels_segmented_equals_per_tensor_bit_for_bit(xp, method, bucket_mb, monkeypatch):
    """Without grace.native (a GPU without grace's CUDA library): the tensor-op forms (a
    method's formula on the whole bucket, the sorted selection) give every gradient, memory and
    byte that the formula gives it alone."""
    spy = []
    kernels = type(kernels_of(METHODS[method]().compressor))
    encode = kernels.encode_segments
    monkeypatch.setattr(kernels, "encode_segments", lambda *args: spy.append(1) or encode(*args))
    with gn.disabled():
        test_segmented_equals_per_tensor_bit_for_bit(xp, method, METHODS[method]().collective.value, bucket_mb,
                                                     monkeypatch)
    assert bool(spy) == (method in WHOLE_BUCKET), "the whole-bucket form ran where there is one"


@pytest.mark.parametrize("width", bits.WIDTHS)
def test_segment_packing_is_each_segments_own(xp, width):
    """Segments of sizes off every byte boundary (and empty ones) pack as each packs alone."""
    numels = [0, 1, 7, 8, 9, 3, 0, 16, 13]
    rng = np.random.default_rng(width)
    codes = rng.integers(0, 2**width, sum(numels)).astype(np.uint8)
    table = segments.SegmentTable.build(xp, numels, None if xp.name == "numpy" else to_backend(xp, [0.0]))
    if xp.name != "numpy":
        codes = xp.cast(to_backend(xp, codes), "uint8")
    packed = segment_packing.pack(xp, codes, width, table)
    alone = [bits.pack(xp, codes[s:s + n], width) for s, n in zip(table.starts, table.numels)]
    assert_same(xp, xp.concat(alone), packed, "packed")
    assert_same(xp, codes, segment_packing.unpack(xp, packed, width, table), "unpacked")



RANDOM = [label for label in SEGMENTED if hasattr(METHODS[label]().compressor, "seed")]


@pytest.mark.parametrize("method", RANDOM)
def test_counter_draws_give_each_segment_its_tensors_own_draws(method, monkeypatch):
    """The counter-based draws (and the GPU's counter-based random indices, forced here on the
    CPU): a segment-wise bucket draws for each gradient what the gradient draws alone, so it
    equals the per-gradient exchange."""
    torch_backend = pytest.importorskip("grace.backends.torch_backend")
    monkeypatch.setattr(torch_backend, "_counter_indices", lambda backend, like: True)
    xp = torch_backend.TorchBackend()
    make = lambda: with_buckets(METHODS[method], 25)  # noqa: E731
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: False)
    units = run(xp, make())
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    segmented = run(xp, make())
    assert segmented_plans(segmented[0])
    assert_runs_equal(xp, units, segmented, method)


@pytest.mark.parametrize("communicator", ["allgather", "broadcast"])
@pytest.mark.parametrize("bucket_mb", [25, 0.002], ids=["one-bucket", "several-buckets"])
def test_segmented_threshold_sends_what_the_buckets_of_gradients_send(xp, communicator, bucket_mb, monkeypatch):
    """A threshold that keeps ~5% (sparse frames every step, of every index width): the
    segment-wise exchange's results, memories and bytes are the gradient-by-gradient bucket's,
    and (nothing dense) the per-tensor exchange's."""
    make = lambda mb: grace.threshold(2.0, communicator=communicator, bucket_mb=mb)  # noqa: E731
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: False)
    units, per_tensor = run(xp, make(bucket_mb), steps=4), run(xp, make(0), steps=4)
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    segmented = run(xp, make(bucket_mb), steps=4)
    assert {type(plan.own_layout).__name__ for plan in segmented_plans(segmented[0])} == {"SparseFrames"}
    assert_runs_equal(xp, units, segmented, "threshold(2.0)")
    assert segmented[0].stats.bytes_sent < 0.5 * 4 * 4 * sum(np.prod(s) for s in SHAPES.values())
    for w, g in zip(per_tensor[1], segmented[1]):
        for name in w:
            assert_same(xp, w[name], g[name], f"threshold(2.0): {name}")


def test_sparse_frames_are_the_frames_of_the_segments_payloads(xp):
    """SparseFrames writes a header and a frame that, end to end, are byte for byte the frame of
    each segment's own (values, indices) (every index width, empty segments' selections, the
    flag), and reads a run of frames with a dense one among them (counts whose frame would be
    larger), and every rank's overflow flag, from their headers."""
    from grace.core import bucket as frames
    from grace.formats import index_dtype

    rng = np.random.default_rng(3)
    numels = [200, 70000, 3, 300, 5000, 256]
    like = to_backend(xp, np.zeros(1, np.float32))
    table = segments.SegmentTable.build(xp, numels, like)
    layout = sparse_frames.SparseFrames(xp, table, "float32", True, like)
    received, headers, want = [], [], []
    over = [100, 40000, 3, 150, 2500, 200]  # half of the elements: pairs larger than the dense bucket
    assert layout.sends_dense(over) and not layout.sends_dense([c - 1 for c in numels[:1]] + [0] * 5)
    raised = [1, 0, 0, 1]  # each rank's overflow flag
    for counts, raise_flag in zip(([5, 0, 3, 17, 0, 256], over, [0, 0, 0, 0, 0, 0], [1, 900, 1, 2, 40, 9]), raised):
        flag = to_backend(xp, np.float32([raise_flag]))
        if counts is over:
            dense = rng.standard_normal(sum(numels)).astype(np.float32)
            header, frame = layout.header_of(xp, to_backend(xp, counts, "int64"), flag), layout.write_dense(
                xp, to_backend(xp, dense), flag)
            whole = frames.dense_frame(xp, to_backend(xp, dense), 2 * len(numels), like, flag)
            assert xp.to_numpy(frame).tobytes() == xp.to_numpy(whole).tobytes()[xp.nbytes(header):]
            assert xp.nbytes(header) + xp.numel(frame) == layout.dense_size()
            received.append(frame)
            headers.append(header)
            want.append(dense)
            continue
        local = [np.sort(rng.choice(n, c, replace=False)) for n, c in zip(numels, counts)]
        values = [rng.standard_normal(c).astype(np.float32) for c in counts]
        pieces = [to_backend(xp, t, t.dtype.name) for v, i, n in zip(values, local, numels)
                  for t in (v, i.astype(index_dtype(n)))]
        header = layout.header_of(xp, to_backend(xp, counts, "int64"), flag)
        frame = layout.write(xp, to_backend(xp, np.concatenate(values)), to_backend(xp, np.concatenate(local), "int64"),
                             counts, flag)
        unflagged = layout.header_of(xp, to_backend(xp, counts, "int64"))  # (the flag's bit aside)
        assert xp.to_numpy(xp.to_bytes(unflagged)).tobytes() + xp.to_numpy(frame).tobytes() == \
            xp.to_numpy(frames.frame(xp, pieces, True, like, flag)).tobytes()
        assert xp.nbytes(header) + xp.numel(frame) == layout.size(counts)
        want.append((np.concatenate(values), np.concatenate([i + s for i, s in zip(local, table.starts)])))
        received.append(frame)
        headers.append(header)
    read, flags = layout.read(xp, xp.concat(received), xp.concat(headers), len(received))
    assert flags == raised
    for got, expected in zip(read, want):
        if isinstance(expected, np.ndarray):
            np.testing.assert_array_equal(xp.to_numpy(got.values), expected)
            continue
        order = np.argsort(xp.to_numpy(got[1]))  # (read back grouped by index width)
        np.testing.assert_array_equal(xp.to_numpy(got[1])[order], expected[1])
        np.testing.assert_array_equal(xp.to_numpy(got[0])[order], expected[0])


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)], ids=["plain", "scaled"])
def test_threshold_select_segments_is_the_selection_its_header_and_flag(scales):
    """``grace.native.threshold_select_segments`` (threshold's bucket on an accelerator, before
    its frame): p, the mask and each segment's count are the tensor ops' (-0.0, ties at the
    threshold, an empty and a full segment), its header is ``SparseFrames.header_of``'s, and an
    inf or a NaN of g sets the flag (a float32 or a frame's byte) and the header's flag bit."""
    torch = pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend

    xp, rng, (beta, gamma) = get_backend("torch"), np.random.default_rng(2), scales
    numels = [300, 70000, 5, 1, 4000]
    table = segments.SegmentTable.build(xp, numels, torch.zeros(1))
    layout = sparse_frames.SparseFrames(xp, table, "float32", True, torch.zeros(1))
    g = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    e = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    g[300:70300], e[300:70300] = g[300:70300] * 0.01, 0.0  # the 70000 send none
    g[70300:70305] = 50.0  # the 5 send all
    g[:3], e[:3] = torch.tensor([-0.0, 1.0, 0.75]), torch.tensor([0.0, 0.5, 0.0])  # -0.0; 1.5 at the threshold
    for bad, dtype in ((None, torch.float32), (float("inf"), torch.uint8), (float("nan"), torch.float32)):
        if bad is not None:
            g[70310] = bad
        flag = torch.full((1,), 7, dtype=dtype)
        p, take, counts, header = gn.threshold_select_segments(g, e, table.start, 1.5, beta, gamma, nonfinite=flag)
        want = (g * gamma if gamma != 1.0 else g) + (e * beta if beta != 1.0 else e)
        assert torch.equal(p.view(torch.int32), want.view(torch.int32))
        assert torch.equal(take.bool(), want.abs() >= 1.5)
        assert counts.tolist() == [int(t.sum()) for t in torch.split(want.abs() >= 1.5, numels)]
        assert counts[1] == 0 and counts[2] == 5
        assert flag.item() == (bad is not None)
        assert torch.equal(header, layout.header_of(xp, counts, flag.float()))
    with pytest.raises(ValueError, match="in a row"):
        gn.threshold_select_segments(g, e, table.start.flip(0), 1.5)


@pytest.mark.parametrize("flagged", [True, False])
def test_threshold_write_segments_is_the_frame_of_the_selected_pairs(flagged):
    """``grace.native.threshold_write_segments`` (threshold's frame on an accelerator, from its
    selection): byte for byte ``SparseFrames.write`` of the selected pairs (every index width,
    an empty selection, the flag byte and the padding), p written over with p - p_hat; a table
    that does not fit the mask refused, nothing written."""
    torch = pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend

    xp, rng = get_backend("torch"), np.random.default_rng(4)
    numels = [300, 70000, 5, 1, 4000]
    table = segments.SegmentTable.build(xp, numels, torch.zeros(1))
    layout = sparse_frames.SparseFrames(xp, table, "float32", flagged, torch.zeros(1))
    g = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    g[300:70300] *= 0.5  # fewer of the 70000
    g[70305] = -0.0
    e = torch.zeros_like(g)
    p, take, counts, _ = gn.threshold_select_segments(g, e, table.start, 1.9)
    own = counts.tolist()
    assert own[3] == 0 and own[1] > 0
    flag = torch.ones(1, dtype=torch.uint8) if flagged else None
    (values, local), p_hat = kernels_of(grace.threshold(1.9).compressor).selected_pairs(xp, p, take.bool(),
                                                                                       (own, counts), table)
    want_frame, want_residual = layout.write(xp, values, local, own, flag), p - p_hat
    places, tail, size = layout.write_places(own)
    refused = torch.from_numpy(places.copy())
    refused[3] += 1  # the first segment's count, one more than its mask holds
    before = p.clone()
    with pytest.raises(ValueError, match="do not fit"):
        gn.threshold_write_segments(p, take, refused, size, tail, flag)
    assert torch.equal(p, before)
    frame = gn.threshold_write_segments(p, take, torch.from_numpy(places), size, tail, flag)
    assert torch.equal(frame, want_frame)
    assert torch.equal(p.view(torch.int32), want_residual.view(torch.int32))


@pytest.mark.parametrize("ratio", [0.1, 0.001])
def test_dgc_cut_segments_is_the_sampled_threshold(ratio):
    """``grace.native.dgc_cut_segments`` (DGC's thresholds on an accelerator: each sample drawn
    and selected where it lies) is ``DGC.segment_cut``'s (its draws keyed, sorted, read) bit for
    bit: drawn samples and whole ones, an inf and a NaN among them."""
    torch = pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend
    from grace.core import draws

    xp, rng = get_backend("torch"), np.random.default_rng(8)
    numels = [30, 7000, 5, 1, 250000]  # samples of 1, 70, 1, 1 and 2500 (0.01 of each, at least 1)
    table = segments.SegmentTable.build(xp, numels, torch.zeros(1))
    dgc = grace.dgc(ratio).compressor
    p = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    p[30:7030:3], p[40], p[7100] = float("inf"), float("nan"), -float("nan")
    infos = [TensorInfo(f"g{s}", 3, 4, rank=1) for s in range(len(numels))]
    ks, want = dgc.segment_cut(xp, p, table, infos)
    sizes, needs, plan_ks = dgc.sample_plan(table.numels, ratio)
    words = [draws.seed_words(info.rank_seed(dgc.seed)) for info in infos]
    got = gn.dgc_cut_segments(p, table.starts, table.numels, sizes, needs, words)
    assert plan_ks == ks and torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_dgc_select_segments_is_the_selection_cut_and_masked():
    """``grace.native.dgc_select_segments`` (DGC's bucket on an accelerator, after its momentum
    correction): the values, indices, new v and new u of DGC's tensor ops (its segments' top-k,
    +0.0 under each segment's cut, ``DGCMemory.update``), bit for bit, with -0.0, an inf and a
    NaN in p; the flag set by them."""
    torch = pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend

    xp, rng = get_backend("torch"), np.random.default_rng(6)
    numels, ks = [300, 7000, 5, 1], (40, 700, 5, 1)
    table = segments.SegmentTable.build(xp, numels, torch.zeros(1))
    kernels = kernels_of(grace.dgc(0.1).compressor)
    memory = grace.dgc(0.1).memory
    p = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    u = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    v_old = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    p[:4] = torch.tensor([-0.0, float("inf"), float("nan"), 9.0])
    u = p - v_old  # (u_new as the momentum correction leaves it)
    cut = torch.tensor([1.0, 2.5, 0.0, 5.0])
    (values, local), _, _ = kernels._top_segments(xp, p, table, ks)
    slots = torch.from_numpy(np.repeat(np.arange(len(numels)), ks))
    want_values = torch.where(values.abs() >= cut[slots], values, 0.0)
    p_hat = kernels.decompress_segments(xp, (want_values, local), ks, table)
    want_u, want_v = memory.update(xp, p, p_hat, (None, v_old))
    flag = torch.zeros(1)
    got_values, got_local = gn.dgc_select_segments(p, u, table.starts, table.numels, ks, cut, nonfinite=flag)
    assert torch.equal(got_local, local) and flag.item() == 1.0
    for got, want in ((got_values, want_values), (p, want_v), (u, want_u)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("flagged", [True, False])
def test_a_fused_selection_writes_its_frame_as_the_layout_does(flagged):
    """Top-k's and DGC's segment steps with a frame to write into (``frame_pairs``: the bucket's
    own fixed layout) write it byte for byte as ``SegmentedFrame.write`` makes it of their
    fields (every index width, the flag byte, the padding zeroed over whatever the buffer held),
    and the same new memory."""
    torch = pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend

    xp, rng = get_backend("torch"), np.random.default_rng(9)
    numels = [100, 900, 70000, 3]  # uint8, int16, int32 and uint8 indices
    table = segments.SegmentTable.build(xp, numels, torch.zeros(1))
    kernels = kernels_of(grace.topk(0.01).compressor)
    layout = segments.SegmentedFrame(xp, kernels.segment_fields(table.numels, "float32"), flagged, torch.zeros(1))
    slots, flag_at = layout.pair_slots(xp, table.starts)
    g = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    e = torch.from_numpy(rng.standard_normal(sum(numels)).astype(np.float32))
    g[5] = float("inf")
    ks = kernels._ks(table)
    flag = torch.zeros(1, dtype=torch.uint8)
    values, local, want_e = gn.topk_ef_step_segments(g, e, table.starts, table.numels, ks, nonfinite=flag)
    want = layout.write(xp, (values, local), flag if flagged else None)
    frame = torch.full((layout.size,), 0xAB, dtype=torch.uint8)
    into = (frame, slots, layout.size - layout.pad)
    got = gn.topk_ef_step_segments(g, e, table.starts, table.numels, ks,
                                   nonfinite=frame[flag_at:flag_at + 1] if flagged else None, frame=into)
    assert got[:2] == (None, None) and torch.equal(frame, want) and flag.item() == 1
    assert torch.equal(got[2].view(torch.int32), want_e.view(torch.int32))
    p, u, cut = g.clone(), e.clone(), torch.tensor([0.5, 1.0, 2.0, 0.0])
    values, local = gn.dgc_select_segments(p, u, table.starts, table.numels, ks, cut, nonfinite=flag)
    want = layout.write(xp, (values, local), flag if flagged else None)
    frame.fill_(0xCD)
    p2, u2 = g.clone(), e.clone()
    assert gn.dgc_select_segments(p2, u2, table.starts, table.numels, ks, cut, frame=into,
                                  nonfinite=frame[flag_at:flag_at + 1] if flagged else None) == (None, None)
    assert torch.equal(frame, want) and torch.equal(p2.view(torch.int32), p.view(torch.int32))
    assert torch.equal(u2.view(torch.int32), u.view(torch.int32))


def test_sparse_variable_mean_reads_the_pairs_where_they_lie():
    """``grace.native.sparse_variable_mean`` (threshold's aggregate on an accelerator, from the
    received frames as they lie, by ``SparseFrames.pair_table``): bit for bit each rank's values
    over the ranks added at their indices rank after rank, with every index width and empty
    selections; no table where a rank sent its dense bucket; an index outside the bucket
    refused, not written."""
    torch = pytest.importorskip("torch")
    if not gn.available("cpu"):
        pytest.skip("no native CPU library")
    from grace.backends import get_backend

    xp, rng = get_backend("torch"), np.random.default_rng(11)
    numels = [200, 70000, 3, 300, 5000, 256]
    like = torch.zeros(1)
    table = segments.SegmentTable.build(xp, numels, like)
    layout = sparse_frames.SparseFrames(xp, table, "float32", True, like)
    want, received, headers = np.zeros(sum(numels), np.float32), [], []
    for counts in ([5, 0, 3, 17, 0, 256], [0, 0, 0, 0, 0, 0], [1, 900, 3, 2, 40, 9]):
        local = [np.sort(rng.choice(n, c, replace=False)) for n, c in zip(numels, counts)]
        values = np.concatenate([rng.standard_normal(c).astype(np.float32) for c in counts])
        received.append(layout.write(xp, torch.from_numpy(values), torch.from_numpy(np.concatenate(local)), counts,
                                     torch.ones(1)))
        headers.append(layout.header_of(xp, torch.tensor(counts), torch.ones(1)))
        want[np.concatenate([i + s for i, s in zip(local, table.starts)])] += values / np.float32(3)
    counts = xp.host_ints(torch.cat(headers), 3 * 2 * len(numels))
    frames, places = torch.cat(received), torch.from_numpy(layout.pair_table(counts, 3))
    got = gn.sparse_variable_mean(frames, places, 3, 3.0, sum(numels))
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))
    assert layout.flags(counts, 3) == [1, 1, 1]
    dense = list(counts)
    dense[2 * len(numels):4 * len(numels)] = [c for c in (100, 40000, 3, 150, 2500, 200) for _ in (0, 1)]  # dense
    assert layout.pair_table(dense, 3) is None
    stray = frames.clone()
    index_at = int(places.view(3, len(numels), 6)[2, 1, 1])  # rank 2's first index of the 70000 (int32)
    stray[index_at:index_at + 4] = 0x7F
    with pytest.raises(IndexError, match="out of range"):
        gn.sparse_variable_mean(stray, places, 3, 3.0, sum(numels))


@pytest.mark.parametrize("through", ["exchange", "ready buckets"])
def test_a_step_of_variable_buckets_reads_every_buckets_headers_at_once(accelerator, through, monkeypatch):
    """Threshold's buckets: each sends its header (its counts and overflow flag) at once and its
    frame once the step has read every bucket's ranks' headers in one wait, the step's only
    one (whether all buckets finish in one call or each when its first gradient is asked for,
    as Horovod's optimizer does); with the results of each bucket reading its own."""
    from grace.core.ready import ReadyBuckets

    xp = accelerator
    reads = []
    host_ints = type(xp).host_ints
    monkeypatch.setattr(type(xp), "host_ints", lambda self, x, count: reads.append(count) or host_ints(self, x, count))
    make = lambda: grace.threshold(2.0, communicator="allgather", bucket_mb=0.002)  # noqa: E731
    want = run(xp, make(), steps=2)[1]
    monkeypatch.setattr(grace.Exchange, "read_counts", lambda self, pendings: None)
    alone = run(xp, make(), steps=2)
    monkeypatch.undo()
    monkeypatch.setattr(type(xp), "on_accelerator", lambda self, x: True)
    monkeypatch.setattr(type(xp), "host_ints", lambda self, x, count: reads.append(count) or host_ints(self, x, count))
    exchange = grace.Exchange(make(), ReplicaCommunicator(3))
    for step in range(2):
        grads = gradients(xp, step)
        reads.clear()
        if through == "exchange":
            got = exchange.exchange(grads)
        else:
            specs = [(name, tuple(xp.shape(g)), xp.dtype(g), xp.device(g)) for name, g in grads.items()]
            ready = ReadyBuckets(exchange, exchange.bucket_layout(specs))
            waits = {name: ready.add(name, g) for name, g in grads.items()}
            got = {name: wait() for name, wait in waits.items()}
            exchange.end_step()
        plans = segmented_plans(exchange)
        assert len(plans) > 2 and all(plan.variable for plan in plans)
        if step:  # (the first step's agreement reads back too)
            assert reads == [3 * sum(len(plan.own_layout.dtypes) for plan in plans)]
        for name in want[step]:
            assert_same(xp, want[step][name], got[name], f"{through} step {step}: {name}")
            assert_same(xp, alone[1][step][name], got[name], f"{through} step {step}: {name}")
