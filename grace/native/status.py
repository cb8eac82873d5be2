"""Whether the native kernels run: the libraries loaded, the inputs they take; the CPU's threads."""
from __future__ import annotations

from grace.native._arrays import NativeUnavailable, kind_of
from grace.native._common import _FLOATS
from grace.native._loader import library


def available(device: str = "cpu") -> bool:
    """Whether the 'cpu' or 'cuda' library is loaded (and native dispatch is enabled)."""
    return library(device) is not None


def supports(x) -> bool:
    """Whether the fused functions run natively on ``x`` (its kind, device and a float dtype
    they take: float16, bfloat16, float32; the quantizers other than signSGD also float64)."""
    try:
        kind = kind_of(x)
    except NativeUnavailable:
        return False
    name = kind.name
    if name == "torch":
        dtype = str(x.dtype)[6:]
    elif name == "numpy":
        dtype = x.dtype.name
    else:
        dtype = x.dtype.name
    return dtype in _FLOATS


def set_num_threads(n: int) -> None:
    """Threads of the CPU kernels (<= 0: OpenMP's default, OMP_NUM_THREADS or all cores)."""
    lib = library("cpu")
    if lib is not None:
        lib.set_num_threads(int(n))
