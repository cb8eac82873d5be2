"""grace: gradient compression for distributed deep learning on stock Horovod.

    import horovod.torch as hvd
    import grace
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=grace.topk(0.01))

Importing grace imports no toolkit and no Horovod module; the adapter for a toolkit is
loaded when that toolkit's Horovod module is.
"""
from grace._import_hooks import install_import_hooks
from grace import backends as _backends  # noqa: F401  (registers the NumPy, PyTorch and TensorFlow backends)
from grace import compressors as _compressors  # noqa: F401  (imports and so registers every method)
from grace import kernels as _kernels  # noqa: F401  (registers the methods' fast paths)
from grace.core import Collective, Compressor, Exchange, GradientCompression, Memory, WireStats
from grace.core.registry import create, factory as _factory, from_params, methods
from grace.about import info
from grace.memories import NoMemory, ResidualMemory

__version__ = "0.1.0"
__all__ = ["Collective", "Compressor", "Exchange", "GradientCompression", "Memory", "NoMemory",
           "ResidualMemory", "WireStats", "create", "from_params", "info", "methods"]
# every method of grace/compressors as grace.<name>: grace.topk(0.01)
for _name in methods():
    if _name in __all__:
        raise ImportError(f"method {_name!r} would hide grace.{_name}")
    globals()[_name] = _factory(_name)
__all__ += methods()
del _name

install_import_hooks()
