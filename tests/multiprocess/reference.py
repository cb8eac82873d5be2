"""The expected outcome of a multi-process exchange, computed from all ranks' inputs at once.

Independent of grace's exchange, communicators, memories and aggregation: per rank and tensor
it writes the memory formulas of docs/methods.md out in NumPy, runs only the method's own
compress/decompress, and combines the ranks' results with plain NumPy (a mean; signSGD's
majority vote; EF-signSGD's mean over lr; PowerSGD's two sums, written out here).

Buckets change only what travels, never the result: the bytes per step are counted here from
the frame layout (payload bytes, an 8-byte count per payload tensor for variable-length
methods, the overflow flag byte, padding to 8 bytes per frame), with buckets planned in
reverse parameter order.
With ``scope='bucket'`` a bucket is compressed as one tensor (elementwise methods also are,
on a GPU; these runs are on the CPU).
"""
from __future__ import annotations

import zlib

import numpy as np

from grace.backends import get_backend
from grace.compressors import EFSignSGD, Signum
from grace.core import draws
from grace.core.compressor import Collective, TensorInfo
from grace.memories import DGCMemory, PowerSGDMemory, ResidualMemory

from tests.multiprocess.workers.common import PARAMS, STEPS, local_input, names

xp = get_backend("numpy")


def buckets(compression):
    """Lists of parameter indices exchanged together: one per parameter with bucket_mb=0, else
    reverse order filled up to the cap (all parameters here are float32). Empty ones: none."""
    order = [i for i in reversed(range(len(PARAMS))) if np.prod(PARAMS[i][1]) > 0]
    if not compression.bucket_mb:
        return [[i] for i in reversed(order)]
    cap, groups, size = compression.bucket_mb * 2**20, [], 0
    for i in order:
        nbytes = 4 * int(np.prod(PARAMS[i][1]))
        if groups and size + nbytes <= cap:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
    return groups


def collective_calls(compression, world_size: int) -> int:
    """Horovod collectives per step for this parameter set (buckets, rounds, broadcasts)."""
    calls = 0
    for group in buckets(compression):
        if compression.compressor.traits.multi_round:  # PowerSGD: a second round if a matrix is in it
            calls += 2 if any(len(PARAMS[i][1]) >= 2 for i in group) else 1
        elif compression.collective is Collective.BROADCAST:
            calls += world_size + (1 if compression.compressor.traits.variable_length else 0)
        else:
            calls += 1
    return calls


def expected(variant, world_size: int):
    """[per rank] {'grad/<name>/<step>', 'memory/<name>[/i]', 'state/<name>': array, 'bytes/<step>': int}"""
    compression = variant.make()
    if compression.collective is Collective.ALLTOALL:  # (its own file: the two-phase algorithm)
        from tests.multiprocess.reference_alltoall import expected_alltoall
        return expected_alltoall(variant, world_size)
    compressor, memory = compression.compressor, compression.memory
    whole = compression.scope == "bucket"
    results = [dict() for _ in range(world_size)]
    memories, states = {}, {}  # (rank, name) -> array or tuple of arrays
    keys = names(variant)
    for step in range(STEPS):
        pass_empty(variant, results, step)
        sent = [0] * world_size
        for index, group in enumerate(buckets(compression)):
            inputs = [[local_input(variant, rank, step, i) for i in group] for rank in range(world_size)]
            if step < compression.warmup_steps:  # a plain allreduce; the memory and state untouched
                warm_up(variant, results, step, group, inputs, sent)
                continue
            compensated = [[compensate(memory, g, memories.get((r, keys[i]))) for i, g in zip(group, inputs[r])]
                           for r in range(world_size)]
            p = [[c[0] for c in row] for row in compensated]
            per_unit_p = [[np.concatenate([x.ravel() for x in p[r]])] for r in range(world_size)] if whole else p
            unit_names = [bucket_key(keys, group, index)] if whole else [keys[i] for i in group]
            means, p_hats, payloads = [], [[] for _ in range(world_size)], [[] for _ in range(world_size)]
            for u, name in enumerate(unit_names):
                p_u = [per_unit_p[r][u] for r in range(world_size)]
                if compressor.traits.multi_round:
                    mean, p_hat, sent_payloads = powersgd(compressor, p_u, states, name, step)
                else:
                    mean, p_hat, sent_payloads = exchange(compressor, p_u, states, name, step)
                means.append(mean)
                for rank in range(world_size):
                    p_hats[rank].append(p_hat[rank])
                    payloads[rank].append(sent_payloads[rank])
            if whole:  # back to the parameters
                sizes = [int(np.prod(PARAMS[i][1])) for i in group]
                means = [m.reshape(PARAMS[i][1]) for m, i in zip(np.split(means[0], np.cumsum(sizes)[:-1]), group)]
                p_hats = [[h.reshape(PARAMS[i][1]) for h, i in zip(np.split(row[0], np.cumsum(sizes)[:-1]), group)]
                          for row in p_hats]
            dense = [False] * world_size
            for rank in range(world_size):
                nbytes, dense[rank] = wire_bytes(compression, payloads[rank], p[rank], world_size)
                sent[rank] += nbytes
            if any(dense):  # those ranks sent their whole compensated bucket; it counts as sent
                for rank in (r for r in range(world_size) if dense[r]):
                    p_hats[rank] = list(p[rank])
                means = [combine(compressor, [p_hats[r][k] for r in range(world_size)]) for k in range(len(group))]
            for rank in range(world_size):
                for k, i in enumerate(group):
                    state = update(memory, p[rank][k], p_hats[rank][k], compensated[rank][k][1])
                    if state is not None:
                        memories[rank, keys[i]] = state
            for k, i in enumerate(group):
                for rank in range(world_size):
                    results[rank][f"grad/{keys[i]}/{step}"] = means[k] * world_size if variant.op == "sum" \
                        else means[k]
        for rank in range(world_size):
            results[rank][f"bytes/{step}"] = sent[rank]
    for kind, table in (("memory", memories), ("state", states)):
        for (rank, name), value in table.items():
            if isinstance(value, tuple):
                results[rank].update({f"{kind}/{name}/{j}": v for j, v in enumerate(value)})
            else:
                results[rank][f"{kind}/{name}"] = value
    return results


def warm_up(variant, results, step: int, group, inputs, sent) -> None:
    """A warm-up step of one bucket (or, with bucket_mb=0, of each tensor): the float32 mean
    of the ranks' gradients, by one allreduce that carries the overflow flag (4 bytes more)."""
    keys, world_size = names(variant), len(inputs)
    launches = 1 if variant.make().bucket_mb else len(group)
    for rank in range(world_size):
        sent[rank] += sum(4 * int(np.prod(PARAMS[i][1])) for i in group) + 4 * launches
    for k, i in enumerate(group):
        mean = np.mean([inputs[r][k] for r in range(world_size)], axis=0)
        for rank in range(world_size):
            results[rank][f"grad/{keys[i]}/{step}"] = mean * world_size if variant.op == "sum" else mean


def pass_empty(variant, results, step: int) -> None:
    """An empty parameter's gradient, handed back as it is (nothing to exchange)."""
    for i, name in enumerate(names(variant)):
        if np.prod(PARAMS[i][1]) == 0:
            for rank, out in enumerate(results):
                out[f"grad/{name}/{step}"] = local_input(variant, rank, step, i).astype(np.float64)


def bucket_key(keys, group, index: int) -> str:
    """The name a whole bucket is compressed under (it seeds random draws): its launch index
    and a checksum of its members' names."""
    return f"grace.bucket{index}.{zlib.crc32(chr(0).join(keys[i] for i in group).encode()):08x}"


def wire_bytes(compression, payloads, p, world_size: int):
    """What one rank hands to the collectives for one bucket (or, with bucket_mb=0, one tensor),
    and whether it sends the bucket dense (its encoding would be larger). Methods that keep
    state add their overflow flag: one element of the summed payload's dtype, or one byte of
    the frame (per tensor: one more uint8 tensor, with its length where lengths are sent)."""
    compressor = compression.compressor
    variable = compressor.traits.variable_length
    flagged = compression.flags_overflow
    tensors = [t for payload in payloads for t in payload]
    size = sum(np.asarray(t).nbytes for t in tensors)
    if compressor.traits.multi_round or compression.collective is Collective.ALLREDUCE:
        return size + (np.asarray(tensors[0]).itemsize if flagged else 0), False
    if not compression.bucket_mb:
        return size + flagged + (8 * (len(tensors) + flagged) if variable else 0), False
    header = 8 * len(tensors) if variable else 0
    dense = 4 * sum(x.size for x in p) + header + flagged
    broadcast_sizes = 8 if compression.collective is Collective.BROADCAST and variable else 0
    encoded = header + size + flagged
    return min(_aligned(encoded), _aligned(dense)) + broadcast_sizes, _aligned(encoded) > _aligned(dense)


def _aligned(n: int) -> int:
    return n + (-n % 8)


def compensate(memory, g, state):
    """(p, DGC's new momentum u or None)."""
    if isinstance(memory, DGCMemory):
        if memory.clip_norm:
            g = g * np.float32(min(1.0, memory.clip_norm / max(np.linalg.norm(g), 1e-30)))
        u, v = state if state is not None else (np.zeros_like(g), np.zeros_like(g))
        u = memory.momentum * u + g
        return v + u, u
    if isinstance(memory, ResidualMemory):
        e = state if state is not None else np.zeros_like(g)
        return (memory.beta * e + memory.gamma * g).astype(np.float32), None
    return g, None


def update(memory, p, p_hat, u):
    if isinstance(memory, DGCMemory):  # momentum factor masking
        return np.where(p_hat != 0, 0, u), p - p_hat
    if isinstance(memory, PowerSGDMemory) and p.ndim < 2:
        return None  # vectors travel exactly
    if isinstance(memory, ResidualMemory):
        return p - p_hat
    return None


def exchange(compressor, p, states, name, step):
    """Every rank compresses on its own; the ranks' decompressions are combined."""
    decompressed, payloads = [], []
    for rank, x in enumerate(p):
        if isinstance(compressor, Signum):  # the momentum is the compressor's state
            m = states.get((rank, name))
            x = (1 - compressor.momentum) * x if m is None else compressor.momentum * m + (1 - compressor.momentum) * x
            states[rank, name] = x
        payload, ctx = compressor.compress(xp, x, TensorInfo(name, step, len(p), rank))
        decompressed.append(compressor.decompress(xp, payload, ctx))
        payloads.append(payload)
    return combine(compressor, decompressed), decompressed, payloads


def combine(compressor, decompressed):
    total = np.sum([d.astype(np.float64) for d in decompressed], axis=0)
    if getattr(compressor, "aggregate_by", "mean") == "majority":
        return np.sign(total)
    if isinstance(compressor, EFSignSGD):
        return total / len(decompressed) / compressor.lr
    return total / len(decompressed)


def powersgd(compressor, p, states, name, step):
    """P = sum_i M_i Q; P = orthonormal(P); Q = sum_i M_i^T P / n; every rank gets P Q^T."""
    n = len(p)
    if p[0].ndim < 2:
        return np.sum(p, axis=0) / n, p, [(x,) for x in p]
    m = [x.reshape(x.shape[0], -1).astype(np.float32) for x in p]
    rows, cols = m[0].shape
    q = states.get((0, name))
    if q is None:  # shared seed of the tensor's first step (all ranks draw the same)
        r = min(compressor.rank, rows, cols)
        draw = draws.uniform_numpy([cols * r], [TensorInfo(name, 0, n).seed(compressor.seed)])
        q = draw.reshape(cols, r) - 0.5
    basis, triangle = np.linalg.qr(sum(mi @ q for mi in m))
    basis = basis * np.where(np.diagonal(triangle) < 0, -1, 1)
    q = sum(mi.T @ basis for mi in m) / n
    approx = (basis @ q.T).reshape(p[0].shape)
    for rank in range(n):
        states[rank, name] = q
    return approx, [approx] * n, [(np.zeros((rows + cols) * q.shape[1], np.float32),)] * n  # P and Q
