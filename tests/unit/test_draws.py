"""Random draws. Uniform draws are counter-based on every backend and device (grace.core.draws);
random indices are NumPy's generator's on a CPU (every backend alike) and come from the
counter-based draws on a GPU.

The counter-based indices are forced here on torch CPU tensors; with GRACE_TEST_DEVICE=cuda the
tensors are on the GPU, where they are the default."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from grace.backends import get_backend
from tests.unit.conftest import TORCH_DEVICE

torch = pytest.importorskip("torch")
torch_backend = pytest.importorskip("grace.backends.torch_backend")


@pytest.fixture
def xp(monkeypatch):
    monkeypatch.setattr(torch_backend, "_counter_indices", lambda backend, like: True)
    return get_backend("torch")


LIKE = torch.zeros(1, device=TORCH_DEVICE)
SEED = (123456789, 7)


def host(t):
    return t.cpu().numpy()


def test_uniform_draws_are_float32_in_0_1_and_fixed_by_their_seed(xp):
    u = host(xp.uniform(200_000, SEED, like=LIKE))
    assert u.dtype == np.float32 and u.shape == (200_000,)
    assert u.min() >= 0 and u.max() < 1
    np.testing.assert_array_equal(u, host(xp.uniform(200_000, SEED, like=LIKE)))
    for other in [(SEED[0], SEED[1] + 1), (SEED[0] + 1, SEED[1]), (SEED[0] | 1 << 56, SEED[1])]:
        assert np.mean(u == host(xp.uniform(200_000, other, like=LIKE))) < 1e-3, other
    # 16 equal bins of 12,500 expected each: a binomial standard deviation of about 108
    counts = np.bincount((u * 16).astype(np.int64), minlength=16)
    assert np.all(np.abs(counts - 12_500) < 6 * 108), counts
    # neighbours are independent: the correlation of draw j and draw j + 1
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01


def test_uniform_segments_draw_what_each_seed_draws_alone(xp):
    counts, seeds = [5, 0, 1000, 3], [(1, 0), (2, 0), (3, 9), (1, 1)]
    together = host(xp.uniform_segments(counts, seeds, like=LIKE))
    alone = np.concatenate([host(xp.uniform(c, s, like=LIKE)) for c, s in zip(counts, seeds)])
    np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("numel, k", [(1, 1), (10, 10), (1000, 1), (5000, 50), (70_000, 700)])
def test_random_indices_are_k_distinct_sorted_indices(xp, numel, k):
    idx = host(xp.random_indices(numel, k, SEED, like=LIKE))
    assert idx.dtype == np.int64 and len(idx) == k
    assert np.all(np.diff(idx) > 0) and idx[0] >= 0 and idx[-1] < numel
    np.testing.assert_array_equal(idx, host(xp.random_indices(numel, k, SEED, like=LIKE)))


def test_random_indices_pick_every_index_alike(xp):
    # 2,000 draws of 10 of 100 indices: each index 200 times expected, standard deviation 13.4
    hits = np.zeros(100, np.int64)
    for step in range(2000):
        hits[host(xp.random_indices(100, 10, (99, step), like=LIKE))] += 1
    assert np.all(np.abs(hits - 200) < 6 * 13.4), hits


def test_random_indices_segments_draw_what_each_seed_draws_alone(xp):
    numels, ks, seeds = [300, 1, 4000, 7], [3, 1, 40, 7], [(5, 0), (6, 0), (7, 3), (5, 1)]
    together = host(xp.random_indices_segments(numels, ks, seeds, like=LIKE))
    alone = np.concatenate([host(xp.random_indices(d, k, s, like=LIKE)) for d, k, s in zip(numels, ks, seeds)])
    np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("native", [True, False], ids=["native", "tensor ops"])
def test_every_backend_draws_the_same_uniforms(native):
    """NumPy's formula (the reference), the CPU kernel, and torch's whole-buffer ops (a GPU's
    path, run here on whatever device the tests use) give the same float32 draws."""
    from grace import native as grace_native
    from grace.core import draws

    counts, seeds = [3, 0, 4097, 1, 70_001], [(1, 2), (3, 4), (2**40 + 5, 9), (7, 0), (11, 2**20)]
    want = draws.uniform_numpy(counts, seeds)
    assert want.dtype == np.float32 and want.shape == (sum(counts),)
    with (contextlib.nullcontext() if native else grace_native.disabled()):
        np.testing.assert_array_equal(want, draws.uniform_host(counts, seeds))
        np.testing.assert_array_equal(want, get_backend("numpy").uniform_segments(counts, seeds))
        np.testing.assert_array_equal(want, host(get_backend("torch").uniform_segments(counts, seeds, like=LIKE)))
    hashes, _, _ = torch_backend._counter_hashes(counts, seeds, torch.device("cpu"))
    np.testing.assert_array_equal(want, ((hashes >> 8).to(torch.float32) * draws.UNIT).numpy())


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_off_an_accelerator_every_backend_draws_the_same_indices(monkeypatch, native):
    """Random indices on a CPU: the first k distinct index draws, by NumPy operations (the
    reference) and by the CPU kernel, for the NumPy and torch backends alike."""
    from grace import native as grace_native
    from grace.core import draws

    monkeypatch.setattr(torch_backend, "_counter_indices", lambda backend, like: False)
    numels, ks = [30, 40, 1, 7, 70_000, 5], [3, 4, 1, 7, 700, 0]
    seeds = [(1, 2), (3, 4), (5, 6), (7, 8), (2**40 + 9, 11), (1, 1)]
    want = np.concatenate([draws.random_indices_numpy(d, k, s) for d, k, s in zip(numels, ks, seeds)])
    with (contextlib.nullcontext() if native else grace_native.disabled()):
        np.testing.assert_array_equal(want, draws.random_indices_host(numels, ks, seeds))
        np.testing.assert_array_equal(want, get_backend("numpy").random_indices_segments(numels, ks, seeds))
        np.testing.assert_array_equal(want, host(get_backend("torch").random_indices_segments(numels, ks, seeds)))
    at = 0
    for d, k in zip(numels, ks):  # k distinct indices below d, ascending
        idx = want[at:at + k]
        at += k
        assert len(idx) == k and np.all(np.diff(idx) > 0) and (k == 0 or (idx[0] >= 0 and idx[-1] < d))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_buckets_random_indices_are_each_segments_on_any_number_of_threads(threads):
    """The CPU kernel draws a bucket's segments side by side on its threads, the largest first:
    each segment's indices are still NumPy's, in the bucket's order."""
    from grace import native as grace_native
    from grace.core import draws

    if not grace_native.available("cpu"):
        pytest.skip("no native CPU library")
    numels = [3_000, 400_000, 70, 250_000, 9, 120_000, 64]
    ks = [30, 8_000, 7, 5_000, 9, 2_400, 0]
    seeds = [(i + 1, 2 * i + 3) for i in range(len(numels))]
    want = np.concatenate([draws.random_indices_numpy(d, k, s) for d, k, s in zip(numels, ks, seeds)])
    grace_native.set_num_threads(threads)
    try:
        np.testing.assert_array_equal(want, draws.random_indices_host(numels, ks, seeds))
    finally:
        grace_native.set_num_threads(0)


def test_cpu_random_indices_pick_every_index_alike():
    from grace.core import draws

    # 2,000 draws of 10 of 100 indices: each index 200 times expected, standard deviation 13.4
    hits = np.zeros(100, np.int64)
    for step in range(2000):
        hits[draws.random_indices_host([100], [10], [(99, step)])] += 1
    assert np.all(np.abs(hits - 200) < 6 * 13.4), hits


def test_random_indices_refuse_more_than_there_are():
    from grace.core import draws

    with pytest.raises(ValueError, match="distinct"):
        draws.random_indices_numpy(5, 6, (1, 2))
    with pytest.raises(ValueError, match="at most"):
        draws.random_indices_host([5], [6], [(1, 2)])


def test_seed_words_are_alike_from_ints_arrays_and_tensors_and_apart():
    """A seed's words from host ints (what the native kernels get), from NumPy arrays and from
    torch tensors on the test device (a fused GPU program's step, an input): the same bits. And
    no two of a grid of keys and steps share them."""
    from grace.core import draws

    keys = [0, 1, 2**32 - 1, 2**32, 2**56 + 2**40 + 12345, 2**63 - 1]
    grid = set()
    for step in [0, 1, 7, 2**31, 2**32 - 1]:
        want = [draws.seed_words((key, step)) for key in keys]
        grid.update(want)
        arrays = draws.step_words(draws.key_words(np.asarray(keys, np.int64)), np.int64(step))
        tensors = draws.step_words(draws.key_words(torch.tensor(keys, device=TORCH_DEVICE)),
                                   torch.tensor(step, device=TORCH_DEVICE))
        for words in (arrays, [t.cpu().numpy() for t in tensors]):
            assert [(int(words[0][i]), int(words[1][i])) for i in range(len(keys))] == want, step
    assert len(grid) == 5 * len(keys)


@pytest.mark.parametrize("step", [0, 7, 2**32 + 5])
@pytest.mark.parametrize("rank", [0, 3, 127])
def test_a_buckets_seed_words_are_each_gradients_own(step, rank):
    """``bucket_seed_words``: a bucket's words made at once (its keys kept between steps) are
    each gradient's ``seed_words`` of its seed, or of its rank's seed, as host ints; a step
    later, that step's. From a list of infos, or from the plans' ``UnitInfos`` (each its unit's
    TensorInfo, made when asked for; their keys read as one tuple)."""
    from grace.core import draws
    from grace.core.compressor import TensorInfo, UnitInfos, name_key_of
    from grace.native._common import _seed_word_arrays

    names = tuple(f"layer{i}.weight" for i in range(40))
    for base in (0, 5, 2**25 + 3):
        for own in (False, True):
            for at in (step, step + 1, step + 2):  # (the second: from the kept keys; the third: of UnitInfos)
                infos = [TensorInfo(name, at, 8, rank) for name in names]
                if at == step + 2:
                    infos = UnitInfos(names, tuple(map(name_key_of, names)), at, 8, rank)
                    assert list(infos) == [TensorInfo(name, at, 8, rank) for name in names]
                    assert [i.name_key for i in infos] == [name_key_of(name) for name in names]
                    assert infos[-1].name == names[-1] and [i.name for i in infos[38:]] == list(names[38:])
                want = [draws.seed_words(i.rank_seed(base) if own else i.seed(base)) for i in infos]
                words = draws.bucket_seed_words(infos, base, own)
                assert list(words) == want and all(type(w) is int for pair in words for w in pair)
                c_arrays = _seed_word_arrays(words)  # (what a native call gets: from the arrays)
                assert [tuple(pair) for pair in zip(*c_arrays)] == want
