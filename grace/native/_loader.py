"""Loading the native libraries with ctypes, and the switch that turns them off.

The libraries live in grace/native/_lib/ (built by setup.py through csrc/build.py). A library
that is missing, or that does not load (no CUDA driver, ...), is simply absent: every caller
then takes the tensor-op path. ``GRACE_NATIVE=0`` in the environment turns native dispatch off
for the process; ``set_enabled`` / ``disabled()`` do it at run time (tests compare both paths).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from ctypes import c_double, c_float, c_int, c_int64, c_void_p
from pathlib import Path

LIB_DIR = Path(__file__).resolve().parent / "_lib"
ABI = 2

_P, _I, _L, _F, _D = c_void_p, c_int, c_int64, c_float, c_double

# name -> (restype, argtypes without the CUDA stream); the same for grace_cpu_* and grace_cuda_*
_COMMON = {
    "pack": (_I, [_P, _L, _I, _P]),
    "unpack": (_I, [_P, _L, _I, _P]),
    "sign_pack": (None, [_P, _L, _I, _P]),
    "efsign_compress": (None, [_P, _L, _P, _P]),
    "onebit_compress": (None, [_P, _L, _P, _P]),
    "maxabs": (None, [_P, _L, _P]),
    "terngrad_compress": (None, [_P, _P, _L, _P, _P]),
    "qsgd_norms": (None, [_P, _L, _L, _P]),
    "qsgd_compress": (_I, [_P, _P, _L, _I, _L, _I, _P, _I, _P]),
    "natural_compress": (None, [_P, _P, _L, _P, _P]),
    "sign_decode": (None, [_P, _L, _P, _P]),
    "onebit_decode": (None, [_P, _L, _P, _P]),
    "terngrad_decode": (None, [_P, _L, _P, _P]),
    "qsgd_decode": (_I, [_P, _L, _I, _L, _I, _P, _P]),
    "natural_decode": (None, [_P, _P, _L, _P]),
    "topk": (_L, [_P, _I, _L, _L, _I, _P, _I, _P]),
    "threshold": (_L, [_P, _I, _L, _D, _I, _P, _I, _P]),
    "nonzero": (_L, [_P, _L, _P, _I]),
    "topk_ef": (_L, [_P, _P, _L, _L, _F, _F, _I, _P, _P, _I, _P]),
    "threshold_ef": (_L, [_P, _P, _L, _F, _F, _F, _I, _P, _P, _I, _P]),
    "scatter_add": (_I, [_I, _P, _P, _P, _P, _I, _L, _P]),
}
# CUDA functions return a status (or a count) where the CPU ones return nothing
_CUDA_RESTYPE = {name: (_I if res is None else res) for name, (res, _) in _COMMON.items()}


class _Lib:
    """A loaded library: ``lib.pack(...)`` calls grace_cpu_pack / grace_cuda_pack."""

    def __init__(self, path: Path, kind: str):
        self.kind = kind
        self.path = path
        self._dll = ctypes.CDLL(str(path))
        prefix = f"grace_{kind}_"
        abi = getattr(self._dll, prefix + "abi")
        abi.restype = c_int
        if abi() != ABI:
            raise OSError(f"{path} has ABI {abi()}, this grace expects {ABI}: rebuild (python csrc/build.py)")
        for name, (res, args) in _COMMON.items():
            fn = getattr(self._dll, prefix + name)
            if kind == "cuda":
                fn.restype, fn.argtypes = _CUDA_RESTYPE[name], [*args, _P]
            else:
                fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)
        if kind == "cpu":
            self._dll.grace_cpu_set_num_threads.argtypes = [c_int]
            self._dll.grace_cpu_get_num_threads.restype = c_int
            self.set_num_threads = self._dll.grace_cpu_set_num_threads
            self.get_num_threads = self._dll.grace_cpu_get_num_threads
        else:
            self._dll.grace_cuda_device_sync.restype = c_int
            self.device_sync = self._dll.grace_cuda_device_sync
            self._dll.grace_cuda_device_count.restype = c_int
            if self._dll.grace_cuda_device_count() < 1:
                raise OSError("no CUDA device (or driver) on this machine")


_lock = threading.Lock()
_libs: dict = {}
_errors: dict = {}
_enabled = os.environ.get("GRACE_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _load(kind: str):
    with _lock:
        if kind in _libs:
            return _libs[kind]
        path = LIB_DIR / f"libgrace_{kind}.so"
        lib = None
        if path.is_file():
            try:
                lib = _Lib(path, kind)
            except (OSError, AttributeError) as exc:  # e.g. no CUDA driver on this machine
                _errors[kind] = f"{path}: {exc}"
        else:
            _errors[kind] = f"{path} is not built (python csrc/build.py, or pip install -e .)"
        _libs[kind] = lib
        return lib


def library(kind: str):
    """The loaded 'cpu' or 'cuda' library, or None (not built, not loadable, or disabled)."""
    if not _enabled:
        return None
    lib = _libs.get(kind, False)
    return _load(kind) if lib is False else lib


def load_error(kind: str):
    """Why library(kind) is None, if it was tried and failed."""
    return _errors.get(kind)


def enabled() -> bool:
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn native dispatch on or off for the process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


@contextlib.contextmanager
def disabled():
    """``with grace.native.disabled():`` runs the tensor-op fallback."""
    previous = set_enabled(False)
    try:
        yield
    finally:
        set_enabled(previous)
