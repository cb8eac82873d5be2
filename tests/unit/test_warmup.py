"""warmup_steps: the first steps go by a plain allreduce (dense bytes, the exact mean, the memory
untouched), then the method runs as if it had started there; the count is state, so an overflow
does not shorten the warm-up and a checkpoint resumes past it."""
from __future__ import annotations

import numpy as np
import pytest

import grace
from grace.backends import get_backend
from grace.core import registry
from grace.core.communicator import ReplicaCommunicator
from tests.unit.test_buckets import assert_same, gradients
from tests.unit.test_overflow import overflowing

RANKS = 3
DENSE = 4 * sum(int(np.prod(np.shape(g))) for g in gradients(get_backend("numpy"), 0).values())


def exchange(method, **options):
    return grace.Exchange(method(**options), ReplicaCommunicator(RANKS))


def methods():
    return {"topk": lambda **o: grace.topk(0.1, **o), "qsgd": lambda **o: grace.qsgd(4, **o),
            "fp16": lambda **o: grace.fp16(**o), "dgc": lambda **o: grace.dgc(0.05, sample_ratio=0.5, **o)}


@pytest.mark.parametrize("bucket_mb", [0, 25])
@pytest.mark.parametrize("method", list(methods()))
def test_dense_bytes_until_the_step_and_compressed_after(xp, method, bucket_mb):
    make = methods()[method]
    warm = exchange(make, warmup_steps=2, bucket_mb=bucket_mb)
    cold = exchange(make, bucket_mb=bucket_mb)
    flags = sum(xp.numel(g) > 0 for g in gradients(xp, 0).values()) if not bucket_mb else len(warm.bucket_layout(
        [(n, xp.shape(g), xp.dtype(g), None) for n, g in gradients(xp, 0).items()]))
    for step in range(2):
        grads = gradients(xp, step)
        out = warm.exchange(grads)
        assert warm.stats.last_step_bytes == DENSE + 4 * flags, step  # float32 values, one flag per allreduce
        for name, g in grads.items():  # identical replicas: the mean is the gradient (3g / 3 in float32)
            np.testing.assert_allclose(xp.to_numpy(out[name]), xp.to_numpy(g), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{method} step {step} {name}")
        assert not warm.memory, "the warm-up wrote the memory"
    for step in range(2, 5):  # then the method, as a fresh one would run from there
        grads = gradients(xp, step)
        want, got = cold.exchange(grads), warm.exchange(grads)
        assert warm.stats.last_step_bytes < DENSE * (0.7 if method == "fp16" else 0.3), step
        if method in ("topk", "fp16"):  # (deterministic: their draws do not depend on the step)
            for name in want:
                assert_same(xp, want[name], got[name], f"{method} step {step} {name}")


def test_an_overflow_in_the_warm_up_does_not_count(xp):
    warm = exchange(methods()["topk"], warmup_steps=2)
    warm.exchange(gradients(xp, 0))
    out = warm.exchange(overflowing(xp, 1, np.inf))
    assert not np.isfinite(xp.to_numpy(out["fc.weight"])).all()
    warm.exchange(gradients(xp, 1))
    assert warm.stats.last_step_bytes > DENSE, "the skipped step counted as a warm-up step"
    warm.exchange(gradients(xp, 2))
    assert warm.stats.last_step_bytes < DENSE * 0.3


def test_a_checkpoint_resumes_past_the_warm_up(xp):
    first = exchange(methods()["topk"], warmup_steps=3)
    for step in range(2):
        first.exchange(gradients(xp, step))
    resumed = exchange(methods()["topk"], warmup_steps=3)
    resumed.load_state_dict(first.state_dict())
    resumed.exchange(gradients(xp, 2))
    assert resumed.stats.last_step_bytes > DENSE  # the third warm-up step
    resumed.exchange(gradients(xp, 3))
    assert resumed.stats.last_step_bytes < DENSE * 0.3


def test_every_method_takes_it_and_shows_it():
    for label, make in registry.examples(registry.SHIPPED).items():  # (each with its example's arguments)
        assert make(warmup_steps=5).warmup_steps == 5, label
    assert "warmup_steps=5" in repr(grace.qsgd(4, warmup_steps=5))
    assert grace.from_params({"compressor": "qsgd", "quantum_num": 4, "warmup_steps": 5}).warmup_steps == 5
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
            grace.topk(0.1, warmup_steps=bad)


def test_a_traced_tensorflow_step_is_refused_with_the_way_out():
    tf = pytest.importorskip("tensorflow")
    from grace.tensorflow.state import VariableStore, VariableWireStats

    xp = get_backend("tensorflow")
    ex = grace.Exchange(grace.topk(0.1, warmup_steps=2), ReplicaCommunicator(RANKS), store=VariableStore(),
                        stats=VariableWireStats())
    out = ex.exchange(gradients(xp, 0))  # eagerly: it warms up
    assert ex.stats.last_step_bytes > DENSE
    np.testing.assert_allclose(out["fc.weight"].numpy(), gradients(xp, 0)["fc.weight"].numpy(), rtol=1e-6)
    with pytest.raises(NotImplementedError, match="run_eagerly=True"):
        tf.function(ex.exchange)(gradients(xp, 1))
