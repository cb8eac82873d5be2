"""The multi-round plan (PowerSGD): a bucket's gradients driven through their rounds together,
each round's payloads summed by one allreduce (``MethodKernels.rounds_many``).

Each gradient keeps its own memory. Where tensors are mutable, p = compensate(g, e) is written
into the gradient's spare buffer (by the kernel that makes its first payload, where the method
has one: ``Memory.fused_firsts``); there the new memory is p less the approximation, that
subtraction deferred to the next step's first pass (a ``Deferred`` memory holding p's buffer).
"""
from __future__ import annotations

import operator
from typing import Any, List

from grace.core.buffers import Pieces, subset
from grace.core.compressor import native_or_none
from grace.core.journal import any_flag, no_overflow, poisoned_many
from grace.core.memory import buffer_of, stored
from grace.core.plans.base import BucketPending, BucketPlan, defers_on_device
from grace.core.plans.reference import later_rounds


class MultiRound(BucketPlan):
    name = "multi-round"

    def _defers(self, xp, g) -> bool:
        return defers_on_device(xp, g)  # (its results poisoned at once: ``poisoned_many``)

    def start(self, xp, grads, flat) -> BucketPending:
        s = self.services
        pending, g_units, infos, states = self.begin(xp, grads, flat)
        units, g = pending.units, pending.g
        flagged = s.journal.guarded and not s.flags_from_payload
        # on a CPU the overflow flag comes from the passes that make the first payloads, where a
        # kernel makes them, and from one check of the other gradients
        in_passes = flagged and not xp.on_accelerator(g)
        if flagged and not in_passes:
            pending.flag = xp.nonfinite(g_units)
        # each result may go straight over its gradient, where it is written in the end anyway
        outs = g_units if s.writes_over(xp, g) else None
        shared = xp.zeros(1, "float32", like=g) if in_passes else None  # the fused first rounds set it
        places = self._places(xp, g)
        firsts, spares = self._compensate_in_first_rounds(xp, units, g_units, pending.old, infos, states, shared,
                                                          places)
        pending.updates = [first is not None for first in firsts]  # their new memory: p less p_hat, deferred
        rest = [i for i, first in enumerate(firsts) if first is None]
        if in_passes:  # (0 where no fused round ran; the others checked into it in one call, where it can)
            others = subset(g_units, rest)  # (their buffers derived once: the rounds write their means over them)
            checked = not others or xp.mutable_tensors and \
                native_or_none(xp, "flag_nonfinite_many", g, others, shared) is not None
            pending.flag = shared if checked else any_flag(xp, [shared, xp.nonfinite(others)])
        # (a unit's spare, where its first pass wrote p)
        pending.p = [None if first is None else spares[i] for i, first in enumerate(firsts)]
        compensated = self._compensate(xp, [units[i].name for i in rest], [g_units[i] for i in rest],
                                        [pending.old[i] for i in rest])
        for i, p in zip(rest, compensated):
            pending.p[i] = p
        # p kept while the same tensors (what kernels derive from them serves every step); p in the
        # spares throughout (no gradient handed over: vectors without memory send theirs), the
        # first payloads are the exchange's own: summed in place where the communicator can
        owned = spares is not None and all(map(operator.is_, pending.p, spares))
        if owned:
            pending.p = spares
        elif places is not None:
            pending.p = s.buffers.kept(f"{self.bucket.key}.p", pending.p)
        pending.rounds = s.kernels.rounds_many(xp, pending.p, infos, states, outs, firsts, pending.updates,
                                               places)
        pending.wait, nbytes = s.transport.allreduce_units(xp, self.bucket.key, next(pending.rounds), pending.flag,
                                                           owned=owned, defer=pending.defer)
        s.transport.stats.add(nbytes, 0)
        return pending

    def _places(self, xp, like):
        """Where the method's kernels keep the bucket's factors (``MethodKernels.rounds_many``),
        on a CPU where tensors are mutable; else None."""
        if not xp.mutable_tensors or xp.on_accelerator(like):
            return None
        buffers, key = self.services.buffers, self.bucket.key
        return lambda name, shapes: buffers.shaped_pieces(xp, f"{key}.{name}", "float32", shapes, like)

    def _compensate_in_first_rounds(self, xp, units, gs, old, infos, states, nonfinite, places):
        """The compensations and first payloads, each gradient's in one pass, the compensation
        written into its spare buffer (``Memory.fused_firsts``, which sets ``nonfinite`` where a
        g holds an inf or a NaN): (per gradient, its first payload or None (not made); the spares
        taken, kept, or None)."""
        s = self.services
        memory, none = s.compression.memory, [None] * len(units)
        if not memory.needs_feedback or not xp.mutable_tensors or any(isinstance(e, tuple) for e in old):
            return none, None
        old = Pieces(old)  # (marked with its buffers, kept: derived once)
        # (left in the spares either way: finish tells by them where p is)
        spares = s.buffers.take_spares(self.bucket.key, xp, self._unit_keys(units)[0], old, leave=True)
        firsts = s.feedback.fused_firsts(xp, s.kernels, gs, old, infos, states, spares, nonfinite, places)
        return firsts or none, spares

    def _compensate(self, xp, keys, gs, es):
        """``memory.compensate`` of the gradients, each written into its key's spare buffer where
        tensors are mutable, all at once where the memory can (``Memory.compensate_many_into``)."""
        s = self.services
        memory = s.compression.memory
        es = [stored(e) for e in es]  # (a deferred memory made: the fused first rounds did not run)
        spares = [s.buffers.take_spare(key, xp, e) if memory.needs_feedback and not isinstance(e, tuple) else None
                  for key, e in zip(keys, es)]
        ps = [None] * len(gs)
        into = [i for i, spare in enumerate(spares) if spare is not None]
        for i in into:
            s.buffers.spares[keys[i]] = spares[i]  # (kept: finish tells by it where p was written)
        if into:
            made = s.feedback.compensate_many_into(xp, [gs[i] for i in into], [es[i] for i in into],
                                               [spares[i] for i in into])
            for i, p in zip(into, made):
                ps[i] = p
        return [memory.compensate(xp, g, e) if p is None else p for p, g, e in zip(ps, gs, es)]

    def finish(self, pending: BucketPending, into=None) -> List[Any]:
        """The later rounds (one allreduce each); then each gradient's result delivered (over its
        ``outs`` entry, where given), after its new memory."""
        s, xp, key = self.services, pending.xp, self.bucket.key
        outs = pending.outs or [None] * len(self.bucket.segments)
        summed, overflow, _ = pending.wait()

        def allreduce(payloads, r):  # (a later round's payloads are the rounds' own: summed in place, where it can)
            wait, nbytes = s.transport.allreduce_units(xp, f"{key}.round{r}", payloads, owned=True)
            s.transport.stats.add(nbytes, 0)
            return wait()[0]

        results = later_rounds(s, pending.rounds, summed, allreduce)
        new_memory = self._new_memories(pending, results)
        g_hats = [g_u for g_u, _, _ in results]
        if pending.defer and not no_overflow(overflow):  # a count left on the device: all poisoned at once
            g_hats, overflow = poisoned_many(xp, g_hats, overflow), None
        names, _ = self._unit_keys(pending.units)
        s.journal.set_many("state", names, [state for _, _, state in results], pending.states)
        if s.compression.memory.needs_feedback:
            s.journal.set_many("memory", names, new_memory, pending.old)
        return s.delivered_many(xp, g_hats, overflow, outs)

    def _new_memories(self, pending: BucketPending, results):
        """Each gradient's new memory: where p is its spare buffer, written there, all at once, or,
        where the fused first rounds made p, p with its subtraction deferred (the rounds gave
        p_hat as factors); else a new one."""
        s, xp = self.services, pending.xp
        memory = s.compression.memory
        if not memory.needs_feedback:
            return [None] * len(results)
        with s.phase("feedback"):
            names, spares, updates = self._unit_keys(pending.units)[0], s.buffers.spares, pending.updates
            in_spare = [p_u is spares.get(name) for name, p_u in zip(names, pending.p)]
            over = [i for i, spare in enumerate(in_spare) if spare and not updates[i]]
            updated = dict(zip(over, s.feedback.update_many_into(
                xp, [pending.p[i] for i in over], [results[i][1] for i in over],
                [pending.old[i] for i in over], [pending.p[i] for i in over]))) if over else {}
            new_memory = []
            for i, (name, p_u, e) in enumerate(zip(names, pending.p, pending.old)):
                if in_spare[i]:
                    new_memory.append(results[i][1].residual_of(p_u) if updates[i] else updated[i])
                    spares[name] = buffer_of(e)  # and the old memory is the next step's spare
                else:
                    new_memory.append(memory.update(xp, p_u, results[i][1], e))
            return new_memory
