"""The CPU's bucket calls tell the overflow flag (``nonfinite=``) from their own pass: 1 where any
gradient of the bucket holds an inf or a NaN, wherever it lies (the first element, a SIMD lane
in the middle of a large gradient, the last element past the 8-lane groups), 0 otherwise; and
asking for it changes none of their results."""
from __future__ import annotations

import numpy as np
import pytest

import grace.native as gn
from tests.native.conftest import gradient, same_bytes, torch  # noqa: F401

SIZES = [1, 9, 300, 40000, 2**16 + 3]
WORDS = [(0x9E3779B9 * (s + 1) % 2**32, 777 + s) for s in range(len(SIZES))]
# (gradient, element): where a special is put
PLACES = {"first": (0, 0), "tail": (1, 8), "lane": (4, 2**15 + 5), "last": (4, 2**16 + 2)}


def _residuals():
    return [torch.from_numpy(gradient(n, seed=n + 1)) * 0.3 for n in SIZES]


def _ks():
    return [max(1, n // 100) for n in SIZES]


CALLS = {  # each bucket call on gradients gs, with **flag
    "topk": lambda gs, **f: gn.topk_ef_step_many(gs, _residuals(), _ks(), beta=0.9,
                                                 outs=[torch.empty(n) for n in SIZES], **f),
    "threshold": lambda gs, **f: gn.threshold_ef_step_many(gs, _residuals(), [0.8] * len(SIZES), gamma=0.5,
                                                           outs=[torch.empty(n) for n in SIZES], **f),
    "randomk": lambda gs, **f: gn.randomk_ef_step_many(
        gs, _residuals(), [torch.arange(0, n, max(1, n // k)) for n, k in zip(SIZES, _ks())], 1.0, 1.0, None,
        outs=[torch.empty(n) for n in SIZES], **f),
    "efsignsgd": lambda gs, **f: gn.efsignsgd_ef_step_many(gs, _residuals(), 1.0, 1.0,
                                                          [torch.empty(n) for n in SIZES], **f),
    "onebit": lambda gs, **f: gn.onebit_ef_step_many(gs, _residuals(), 1.0, 1.0, [torch.empty(n) for n in SIZES],
                                                    **f),
    **{f"dgc sample {sample}": (lambda sample: lambda gs, **f: gn.dgc_step_many(
        gs, _residuals(), [torch.from_numpy(gradient(n, seed=n + 2)) for n in SIZES], 0.9, 0.01, sample, WORDS,
        [torch.empty(n) for n in SIZES], [torch.empty(n) for n in SIZES], **f))(sample) for sample in (0.01, 1.0)},
    **{f"compress_many {m}": (lambda m, a: lambda gs, **f: gn.compress_many(m, gs, WORDS, *a, **f))(m, a)
       for m, a in [("signsgd", ()), ("terngrad", ()), ("natural", ()), ("qsgd", (127, 0)), ("qsgd", (5, 1000))]},
}


def _flat(result):
    """Every tensor of a call's result, in order."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for part in result for t in _flat(part)]


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("special, place", [("none", None)] + [(v, p) for v in ("inf", "-inf", "nan") for p in PLACES])
def test_a_bucket_call_tells_its_overflow_flag(call, special, place):
    gs = [torch.from_numpy(gradient(n, seed=n)) for n in SIZES]
    if place is not None:
        s, i = PLACES[place]
        gs[s][i] = float(special)
    flag = torch.full((1,), 0.5)
    with np.errstate(all="ignore"):
        want = _flat(CALLS[call]([g.clone() for g in gs]))
        got = _flat(CALLS[call]([g.clone() for g in gs], nonfinite=flag))
    assert flag.item() == (0.0 if special == "none" else 1.0)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        same_bytes(a, b, f"{call} with the flag asked")


def test_the_flag_is_one_float32_element():
    with pytest.raises(ValueError, match="one float32 element"):
        gn.compress_many("signsgd", [torch.ones(9)], nonfinite=torch.zeros(2))
