"""PowerSGD's fast paths: a bucket's rounds batched (one native call per product for all of its
matrices on a CPU: ``PowerSGD.rounds_many``), and with residual memory M = g + e written in the
pass that makes the first product, e's own subtraction (e = M' - P Q^T, deferred) in that pass too.
"""
from grace.compressors.powersgd import LowRankResidual, PowerSGD, matrix_shape, native_products
from grace.core.memory import buffer_of
from grace.core.plans.kernels import MethodKernels, kernels_for


@kernels_for(PowerSGD)
class PowerSGDKernels(MethodKernels):
    def rounds_many(self, xp, xs, infos, states, outs=None, firsts=None, deferred=None):
        return self.compressor.rounds_many(xp, xs, infos, states, outs, firsts, deferred)

    def firsts_with_residual(self, xp, gs, residuals, beta, gamma, infos, qs, p_outs, nonfinite=None):
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
        ps = native_products(xp, "lowrank_project_many", [gs[i] for i in chosen], [qs[i] for i in chosen], shapes,
                             [buffer_of(residuals[i]) for i in chosen],
                             [p_outs[i] for i in chosen], nonfinite, deferred if any(deferred) else None)
        if ps is None:
            return None
        firsts = [None] * len(gs)
        for i, p, (rows, _) in zip(chosen, ps, shapes):
            firsts[i] = xp.reshape(p, (rows, -1))
        return firsts
