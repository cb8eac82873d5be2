"""Alpha-beta cost model of one data-parallel training step (Tang et al. 2020, §VII, Table III; docs/methods.md).

Sending m bytes costs alpha + beta * m (alpha: per-message latency, beta: seconds per byte of
the link). For n ranks (Horovod's ring algorithms, one rank per host):

    allreduce  2 (n - 1) alpha + 2 (n - 1) / n * beta * m      m = one rank's payload
    allgather    (n - 1) alpha +   (n - 1)     * beta * m      every rank receives n - 1 payloads
    alltoall   2 (n - 1) alpha + 2 (n - 1) / n * beta * m      m = its n - 1 shards and its owner frame:
                                                           (n - 1) / n of m each way, then n - 1 frames of m / n
    broadcast  n rounds of a binomial tree: n * log2(n) * (alpha + beta * m)

A step is predicted as compute + compression + communication, all measured apart:

    compute       forward + backward + optimizer step with no communication
    compression   the method's local work in an n-rank step (compress, memory, decode n payloads)
    communication the formula above for the bytes the method hands to the collectives

The sum assumes no overlap; Horovod starts communicating during the backward pass, so a
step can take less when compute and communication are of similar size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    bandwidth: float  # bytes per second (measured goodput)

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth


def collective_seconds(collective: str, nbytes: float, ranks: int, link: Link, rounds: int = 1) -> float:
    """Time of ``rounds`` collectives that together carry ``nbytes`` per rank."""
    n = ranks
    if n == 1:
        return 0.0
    if collective in ("allreduce", "alltoall"):  # (the two phases move what a ring allreduce moves)
        return rounds * 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * link.beta * nbytes
    if collective == "allgather":
        return rounds * (n - 1) * link.alpha + (n - 1) * link.beta * nbytes
    if collective == "broadcast":
        return n * math.log2(n) * (rounds * link.alpha + link.beta * nbytes)
    raise ValueError(f"unknown collective {collective!r}; expected allreduce, allgather, alltoall or broadcast")


def alpha_from_allreduce(seconds: float, ranks: int) -> float:
    """The alpha that makes a tiny ring allreduce take ``seconds`` (its bandwidth term is nil)."""
    return seconds / (2 * (ranks - 1))


def step_seconds(compute: float, compression: float, collective: str, nbytes: float, ranks: int, link: Link,
                 rounds: int = 1) -> float:
    return compute + compression + collective_seconds(collective, nbytes, ranks, link, rounds)
