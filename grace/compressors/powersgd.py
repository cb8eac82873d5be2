"""PowerSGD (Vogels et al. 2019): rank-r power iteration, two allreduce rounds, warm start.

    M = x reshaped to (shape[0], -1);  Q: (cols, r), kept between steps (first: shared random)
    P = M Q;          allreduce P;   P = orthonormalise(P)
    Q = M^T P;        allreduce Q;   Q = Q / n
    out = P Q^T       (the same on every rank: the mean of the ranks' rank-r approximations)

Vectors and scalars travel uncompressed in one allreduce. Q is the per-tensor state; with the
'powersgd' memory the residual is e = M - P Q^T against the approximation all ranks share.
"""
from grace.core.compression import GradientCompression
from grace.core.compressor import Collective, Compressor
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

    def rounds(self, xp, x, info, q, out=None):
        n, shape = info.world_size, xp.shape(x)
        if len(shape) < 2:
            (summed,) = yield (x,)
            return summed / n, x, q
        m = xp.cast(xp.reshape(x, (shape[0], -1)), "float32")
        (p,) = yield (xp.matmul(m, q),)
        p = xp.orthonormalize(p)
        (q,) = yield (xp.matmul(xp.transpose(m), p),)
        q = q / n
        if out is not None and xp.dtype(x) == xp.dtype(out) == "float32":  # P Q^T straight into out: no copy
            approx = xp.matmul_into(p, xp.transpose(q), out)
        else:
            approx = xp.reshape(xp.cast(xp.matmul(p, xp.transpose(q)), xp.dtype(x)), shape)
        return approx, approx, q


@register("powersgd", matrix_approximation_rank="rank", rank="rank", seed="seed",
          examples=dict(powersgd=example(2)))
def powersgd(rank: int = 1, *, seed: int = 0, memory="powersgd", communicator=None) -> GradientCompression:
    """PowerSGD: rank-``rank`` approximation of each matrix, two allreduce rounds."""
    return GradientCompression(PowerSGD(rank, seed), make_memory(memory), communicator)
