"""One step's undo log: an overflow costs one step and leaves no trace.

An overflow is an inf or a NaN in a rank's gradient, as mixed precision produces. Each rank
flags its own in what it sends anyway (an extra element of an allreduce, a byte of a frame);
``overflow`` counts the ranks that flagged one, and every rank hands back non-finite gradients
for that exchange (``poisoned``), so a loss scaler skips the step. Every state value a step
changes goes through ``set``, which keeps the value from before the step, and ``end_step``
puts them back where any rank flagged one. Methods that keep nothing and pass an inf through
by themselves (``none``, ``fp16`` without memory) are not ``guarded``: no flag, no step
counters, nothing logged.
"""
from __future__ import annotations

from typing import Any, Dict, List

from grace.core.memory import buffer_of
from grace.core.tensors import backend_for


def no_overflow(overflow) -> bool:
    """Whether no rank flagged an overflow (None: not guarded; a traced count: not known yet)."""
    return overflow is None or (isinstance(overflow, int) and not overflow)


def left_on_device(overflow):
    """The overflow count where it is left on the device (a tensor, for a kernel that poisons by
    it); None where it is an int read back already, or not guarded."""
    return overflow if overflow is not None and not isinstance(overflow, int) else None


def poisoned(xp, t, overflow):
    """NaN everywhere when any rank flagged an overflow (``overflow``: how many did, an int or
    a traced tensor; None: not guarded), so that a loss scaler sees it and skips the step."""
    if no_overflow(overflow):
        return t
    if isinstance(overflow, int):
        return t * float("nan")
    return xp.where(overflow > 0, float("nan"), t)


def poisoned_many(xp, ts, overflow):
    """``poisoned`` of several tensors; with the count left on the device, by one multi-tensor
    division (by 1, exactly t; or by NaN)."""
    if no_overflow(overflow):
        return list(ts)
    if isinstance(overflow, int):
        return [t * float("nan") for t in ts]
    ts = list(ts)
    divisor = xp.cast(xp.where(xp.reshape(overflow, ()) > 0, float("nan"), 1.0), xp.dtype(ts[0]))
    return xp.divide_many(ts, divisor)


def any_flag(xp, flags):
    """One overflow flag (1 where any is) from several."""
    return flags[0] if len(flags) == 1 else xp.reshape(xp.max(xp.concat(flags)), (1,))


class Journal:
    def __init__(self, store, guarded: bool):
        self.store = store
        self.guarded = guarded
        self._before: Dict[tuple, Any] = {}  # (table, key): its value before this step
        self._counts: List[Any] = []  # per exchange of this step: how many ranks flagged an overflow
        self._deferred: List[Any] = []  # ... those left on the device, read by end_step

    def set(self, table: str, key: str, value) -> None:
        """Store a value this step changes, keeping its old value until the step ends."""
        if self.guarded and (table, key) not in self._before:
            self._before[table, key] = self.store.value(table, key)
        self.store.set(table, key, value)

    def set_many(self, table: str, keys, values, olds) -> None:
        """``set`` of each of ``keys`` to its value (a bucket's units), ``olds`` being their values
        as the caller read them this step (not read again); a key with no value, given none, is
        left as it is: nothing to store or put back (PowerSGD's vectors)."""
        if not self.guarded:
            self.store.set_many(table, keys, values)
            return
        before, store = self._before, self.store
        for key, value, old in zip(keys, values, olds):
            if (table, key) not in before:  # (else set this step already: its value before kept)
                if old is None and value is None:
                    continue
                before[table, key] = old
            store.set(table, key, value)

    def next_step(self, key: str, like):
        """This exchange's step for ``key`` (it seeds random draws), counted on. Unguarded
        methods read no step and count nothing, so an overflow changes nothing of theirs."""
        if not self.guarded:
            return 0
        step = self.store.get("steps", key, lambda _: 0, like)
        self.set("steps", key, step + 1)
        return step

    def overflow(self, xp, flags, defer: bool = False) -> Any:
        """How many ranks flagged an overflow (summed flags, or each rank's): read back now, or
        where ``defer`` (a flat result on an accelerator, poisoned on the device) left there as
        a tensor until ``end_step`` reads the whole step's at once: no stall per bucket."""
        flags = [xp.flatten(f) for f in flags]
        if defer and len(flags) == 1 and xp.dtype(flags[0]).startswith(("float", "bfloat")) \
                and xp.numel(flags[0]) == 1:  # an allreduce's summed flag: the count already (no sum, no cast)
            self._deferred.append(flags[0])
            return flags[0]
        if len({xp.dtype(f) for f in flags}) > 1:
            flags = [xp.cast(f, "int64") for f in flags]
        total = xp.sum(flags[0] if len(flags) == 1 else xp.concat(flags))  # (integers: summed in int64)
        if xp.dtype(total) != "int64":  # an allreduce's float flags, summed
            total = xp.cast(total, "int64")
        if defer:
            self._deferred.append(total)
            return total
        return self.counted(xp.host_ints(xp.reshape(total, (1,)), 1)[0])

    def leave_on_device(self, count) -> None:
        """How many ranks flagged an overflow (int64, one element), left on the device until
        ``end_step`` reads the step's at once."""
        self._deferred.append(count)

    def counted(self, count: int) -> int:
        """How many ranks flagged an overflow, where it was read back already (with a bucket's
        headers)."""
        self._counts.append(count)
        return count

    def end_step(self, spares: Dict[str, Any]) -> None:
        """Close a step: where any rank flagged an overflow, put back every value it changed.
        ``spares``: the exchange's spare memory buffers (an old memory put back is no longer
        free to be written over)."""
        if self._deferred:  # one read back for the step's results left on the device
            deferred, self._deferred = self._deferred, []
            self.overflow(backend_for(deferred[0]), deferred)
        overflow = sum(self._counts)  # an int; a tensor inside a trace
        if self._before and not no_overflow(overflow):
            for (table, key), old in self._before.items():
                if isinstance(overflow, int):
                    if spares.get(key) is buffer_of(old):  # (the new value's buffer is free instead)
                        spares[key] = buffer_of(self.store.value(table, key))
                    self.store.set(table, key, old)
                elif old is not None:  # traced: chosen when the step runs
                    self.store.set(table, key, _chosen(overflow, old, self.store.value(table, key)))
        self.abandon()

    def abandon(self) -> None:
        """Forget the step in progress (a state was loaded over it)."""
        self._before.clear()
        self._counts.clear()
        self._deferred.clear()


def _chosen(overflow, old, current):
    """``old`` where a traced ``overflow`` count is positive, else ``current`` (tuples alike)."""
    if isinstance(old, tuple):
        return tuple(_chosen(overflow, o, c) for o, c in zip(old, current))
    return backend_for(current).where(overflow > 0, old, current)
