"""PowerSGD's memory (Vogels et al. 2019): residual against the rank-r approximation that all
ranks agreed on, e = M - P Q^T. Vectors travel exactly and keep no residual."""
from grace.memories.residual import ResidualMemory


class PowerSGDMemory(ResidualMemory):
    def fits(self, compressor) -> bool:
        return compressor.traits.multi_round  # elsewhere a vector's residual would be dropped

    def init(self, xp, g):
        return super().init(xp, g) if len(xp.shape(g)) >= 2 else None

    def compensate(self, xp, g, residual):
        return g if residual is None else super().compensate(xp, g, residual)

    def update(self, xp, p, p_hat, residual):
        if len(xp.shape(p)) < 2:
            return None
        return p - p_hat
