"""Exponents of float32 values, written on backend operations."""


def floor_log2(xp, magnitude, lowest: int):
    """floor(log2(m)) for float32 magnitudes m >= 0, at least ``lowest`` (also for m = 0).

    log2 rounds to the nearest float, so just below a power of two it can return the power's
    exponent; one comparison each way makes 2**e <= m < 2**(e + 1) exact.
    """
    e = xp.floor(xp.log2(xp.clip_min(magnitude, 2.0 ** (lowest - 1))))
    e = xp.where(xp.exp2(e) > magnitude, e - 1, e)
    e = xp.where(xp.exp2(e + 1) <= magnitude, e + 1, e)
    return xp.clip_min(e, float(lowest))
