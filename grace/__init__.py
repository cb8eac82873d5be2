"""grace: gradient compression for distributed deep learning on stock Horovod.

    import horovod.torch as hvd
    import grace
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=grace.topk(0.01))

Importing grace imports no toolkit and no Horovod module; the adapter for a toolkit is
loaded when that toolkit's Horovod module is.
"""
from grace._import_hooks import install_import_hooks
from grace.compressors import (adaq, dgc, efsignsgd, fp16, inceptionn, natural, none, onebit, powersgd, qsgd,
                               randomk, signsgd, signum, sketchml, terngrad, threshold, topk, u8bit)
from grace.core import Collective, Compressor, Exchange, GradientCompression, Memory, WireStats
from grace.core.registry import create, from_params, methods
from grace.memories import NoMemory, ResidualMemory

__version__ = "0.1.0"
__all__ = ["Collective", "Compressor", "Exchange", "GradientCompression", "Memory", "NoMemory",
           "ResidualMemory", "WireStats", "adaq", "create", "dgc", "efsignsgd", "fp16", "from_params",
           "inceptionn", "methods", "natural", "none", "onebit", "powersgd", "qsgd", "randomk", "signsgd",
           "signum", "sketchml", "terngrad", "threshold", "topk", "u8bit"]

install_import_hooks()
