"""Counter-based draws: draw j of a (key, step) seed is a hash of (j, seed).

Every backend and device draws the same numbers (NumPy, PyTorch on a CPU or a GPU, TensorFlow
off the GPU), any number of tensors' draws come from a few whole-buffer operations (or one
native call) with no generator per tensor, and a bucket's segments draw exactly what each of
its tensors draws alone:

    (s0, s1) = seed_words(key, step)
    u_j      = (hash32(hash32(j ^ s0) ^ s1) >> 8) / 2**24       float32 in [0, 1)

The seed words mix the key's two words with the step's by the same hash, so they are computed
alike from Python ints, integer arrays or tensors: a fused GPU program takes its step as a
tensor (the step is then an input of the program, not a constant of it).

Random indices on a CPU (random-k's) are the first k distinct of the index draws
floor(hash_j * d / 2**32); on a GPU the torch backend takes the k smallest hashes instead.

The hash functions take Python ints or int64 arrays (NumPy, torch): the arithmetic stays
below 2**63, so int64 tensors never overflow; NumPy's uint32 arrays wrap where the masks
cut. grace.native's ``uniform_segments`` and ``random_indices_segments`` compute the same in C.
"""
from __future__ import annotations

import collections.abc
from typing import Sequence

import numpy as np

from grace import native

M32 = 0xFFFFFFFF


#: what the key's and the step's words are mixed with (any 32-bit odd constants, apart)
SALTS = (0x9E3779B9, 0x7F4A7C15, 0x85EBCA6B, 0xC2B2AE35)


def key_words(key):
    """A key's two words (key: below 2**63; an int, or an int64 array of keys)."""
    low, high = key & M32, key >> 32
    return hash32(low ^ hash32(high ^ SALTS[0])), hash32(high ^ hash32(low ^ SALTS[1]))


def step_words(words, step):
    """The seed words of key words ``words`` at ``step`` (an int below 2**32, or an int64
    array or tensor of one element)."""
    step = step & M32
    return hash32(words[0] ^ hash32(step ^ SALTS[2])), hash32(words[1] ^ hash32(step ^ SALTS[3]))


def seed_words(seed) -> tuple:
    """The (key, step) seed mixed into two 32-bit words, as host ints (``step_words`` mixes a
    step that is a tensor on the device). A key's words are kept, and the latest step's (a
    step's seeds: a bucket's gradients' keys, the same every step)."""
    key, step = int(seed[0]), int(seed[1]) & M32
    words = _KEY_WORDS.get(key)
    if words is None:
        if len(_KEY_WORDS) > 1 << 16:
            _KEY_WORDS.clear()
        words = _KEY_WORDS[key] = key_words(key)
    latest = _latest_step[0]  # (one read: another thread may replace it)
    if latest[0] != step:
        latest = _latest_step[0] = (step, hash32(step ^ SALTS[2]), hash32(step ^ SALTS[3]))
    return hash32(words[0] ^ latest[1]), hash32(words[1] ^ latest[2])


_KEY_WORDS: dict = {}  # key -> key_words(key)
_latest_step: list = [(None, 0, 0)]  # the latest step, and its two hashes


def bucket_seed_words(infos, base_seed: int = 0, own: bool = False) -> "BucketWords":
    """``seed_words`` of each info's seed (``own``: its ``rank_seed``), for the infos of one
    bucket (one step, one rank): the key words of the bucket's gradients kept as one uint32 array
    (every first word, then every second), mixed with the step's at once (a ResNet-50 step's 161
    gradients one by one: about 0.5 ms)."""
    first = infos[0]
    # (a bucket's UnitInfos hold their keys as one tuple: no TensorInfo made per gradient and step)
    name_keys = getattr(infos, "name_keys", None) or tuple(info.name_key for info in infos)
    cached = (name_keys, base_seed, first.rank if own else None)
    words = _BUCKET_WORDS.get(cached)
    if words is None:
        if len(_BUCKET_WORDS) > 1 << 10:
            _BUCKET_WORDS.clear()
        keys = np.array([(info.rank_seed(base_seed) if own else info.seed(base_seed))[0] for info in infos], np.int64)
        words = _BUCKET_WORDS[cached] = np.concatenate(key_words(keys)).astype(np.uint32)
    # step_words, the step's hashes as host ints and the keys' in place in uint32 (whose products
    # wrap as hash32's masks ask): a dozen NumPy operations a bucket, not two dozen and the casts
    step = int(first.step) & M32
    mixed, n = words.copy(), len(infos)
    mixed[:n] ^= np.uint32(hash32(step ^ SALTS[2]))
    mixed[n:] ^= np.uint32(hash32(step ^ SALTS[3]))
    _hash32_in_place(mixed)
    return BucketWords(mixed[:n], mixed[n:])


class BucketWords(collections.abc.Sequence):
    """A bucket's seed words (``bucket_seed_words``): (s0, s1) pairs of host ints, kept as two
    uint32 arrays (``columns``), from which a native call's C arrays are made without a Python
    int per word."""

    def __init__(self, s0, s1):
        self.columns = (s0, s1)

    def __len__(self) -> int:
        return len(self.columns[0])

    def __getitem__(self, i):
        return int(self.columns[0][i]), int(self.columns[1][i])


_BUCKET_WORDS: dict = {}  # (a bucket's name keys, base seed, rank) -> key_words of its keys, as arrays


def hash32(h):
    """A 32-bit integer hash (a bijection in which every input bit moves every output bit;
    constants from C. Wellons' hash prospector, below 2**31 so that products of 32-bit values
    stay in int64: two ops per multiplication)."""
    h = h ^ (h >> 16)
    h = (h * _FACTORS[0]) & M32
    h = h ^ (h >> 15)
    h = (h * _FACTORS[1]) & M32
    return h ^ (h >> 15)


_FACTORS = (0x21F0AAAD, 0x735A2D97)  # hash32's multipliers


def _hash32_in_place(h: np.ndarray) -> None:
    """``hash32`` of a uint32 array, written over it (its products wrap as hash32's masks ask)."""
    h ^= h >> 16
    h *= np.uint32(_FACTORS[0])
    h ^= h >> 15
    h *= np.uint32(_FACTORS[1])
    h ^= h >> 15


def draw_hashes(j, words):
    """The 32-bit hashes of draws ``j`` (an int64 array) of the seed ``words``."""
    s0, s1 = words
    return hash32(hash32(j ^ s0) ^ s1)


#: the scale of the 24 bits a draw keeps: u = (hash >> 8) * UNIT
UNIT = 2.0**-24


def uniform_numpy(counts: Sequence[int], seeds: Sequence) -> np.ndarray:
    """``counts[s]`` draws of each seed ``seeds[s]``, in a row, by NumPy operations (the
    reference: 32-bit arithmetic, whose products wrap as the masks above ask)."""
    parts = []
    for count, seed in zip(counts, seeds):
        s0, s1 = seed_words(seed)
        j = np.arange(int(count), dtype=np.uint32 if count <= 2**32 else np.uint64)
        parts.append(((draw_hashes(j, (s0, s1)) >> 8).astype(np.float32) * np.float32(UNIT)))
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.float32)


def uniform_host(counts: Sequence[int], seeds: Sequence) -> np.ndarray:
    """``uniform_numpy``'s draws, by one native call where the CPU kernels are built."""
    counts = [int(c) for c in counts]
    out = np.empty(sum(counts), np.float32)
    drawn = native.run("uniform_segments", out, counts, [seed_words(s) for s in seeds], out)
    return uniform_numpy(counts, seeds) if drawn is None else drawn


def _index_draws(j, numel: int, words):
    """Draws ``j`` as indices below ``numel``: floor(hash * numel / 2**32)."""
    return (draw_hashes(j, words).astype(np.uint64) * np.uint64(numel)) >> np.uint64(32)


def random_indices_numpy(numel: int, k: int, seed) -> np.ndarray:
    """k distinct indices below ``numel`` from the (key, step) ``seed``, ascending (int64): the
    first k distinct ones of the index draws floor(hash_j * numel / 2**32), j = 0, 1, ...
    (a uniformly random k-subset). NumPy operations: enough draws at once, then more."""
    numel, k = int(numel), int(k)
    if not 0 <= k <= numel <= 2**32:
        raise ValueError(f"cannot draw {k} distinct indices below {numel}")
    if k == numel:
        return np.arange(numel, dtype=np.int64)
    words, m = seed_words(seed), k + k // 2 + 16
    while True:
        drawn = _index_draws(np.arange(m, dtype=np.uint64), numel, words)
        _, first = np.unique(drawn, return_index=True)  # where each index is drawn first
        if len(first) >= k:
            return np.sort(drawn[np.sort(first)[:k]]).astype(np.int64)
        m *= 2


def random_indices_host(numels: Sequence[int], ks: Sequence[int], seeds: Sequence) -> np.ndarray:
    """``random_indices_numpy`` of every segment in a row, by one native call where built."""
    numels, ks = [int(d) for d in numels], [int(k) for k in ks]
    out = np.empty(sum(ks), np.int64)
    drawn = native.run("random_indices_segments", out, numels, ks, [seed_words(s) for s in seeds], out)
    if drawn is None:
        parts = [random_indices_numpy(d, k, s) for d, k, s in zip(numels, ks, seeds)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return drawn
