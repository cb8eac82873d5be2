"""Bytes each rank receives per step for one bucket, under each way of exchanging it (the ring
model), and the way ``communicator='auto'`` takes.

    dense        a ring allreduce of float32:  2 (N-1)/N x 4 bytes per element (Horovod's own)
    allreduce    a method that sums its payloads (fp16, random-k, PowerSGD): 2 (N-1)/N x its payload
    allgather    every other rank's frame: (N-1) x frame (the frame no larger than the dense one)
    alltoall     every other rank's frame of this rank's shard, then every other owner's frame:
                 (N-1) x (frame of a shard + frame of the owner's second payload; only the
                 second carries the rank's overflow flag; a variable-length frame no larger
                 than the dense shard's)

A fixed-length payload's size depends on the element count alone: 'auto' takes the way with the
fewest bytes. A variable-length one's (threshold, DGC, ...) is known only as the step runs (here
it is measured on a standard-normal probe, for the table): its frames fall back to the dense
values wherever the encoding is larger, so both its ways are bounded by a dense ring allreduce
(to the frames' headers), and 'auto' takes the two phases from 3 ranks on, where they receive
2 (N-1)/N frames of the bucket against the allgather's N-1. Every rank decides alike.
"""
from __future__ import annotations

import functools
from typing import Dict

import numpy as np

from grace.core import bucket as frames
from grace.core.compressor import Collective, TensorInfo
from grace.core.tensors import get_backend

_PROBE_SEED = 20240229


@functools.lru_cache(maxsize=4)  # (bucket-sized arrays)
def _probe(numel: int) -> np.ndarray:
    return np.random.default_rng(_PROBE_SEED).standard_normal(numel).astype(np.float32)


def _frame(xp, payload, variable: bool, flagged: bool) -> int:
    counts = [xp.numel(t) for t in payload]
    return frames.frame_size(counts, [xp.dtype(t) for t in payload], variable, flagged)


def received(compression, numel: int, ranks: int) -> Dict[str, int]:
    """Bytes one rank receives for a bucket of ``numel`` float32 elements in a world of ``ranks``:
    {'dense': ..., and the method's ways: 'allreduce', or 'allgather' and 'alltoall'}."""
    from grace.core.plans.alltoall import shard_size  # (here: grace.core.plans imports this module)
    from grace.core.plans.owner import owner_of

    xp, compressor = get_backend("numpy"), compression.compressor
    variable, flagged = compressor.traits.variable_length, compression.flags_overflow
    ring = 2 * (ranks - 1) / ranks
    out = {"dense": int(ring * 4 * numel)}
    info = TensorInfo("grace.traffic", 0, ranks, 0)
    if compressor.collective is Collective.ALLREDUCE or compressor.traits.multi_round:
        if compressor.traits.multi_round:
            return out  # (its rounds' sizes: the method's own; it never allgathers)
        payload, _ = compressor.compress(xp, _probe(numel), info)
        out["allreduce"] = int(ring * sum(xp.nbytes(t) for t in payload))
        return out
    payload, _ = compressor.compress(xp, _probe(numel), info)
    dense_frame = frames.dense_frame_size(numel, "float32", len(payload) if variable else 0, flagged)
    out["allgather"] = (ranks - 1) * min(_frame(xp, payload, variable, flagged), dense_frame)
    owner = owner_of(compressor)
    if owner.refusal() is None and compression.scope == "tensor":  # (a bucket compressed whole is not sharded)
        size = shard_size(numel, ranks, owner.align)
        first, _ = owner.compress(xp, _probe(size), info)
        second, _ = owner.compress_again(xp, _probe(size), info)
        frames_of = [_frame(xp, first, variable, False), _frame(xp, second, variable, flagged)]
        if variable:  # (a larger encoding goes dense)
            frames_of = [min(f, frames.dense_frame_size(size, "float32", len(payload), flag))
                         for f, flag, payload in zip(frames_of, (False, flagged), (first, second))]
        out["alltoall"] = (ranks - 1) * sum(frames_of)
    return out


def chosen(compression, costs: Dict[str, int], ranks: int) -> str:
    """The way 'auto' takes, from ``received``'s ``costs``: a fixed-length method's cheapest (a
    tie goes to its own way, then to the two phases, before dense); a variable-length method's
    two phases from 3 ranks on, else its own way (both bounded by dense, whatever its data)."""
    if compression.compressor.traits.variable_length and "alltoall" in costs:
        return "alltoall" if ranks > 2 else "allgather"
    order = [way for way in ("allreduce", "allgather", "alltoall", "dense") if way in costs]
    return min(order, key=lambda way: (costs[way], order.index(way)))
