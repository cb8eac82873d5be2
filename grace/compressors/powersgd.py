"""PowerSGD (Vogels et al. 2019): rank-r power iteration, two allreduce rounds, warm start.

    M = x reshaped to (shape[0], -1);  Q: (cols, r), kept between steps (first: shared random)
    P = M Q;          allreduce P;   P = orthonormalise(P)
    Q = M^T P;        allreduce Q;   Q = Q / n
    out = P Q^T       (the same on every rank: the mean of the ranks' rank-r approximations)

Vectors and scalars travel uncompressed in the first round. Q is the per-tensor state; with
the 'powersgd' memory the residual is e = M - P Q^T against the approximation all ranks share.
Where the next step's first product makes M = g + e in its pass (a CPU's native call), e is
never written: the memory keeps M, P and Q (``LowRankResidual``) and that pass subtracts P Q^T.

A bucket's tensors go through their rounds together (``rounds_many``; ``rounds`` is that for
one tensor). On a CPU (torch) each product is one grace.native call for all the bucket's
matrices (each element summed in one fixed order), rank 1's orthonormalisation is in the
second, Q / n in the third, and with the residual memory the compensation M = g + e and the
overflow check are in the first product's pass over g and e.
"""
from dataclasses import dataclass
from typing import Any

from grace.core.compression import GradientCompression
from grace.core.compressor import check_seed, Collective, Compressor, native_or_none, Traits
from grace.core.memory import Deferred
from grace.core.registry import example, register
from grace.core.tensors import backend_for
from grace.memories import make_memory


class PowerSGD(Compressor):
    collective = Collective.ALLREDUCE
    traits = Traits(supports_allreduce=True, multi_round=True, shared_state=True, seeded=True)  # (Q's start)

    def __init__(self, rank: int = 1, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        self.rank = rank
        self.seed = check_seed(seed)

    def ideal_bits(self, xp, payload, ctx):
        return 32 * sum(xp.numel(t) for t in payload)  # P and Q: (rows + cols) * r floats

    def init_state(self, xp, x, info):
        """Q, the same on every rank: drawn from the tensor's shared seed. Vectors: none."""
        shape = xp.shape(x)
        if len(shape) < 2:
            return None
        rows, cols = shape[0], xp.numel(x) // shape[0]
        r = factor_rank(self.rank, rows, cols)
        return xp.reshape(xp.uniform(cols * r, info.seed(self.seed), like=x), (cols, r)) - 0.5

    def rounds(self, xp, x, info, q, out=None):
        many = self.rounds_many(xp, [x], [info], [q], [out])
        payloads = next(many)
        try:
            while True:
                payloads = many.send([(yield payloads[0])])
        except StopIteration as done:
            return done.value[0]

    def rounds_many(self, xp, xs, infos, qs, outs=None, firsts=None, deferred=None):
        """The rounds of a bucket's tensors (a generator: it yields each round's payloads and is
        sent their sums), returning each tensor's (result, p_hat, new Q). Where ``deferred[i]``,
        a matrix's p_hat is its approximation unmade (``Factors``: the memory keeps its residual
        against x_i, x_i's buffer, as a ``LowRankResidual``)."""
        n, count = infos[0].world_size, len(xs)
        outs, firsts = outs or [None] * count, firsts or [None] * count
        matrices = [i for i, x in enumerate(xs) if len(xp.shape(x)) >= 2]
        m = {i: xp.cast(xp.reshape(xs[i], (xp.shape(xs[i])[0], -1)), "float32") for i in matrices}
        made = iter(_project(xp, [m[i] for i in matrices if firsts[i] is None],
                             [qs[i] for i in matrices if firsts[i] is None]))
        p = {i: next(made) if firsts[i] is None else firsts[i] for i in matrices}
        summed = yield [(p[i],) if i in m else (xs[i],) for i in range(count)]
        vectors = [i for i in range(count) if i not in m]  # (sent whole: their mean is the result)
        results = [None] * count
        for i, mean in zip(vectors, xp.divide_many([summed[i][0] for i in vectors], n)):
            results[i] = (mean, xs[i], qs[i])
        if not matrices:
            return results
        p, q = _orthonormalise_and_back(xp, [m[i] for i in matrices], [summed[i][0] for i in matrices])
        q = dict(zip(matrices, q))
        summed = yield [(q[i],) if i in m else () for i in range(count)]
        # P Q^T straight into out where it has the matrix's dtype: no copy
        into = [outs[i] if outs[i] is not None and xp.dtype(xs[i]) == xp.dtype(outs[i]) == "float32" else None
                for i in matrices]
        approx, q = _expand(xp, p, [summed[i][0] for i in matrices], n, into)
        for i, a, p_i, q_i, placed in zip(matrices, approx, p, q, into):
            a = a if placed is not None else xp.reshape(xp.cast(a, xp.dtype(xs[i])), xp.shape(xs[i]))
            # (P copied: the summed payload's buffer holds the next step's before the memory is read
            # again where that step is skipped)
            results[i] = (a, Factors(xp.copy(p_i), q_i) if deferred and deferred[i] else a, q_i)
        return results


@dataclass(frozen=True)
class Factors:
    """An approximation P Q^T (rows x r, cols x r) not made."""

    p: Any
    q: Any

    def residual_of(self, m) -> "LowRankResidual":
        return LowRankResidual(m, self.p, self.q)


@dataclass(frozen=True)
class LowRankResidual(Deferred):
    """PowerSGD's residual e = M - P Q^T, kept as M (``buffer``, the compensated gradient) and the
    factors: the next step's first product subtracts P Q^T in its pass over M."""

    buffer: Any
    p: Any
    q: Any

    def value(self):
        xp = backend_for(self.buffer)
        m = xp.reshape(self.buffer, (xp.shape(self.p)[0], -1))
        e = xp.zeros_like(m)
        made = native_products(xp, "lowrank_expand_many", [self.p], [self.q], [xp.shape(m)], [None], 1.0,
                               ms=[m], residual_outs=[e])  # (P Q^T as the expand that made p_hat makes it)
        if made is None:
            e = m - xp.matmul(self.p, xp.transpose(self.q))
        return xp.reshape(e, xp.shape(self.buffer))


def factor_rank(rank: int, rows: int, cols: int) -> int:
    """r of a rows x cols matrix's factors (rows x r, cols x r) at rank ``rank``."""
    return min(rank, rows, cols)


def matrix_shape(xp, x):
    rows = xp.shape(x)[0]
    return rows, xp.numel(x) // rows


def native_products(xp, name: str, matrices, *args, **kwargs):
    """grace.native's product ``name`` for ``matrices`` in one call (CPU, float32: the kernels
    return new tensors or write into given ones), where the backend's tensors are mutable; else
    None."""
    return native_or_none(xp, name, matrices[0], matrices, *args, **kwargs) if xp.mutable_tensors else None


def _project(xp, ms, qs):
    """P = M Q of each matrix."""
    if not ms:
        return []
    ps = native_products(xp, "lowrank_project_many", ms, qs, [xp.shape(m) for m in ms])
    if ps is None:
        return [xp.matmul(m, q) for m, q in zip(ms, qs)]
    return [xp.reshape(p, (xp.shape(m)[0], -1)) for p, m in zip(ps, ms)]


def _orthonormalise_and_back(xp, ms, ps):
    """Each summed P orthonormalised, then Q = M^T P: (Ps, Qs). The native call makes a P of
    one column a unit vector in place, as ``xp.orthonormalize`` would; several go through QR."""
    ps = [p if xp.shape(p)[1] == 1 else xp.orthonormalize(p) for p in ps]
    qs = native_products(xp, "lowrank_back_many", ms, ps, [xp.shape(m) for m in ms], unit=True)
    if qs is None:
        columns = [i for i, p in enumerate(ps) if xp.shape(p)[1] == 1]
        for i, p in zip(columns, xp.orthonormalize_many([ps[i] for i in columns])):
            ps[i] = p
        return ps, [xp.matmul(xp.transpose(m), p) for m, p in zip(ms, ps)]
    return ps, [xp.reshape(q, (xp.shape(m)[1], -1)) for q, m in zip(qs, ms)]


def _expand(xp, ps, qs, n, into):
    """Q = Q / n, and P Q^T of each matrix (into ``into[i]`` where given): (approximations, Qs)."""
    shapes = [(xp.shape(p)[0], xp.shape(q)[0]) for p, q in zip(ps, qs)]
    done = native_products(xp, "lowrank_expand_many", ps, qs, shapes, into, n)
    if done is not None:
        approx, divided = done
        return approx, [xp.reshape(q, xp.shape(old)) for q, old in zip(divided, qs)]
    qs = xp.divide_many(qs, n)
    approx = [xp.matmul(p, xp.transpose(q)) if o is None else xp.matmul_into(p, xp.transpose(q), o)
              for p, q, o in zip(ps, qs, into)]
    return approx, qs


def _no_momentum(factor) -> dict:
    raise ValueError(f"powersgd: momentum_factor={factor!r} (GRACE's momentum on the decoded gradient) is not "
                     "offered; grace leaves momentum to the optimizer: torch.optim.SGD(..., momentum=...)")


@register("powersgd", matrix_approximation_rank="rank", rank="rank", seed="seed", compress_rank="rank",
          momentum_factor=_no_momentum,
          examples=dict(powersgd=example(2)))
def powersgd(rank: int = 1, *, seed: int = 0, memory="powersgd", communicator=None) -> GradientCompression:
    """PowerSGD: rank-``rank`` approximation of each matrix, two allreduce rounds."""
    return GradientCompression(PowerSGD(rank, seed), make_memory(memory), communicator)
