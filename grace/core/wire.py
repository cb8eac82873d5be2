"""Bytes on the wire against each method's ideal (docs/methods.md, column 'bits (ideal)').

    report = wire_report(grace.qsgd(), (1024, 1024))
    report.ideal_bits, report.sent_bytes, report.header_bytes

The bytes are those an ``Exchange`` hands to the collectives in a world of one, counted as in
training (lengths of variable payloads included); the ideal is the compressor's own formula.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from grace.core.tensors import get_backend
from grace.core.communicator import LocalCommunicator
from grace.core.compression import GradientCompression
from grace.core.exchange import Exchange


@dataclass(frozen=True)
class WireReport:
    method: str
    numel: int
    ideal_bits: float
    sent_bytes: int
    payload_bytes: int  # sent_bytes without the exchange's header (lengths)

    @property
    def header_bytes(self) -> int:
        return self.sent_bytes - self.payload_bytes

    @property
    def bits_per_element(self) -> float:
        return 8 * self.sent_bytes / self.numel

    @property
    def excess(self) -> float:
        """Payload bits beyond the ideal, as a fraction of the ideal."""
        return 8 * self.payload_bytes / self.ideal_bits - 1


class _Recorder(LocalCommunicator):
    """A world of one that keeps every payload it is handed, one tuple per collective call."""

    def __init__(self):
        self.calls = []

    def exchange(self, collective, xp, payload, name, equal_lengths):
        self.calls.append(tuple(payload))
        return super().exchange(collective, xp, payload, name, equal_lengths)


def wire_report(compression: GradientCompression, shape: Tuple[int, ...], seed: int = 0) -> WireReport:
    """One step of ``compression`` on a standard-normal float32 tensor of ``shape``: the bytes
    of its bucketed exchange, and the ideal bits of the payload its per-tensor exchange sends
    (multi-round methods: all rounds' payloads)."""
    xp = get_backend("numpy")
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    exchange = Exchange(compression, LocalCommunicator())
    exchange.exchange({"wire": x})

    compressor, recorder = compression.compressor, _Recorder()
    per_tensor = Exchange(GradientCompression(compressor, compression.memory, compression.collective, bucket_mb=0),
                          recorder)
    pending = per_tensor.start("wire", x)
    per_tensor.finish(pending)
    if pending.flagged:  # the first call's payload ends with the overflow flag
        recorder.calls[0] = recorder.calls[0][:-1]
    payload = tuple(t for call in recorder.calls for t in call)
    return WireReport(method=repr(compressor), numel=x.size, ideal_bits=compressor.ideal_bits(xp, payload, pending.ctx),
                      sent_bytes=exchange.stats.last_step_bytes,
                      payload_bytes=sum(xp.nbytes(t) for t in payload))
