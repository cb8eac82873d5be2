"""Loading the native libraries with ctypes, and the switch that turns them off.

The libraries live in grace/native/_lib/ (built by setup.py through csrc/build.py). A library
that is missing, or that does not load (no CUDA driver, ...), is simply absent: every caller
then takes the tensor-op path. ``GRACE_NATIVE=0`` in the environment turns native dispatch off
for the process; ``set_enabled`` / ``disabled()`` do it at run time (tests compare both paths).

On x86-64 the CPU kernels come in two builds of the same source: libgrace_cpu.so (x86-64-v2,
runs everywhere) and libgrace_cpu_avx2.so (x86-64-v3), taken where the portable library says
the CPU runs x86-64-v3 code. ``GRACE_NATIVE_ISA=x86-64-v2`` keeps the portable one. A few
kernels of the x86-64-v3 build also have a 16-lane AVX-512 body, which they take where the CPU
has AVX-512 (the same results); ``GRACE_NATIVE_AVX512=0`` keeps their 8-lane loops. The passes
over large inputs prefetch ahead themselves except on an AMD CPU; ``GRACE_NATIVE_PREFETCH=0`` or
``1`` decides instead (the same results either way).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from pathlib import Path

from grace.native import _abi

LIB_DIR = Path(__file__).resolve().parent / "_lib"
ABI = _abi.ABI  # the header's GRACE_NATIVE_ABI: a library built from another header is not loaded
ISAS = ("x86-64-v3", "x86-64-v2")  # the builds on x86-64, best first

# The C functions' types come from csrc/include/grace_native.h, through grace/native/_abi.py (generated
# by csrc/abi.py): name -> (restype, argtypes) of grace_cpu_<name> and of grace_cuda_<name>.
FUNCTIONS = {"cpu": _abi.CPU, "cuda": _abi.CUDA}
#: the functions only one library has (derived): the CPU's bucket-at-once entry points, decoded sums,
#: DGC's passes, random indices and PowerSGD's products, and what it tells of its build and threads;
#: CUDA's segment kernels and its device count and sync
CPU_ONLY = set(_abi.CPU) - set(_abi.CUDA)
CUDA_ONLY = set(_abi.CUDA) - set(_abi.CPU)


def _without_stream(name: str):
    res, args = _abi.CUDA[name]
    return res, (args[:-1] if name in _abi.CUDA_STREAM else args)


#: C function name -> (restype, argtypes without the CUDA stream): the CPU's where the CPU has it,
#: else CUDA's (a view for readers: each library binds its own table, FUNCTIONS[kind])
SYMBOLS = {name: _abi.CPU[name] if name in _abi.CPU else _without_stream(name) for name in {**_abi.CPU, **_abi.CUDA}}


class _Lib:
    """A loaded library: ``lib.pack(...)`` calls grace_cpu_pack / grace_cuda_pack (every function
    of the header, by its name without the prefix)."""

    def __init__(self, path: Path, kind: str):
        self.kind = kind
        self.path = path
        self._dll = ctypes.CDLL(str(path))
        functions = FUNCTIONS[kind]
        self._bind("abi", *functions["abi"])
        if self.abi() != ABI:  # before the others: an older library may lack some
            raise OSError(f"{path} has ABI {self.abi()}, this grace expects {ABI}: rebuild (python csrc/build.py)")
        for name, (res, args) in functions.items():
            self._bind(name, res, args)
        if kind == "cpu":  # what the library tells of itself, read once (these replace the functions)
            self.isa = self.isa().decode()
            self.runs_x86_64_v3 = bool(self.runs_x86_64_v3())
            self.avx512 = bool(self.uses_avx512())  # the 16-lane bodies of a few kernels
            self.prefetch = bool(self.uses_prefetch())  # the passes' own prefetching
        elif self.device_count() < 1:
            raise OSError("no CUDA device (or driver) on this machine")

    def _bind(self, name: str, res, args):
        fn = getattr(self._dll, f"grace_{self.kind}_{name}")
        fn.restype, fn.argtypes = res, args
        setattr(self, name, fn)


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
        lib.set_cache_bytes(previous.get_cache_bytes())
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
