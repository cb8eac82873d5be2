"""Fast paths, registered per method beside the plans that use them: a method without one runs
every plan through its formula.

    residual.py   residual memory's buffered and fused steps (grace.core.plans.feedback)
    dgc.py        DGC memory's buffered and fused steps
"""
from grace.kernels import dgc, residual  # noqa: F401  (imported: they register)
