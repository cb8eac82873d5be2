"""PowerSGD's fast paths: a bucket's rounds batched (one native call per product for all of its
matrices on a CPU: ``PowerSGD.rounds_many``), and with residual memory M = g + e written in the
pass that makes the first product, e's own subtraction (e = M' - P Q^T, deferred) in that pass too.

Where the plan keeps places for them (``places(name, shapes)``: the same tensors step after step),
the factors are written there, not into new buffers: P and the new Q each into the one of two
kept sets that no memory or state still refers to (a skipped step's are put back), the Q sent
into one set of its own.
"""
import operator
from dataclasses import dataclass

from grace.compressors.powersgd import Factors, LowRankResidual, PowerSGD, factor_rank, matrix_shape, native_products
from grace.core.buffers import Pieces, buffers_of, subset, zipped
from grace.core.compressor import native_or_none
from grace.core.plans.kernels import MethodKernels, kernels_for


@kernels_for(PowerSGD)
class PowerSGDKernels(MethodKernels):
    def rounds_many(self, xp, xs, infos, states, outs=None, firsts=None, deferred=None, places=None):
        layout = _layout(xp, xs, self.compressor.rank)
        made = [firsts[i] for i in layout.matrices] if firsts and layout.matrices else []
        ps = _kept(_sets(places, ("p0", "p1"), layout.p_shapes), made) \
            if places is not None and made and all(p is not None for p in made) else None
        if ps is None:
            return self.compressor.rounds_many(xp, xs, infos, states, outs, firsts, deferred)
        return self._kept_rounds(xp, xs, infos, states, outs, firsts, deferred, places, layout, ps)

    def _kept_rounds(self, xp, xs, infos, qs, outs, firsts, deferred, places, layout, ps):
        """``rounds_many`` where every matrix's first payload was made (``firsts_with_residual``)
        into kept places (``ps``): the rounds' factors kept there too."""
        n, count, matrices, shapes = infos[0].world_size, len(xs), layout.matrices, layout.shapes
        summed = yield [(x,) if first is None else (first,) for x, first in zip(xs, firsts)]
        vectors = [i for i, first in enumerate(firsts) if first is None]  # (sent whole: their mean is the result)
        results = [None] * count
        sums = [summed[i][0] for i in vectors]
        # the means straight into their outs (one call, not an op per vector), where given
        means = native_or_none(xp, "divide_many_into", sums[0], sums, n, subset(outs, vectors)) \
            if vectors and outs is not None else None
        for i, mean in zip(vectors, means or xp.divide_many(sums, n)):
            results[i] = (mean, xs[i], qs[i])
        sums = [summed[i][0] for i in matrices]
        if any(map(operator.is_not, sums, ps)):  # (new tensors: the collective did not sum in place)
            xp.assign_many(list(ps), sums)
        for p, r in zip(ps, layout.ranks):
            if r > 1:  # (one column: made a unit vector by the native call)
                xp.assign(p, xp.orthonormalize(p))
        sent = places("q", layout.q_shapes)
        _native(xp, "lowrank_back_many", subset(xs, matrices), ps, shapes, unit=True, q_into=sent)
        payloads = [()] * count
        for i, q in zip(matrices, sent):
            payloads[i] = (q,)
        summed = yield payloads
        new_qs = _free(_sets(places, ("q0", "q1"), layout.q_shapes), [qs[i] for i in matrices])
        # P Q^T straight into the outs, where given: float32, as the gradients the first product took
        into = subset(outs, matrices) if outs is not None else [None] * len(matrices)
        sums = [summed[i][0] for i in matrices]
        sums = sent if all(map(operator.is_, sums, sent)) else sums  # (summed in place)
        approx, made = _native(xp, "lowrank_expand_many", ps, sums, shapes, into, n, q_into=new_qs)
        new_qs = made if new_qs is None else new_qs
        for j, i in enumerate(matrices):
            a = approx[j] if outs is not None else xp.reshape(xp.cast(approx[j], xp.dtype(xs[i])), xp.shape(xs[i]))
            results[i] = (a, Factors(ps[j], new_qs[j]) if deferred and deferred[i] else a, new_qs[j])
        return results

    def firsts_with_residual(self, xp, gs, residuals, beta, gamma, infos, qs, p_outs, nonfinite=None, places=None):
        """One native call for the bucket's matrices (CPU): each M = g + e written into its
        p_out in the pass that makes P = M Q (e = M' - P' Q'^T made there too where the memory
        left its subtraction: a ``LowRankResidual``); vectors (and gradients without a p_out) get None."""
        if beta != 1.0 or gamma != 1.0 or not xp.mutable_tensors:
            return None
        layout = _layout(xp, p_outs, self.compressor.rank)  # (a p_out is laid out like its memory, and its g)
        chosen, shapes = layout.matrices, layout.shapes
        if not chosen:
            return None
        deferred = [(e.p, e.q) if isinstance(e, LowRankResidual) else None for e in (residuals[i] for i in chosen)]
        qs, p_into = [qs[i] for i in chosen], None
        if places is not None:  # (Q: last step's, kept; P into the kept set no memory still refers to)
            kept = _kept(_sets(places, ("q0", "q1"), layout.q_shapes), qs)
            # (Qs not kept, the first step's: their own rank, as Q's init drew them)
            p_sets = _sets(places, ("p0", "p1"), layout.p_shapes if kept is not None else
                           [(rows, xp.shape(q)[1]) for q, (rows, _) in zip(qs, shapes)])
            qs = kept or qs
            held = [pair and pair[0] for pair in deferred]
            p_into = _free(p_sets, held)
            deferred = _kept_pairs(p_sets, held, qs, deferred)
        ps = native_products(xp, "lowrank_project_many", subset(gs, chosen), qs, shapes,
                             subset(buffers_of(residuals), chosen), subset(p_outs, chosen), nonfinite,
                             deferred if any(deferred) else None, p_into=p_into)
        if ps is None:
            return None
        firsts = [None] * len(gs)
        for i, p, (rows, _) in zip(chosen, ps, shapes):
            firsts[i] = p if p_into is not None else xp.reshape(p, (rows, -1))
        return firsts


@dataclass(frozen=True)
class _Layout:
    """A bucket's matrices (``matrices``: their indices among its units), each (rows, cols), the
    rank r of its factors (as Q's init makes them) and its factors' shapes: P's, Q's."""

    matrices: tuple
    shapes: tuple
    ranks: tuple
    p_shapes: tuple
    q_shapes: tuple


def _layout(xp, xs, rank: int) -> _Layout:
    """The layout of ``xs``' matrices (2-d or more; None, or a tuple of tensors, is none) at
    ``rank``: made once for a kept ``Pieces`` (a bucket's spares: the same tensors step after step)."""
    def made():
        matrices = tuple(i for i, x in enumerate(xs)
                         if x is not None and not isinstance(x, tuple) and len(xp.shape(x)) >= 2)
        shapes = tuple(matrix_shape(xp, xs[i]) for i in matrices)
        ranks = tuple(factor_rank(rank, rows, cols) for rows, cols in shapes)
        return _Layout(matrices, shapes, ranks, tuple((rows, r) for (rows, _), r in zip(shapes, ranks)),
                       tuple((cols, r) for (_, cols), r in zip(shapes, ranks)))

    return xs.derive(("layout", rank), made) if isinstance(xs, Pieces) else made()


def _sets(places, names, shapes):
    """The kept sets of tensors of ``shapes`` per name (``places``)."""
    shapes = tuple(shapes)
    return [places(name, shapes) for name in names]


def _free(sets, held):
    """The first of ``sets`` none of whose tensors is one of ``held`` (what a memory or a state
    still refers to, in the same order), or None: new tensors then."""
    return next((pieces for pieces in sets if not any(map(operator.is_, pieces, held))), None)


def _kept(sets, tensors):
    """The one of ``sets`` whose tensors ``tensors`` are, or None."""
    return next((pieces for pieces in sets if all(map(operator.is_, pieces, tensors))), None)


def _kept_pairs(p_sets, ps, qs, deferred):
    """``deferred`` (each matrix's deferred factors (P, Q), or None; ``ps``: their Ps) as pairs of
    one of the kept ``p_sets`` and the Qs ``qs``, where they are those (their native buffers then
    derived once), else as it is."""
    kept = _kept(p_sets, ps)
    if kept is None or not all(pair[1] is q for pair, q in zip(deferred, qs)):
        return deferred
    return zipped(kept, qs)


def _native(xp, name, matrices, *args, **kwargs):
    """``native_products`` where the first product ran natively: it runs."""
    made = native_products(xp, name, matrices, *args, **kwargs)
    if made is None:
        raise RuntimeError(f"grace.native's {name} did not run where lowrank_project_many did")
    return made
