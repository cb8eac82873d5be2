"""What this installation runs: versions, the native libraries loaded (and their instruction
set), and which methods have native kernels on each device. ``python -m grace`` and
``grace.info()`` print it.

Versions are read from the installed packages' metadata, so nothing imports PyTorch,
TensorFlow or Horovod here."""
from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Dict, List

import grace
from grace import native
from grace.native import _loader

_PACKAGES = ("numpy", "torch", "tensorflow", "tensorflow-cpu", "horovod", "mpi4py")
# the kernels a method calls when they are not named after it
_KERNEL_PREFIXES = {"powersgd": ("lowrank_",), "dgc": ("dgc_", "topk_", "threshold_"), "fp16": ("fp16_",)}


def versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "grace": _version("grace")}
    for name in _PACKAGES:
        version = _version(name)
        if version != "not installed":
            out[name] = version
    return out


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def libraries() -> Dict[str, str]:
    """Per device: the library loaded (with the CPU build's instruction set), or why not."""
    out = {}
    for device in ("cpu", "cuda"):
        lib = native.library(device)
        if lib is not None:
            out[device] = f"{lib.path}" + (f" ({lib.isa})" if device == "cpu" else "")
        elif not _loader.enabled():
            out[device] = "off (GRACE_NATIVE=0)"
        else:
            out[device] = f"not loaded: {native.load_error(device) or 'not found'}"
    return out


def native_methods(device: str) -> List[str]:
    """The methods with native kernels on ``device`` where its library is loaded."""
    if native.library(device) is None:
        return []
    out = []
    for method in grace.methods():
        prefixes = _KERNEL_PREFIXES.get(method, (method + "_",))
        if any(name.startswith(prefixes) and kernel.symbols_on(device) for name, kernel in native.KERNELS.items()):
            out.append(method)
    return out


def info(file=None) -> None:
    """Print the report (to ``file``, default standard output)."""
    print(report(), file=file or sys.stdout)


def report() -> str:
    """The report ``info`` prints."""
    installed = versions()
    lines = [f"grace {installed.pop('grace')} on {platform.system()} {platform.machine()}"]
    lines += [f"  {name:<15} {version}" for name, version in installed.items()]
    lines.append("native libraries:")
    lines += [f"  {device:<5} {what}" for device, what in libraries().items()]
    for device in ("cpu", "cuda"):
        methods = native_methods(device)
        rest = [m for m in grace.methods() if m not in methods]
        if methods:
            lines.append(f"native on {device}: {', '.join(methods)}; tensor ops: {', '.join(rest) or '-'}")
    return "\n".join(lines)
