"""Loading the native libraries with ctypes, and the switch that turns them off.

The libraries live in grace/native/_lib/ (built by setup.py through csrc/build.py). A library
that is missing, or that does not load (no CUDA driver, ...), is simply absent: every caller
then takes the tensor-op path. ``GRACE_NATIVE=0`` in the environment turns native dispatch off
for the process; ``set_enabled`` / ``disabled()`` do it at run time (tests compare both paths).

On x86-64 the CPU kernels come in two builds of the same source: libgrace_cpu.so (x86-64-v2,
runs everywhere) and libgrace_cpu_avx2.so (x86-64-v3), taken where the portable library says
the CPU runs x86-64-v3 code. ``GRACE_NATIVE_ISA=x86-64-v2`` keeps the portable one. A few
kernels of the x86-64-v3 build also have a 16-lane AVX-512 body, which they take where the CPU
has AVX-512 (the same results); ``GRACE_NATIVE_AVX512=0`` keeps their 8-lane loops.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from ctypes import c_double, c_float, c_int, c_int64, c_uint32, c_void_p
from pathlib import Path

LIB_DIR = Path(__file__).resolve().parent / "_lib"
ABI = 13
ISAS = ("x86-64-v3", "x86-64-v2")  # the builds on x86-64, best first

_P, _I, _L, _F, _D = c_void_p, c_int, c_int64, c_float, c_double

# C symbol -> (restype, argtypes without the CUDA stream); the same for grace_cpu_* and grace_cuda_*
SYMBOLS = {
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
    "bits_sum": (None, [_P, _L, _L, _P, _I, _P]),
    "terngrad_decode": (None, [_P, _L, _P, _P]),
    "qsgd_decode": (_I, [_P, _L, _I, _L, _I, _P, _P]),
    "natural_decode": (None, [_P, _P, _L, _P]),
    "topk": (_L, [_P, _I, _L, _L, _I, _P, _I, _P]),
    "threshold": (_L, [_P, _I, _L, _D, _I, _P, _I, _P]),
    "nonzero": (_L, [_P, _L, _P, _I]),
    "topk_ef": (_L, [_P, _P, _L, _L, _F, _F, _I, _P, _P, _I, _P]),
    "threshold_ef": (_L, [_P, _P, _L, _F, _F, _F, _I, _P, _P, _I, _P]),
    "scatter_add": (_I, [_I, _P, _P, _P, _P, _I, _L, _P]),
    "topk_ef_many": (_I, [_L, _P, _P, _P, _P, _P, _F, _F, _I, _P, _P, _P, _P]),
    "scatter_add_segments": (_I, [_L, _I, _P, _P, _P, _P, _F, _P, _P]),
    "bits_sum_segments": (None, [_L, _I, _P, _P, _I, _P, _I, _P, _I, _P]),
    "bits_residual": (None, [_P, _P, _L, _P, _I, _P]),
    "uniform_segments": (None, [_L, _P, _P, _P, _P]),
    "random_indices_segments": (_I, [_L, _P, _P, _P, _P, _P]),
    "randomk_ef_many": (_I, [_L, _P, _P, _P, _P, _P, _P, _F, _F, _I, _P, _P, _P]),
    "threshold_ef_many": (_I, [_L, _P, _P, _P, _P, _F, _F, _F, _I, _P, _P, _P, _P, _P]),
    "bits_ef_many": (_I, [_L, _P, _P, _P, _P, _F, _F, _I, _I, _P, _P, _P]),
    "qsgd_sum_segments": (_I, [_L, _I, _P, _P, _P, _I, _L, _I, _I, _P, _I, _P]),
    "natural_sum_segments": (None, [_L, _I, _P, _P, _P, _I, _P, _I, _P]),
    "dgc_compensate": (None, [_P, _P, _P, _L, _F, _P, _P]),
    "dgc_step_many": (_I, [_L, _P, _P, _P, _P, _P, _P, _F, _D, _D, _P, _P, _P, _P, _P, _P, _P, _P]),
    "compress_many": (_I, [_I, _L, _P, _P, _P, _P, _P, _P, _I, _L, _I, _P]),
    "natural_compress_drawn": (None, [_P, _L, c_uint32, c_uint32, _P, _P]),
    "terngrad_compress_drawn": (None, [_P, _L, c_uint32, c_uint32, _P, _P]),
    "qsgd_compress_drawn": (_I, [_P, _L, c_uint32, c_uint32, _I, _L, _I, _P, _P]),
    "half_encode_many": (None, [_L, _P, _P, _F, _P]),
    "half_decode_many": (None, [_L, _P, _P, _F, _F, _P]),
    # CUDA only: a bucket's segments in one launch per kernel (the CPU runs them one by one)
    "hash_keys_segments": (_I, [_L, _P, _P, _P, _P]),
    "terngrad_compress_segments": (_I, [_P, _L, _P, _P, _P, _P, _P, _P]),
    "natural_compress_segments": (_I, [_P, _L, _P, _P, _P, _P, _P, _P]),
    "qsgd_compress_segments": (_I, [_P, _L, _P, _P, _P, _P, _I, _L, _I, _P, _P]),
    "efsign_compress_segments": (_I, [_P, _L, _P, _P, _P, _P]),
    "onebit_compress_segments": (_I, [_P, _L, _P, _P, _P, _P]),
    "decode_segments": (_I, [_I, _L, _P, _P, _P, _I, _L, _I, _P]),
    "topk_ef_segments": (_I, [_P, _P, _L, _P, _P, _P, _F, _F, _I, _P, _P, _P]),
    "lowrank_project_many": (None, [_L, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "lowrank_back_many": (None, [_L, _P, _P, _P, _P, _P, _I, _P]),
    "lowrank_expand_many": (None, [_L, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P]),
}
#: CPU-only: the bucket-at-once entry points (a GPU compresses a bucket segment-wise instead),
#: the decoded sums of QSGD and natural compression, DGC's momentum correction and whole step,
#: the random indices (a GPU sorts hash keys), and PowerSGD's products (a GPU has its BLAS)
CPU_ONLY = {"topk_ef_many", "randomk_ef_many", "threshold_ef_many", "bits_ef_many", "scatter_add_segments",
            "bits_sum_segments", "bits_residual", "qsgd_sum_segments", "natural_sum_segments",
            "random_indices_segments", "dgc_compensate", "dgc_step_many", "compress_many", "natural_compress_drawn",
            "terngrad_compress_drawn", "qsgd_compress_drawn", "half_encode_many", "half_decode_many",
            "lowrank_project_many", "lowrank_back_many", "lowrank_expand_many"}
CUDA_ONLY = {"hash_keys_segments", "terngrad_compress_segments", "natural_compress_segments", "qsgd_compress_segments",
             "efsign_compress_segments", "onebit_compress_segments", "decode_segments", "topk_ef_segments"}
# CUDA functions return a status (or a count) where the CPU ones return nothing
_CUDA_RESTYPE = {name: (_I if res is None else res) for name, (res, _) in SYMBOLS.items()}


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
        for name, (res, args) in SYMBOLS.items():
            if name in (CPU_ONLY if kind == "cuda" else CUDA_ONLY):
                continue
            fn = getattr(self._dll, prefix + name)
            if kind == "cuda":
                fn.restype, fn.argtypes = _CUDA_RESTYPE[name], [*args, _P]
            else:
                fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)
        if kind == "cpu":
            self._dll.grace_cpu_isa.restype = ctypes.c_char_p
            self.isa = self._dll.grace_cpu_isa().decode()
            self._dll.grace_cpu_runs_x86_64_v3.restype = c_int
            self.runs_x86_64_v3 = bool(self._dll.grace_cpu_runs_x86_64_v3())
            self._dll.grace_cpu_uses_avx512.restype = c_int
            self.avx512 = bool(self._dll.grace_cpu_uses_avx512())  # the 16-lane bodies of a few kernels
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


def _open(path: Path, kind: str):
    """The library at path, or None with the reason in _errors."""
    if not path.is_file():
        _errors[kind] = f"{path} is not built (python csrc/build.py, or pip install -e .)"
        return None
    try:
        return _Lib(path, kind)
    except (OSError, AttributeError) as exc:  # e.g. no CUDA driver on this machine
        _errors[kind] = f"{path}: {exc}"
        return None


def _load(kind: str):
    with _lock:
        if kind in _libs:
            return _libs[kind]
        lib = _open(LIB_DIR / f"libgrace_{kind}.so", kind)
        if kind == "cpu" and lib is not None:
            _cpu_builds["portable"] = lib  # the build that can ask the CPU what it runs
            lib = _best_cpu_build(lib)
        _libs[kind] = lib
        return lib


_CPU_BUILDS = {"x86-64-v2": "libgrace_cpu.so", "x86-64-v3": "libgrace_cpu_avx2.so"}
_cpu_builds: dict = {}


def _cpu_build(isa: str, portable):
    """The CPU library built for ``isa``; OSError where it is missing or this CPU cannot run it
    (only the portable library can ask the CPU: the other may not even load on an older one)."""
    if isa not in _cpu_builds:
        if isa not in _CPU_BUILDS and isa != portable.isa:
            raise OSError(f"no CPU build for {isa!r}: there are {', '.join(_CPU_BUILDS)}")
        if isa == portable.isa:
            _cpu_builds[isa] = portable
        elif isa == "x86-64-v3" and portable.isa == "x86-64-v2" and not portable.runs_x86_64_v3:
            raise OSError("this CPU does not run x86-64-v3 code (AVX2, FMA, BMI2)")
        else:
            path = LIB_DIR / _CPU_BUILDS[isa]
            if not path.is_file():
                raise OSError(f"{path} is not built")
            lib = _Lib(path, "cpu")
            if lib.isa != isa:
                raise OSError(f"{path} is built for {lib.isa}, not {isa}")
            _cpu_builds[isa] = lib
    return _cpu_builds[isa]


def _best_cpu_build(portable):
    """The x86-64-v3 build where this CPU runs it and GRACE_NATIVE_ISA allows, else ``portable``."""
    wanted = os.environ.get("GRACE_NATIVE_ISA", "").strip() or ISAS[0]
    if wanted not in ISAS:
        raise ValueError(f"GRACE_NATIVE_ISA={wanted!r}: expected one of {', '.join(ISAS)}")
    try:
        return _cpu_build(wanted, portable)
    except (OSError, AttributeError) as exc:
        _errors[f"cpu {wanted}"] = str(exc)
        return portable


@contextlib.contextmanager
def cpu_build(isa: str):
    """``with cpu_build("x86-64-v2"):`` the CPU kernels of that build run (benchmarks compare
    the builds in one process); OSError where it is not built or this CPU cannot run it."""
    if _load("cpu") is None:
        raise OSError(f"libgrace_cpu is not loaded: {_errors.get('cpu')}")
    with _lock:
        lib = _cpu_build(isa, _cpu_builds["portable"])
        previous, _libs["cpu"] = _libs["cpu"], lib
        lib.set_num_threads(previous.get_num_threads())
    try:
        yield lib
    finally:
        with _lock:
            _libs["cpu"] = previous


def library(kind: str):
    """The loaded 'cpu' or 'cuda' library, or None (not built, not loadable, or disabled)."""
    if not _enabled:
        return None
    lib = _libs.get(kind, False)
    return _load(kind) if lib is False else lib


def cpu_isa():
    """The instruction set of the CPU kernels in use ("x86-64-v3", "x86-64-v2", "generic"), or
    None when libgrace_cpu is not loaded."""
    lib = library("cpu")
    return lib.isa if lib is not None else None


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
