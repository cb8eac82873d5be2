"""PowerSGD (Vogels et al. 2019): rank-r power iteration, two allreduce rounds, warm start.

    M = x reshaped to (shape[0], -1);  Q: (cols, r), kept between steps (first: shared random)
    P = M Q;          allreduce P;   P = orthonormalise(P)
    Q = M^T P;        allreduce Q;   Q = Q / n
    out = P Q^T       (the same on every rank: the mean of the ranks' rank-r approximations)

Vectors and scalars travel uncompressed in one allreduce. Q is the per-tensor state; with the
'powersgd' memory the residual is e = M - P Q^T against the approximation all ranks share.

On a CPU (torch) the three products are grace.native's (each element summed in one fixed
order), and with the residual memory the compensation M = g + e, the overflow check and P = M Q
take one pass over g and e.
"""
from grace.core.compression import GradientCompression
from grace.core.compressor import Collective, Compressor, native_or_none
from grace.core.registry import example, register
from grace.memories import make_memory


class PowerSGD(Compressor):
    collective = Collective.ALLREDUCE
    supports_allreduce = True
    multi_round = True
    shared_state = True

    def __init__(self, rank: int = 1, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        self.rank = rank
        self.seed = seed

    def ideal_bits(self, xp, payload, ctx):
        return 32 * sum(xp.numel(t) for t in payload)  # P and Q: (rows + cols) * r floats

    def init_state(self, xp, x, info):
        """Q, the same on every rank: drawn from the tensor's shared seed. Vectors: none."""
        shape = xp.shape(x)
        if len(shape) < 2:
            return None
        rows, cols = shape[0], xp.numel(x) // shape[0]
        r = min(self.rank, rows, cols)
        return xp.reshape(xp.uniform(cols * r, info.seed(self.seed), like=x), (cols, r)) - 0.5

    def rounds(self, xp, x, info, q, out=None, first=None, residual_over=False):
        """(``first``: the first round's payload, where a fused kernel made it already;
        ``residual_over``: write x - P Q^T over x in the pass that makes P Q^T, as
        ``rounds_with_residual`` does.)"""
        n, shape = info.world_size, xp.shape(x)
        if len(shape) < 2:
            (summed,) = yield (x,)
            return summed / n, x, q
        m = xp.cast(xp.reshape(x, (shape[0], -1)), "float32")
        rows, cols = xp.shape(m)
        (p,) = yield (_product(xp, m, q) if first is None else first,)
        p = xp.orthonormalize(p)
        q = _native(xp, "lowrank_back", m, m, p, rows, cols)
        (q,) = yield (xp.matmul(xp.transpose(m), p) if q is None else xp.reshape(q, (cols, -1)),)
        q = q / n
        into = out if out is not None and xp.dtype(x) == xp.dtype(out) == "float32" else None  # P Q^T there: no copy
        residual = dict(m=x, residual_out=x) if residual_over else {}
        approx = _native(xp, "lowrank_expand", p, p, q, rows, cols, out=into, **residual)
        done = approx is not None
        if not done:
            approx = xp.matmul(p, xp.transpose(q)) if into is None else xp.matmul_into(p, xp.transpose(q), into)
        if into is None:
            approx = xp.reshape(xp.cast(approx, xp.dtype(x)), shape)
        if residual_over and not done:
            xp.subtract_into(x, approx, x)
        return approx, approx, q

    def rounds_with_residual(self, xp, g, residual, beta, gamma, info, q, p_out, nonfinite=None, out=None):
        shape = xp.shape(g)
        if residual is None or beta != 1.0 or gamma != 1.0 or len(shape) < 2:
            return None
        rows = shape[0]
        first = _native(xp, "lowrank_project", g, g, q, rows, xp.numel(g) // rows, residual=residual,
                        m_out=p_out, nonfinite=nonfinite)
        if first is None:
            return None
        return p_out, self.rounds(xp, p_out, info, q, out, xp.reshape(first, (rows, -1)), residual_over=True), True


def _native(xp, name: str, like, *args, **kwargs):
    """grace.native's product ``name`` (CPU, float32), where the backend's tensors are mutable
    (the kernels return new flat tensors or write into given ones); else None."""
    return native_or_none(xp, name, like, *args, **kwargs) if xp.mutable_tensors else None


def _product(xp, m, q):
    """P = M Q."""
    rows, cols = xp.shape(m)
    p = _native(xp, "lowrank_project", m, m, q, rows, cols)
    return xp.matmul(m, q) if p is None else xp.reshape(p, (rows, -1))


@register("powersgd", matrix_approximation_rank="rank", rank="rank", seed="seed",
          examples=dict(powersgd=example(2)))
def powersgd(rank: int = 1, *, seed: int = 0, memory="powersgd", communicator=None) -> GradientCompression:
    """PowerSGD: rank-``rank`` approximation of each matrix, two allreduce rounds."""
    return GradientCompression(PowerSGD(rank, seed), make_memory(memory), communicator)
