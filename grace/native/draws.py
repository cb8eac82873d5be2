"""Counter-based draws (grace.core.draws) made natively, segment after segment.

    uniform_segments(counts, words, out), hash_keys_segments(counts, words, out) (GPU),
    random_indices_segments(numels, ks, words, out) (CPU)
"""
from __future__ import annotations

from grace.native._arrays import NativeUnavailable, call, kind_of
from grace.native._common import _cpu_kind, _in_place, _int64s, _on_gpu, _seed_word_arrays


def _check_draw_counts(counts) -> None:
    if any(not 0 <= c <= 2**32 for c in counts):
        raise ValueError("draw numbers are 32-bit: at most 2**32 draws per seed")


def _draws_into(symbol: str, kind, counts, words, out, dtype: str):
    """``symbol`` (uniform_segments, hash_keys_segments) of each segment's draws, into ``out``."""
    _check_draw_counts(counts)
    ob = _in_place(kind, out, dtype)
    if ob.n != sum(counts):
        raise ValueError(f"out has {ob.n} elements for {sum(counts)} draws")
    s0, s1 = _seed_word_arrays(words)
    call(kind, symbol, len(counts), _int64s(counts), s0, s1, ob.ptr)
    return out


def uniform_segments(counts, words, out):
    """Counter-based uniform draws (grace.core.draws): ``counts[s]`` draws of the seed words
    ``words[s]`` (two 32-bit ints), in a row, written into the float32 ``out``."""
    return _draws_into("uniform_segments", kind_of(out), counts, words, out, "float32")


def hash_keys_segments(counts, words, out):
    """The sort keys of counter-based random indices on a GPU: for the draws of each segment s
    in a row, s << 32 | the 32-bit hash of the draw (grace.core.draws.draw_hashes), written
    into the int64 ``out``."""
    kind = kind_of(out)
    if not _on_gpu(kind):
        raise NativeUnavailable("hash keys are made on a GPU")
    return _draws_into("hash_keys_segments", kind, counts, words, out, "int64")


def random_indices_segments(numels, ks, words, out):
    """Counter-based random indices (grace.core.draws) on the CPU: for each segment, the first
    ``ks[s]`` distinct index draws below ``numels[s]`` from the seed words ``words[s]``,
    ascending, in a row, written into the int64 ``out``."""
    kind = _cpu_kind(out)
    ob = _in_place(kind, out, "int64")
    if ob.n != sum(ks):
        raise ValueError(f"out has {ob.n} elements for {sum(ks)} indices")
    s0, s1 = _seed_word_arrays(words)
    if call(kind, "random_indices_segments", len(ks), _int64s(numels), _int64s(ks), s0, s1, ob.ptr) != 0:
        raise ValueError("every k must be at most its segment's size (and the size at most 2**32)")
    return out
