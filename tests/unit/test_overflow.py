"""An overflow (an inf or a NaN in a gradient) costs one step: that step's result is
non-finite, and the exchange then goes on exactly as if the step had not happened."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import grace
from grace.backends import get_backend
from grace.core.communicator import ReplicaCommunicator
from grace.core.journal import Journal
from grace.core.state import StateStore
from tests.unit.conftest import METHODS
from tests.unit.test_buckets import assert_same, gradients

VARIANTS = {
    **{f"{label}/{mb:g}": (make, dict(bucket_mb=mb)) for label, make in METHODS.items() for mb in (0, 25, 0.002)},
    "topk/bucket-scope": (METHODS["topk"], dict(scope="bucket")),
    "efsignsgd/bucket-scope": (METHODS["efsignsgd"], dict(scope="bucket")),
}


def configured(make, options):
    method = make()
    return grace.GradientCompression(method.compressor, method.memory, method.collective, **options)


def overflowing(xp, step, bad, name="fc.weight"):
    grads = gradients(xp, step)
    value = xp.to_numpy(grads[name]).copy()
    value.flat[7] = bad
    grads[name] = xp.asarray(value.astype(np.float32), like=grads["fc.bias"])
    return grads


def assert_same_state(xp, a, b, tables, what):
    for table in tables:
        assert sorted(a[table]) == sorted(b[table]), f"{what}: {table}"
        for name in a[table]:
            assert_same(xp, a[table][name], b[table][name], f"{what}: {table} {name}")


@pytest.mark.parametrize("in_place", [False, True], ids=["new-results", "in-place"])
@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_an_overflow_costs_one_step(xp, variant, bad, in_place):
    make, options = VARIANTS[variant]
    compression = configured(make, options)
    faulty = grace.Exchange(compression, ReplicaCommunicator(3), in_place=in_place)
    clean = grace.Exchange(configured(make, options), ReplicaCommunicator(3))

    faulty.exchange(gradients(xp, 0))
    clean.exchange(gradients(xp, 0))
    before = faulty.state_dict()
    out = faulty.exchange(overflowing(xp, 1, bad))
    assert not np.isfinite(xp.to_numpy(out["fc.weight"])).all(), "the overflow did not reach the result"
    # nothing the step changed is kept
    assert_same_state(xp, before, faulty.state_dict(), ("memory", "state", "steps"), variant)
    for s in (2, 3):  # then exactly as if step 1 had not happened
        want, got = clean.exchange(gradients(xp, s)), faulty.exchange(gradients(xp, s))
        for name in want:
            assert np.isfinite(xp.to_numpy(got[name])).all(), f"{variant} step {s} {name}"
            assert_same(xp, want[name], got[name], f"{variant} step {s} {name}")
    assert_same_state(xp, clean.state_dict(), faulty.state_dict(), ("memory", "state"), variant)


def test_the_journal_puts_back_what_a_bucket_changed():
    """``Journal.set_many``: each key's value before the step kept (given by the caller; the
    first one, where it was set earlier in the step), a key with no value, given none, left
    without one; all put back where a rank flagged an overflow."""
    store = StateStore()
    store.set("memory", "w", 1)
    journal = Journal(store, guarded=True)
    journal.set("memory", "w", 2)  # (earlier in the step)
    journal.set_many("memory", ["w", "b", "v"], [3, None, 4], [2, None, None])
    assert store.tables["memory"] == {"w": 3, "v": 4}
    journal.counted(1)
    journal.end_step({})
    assert store.tables["memory"] == {"w": 1}


class JoinedSums(ReplicaCommunicator):
    """A communicator without a grouped allreduce: the exchange joins each round's payloads in a
    buffer it keeps, summed there in place, so the next step's sums overwrite this step's."""

    def grouped_allreduce(self, dtype):
        return False


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("bucket_mb", [0, 25])
def test_powersgd_deferred_memory_survives_a_skipped_step_whose_sums_overwrite_its_factors(bucket_mb, rank):
    """PowerSGD's memory keeps M and the factors, P Q^T subtracted in the next step's first pass
    (a CPU's native products): after a skipped step it is put back, its P intact although the
    skipped step's sums went where the P it keeps was summed (rank 1: P made a unit vector there)."""
    xp = get_backend("torch")
    faulty, clean = (grace.Exchange(configured(lambda: grace.powersgd(rank), dict(bucket_mb=bucket_mb)),
                                    JoinedSums(3)) for _ in range(2))
    faulty.exchange(gradients(xp, 0))
    clean.exchange(gradients(xp, 0))
    faulty.exchange(overflowing(xp, 1, np.inf))
    for s in (2, 3):
        want, got = clean.exchange(gradients(xp, s)), faulty.exchange(gradients(xp, s))
        for name in want:
            assert_same(xp, want[name], got[name], f"powersgd step {s} {name}")
    assert_same_state(xp, clean.state_dict(), faulty.state_dict(), ("memory", "state"), "powersgd")


@pytest.mark.parametrize("method", ["topk", "randomk", "threshold", "signum", "dgc", "powersgd", "qsgd", "onebit"])
@pytest.mark.parametrize("bucket_mb", [0, 25])
def test_tensorflow_traced_overflow_costs_one_step(method, bucket_mb):
    tf = pytest.importorskip("tensorflow")
    from grace.tensorflow.state import VariableStore, VariableWireStats

    xp = get_backend("tensorflow")

    def exchange():
        ex = grace.Exchange(configured(METHODS[method], dict(bucket_mb=bucket_mb)), ReplicaCommunicator(3),
                            store=VariableStore(), stats=VariableWireStats())
        return ex, tf.function(ex.exchange)

    faulty, faulty_step = exchange()
    clean, clean_step = exchange()
    faulty_step(gradients(xp, 0))
    clean_step(gradients(xp, 0))
    before = faulty.state_dict()
    out = faulty_step(overflowing(xp, 1, np.inf))  # the same trace as the clean steps
    assert not np.isfinite(out["fc.weight"].numpy()).all()
    assert_same_state(xp, before, faulty.state_dict(), ("memory", "state", "steps"), method)
    for s in (2, 3):
        want, got = clean_step(gradients(xp, s)), faulty_step(gradients(xp, s))
        for name in want:
            if method == "powersgd":  # two graphs: float32 rounding, as in test_buckets
                np.testing.assert_allclose(got[name].numpy(), want[name].numpy(), rtol=1e-5, atol=1e-5)
            else:
                assert_same(xp, want[name], got[name], f"{method} step {s} {name}")



@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_the_flag_sees_every_inf_and_nan_and_no_large_finite_sum(backend, dtype):
    if backend == "tensorflow":
        pytest.importorskip("tensorflow")
    xp = get_backend(backend)
    large = xp.cast(xp.asarray(np.full(100_000, 60_000.0, np.float32)), dtype)  # sums far past float16's range
    small = xp.cast(xp.asarray(np.arange(10, dtype=np.float32)), dtype)
    assert xp.to_numpy(xp.nonfinite([large, small])).tolist() == [0.0]
    for bad in (np.inf, -np.inf, np.nan):
        values = np.arange(10, dtype=np.float32)
        values[4] = bad
        assert xp.to_numpy(xp.nonfinite([large, xp.cast(xp.asarray(values), dtype)])).tolist() == [1.0]


@pytest.mark.parametrize("backend", ["numpy", "torch", "tensorflow"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_flag_over_many_small_tensors_sees_each_ones_inf_and_nan(backend, dtype):
    """A model's biases and norms (the torch backend sums the small ones joined, in one op): an inf
    or a NaN in any one of them, a vector or a matrix, raises the flag, as a byte too."""
    if backend == "tensorflow":
        pytest.importorskip("tensorflow")
    xp = get_backend(backend)
    shapes = [(7,), (64,), (3, 5), (4096,), (4097,), (1,), (2, 2, 3)]
    made = [np.full(shape, 60_000.0 if len(shape) == 1 else -3.0, np.float32) for shape in shapes]
    tensors = [xp.cast(xp.asarray(m), dtype) for m in made]
    assert xp.to_numpy(xp.nonfinite(tensors)).tolist() == [0.0]
    assert xp.to_numpy(xp.nonfinite(tensors, "uint8")).tolist() == [0]
    for i, bad in itertools.product(range(len(shapes)), (np.inf, -np.inf, np.nan)):
        values = made[i].copy()
        values.reshape(-1)[-1] = bad
        flagged = tensors[:i] + [xp.cast(xp.asarray(values), dtype)] + tensors[i + 1:]
        assert xp.to_numpy(xp.nonfinite(flagged)).tolist() == [1.0], (shapes[i], bad)
        assert xp.to_numpy(xp.nonfinite(flagged, "uint8")).tolist() == [1], (shapes[i], bad)


@pytest.mark.parametrize("method", [m for m in METHODS if METHODS[m]().compressor.traits.nonfinite_field is not None])
def test_the_payload_tensor_the_flag_is_read_from_holds_every_inf_and_nan(xp, method):
    """``Traits.nonfinite_field``: where the flag is read from the payload instead of a pass
    over the gradient, that payload tensor is non-finite for an inf, a -inf or a NaN anywhere
    (native kernels and tensor ops alike), and finite otherwise."""
    from grace.core.compressor import TensorInfo
    from tests.unit.conftest import to_backend

    compressor = METHODS[method]().compressor
    info = TensorInfo("w", 0, 3)
    rng = np.random.default_rng(0)

    def sent(values):
        x = to_backend(xp, values)
        payload = compressor.step(xp, x, info, compressor.init_state(xp, x, info))[0]
        return xp.to_numpy(payload[compressor.traits.nonfinite_field])

    assert np.isfinite(sent(rng.standard_normal(1000))).all()
    for bad in (np.inf, -np.inf, np.nan):
        for where in (0, 517, 999):
            values = rng.standard_normal(1000)
            values[where] = bad
            assert not np.isfinite(sent(values)).all(), f"{method}: {bad} at {where}"
