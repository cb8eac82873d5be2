"""PowerSGD's fast paths: a bucket's rounds batched (one native call per product for all of its
matrices on a CPU: ``PowerSGD.rounds_many``), and with residual memory M = g + e written in the
pass that makes the first product, e's own subtraction (e = M' - P Q^T, deferred) in that pass too.

Where the plan keeps places for them (``places(name, shapes)``: the same tensors step after step),
the factors are written there, not into new buffers: P and the new Q each into the one of two
kept sets that no memory or state still refers to (a skipped step's are put back), the Q sent
into one set of its own.
"""
import operator

from grace.compressors.powersgd import Factors, LowRankResidual, PowerSGD, matrix_shape, native_products
from grace.core.buffers import subset
from grace.core.compressor import native_or_none
from grace.core.memory import buffer_of
from grace.core.plans.kernels import MethodKernels, kernels_for


@kernels_for(PowerSGD)
class PowerSGDKernels(MethodKernels):
    def rounds_many(self, xp, xs, infos, states, outs=None, firsts=None, deferred=None, places=None):
        matrices = [i for i, first in enumerate(firsts or []) if first is not None]
        ps = _kept(places, ("p0", "p1"), [firsts[i] for i in matrices], xp) if places is not None and matrices else None
        if ps is None or any(len(xp.shape(xs[i])) >= 2 for i, first in enumerate(firsts) if first is None):
            return self.compressor.rounds_many(xp, xs, infos, states, outs, firsts, deferred)
        return self._kept_rounds(xp, xs, infos, states, outs, firsts, deferred, places, matrices, ps)

    def _kept_rounds(self, xp, xs, infos, qs, outs, firsts, deferred, places, matrices, ps):
        """``rounds_many`` where every matrix's first payload was made (``firsts_with_residual``)
        into kept places (``ps``): the rounds' factors kept there too."""
        n, count = infos[0].world_size, len(xs)
        shapes = [matrix_shape(xp, xs[i]) for i in matrices]
        summed = yield [(x,) if first is None else (first,) for x, first in zip(xs, firsts)]
        vectors = [i for i, first in enumerate(firsts) if first is None]  # (sent whole: their mean is the result)
        results = [None] * count
        sums = [summed[i][0] for i in vectors]
        # the means straight into their outs (one call, not an op per vector), where given
        means = native_or_none(xp, "divide_many_into", sums[0], sums, n, [outs[i] for i in vectors]) \
            if vectors and outs is not None else None
        for i, mean in zip(vectors, means or xp.divide_many(sums, n)):
            results[i] = (mean, xs[i], qs[i])
        sums = [summed[i][0] for i in matrices]
        if any(map(operator.is_not, sums, ps)):  # (new tensors: the collective did not sum in place)
            xp.assign_many(list(ps), sums)
        ranks = [xp.shape(p)[1] for p in ps]
        for p, r in zip(ps, ranks):
            if r > 1:  # (one column: made a unit vector by the native call)
                xp.assign(p, xp.orthonormalize(p))
        q_shapes = [(cols, r) for (_, cols), r in zip(shapes, ranks)]
        sent = places("q", q_shapes)
        _native(xp, "lowrank_back_many", subset(xs, matrices), ps, shapes, unit=True, q_into=sent)
        payloads = [()] * count
        for i, q in zip(matrices, sent):
            payloads[i] = (q,)
        summed = yield payloads
        new_qs = _free(places, ("q0", "q1"), q_shapes, [qs[i] for i in matrices])
        # P Q^T straight into out where it has the matrix's dtype: no copy
        into = [outs[i] if outs is not None and xp.dtype(xs[i]) == xp.dtype(outs[i]) == "float32" else None
                for i in matrices]
        sums = [summed[i][0] for i in matrices]
        sums = sent if all(map(operator.is_, sums, sent)) else sums  # (summed in place)
        approx, made = _native(xp, "lowrank_expand_many", ps, sums, shapes,
                               subset(outs, matrices) if all(o is not None for o in into) else into, n,
                               q_into=new_qs)
        new_qs = made if new_qs is None else new_qs
        for j, i in enumerate(matrices):
            a = approx[j] if into[j] is not None else xp.reshape(xp.cast(approx[j], xp.dtype(xs[i])), xp.shape(xs[i]))
            results[i] = (a, Factors(ps[j], new_qs[j]) if deferred and deferred[i] else a, new_qs[j])
        return results

    def firsts_with_residual(self, xp, gs, residuals, beta, gamma, infos, qs, p_outs, nonfinite=None, places=None):
        """One native call for the bucket's matrices (CPU): each M = g + e written into its
        p_out in the pass that makes P = M Q (e = M' - P' Q'^T made there too where the memory
        left its subtraction: a ``LowRankResidual``); vectors (and gradients without a p_out) get None."""
        if beta != 1.0 or gamma != 1.0 or not xp.mutable_tensors:
            return None
        chosen = [i for i, (g, e, o) in enumerate(zip(gs, residuals, p_outs))
                  if len(xp.shape(g)) >= 2 and o is not None and not isinstance(e, tuple)]
        if not chosen:
            return None
        shapes = [matrix_shape(xp, gs[i]) for i in chosen]
        deferred = [(e.p, e.q) if isinstance(e, LowRankResidual) else None for e in (residuals[i] for i in chosen)]
        qs, p_into = [qs[i] for i in chosen], None
        if places is not None:  # (Q: last step's, kept; P into the kept set no memory still refers to)
            qs = _kept(places, ("q0", "q1"), qs, xp) or qs
            p_shapes = [(rows, xp.shape(q)[1]) for q, (rows, _) in zip(qs, shapes)]
            p_into = _free(places, ("p0", "p1"), p_shapes, [pair and pair[0] for pair in deferred])
        ps = native_products(xp, "lowrank_project_many", subset(gs, chosen), qs, shapes,
                             [buffer_of(residuals[i]) for i in chosen], subset(p_outs, chosen), nonfinite,
                             deferred if any(deferred) else None, p_into=p_into)
        if ps is None:
            return None
        firsts = [None] * len(gs)
        for i, p, (rows, _) in zip(chosen, ps, shapes):
            firsts[i] = p if p_into is not None else xp.reshape(p, (rows, -1))
        return firsts


def _free(places, names, shapes, held):
    """The first of the kept sets ``places(name, shapes)`` none of whose tensors is one of ``held``
    (what a memory or a state still refers to, in the same order), or None: new tensors then."""
    for name in names:
        pieces = places(name, shapes)
        if not any(map(operator.is_, pieces, held)):
            return pieces
    return None


def _kept(places, names, tensors, xp):
    """The kept set of ``names`` whose tensors ``tensors`` are, or None."""
    shapes = [xp.shape(t) for t in tensors]
    for name in names:
        pieces = places(name, shapes)
        if all(map(operator.is_, pieces, tensors)):
            return pieces
    return None


def _native(xp, name, matrices, *args, **kwargs):
    """``native_products`` where the first product ran natively: it runs."""
    made = native_products(xp, name, matrices, *args, **kwargs)
    if made is None:
        raise RuntimeError(f"grace.native's {name} did not run where lowrank_project_many did")
    return made
