"""EF-signSGD's memory (Karimireddy et al. 2019): error feedback in model units.

    p = lr * g + e;   e = p - C(p)

It is residual memory with gamma = lr; the compressor divides the result by lr again.
"""
from grace.memories.residual import ResidualMemory


class EFSignSGDMemory(ResidualMemory):
    def __init__(self, lr: float):
        super().__init__(beta=1.0, gamma=lr)
