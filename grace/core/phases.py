"""Where an exchange spends its time: a clock that benchmarks hand to ``Exchange.phases``.

``Exchange`` marks the phases of the path training runs (fused kernels included):

    compress     compensate, compress (the fused error-feedback kernels too), framing
    feedback     decompress of the rank's own payload and memory update (unfused methods)
    collective   the communicator's calls and the waits for them
    decompress   reading frames, decompress or aggregate (PowerSGD: after its last round)

Phases nest and count exclusively: a collective launched while compressing counts as
collective only. Without a clock each mark is one shared no-op context manager.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional

PHASES = ("compress", "feedback", "collective", "decompress")
NO_CLOCK = contextlib.nullcontext()


class PhaseClock:
    """Seconds per phase, summed over every exchange timed with it. ``sync`` runs before
    each reading (``torch.cuda.synchronize`` on a GPU: kernels are asynchronous)."""

    def __init__(self, sync: Optional[Callable[[], None]] = None):
        self.sync = sync or (lambda: None)
        self.seconds: Dict[str, float] = defaultdict(float)
        self._open: List[list] = []  # [phase, since when it runs] per open phase, innermost last

    def reset(self) -> Dict[str, float]:
        """The seconds so far (each phase, zero if it did not occur), and start again."""
        seconds = {phase: self.seconds.get(phase, 0.0) for phase in PHASES}
        self.seconds.clear()
        return seconds

    def _now(self) -> float:
        self.sync()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as ``name``; the yielded mark's ``[0]`` may be renamed inside it
        (a round found to be the last one is decompression)."""
        now = self._now()
        if self._open:
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        mark = [name, now]
        self._open.append(mark)
        try:
            yield mark
        finally:
            now = self._now()
            self._open.pop()
            self.seconds[mark[0]] += now - mark[1]
            if self._open:
                self._open[-1][1] = now
