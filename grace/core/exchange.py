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
from typing import Any, Dict

from grace.backends import backend_for
from grace.core.communicator import Communicator, Handle
from grace.core.compression import GradientCompression
from grace.core.compressor import FLOAT_DTYPES, Collective, TensorInfo


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


class Exchange:
    def __init__(self, compression: GradientCompression, communicator: Communicator,
                 average: bool = True):
        if not isinstance(compression, GradientCompression):
            raise TypeError(f"expected a grace compression such as grace.topk(0.01), got {compression!r}")
        self.compression = compression
        self.communicator = communicator
        self.average = average
        self.memory: Dict[str, Any] = {}  # error-feedback state per tensor name
        self.state: Dict[str, Any] = {}  # compressor state per tensor name (momentum, Q)
        self.steps: Dict[str, int] = {}  # exchanges so far per tensor name (seeds random methods)
        self.stats = WireStats()

    def start(self, name: str, g) -> Pending:
        xp = backend_for(g)
        if xp.dtype(g) not in FLOAT_DTYPES:
            raise TypeError(f"grace compresses floating-point gradients; {name!r} has dtype {xp.dtype(g)}")
        if xp.numel(g) == 0:  # nothing to send, nothing to remember
            return Pending(name, xp, _EMPTY, Handle(lambda: g, 0))
        compressor, memory = self.compression.compressor, self.compression.memory
        step = self.steps.get(name, 0)
        info = TensorInfo(name=name, step=step, world_size=self.communicator.size,
                          rank=self.communicator.rank)
        self.steps[name] = step + 1
        self.stats.add(0, 4 * xp.numel(g))

        if name not in self.memory:
            self._keep(self.memory, name, memory.init(xp, g))
        if name not in self.state:
            self._keep(self.state, name, compressor.init_state(xp, g, info))
        p = memory.compensate(xp, g, self.memory.get(name))
        if compressor.multi_round:
            rounds = compressor.rounds(xp, p, info, self.state.get(name))
            return Pending(name, xp, None, self._send(name, xp, next(rounds), 0), p, rounds)

        payload, ctx, state = compressor.step(xp, p, info, self.state.get(name))
        self._keep(self.state, name, state)
        if memory.needs_feedback:
            p_hat = compressor.decompress(xp, payload, ctx)
            self._keep(self.memory, name, memory.update(xp, p, p_hat, self.memory.get(name)))
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
                self._keep(self.state, name, state)
                break
            r += 1
            summed = self._send(name, xp, payload, r).wait()
        if memory.needs_feedback:
            self._keep(self.memory, name, memory.update(xp, pending.p, p_hat, self.memory.get(name)))
        return g_hat

    def _send(self, name: str, xp, payload, round_: int) -> Handle:
        suffix = f".round{round_}" if round_ else ""
        handle = self.communicator.exchange(self.compression.collective, xp, payload, f"grace.{name}{suffix}",
                                            equal_lengths=not self.compression.compressor.variable_length)
        self.stats.add(handle.nbytes, 0)
        return handle

    @staticmethod
    def _keep(states: Dict[str, Any], name: str, state) -> None:
        if state is None:
            states.pop(name, None)
        else:
            states[name] = state

    def exchange(self, grads: Dict[str, Any]) -> Dict[str, Any]:
        """Exchange a whole step's gradients (all launched before any is awaited)."""
        pending = {name: self.start(name, g) for name, g in grads.items()}
        out = {name: self.finish(p) for name, p in pending.items()}
        self.stats.end_step()
        return out

    # --- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"memory": dict(self.memory), "state": dict(self.state), "steps": dict(self.steps)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.memory = dict(state["memory"])
        self.state = dict(state.get("state", {}))
        self.steps = dict(state["steps"])
