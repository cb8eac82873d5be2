"""Fast paths, registered per method beside the plans that use them; a method without one runs
every plan through its formula.

    sparse.py       top-k, threshold, DGC: residual steps fused with selection, segment-wise forms
    randomk.py      random-k: a bucket's residual steps, its decoded sums, segment-wise form
    signs.py        signSGD, EF-signSGD, 1-bit SGD: a bucket's payloads or residual steps, sums
    quantizers.py   TernGrad, QSGD, natural: a bucket's payloads, sums, segment-wise forms
    fp16.py         fp16: a bucket's payloads in one kept buffer, its averaged decode
    powersgd.py     PowerSGD: a bucket's rounds batched, the residual fused in
    residual.py     residual memory: its steps in kept buffers, fused with the method's kernels
    dgc.py          DGC's memory: its steps in kept buffers, a bucket in one native call
    owners.py       the owner's part in the two-phase exchange (communicator='alltoall'): signSGD's exact
                    vote, QSGD's aligned shards, the wider second payload of top-k, DGC, AdaQ, onebit, EF-signSGD
"""
# imported: each registers its kernels
from grace.kernels import dgc, fp16, owners, powersgd, quantizers, randomk, residual, signs, sparse  # noqa: F401
