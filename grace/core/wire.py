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

from grace.backends import get_backend
from grace.core.communicator import LocalCommunicator
from grace.core.compression import GradientCompression
from grace.core.compressor import TensorInfo
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


def run_local(compressor, xp, x, info: TensorInfo):
    """(payload, decompressed) in a world of one. Multi-round methods: the payloads of all
    rounds in order, and the result after the last round."""
    if not compressor.multi_round:
        payload, ctx = compressor.compress(xp, x, info)
        return payload, compressor.decompress(xp, payload, ctx), ctx
    rounds, sent = compressor.rounds(xp, x, info, compressor.init_state(xp, x, info)), []
    payload = next(rounds)
    while True:
        sent.extend(payload)
        try:
            payload = rounds.send(payload)  # the sum over one rank
        except StopIteration as done:
            return tuple(sent), done.value[0], None


def wire_report(compression: GradientCompression, shape: Tuple[int, ...], seed: int = 0) -> WireReport:
    """One step of ``compression`` on a standard-normal float32 tensor of ``shape``."""
    xp = get_backend("numpy")
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    exchange = Exchange(compression, LocalCommunicator())
    exchange.exchange({"wire": x})
    compressor = compression.compressor
    payload, _, ctx = run_local(compressor, xp, x, TensorInfo("wire", 0, 1))
    return WireReport(method=repr(compressor), numel=x.size, ideal_bits=compressor.ideal_bits(xp, payload, ctx),
                      sent_bytes=exchange.stats.last_step_bytes,
                      payload_bytes=sum(xp.nbytes(t) for t in payload))
