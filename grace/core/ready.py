"""Launch each bucket as soon as its last gradient is ready, so its exchange overlaps the rest
of backward, and hand each gradient its part of the result.

For adapters that receive gradients one at a time (backward hooks, as Horovod's PyTorch
optimizer). Gradients in no bucket (empty ones) come back as they are.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from grace.core.bucket import Bucket


class ReadyBuckets:
    def __init__(self, exchange, buckets: List[Bucket]):
        self.exchange = exchange
        self.buckets = buckets
        self._bucket_of = {name: b for b in buckets for name in b.names}
        self.reset()

    def reset(self) -> None:
        """Forget the step in progress (after a step, or when the optimizer is reloaded)."""
        self._ready: Dict[str, Dict[str, Any]] = {b.key: {} for b in self.buckets}
        self._pending: Dict[str, Any] = {}
        self._results: Dict[str, Dict[str, Any]] = {}

    def add(self, name: str, grad) -> Callable[[], Any]:
        """Hand over ``name``'s gradient; returns what waits for its averaged gradient."""
        bucket = self._bucket_of.get(name)
        if bucket is None:
            return lambda: grad
        ready = self._ready[bucket.key]
        if name in ready:
            raise RuntimeError(f"grace: the gradient of {name!r} was handed over twice in one step")
        ready[name] = grad
        if len(ready) == len(bucket.segments):
            self._pending[bucket.key] = self.exchange.start_bucket(bucket, [ready[n] for n in bucket.names])
        return lambda: self._result(bucket, name)

    def _result(self, bucket: Bucket, name: str):
        if bucket.key not in self._results:
            if bucket.key not in self._pending:
                missing = [n for n in bucket.names if n not in self._ready[bucket.key]]
                raise RuntimeError(f"grace: the bucket of {name!r} was awaited before the gradients of "
                                   f"{', '.join(map(repr, missing))} were ready")
            if not self._results:  # the step's first: every launched bucket's lengths read at once
                self.exchange.read_counts(list(self._pending.values()))
            results = self.exchange.finish_bucket(self._pending.pop(bucket.key))
            self._results[bucket.key] = dict(zip(bucket.names, results))
        return self._results[bucket.key][name]
