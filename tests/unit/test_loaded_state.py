"""What an exchange refuses to load (another method's state, NaN memory, damaged counters, a
wrong dtype, shape or name), and the data-only encoding that carries state between ranks."""
from __future__ import annotations

import numpy as np
import pytest

import grace
from grace.core import portable
from grace.core.communicator import LocalCommunicator

torch = pytest.importorskip("torch")

SHAPES = {"fc.weight": (4, 3), "fc.bias": (3,)}


def exchange(compression, known: bool = True):
    """An exchange that knows its gradients from the start (PyTorch's optimizer, DDP) or only
    at its first step (TensorFlow's tape: ``known=False``)."""
    made = grace.Exchange(compression, LocalCommunicator())
    if known:
        made.expect([(name, shape, "float32") for name, shape in SHAPES.items()])
    return made


def gradients(convert=np.asarray, step=0):
    rng = np.random.default_rng(step)
    return {name: convert(rng.standard_normal(shape).astype(np.float32)) for name, shape in SHAPES.items()}


def saved(compression=None, convert=np.asarray):
    source = exchange(compression or grace.topk(0.5))
    for step in range(2):
        source.exchange(gradients(convert, step))
    return source.state_dict()


def damaged(state, table, name, value):
    state = {key: dict(v) if isinstance(v, dict) else v for key, v in state.items()}
    state[table][name] = value
    return state


@pytest.mark.parametrize("other", [lambda: grace.randomk(0.5), lambda: grace.powersgd(1),
                                   lambda: grace.topk(0.5, memory="none")])
def test_another_methods_state_is_refused(other):
    with pytest.raises(ValueError, match="saved by TopK with ResidualMemory, and this optimizer runs"):
        exchange(other()).load_state_dict(saved())


@pytest.mark.parametrize("convert", [np.asarray, torch.from_numpy], ids=["numpy", "torch"])
@pytest.mark.parametrize("known", [True, False], ids=["gradients known", "gradients known at the first step"])
@pytest.mark.parametrize("table, value, message", [
    ("memory", "nan", "memory of 'fc.weight' holds an inf or a NaN"),
    ("memory", "inf", "memory of 'fc.weight' holds an inf or a NaN"),
    ("steps", -1, r"step counter of 'fc.weight' is -1; a counter is an integer in \[0, 2\*\*40\)"),
    ("steps", 2**62, "step counter of 'fc.weight' is 4611686018427387904"),
    ("steps", 1.5, "step counter of 'fc.weight' is 1.5"),
    ("memory", "float64", "memory of 'fc.weight' is float64, and this optimizer keeps float32"),
    ("memory", "flat", r"memory of 'fc.weight' has the layout \[12\], and this optimizer's 'fc.weight' needs \[4, 3\]"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_parameter(convert, known, table, value, message):
    arrays = {"nan": np.full((4, 3), np.nan, np.float32), "inf": np.full((4, 3), np.inf, np.float32),
              "float64": np.zeros((4, 3), np.float64), "flat": np.zeros(12, np.float32)}
    state = damaged(saved(), table, "fc.weight", convert(arrays[value]) if value in arrays else value)
    target = exchange(grace.topk(0.5), known)
    if known or table == "steps" or "NaN" in message:  # found at once
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(state)
    else:  # a layout is found when the gradients are known: at the first step, before any is sent
        target.load_state_dict(state)
        with pytest.raises(ValueError, match=message):
            target.exchange(gradients(convert))


def test_memory_of_a_parameter_the_model_lacks_is_refused():
    state = damaged(saved(), "memory", "fc2.weight", np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="holds memory for 'fc2.weight', which is no parameter of this optimizer"):
        exchange(grace.topk(0.5)).load_state_dict(state)


def test_compressor_state_is_held_against_the_methods_own_layout():
    state = damaged(saved(grace.powersgd(1)), "state", "fc.weight", np.zeros((3, 2), np.float32))  # rank 2's Q
    with pytest.raises(ValueError, match=r"state of 'fc.weight' has the layout \[3, 2\].*needs \[3, 1\]"):
        exchange(grace.powersgd(1)).load_state_dict(state)


@pytest.mark.parametrize("make", [lambda: grace.topk(0.5), lambda: grace.dgc(0.5), lambda: grace.powersgd(1),
                                  lambda: grace.signum()])
@pytest.mark.parametrize("convert", [np.asarray, torch.from_numpy], ids=["numpy", "torch"])
def test_a_sound_checkpoint_still_loads_and_resumes_exactly(make, convert):
    straight = exchange(make())
    outs = [straight.exchange(gradients(convert, step)) for step in range(4)]
    first = exchange(make())
    for step in range(2):
        first.exchange(gradients(convert, step))
    resumed = exchange(make(), known=False)
    resumed.load_state_dict(first.state_dict())
    for step in range(2, 4):
        got = resumed.exchange(gradients(convert, step))
        for name in SHAPES:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(outs[step][name]))


@pytest.mark.parametrize("make", [lambda: grace.powersgd(1), lambda: grace.powersgd(2), lambda: grace.dgc(0.5)])
def test_a_state_taken_is_not_changed_by_the_steps_after_it(make):
    """A state_dict held in memory (not written out) while training goes on: the exchange writes
    its kept buffers (PowerSGD's factors) again at every step, never into what was handed out."""
    convert = torch.from_numpy
    straight = exchange(make())
    outs = [straight.exchange(gradients(convert, step)) for step in range(4)]
    first = exchange(make())
    for step in range(2):
        first.exchange(gradients(convert, step))
    held = first.state_dict()
    for step in range(2, 6):
        first.exchange(gradients(convert, step))
    resumed = exchange(make(), known=False)
    resumed.load_state_dict(held)
    for step in range(2, 4):
        got = resumed.exchange(gradients(convert, step))
        for name in SHAPES:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(outs[step][name]))


def test_portable_values_round_trip():
    import ml_dtypes

    value = {("cfg", 0, False, 1): {"steps": {"a": 3, "b": 2**45}, "state": {"q": np.arange(6.0).reshape(2, 3)}},
             "x": [None, True, 1.5, "s", np.zeros(0, np.int64), np.ones(3, ml_dtypes.bfloat16), (1, (2,))]}
    back = portable.decode(portable.encode(value))
    assert list(back) == list(value)
    assert back[("cfg", 0, False, 1)]["steps"] == {"a": 3, "b": 2**45}
    np.testing.assert_array_equal(back[("cfg", 0, False, 1)]["state"]["q"], value[("cfg", 0, False, 1)]["state"]["q"])
    assert back["x"][:4] == [None, True, 1.5, "s"] and back["x"][6] == (1, (2,))
    assert back["x"][5].dtype == np.dtype(ml_dtypes.bfloat16) and back["x"][4].dtype == np.int64


def described(text: bytes) -> np.ndarray:
    return np.frombuffer(len(text).to_bytes(8, "little") + text, np.uint8)


@pytest.mark.parametrize("data, message", [
    (lambda: portable.encode({"a": np.ones(4)})[:-3], "cut short or damaged"),
    (lambda: described(b'{"object":"os.system"}'), "unknown entry 'object'"),
    (lambda: described(b'{"array":0,"dtype":"object","shape":[1]}'), "dtype 'object'"),
])
def test_a_damaged_or_foreign_encoding_builds_nothing(data, message):
    with pytest.raises(ValueError, match=message):
        portable.decode(data())


def test_only_data_can_be_encoded():
    with pytest.raises(TypeError, match="cannot send a object between ranks"):
        portable.encode({"a": object()})
