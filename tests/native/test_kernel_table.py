"""The native kernel table and the fallback rule: a backend falls back to its tensor-op code
only where no kernel serves the inputs (NativeUnavailable), never on a real error."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import grace.native as gn
from grace.native import _loader


def test_every_fused_kernel_names_c_functions_the_libraries_export():
    for name, kernel in gn.KERNELS.items():
        assert kernel.symbols and set(kernel.symbols) <= set(_loader.SYMBOLS), name
        assert set(kernel.devices) <= {"cpu", "cuda"} and kernel.outputs, name
        assert all(0 <= i < len(kernel.outputs) for i in kernel.variable), name


def test_an_unknown_fused_kernel_is_a_bug_not_a_fallback():
    with pytest.raises(KeyError):
        gn.kernel("zipk_compress", np.zeros(4, np.float32))


def test_real_errors_propagate_through_the_fallback_helpers():
    with pytest.raises(IndexError, match="out of range"):
        gn.run("scatter_add", np.zeros(1, np.float32), np.array([7]), np.array([1.0], np.float32), 3)
    with pytest.raises(TypeError, match="uint8"):
        gn.run("unpack", np.zeros(2, np.uint8), np.zeros(2, np.float32), 1, 8)


def test_unavailable_kernels_fall_back():
    with gn.disabled():
        assert gn.run("scatter_add", np.zeros(1, np.float32), np.array([1]), np.array([1.0], np.float32), 3) is None
        assert gn.kernel("qsgd_compress", np.zeros(4, np.float32)) is None


def test_on_the_cpu_a_kernel_calls_only_the_c_functions_its_table_entry_lists(monkeypatch):
    """Every catalogue method's exchange on the CPU (per tensor and bucketed, torch tensors): every
    C function is reached through the kernel table, and is one its entry names for the CPU."""
    import sys

    import grace
    from grace.core.communicator import ReplicaCommunicator
    from grace.core.exchange import Exchange
    from tests.native.conftest import gradient, torch
    from tests.unit.conftest import METHODS

    active, seen, strays = [], {}, []

    def entered(name, function):
        def run(*args, **kwargs):
            active.append(name)
            try:
                return function(*args, **kwargs)
            finally:
                active.pop()
        return run

    for name, entry in list(gn.KERNELS.items()):
        monkeypatch.setitem(gn.KERNELS, name, dataclasses.replace(entry, function=entered(name, entry.function)))
    for module in [m for n, m in sys.modules.items() if n.startswith("grace.native.") and hasattr(m, "call")]:
        real = module.call

        def spy(kind, symbol, *args, _real=real):
            if active:
                seen.setdefault(active[0], set()).add(symbol)
            else:
                strays.append(symbol)
            return _real(kind, symbol, *args)
        monkeypatch.setattr(module, "call", spy)
    grads = {"w": torch.from_numpy(gradient(64 * 33, seed=1).reshape(64, 33)), "b": torch.from_numpy(gradient(77, 2))}
    for method in METHODS:
        for bucket_mb in (0, 25):
            compression = METHODS[method]()
            compression.bucket_mb = float(bucket_mb or compression.bucket_mb * (compression.scope == "bucket"))
            exchange = Exchange(compression, ReplicaCommunicator(3))
            for _ in range(2):
                exchange.exchange({k: v.clone() for k, v in grads.items()})
    assert grace  # (imported for the methods' registration)
    for name, symbols in seen.items():
        assert symbols <= set(gn.KERNELS[name].cpu), f"{name} called {symbols - set(gn.KERNELS[name].cpu)} on the CPU"
    assert len(seen) >= 30, sorted(seen)
    assert not strays, f"C functions called outside the kernel table: {sorted(set(strays))}"
