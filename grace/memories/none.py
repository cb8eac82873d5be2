"""No error feedback: what the compressor drops is lost."""
from grace.core.memory import Memory


class NoMemory(Memory):
    """phi(g) = g; psi keeps nothing."""
    elementwise = True
    passes_gradient = True
