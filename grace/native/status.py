"""Whether the native kernels run: the libraries loaded, the inputs they take; the CPU's threads."""
from __future__ import annotations

import warnings

from grace.native._arrays import NativeUnavailable, kind_of
from grace.native._common import _FLOATS
from grace.native._loader import enabled, library, load_error

_warned: set = set()  # the devices whose missing library was reported


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


def set_cache_bytes(n: int) -> int:
    """The last-level cache's size the CPU kernels plan by (fp16's payloads stay in it where it
    holds what a step writes before reading them back, else are streamed past it); n < 0: what the
    system tells (one cache instance's size by Linux's sysfs, else the C library's figure). Returns
    the size before (that the system tells, where none was set), or -1 where the library is not loaded."""
    lib = library("cpu")
    if lib is None:
        return -1
    before = lib.get_cache_bytes()
    lib.set_cache_bytes(int(n))
    return before


def warn_if_missing(x) -> None:
    """Once per device and process: warn where the native library of ``x``'s device (a gradient
    the kernels would take) is missing or failed to load, naming why and how to build it. Silent
    where dispatch is off on purpose (``GRACE_NATIVE=0``) and for tensors no kernel takes (a
    traced TensorFlow step)."""
    root = type(x).__module__.split(".")[0]
    if root == "torch":
        device = "cuda" if x.device.type == "cuda" else "cpu"
    elif root == "numpy":
        device = "cpu"
    elif root == "tensorflow" and hasattr(x, "numpy"):  # (eager)
        device = "cuda" if ":GPU:" in (getattr(x, "device", "") or "").upper() else "cpu"
    else:
        return
    if device in _warned or not enabled() or library(device) is not None:
        return
    _warned.add(device)
    warnings.warn(f"grace: the native {device} kernels are not loaded ({load_error(device) or 'not found'}); every "
                  "method runs its tensor-op fallback, several times slower. Build them: python csrc/build.py "
                  "(or pip install -e .); GRACE_NATIVE=0 runs without them and without this warning.",
                  RuntimeWarning, stacklevel=4)
