"""The expected outcome of a two-phase exchange (``communicator='alltoall'``), from all ranks'
inputs at once, written out in NumPy without grace's exchange, communicators or plans.

Per bucket: each rank compensates its flat bucket, pads it with zeros to N equal shards and
compresses shard j under the name '<bucket>/shard<j>' (sent dense where a variable-length
encoding is larger than the shard); the owner j aggregates the ranks' payloads of shard j by the
method's own ``aggregate`` (its mean or vote, in the method's float32 order, the dense shards added),
compresses that aggregate again under '<bucket>/owner<j>' (top-k, DGC and AdaQ at BUDGET times their
ratio, onebit and EF-signSGD in BUDGET passes; SketchML's sketches sized by the shard), with its
own residual memory where the method has error feedback (signSGD and Signum send the count's
outcome exactly instead; a second encoding larger than the shard sends the shard, and the owner
keeps nothing of it), and
every rank receives every owner's decompressed shard. Only the method's own compress, decompress
and aggregate run here, so the owner's random draws see the very aggregate grace must compute:
results are compared bit for bit.
"""
from __future__ import annotations

import copy

import numpy as np

from grace.compressors import AdaQ, DGC, EFSignSGD, OneBit, QSGD, SignSGD, Signum, SketchML, TopK
from grace.core.compressor import TensorInfo
from grace.kernels.owners import BUDGET, ELEMENTS_PER_MEAN, MIN_BUCKETS
from grace.memories import DGCMemory, ResidualMemory

from tests.multiprocess.reference import bucket_key, buckets, pass_empty, xp
from tests.multiprocess.workers.common import PARAMS, STEPS, local_input, names


def expected_alltoall(variant, ranks: int, layouts=None):
    """[per rank] {'grad/<name>/<step>', 'memory/<name>[/i]', 'owner/<name>', 'state/<bucket>', 'bytes/<step>'}.
    ``layouts``: per step, the (bucket key, gradient names) a run used (DDP's own buckets);
    else the buckets grace plans (``buckets``)."""
    compression = variant.make()
    compressor, memory = compression.compressor, compression.memory
    flagged = compression.flags_overflow
    keys = names(variant)
    results = [dict() for _ in range(ranks)]
    memories, owners, states = {}, {}, {}  # (rank, parameter index) -> flat value; (rank, bucket) -> momentum
    seen = set()  # the bucket keys in use so far
    for step in range(STEPS):
        pass_empty(variant, results, step)
        sent = [0] * ranks
        planned = [(bucket_key(keys, group, index), group) for index, group in enumerate(buckets(compression))]
        for key, group in (planned if layouts is None else layouts[step]):
            g = [np.concatenate([local_input(variant, r, step, i).ravel() for i in group]) for r in range(ranks)]
            n = g[0].size
            p, v = zip(*[compensate(memory, g[r], joined(memories, r, group)) for r in range(ranks)])
            x = [momentum(compressor, p[r], states, (r, key)) for r in range(ranks)]
            size = shard_size(compressor, n, ranks)
            if key not in seen:  # a bucket's first step: the owners' memory handed to the shards' owners
                seen.add(key)
                hand_over(owners, group, n, size, ranks)
            shards = [np.concatenate([x[r], np.zeros(size * ranks - n, np.float32)]).reshape(ranks, size)
                      for r in range(ranks)]
            sharded = of_shard(compressor, size)
            first = [[sharded.compress(xp, shards[r][j], TensorInfo(f"{key}/shard{j}", step, ranks, r))
                      for j in range(ranks)] for r in range(ranks)]
            # a variable-length encoding larger than the dense shard goes dense
            dense = [[goes_dense(compression, first[r][j][0], size, False) for j in range(ranks)] for r in range(ranks)]
            for r in range(ranks):
                p_hat = np.concatenate([shards[r][j] if dense[r][j] else compressor.decompress(xp, *first[r][j])
                                        for j in range(ranks)])[:n]
                split(memories, r, group, update(memory, p[r], p_hat, v[r]))
                sent[r] += sum(dense_bytes(first[r][j][0], size, False) if dense[r][j] else
                               frame_bytes(compression, first[r][j][0], False) for j in range(ranks) if j != r)
            result = []
            for j in range(ranks):
                encoded = [first[r][j][0] for r in range(ranks) if not dense[r][j]]
                aggregate = compressor.aggregate(xp, encoded, first[0][j][1]) if encoded else None
                if len(encoded) < ranks:  # the mean of the encoded ones and the dense shards, added rank by rank
                    total = None
                    for r in (r for r in range(ranks) if dense[r][j]):
                        total = shards[r][j] if total is None else total + shards[r][j]
                    aggregate = total / ranks if aggregate is None else (aggregate * len(encoded) + total) / ranks
                held = joined(owners, j, group)
                held = held if held is not None else np.zeros(n, np.float32)
                shard, nbytes, held = second(compression, aggregate, held, j * size, n, f"{key}/owner{j}", step, ranks)
                split(owners, j, group, held)
                result.append(shard)
                sent[j] += nbytes
            mean = np.concatenate(result)[:n]
            for offset, i in offsets(group):
                value = mean[offset:offset + int(np.prod(PARAMS[i][1]))].reshape(PARAMS[i][1])
                for rank in range(ranks):
                    results[rank][f"grad/{keys[i]}/{step}"] = value * ranks if variant.op == "sum" else value
        for rank in range(ranks):
            results[rank][f"bytes/{step}"] = sent[rank]
    for kind, table in (("memory", memories), ("owner", owners)):
        for (rank, i), value in table.items():
            if isinstance(value, tuple):
                results[rank].update({f"{kind}/{keys[i]}/{j}": t.reshape(PARAMS[i][1]) for j, t in enumerate(value)})
            else:
                results[rank][f"{kind}/{keys[i]}"] = value.reshape(PARAMS[i][1])
    in_use = {key for key, _ in (planned if layouts is None else layouts[-1])}
    for (rank, key), value in states.items():  # (a bucket's state ends with its layout: DDP rebuilds)
        if key in in_use:
            results[rank][f"state/{key}"] = value
    return results


def hand_over(owners, group, n: int, size: int, ranks: int) -> None:
    """Every rank's owner memory of a bucket summed, each rank keeping its own shard's part."""
    held = [joined(owners, r, group) for r in range(ranks)]
    if all(h is None for h in held):
        return
    total = sum(h if h is not None else np.zeros(n, np.float32) for h in held)
    for r in range(ranks):
        lo, hi = min(r * size, n), min((r + 1) * size, n)
        split(owners, r, group, np.concatenate([np.zeros(lo, np.float32), total[lo:hi], np.zeros(n - hi, np.float32)]))


def joined(table, rank: int, group):
    """A rank's per-parameter values of a bucket's parameters as one flat value (zeros where one
    has none yet; DGC's two tensors each); None where none has any."""
    values = [table.get((rank, i)) for i in group]
    if all(v is None for v in values):
        return None
    like = next(v for v in values if v is not None)
    zeros = [np.zeros(int(np.prod(PARAMS[i][1])), np.float32) for i in group]
    if isinstance(like, tuple):
        return tuple(np.concatenate([v[t] if v is not None else z for v, z in zip(values, zeros)])
                     for t in range(len(like)))
    return np.concatenate([v if v is not None else z for v, z in zip(values, zeros)])


def split(table, rank: int, group, value) -> None:
    """A bucket's flat value back per parameter (None: the method keeps nothing)."""
    if value is None:
        return
    for offset, i in offsets(group):
        numel = int(np.prod(PARAMS[i][1]))
        table[rank, i] = tuple(t[offset:offset + numel] for t in value) if isinstance(value, tuple) \
            else value[offset:offset + numel]


def offsets(group):
    """(offset in the flat bucket, parameter index) of each parameter of a bucket."""
    out, offset = [], 0
    for i in group:
        out.append((offset, i))
        offset += int(np.prod(PARAMS[i][1]))
    return out


def shard_size(compressor, n: int, ranks: int) -> int:
    align = compressor.bucket_size or 1 if isinstance(compressor, QSGD) else 1
    return max(align, -(-n // (ranks * align)) * align)


def compensate(memory, g, state):
    """(p, DGC's old accumulation v or None), on the flat bucket."""
    if isinstance(memory, DGCMemory):
        g = memory.clipped(xp, g)  # (the memory's own norm: the bucket's, summed as grace sums it)
        u, v = state if state is not None else (np.zeros_like(g), np.zeros_like(g))
        return v + (memory.momentum * u + g), v
    if isinstance(memory, ResidualMemory):
        e = state if state is not None else np.zeros_like(g)
        return (memory.beta * e + memory.gamma * g).astype(np.float32), None
    return g, None


def update(memory, p, p_hat, v):
    if isinstance(memory, DGCMemory):  # momentum factor masking (u read back from p = v + u)
        u = p - v
        return np.where(p_hat != 0, 0, u), p - p_hat
    if isinstance(memory, ResidualMemory):
        return p - p_hat
    return None


def momentum(compressor, p, states, key):
    """Signum's momentum over the rank's whole bucket (its state); other methods send p."""
    if not isinstance(compressor, Signum):
        return p
    m = states.get(key)
    beta = compressor.momentum
    states[key] = (1 - beta) * p if m is None else beta * m + (1 - beta) * p
    return states[key]


def second(compression, aggregate, held, start: int, n: int, name: str, step: int, ranks: int):
    """Owner j's shard as every rank decodes it, the bytes j sends, and j's memory of the bucket
    (``held``: zeros outside its shard): signSGD's count exactly (2 bits for the vote, else the
    sum's width), other methods compressed again under ``name``, with the owner's residual
    memory where the method keeps one."""
    compressor, flagged = compression.compressor, compression.flags_overflow
    size = aggregate.size
    if isinstance(compressor, SignSGD):
        width = 2 if compressor.aggregate_by == "majority" else (2 * ranks).bit_length()
        nbytes = -(-size * width // 8) if width <= 8 else 2 * size
        return aggregate, _aligned(nbytes + flagged), None
    keeps = compression.memory.needs_feedback
    lo, hi = min(start, n), min(start + size, n)
    q = aggregate + np.concatenate([held[lo:hi], np.zeros(size - (hi - lo), np.float32)]) if keeps else aggregate
    if isinstance(compressor, (TopK, DGC, AdaQ)):  # (the owner selects BUDGET times its share of k)
        compressor = copy.copy(compressor)
        compressor.ratio = min(1.0, compressor.ratio * BUDGET)
    compressor = of_shard(compressor, size)
    info = TensorInfo(name, step, ranks, int(name.rsplit("owner", 1)[1]))
    payload, ctx = compressor.compress(xp, q, info)
    if goes_dense(compression, payload, size, flagged):
        held = np.concatenate([held[:lo], np.zeros(hi - lo, np.float32), held[hi:]]) if keeps else None
        return q, dense_bytes(payload, size, flagged), held
    decoded = compressor.decompress(xp, payload, ctx)
    if isinstance(compressor, (OneBit, EFSignSGD)):  # BUDGET passes, each on what the ones before left
        rest = q - decoded
        for _ in range(BUDGET - 1):
            part, ctx = compressor.compress(xp, rest, info)
            payload += part
            step_decoded = compressor.decompress(xp, part, ctx)
            decoded, rest = decoded + step_decoded, rest - step_decoded
    held = np.concatenate([held[:lo], (q - decoded)[:hi - lo], held[hi:]]) if keeps else None
    return decoded, frame_bytes(compression, payload, flagged), held


def of_shard(compressor, size: int):
    """The compressor of a shard of ``size`` elements: SketchML's sketch sized by the shard (one
    mean per ELEMENTS_PER_MEAN elements, MIN_BUCKETS to its own count); the others as they are."""
    if isinstance(compressor, SketchML):
        return SketchML(min(compressor.buckets, max(MIN_BUCKETS, size // ELEMENTS_PER_MEAN)))
    return compressor


def frame_bytes(compression, payload, flagged: bool) -> int:
    """A frame: the lengths of variable payloads (8 bytes each), the tensors, the flag, to 8."""
    header = 8 * len(payload) if compression.compressor.traits.variable_length else 0
    return _aligned(header + sum(np.asarray(t).nbytes for t in payload) + flagged)


def dense_bytes(payload, size: int, flagged: bool) -> int:
    """A variable-length frame that carries the shard's float32 values: its header, values, flag."""
    return 8 * len(payload) + _aligned(4 * size + flagged)


def goes_dense(compression, payload, size: int, flagged: bool) -> bool:
    return compression.compressor.traits.variable_length and \
        frame_bytes(compression, payload, flagged) > dense_bytes(payload, size, flagged)


def _aligned(n: int) -> int:
    return n + (-n % 8)
