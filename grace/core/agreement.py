"""The ranks' first-step agreement: one clear error on every rank where they are configured
differently, instead of a hang or ranks that drift apart.

Before an exchange's first step, and again after the world changed (elastic training) or after
``hvd.join()``, the ranks compare checksums of their configuration, their gradients and their
step counters. It is one small allreduce of a table with a row per rank, under a name every
rank shares: an allreduce, so that a rank in ``hvd.join()`` takes part (its row stays zeros and
is left out). While a rank waits for it, a line on stderr every ``STALL_SECONDS`` says what the
likely causes are: a rank that never joins leaves the others in a collective that cannot be
cancelled.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import zlib

import numpy as np

#: seconds a rank waits for the others' first-step agreement before it says why it may never come
STALL_SECONDS = float(os.environ.get("GRACE_STALL_SECONDS", "20"))

HINTS = {
    "configuration": "build the same compression (method, parameters, seed, bucket_mb, scope, op) on every rank",
    "gradients": "every rank must exchange the same named gradients, of the same shapes",
    "step counters": "after loading a checkpoint on some ranks only, load each rank's own checkpoint on every "
                     "rank, or (PyTorch) call hvd.broadcast_optimizer_state(opt, root_rank=0): it carries grace's "
                     "step counters",
}


@contextlib.contextmanager
def told_if_stalled(rank: int):
    """While the block runs (a wait for every rank), a line on stderr every ``STALL_SECONDS``."""
    started = time.monotonic()
    done = threading.Event()

    def tell():
        while not done.wait(STALL_SECONDS):
            print(f"grace: rank {rank} has waited {time.monotonic() - started:.0f} s for the other ranks' first "
                  "grace exchange. A rank that never makes one leaves the others waiting here for ever: one that "
                  "runs Horovod's own optimizer or DDP's own allreduce (compression not a grace method on every "
                  "rank), one with fewer grace optimizers, one that is stuck or died. (Set GRACE_STALL_SECONDS to "
                  "change this interval.)", file=sys.stderr, flush=True)

    watcher = threading.Thread(target=tell, name="grace-stall-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def agree(exchange, xp, like, adopt: bool = True) -> None:
    """Compare ``exchange``'s fingerprints with every rank's; raise the same error on every rank
    where they differ. With ``shared_state_from_rank_0``, differing step counters become rank
    0's on every rank instead, and are compared once more (``adopt``: whether they may still be
    taken)."""
    comm = exchange.communicator
    parts, table = _fingerprints(exchange, xp, like)
    present = [r for r in range(comm.size) if table[r, 0]]  # (this rank among them)
    first = present[0]
    for i, (what, text) in enumerate(parts.items(), start=1):
        differ = [r for r in present if table[r, i] != table[first, i]]
        if differ and what == "step counters" and exchange.shared_state_from_rank_0 and adopt and first == 0:
            with exchange.store.eager():
                exchange.adopt_shared_state(0, like)
            agree(exchange, xp, like, adopt=False)  # (a rank with counters rank 0 lacks still differs)
        elif differ:
            raise RuntimeError(f"grace: ranks {differ} differ from rank {first} in their {what}; {HINTS[what]}. "
                               f"Rank {comm.rank} has: {text[:500]}")


def _fingerprints(exchange, xp, like):
    """(this rank's parts by name, every rank's row of checksums: present, then one per part)."""
    comm = exchange.communicator
    with exchange.store.eager():
        steps = sorted((name, int(v)) for name, v in exchange.steps.items())  # (no memory copied)
        parts = {
            "configuration": f"{exchange.compression!r}, average={exchange.average}",
            "gradients": repr(sorted(exchange.expected)),
            "step counters": repr(steps),
        }
        width = 1 + len(parts)
        mine = np.zeros((comm.size, width), np.int64)
        mine[comm.rank] = [1, *(zlib.crc32(text.encode()) for text in parts.values())]
        with told_if_stalled(comm.rank):
            wait = comm.allreduce_async(xp.asarray(mine.reshape(-1), like=like), "grace.agreement")
            table = np.asarray(xp.host_ints(wait(), comm.size * width)).reshape(comm.size, width)
    return parts, table
