"""One rank's side of the GRACE pipeline, for any backend and any communicator.

    p            = memory.compensate(g, e)
    payload, ctx = compressor.compress(p)               (with its state: compressor.step)
    e            = memory.update(p, compressor.decompress(payload, ctx))
    allreduce:           g_hat = decompress(sum of payloads) / n
    allgather/broadcast: g_hat = aggregate([payload_1..payload_n])

Multi-round methods (PowerSGD) decompress only after their last round; their memory is then
updated with what the method says this rank's p became (PowerSGD: the approximation all
ranks share).

``start`` runs up to launching the collective and ``finish`` waits for it, so a toolkit can
overlap the exchange of one gradient with the backward pass of the next.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from grace.backends import backend_for
from grace.core.communicator import Communicator, Handle
from grace.core.compression import GradientCompression
from grace.core.compressor import FLOAT_DTYPES, Collective, TensorInfo
from grace.core.state import StateStore


@dataclass
class WireStats:
    """Bytes this rank handed to the collectives, and what dense float32 would have been."""

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    last_step_bytes: int = 0
    last_step_dense_bytes: int = 0
    _step_bytes: int = field(default=0, repr=False)
    _step_dense_bytes: int = field(default=0, repr=False)

    def add(self, nbytes: int, dense_bytes: int) -> None:
        self._step_bytes += nbytes
        self._step_dense_bytes += dense_bytes

    def end_step(self) -> None:
        self.steps += 1
        self.last_step_bytes, self.last_step_dense_bytes = self._step_bytes, self._step_dense_bytes
        self.bytes_sent += self._step_bytes
        self.dense_bytes += self._step_dense_bytes
        self._step_bytes = self._step_dense_bytes = 0

    @property
    def compression_ratio(self) -> float:
        """Dense float32 bytes over bytes sent, over all steps so far."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")


_EMPTY = object()  # ctx of an empty tensor, which is not exchanged


@dataclass
class Pending:
    name: str
    xp: Any
    ctx: Any
    handle: Handle
    p: Any = None  # multi-round methods: the compensated gradient, for the memory update
    rounds: Any = None  # multi-round methods: the protocol, suspended between rounds
    memory_state: Any = None  # multi-round methods: the memory before this step


class Exchange:
    def __init__(self, compression: GradientCompression, communicator: Communicator,
                 average: bool = True, store: Optional[StateStore] = None, stats=None):
        if not isinstance(compression, GradientCompression):
            raise TypeError(f"expected a grace compression such as grace.topk(0.01), got {compression!r}")
        self.compression = compression
        self.communicator = communicator
        self.average = average
        self.store = store if store is not None else StateStore()
        self.stats = stats if stats is not None else WireStats()

    def start(self, name: str, g) -> Pending:
        xp = backend_for(g)
        if xp.dtype(g) not in FLOAT_DTYPES:
            raise TypeError(f"grace compresses floating-point gradients; {name!r} has dtype {xp.dtype(g)}")
        if xp.numel(g) == 0:  # nothing to send, nothing to remember
            return Pending(name, xp, _EMPTY, Handle(lambda: g, 0))
        compressor, memory, store = self.compression.compressor, self.compression.memory, self.store
        step = store.get("steps", name, lambda _: 0, g)
        info = TensorInfo(name=name, step=step, world_size=self.communicator.size,
                          rank=self.communicator.rank)
        store.set("steps", name, step + 1)
        self.stats.add(0, 4 * xp.numel(g))

        memory_state = store.get("memory", name, lambda t: memory.init(xp, t), g)
        first = TensorInfo(name=name, step=0, world_size=info.world_size, rank=info.rank)  # init needs no tensor
        state = store.get("state", name, lambda t: compressor.init_state(xp, t, first), g)
        if not compressor.multi_round:  # one pass over memory where a kernel fuses the three steps
            fused = memory.fused_step(xp, compressor, g, memory_state, info)
            if fused is not None:
                payload, ctx, memory_state = fused
                store.set("memory", name, memory_state)
                return Pending(name, xp, ctx, self._send(name, xp, payload, 0))
        p = memory.compensate(xp, g, memory_state)
        if compressor.multi_round:
            rounds = compressor.rounds(xp, p, info, state)
            return Pending(name, xp, None, self._send(name, xp, next(rounds), 0), p, rounds, memory_state)

        payload, ctx, state = compressor.step(xp, p, info, state)
        store.set("state", name, state)
        if memory.needs_feedback:
            p_hat = compressor.decompress(xp, payload, ctx)
            store.set("memory", name, memory.update(xp, p, p_hat, memory_state))
        return Pending(name, xp, ctx, self._send(name, xp, payload, 0))

    def finish(self, pending: Pending):
        xp, compressor, n = pending.xp, self.compression.compressor, self.communicator.size
        if pending.ctx is _EMPTY:
            return pending.handle.wait()
        if pending.rounds is not None:
            g_hat = self._finish_rounds(pending)
        elif self.compression.collective is Collective.ALLREDUCE:
            g_hat = compressor.decompress(xp, pending.handle.wait(), pending.ctx) / n
        else:
            g_hat = compressor.aggregate(xp, pending.handle.wait(), pending.ctx)
        return g_hat if self.average else g_hat * n

    def _finish_rounds(self, pending: Pending):
        name, xp, memory = pending.name, pending.xp, self.compression.memory
        summed, r = pending.handle.wait(), 0
        while True:
            try:
                payload = pending.rounds.send(summed)
            except StopIteration as done:
                g_hat, p_hat, state = done.value
                self.store.set("state", name, state)
                break
            r += 1
            summed = self._send(name, xp, payload, r).wait()
        if memory.needs_feedback:
            self.store.set("memory", name, memory.update(xp, pending.p, p_hat, pending.memory_state))
        return g_hat

    def _send(self, name: str, xp, payload, round_: int) -> Handle:
        suffix = f".round{round_}" if round_ else ""
        handle = self.communicator.exchange(self.compression.collective, xp, payload, f"grace.{name}{suffix}",
                                            equal_lengths=not self.compression.compressor.variable_length)
        self.stats.add(handle.nbytes, 0)
        return handle

    def exchange(self, grads: Dict[str, Any]) -> Dict[str, Any]:
        """Exchange a whole step's gradients (all launched before any is awaited)."""
        pending = {name: self.start(name, g) for name, g in grads.items()}
        out = {name: self.finish(p) for name, p in pending.items()}
        self.stats.end_step()
        return out

    # --- state and checkpointing ---------------------------------------------------------
    @property
    def memory(self) -> Dict[str, Any]:
        """Error-feedback state per tensor name."""
        return self.store.tables["memory"]

    @property
    def state(self) -> Dict[str, Any]:
        """Compressor state per tensor name (signum's momentum, PowerSGD's Q)."""
        return self.store.tables["state"]

    @property
    def steps(self) -> Dict[str, Any]:
        """Exchanges so far per tensor name (they seed the random methods)."""
        return self.store.tables["steps"]

    def state_dict(self) -> Dict[str, Any]:
        return self.store.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.store.load_state_dict(state)
