"""The expected outcome of a multi-process exchange, computed from all ranks' inputs at once.

Independent of grace's exchange, communicators and aggregation: per rank and tensor it runs
the method's compress/decompress on NumPy with explicit residual memory, then averages
the ranks' decompressed payloads with plain NumPy (signSGD: their majority vote).
"""
from __future__ import annotations

import numpy as np

from grace.backends import get_backend
from grace.core.compressor import TensorInfo
from grace.memories import NoMemory

from tests.multiprocess.workers.common import PARAMS, STEPS, local_input, names

xp = get_backend("numpy")


def expected(variant, world_size: int):
    """[per rank] {'grad/<name>/<step>': array, 'memory/<name>': array, 'bytes/<step>': int}"""
    compression = variant.make()
    compressor, has_memory = compression.compressor, not isinstance(compression.memory, NoMemory)
    keys = names(variant)
    results = [dict() for _ in range(world_size)]
    residual = {}
    for step in range(STEPS):
        sent = [0] * world_size
        for i, name in enumerate(keys):
            decompressed = []
            for rank in range(world_size):
                g = local_input(variant, rank, step, i)
                if g.size == 0:
                    decompressed.append(g)
                    continue
                p = g + residual[rank, name] if (rank, name) in residual else g
                payload, ctx = compressor.compress(xp, p, TensorInfo(name, step, world_size, rank))
                p_hat = compressor.decompress(xp, payload, ctx)
                if has_memory:
                    residual[rank, name] = p - p_hat
                decompressed.append(p_hat.astype(np.float64))
                header = 8 * len(payload) if compressor.variable_length else 0
                sent[rank] += sum(t.nbytes for t in payload) + header
            if getattr(compressor, "aggregate_by", "mean") == "majority":  # signSGD's vote
                mean = np.sign(np.sum(decompressed, axis=0))
            else:
                mean = np.mean(decompressed, axis=0)
            if variant.op == "sum":
                mean = mean * world_size
            for rank in range(world_size):
                results[rank][f"grad/{name}/{step}"] = mean
        for rank in range(world_size):
            results[rank][f"bytes/{step}"] = sent[rank]
    for (rank, name), e in residual.items():
        results[rank][f"memory/{name}"] = e
    return results
