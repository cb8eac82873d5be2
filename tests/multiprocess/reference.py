"""The expected outcome of a multi-process exchange, computed from all ranks' inputs at once.

Independent of grace's exchange, communicators, memories and aggregation: per rank and tensor
it writes the memory formulas of METHODS.md out in NumPy, runs only the method's own
compress/decompress, and combines the ranks' results with plain NumPy (a mean; signSGD's
majority vote; EF-signSGD's mean over lr; PowerSGD's two sums, written out here).
"""
from __future__ import annotations

import numpy as np

from grace.backends import get_backend
from grace.compressors import EFSignSGD, Signum
from grace.core.compressor import TensorInfo
from grace.memories import DGCMemory, PowerSGDMemory, ResidualMemory

from tests.multiprocess.workers.common import STEPS, local_input, names

xp = get_backend("numpy")


def expected(variant, world_size: int):
    """[per rank] {'grad/<name>/<step>', 'memory/<name>[/i]', 'state/<name>': array, 'bytes/<step>': int}"""
    compression = variant.make()
    compressor, memory = compression.compressor, compression.memory
    results = [dict() for _ in range(world_size)]
    memories, states = {}, {}  # (rank, name) -> array or tuple of arrays
    for step in range(STEPS):
        sent = [0] * world_size
        for i, name in enumerate(names(variant)):
            inputs = [local_input(variant, rank, step, i) for rank in range(world_size)]
            if inputs[0].size == 0:
                mean = inputs[0].astype(np.float64)
            else:
                p, momenta = zip(*(compensate(memory, g, memories.get((r, name))) for r, g in enumerate(inputs)))
                if compressor.multi_round:
                    mean, p_hat, nbytes = powersgd(compressor, p, states, name, step)
                else:
                    mean, p_hat, nbytes = exchange(compressor, p, states, name, step)
                for rank in range(world_size):
                    sent[rank] += nbytes[rank]
                    state = update(memory, p[rank], p_hat[rank], momenta[rank])
                    if state is not None:
                        memories[rank, name] = state
            for rank in range(world_size):
                results[rank][f"grad/{name}/{step}"] = mean * world_size if variant.op == "sum" else mean
        for rank in range(world_size):
            results[rank][f"bytes/{step}"] = sent[rank]
    for kind, table in (("memory", memories), ("state", states)):
        for (rank, name), value in table.items():
            if isinstance(value, tuple):
                results[rank].update({f"{kind}/{name}/{j}": v for j, v in enumerate(value)})
            else:
                results[rank][f"{kind}/{name}"] = value
    return results


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
    decompressed, nbytes = [], []
    for rank, x in enumerate(p):
        if isinstance(compressor, Signum):  # the momentum is the compressor's state
            m = states.get((rank, name))
            x = (1 - compressor.momentum) * x if m is None else compressor.momentum * m + (1 - compressor.momentum) * x
            states[rank, name] = x
        payload, ctx = compressor.compress(xp, x, TensorInfo(name, step, len(p), rank))
        decompressed.append(compressor.decompress(xp, payload, ctx))
        header = 8 * len(payload) if compressor.variable_length else 0
        nbytes.append(sum(t.nbytes for t in payload) + header)
    total = np.sum([d.astype(np.float64) for d in decompressed], axis=0)
    if getattr(compressor, "aggregate_by", "mean") == "majority":
        mean = np.sign(total)
    elif isinstance(compressor, EFSignSGD):
        mean = total / len(p) / compressor.lr
    else:
        mean = total / len(p)
    return mean, decompressed, nbytes


def powersgd(compressor, p, states, name, step):
    """P = sum_i M_i Q; P = orthonormal(P); Q = sum_i M_i^T P / n; every rank gets P Q^T."""
    n = len(p)
    if p[0].ndim < 2:
        return np.sum(p, axis=0) / n, p, [x.nbytes for x in p]
    m = [x.reshape(x.shape[0], -1).astype(np.float32) for x in p]
    rows, cols = m[0].shape
    q = states.get((0, name))
    if q is None:  # shared seed of the tensor's first step (all ranks draw the same)
        r = min(compressor.rank, rows, cols)
        draw = np.random.default_rng(TensorInfo(name, 0, n).seed(compressor.seed)).random(cols * r, dtype=np.float32)
        q = draw.reshape(cols, r) - 0.5
    basis, triangle = np.linalg.qr(sum(mi @ q for mi in m))
    basis = basis * np.where(np.diagonal(triangle) < 0, -1, 1)
    q = sum(mi.T @ basis for mi in m) / n
    approx = (basis @ q.T).reshape(p[0].shape)
    for rank in range(n):
        states[rank, name] = q
    return approx, [approx] * n, [4 * (rows + cols) * q.shape[1]] * n
