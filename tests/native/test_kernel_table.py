"""The native kernel table and the fallback rule: a backend falls back to its tensor-op code
only where no kernel serves the inputs (NativeUnavailable), never on a real error."""
from __future__ import annotations

import numpy as np
import pytest

import grace.native as gn
from grace.native import _loader


def test_every_fused_kernel_names_c_functions_the_libraries_export():
    for name, kernel in gn.FUSED.items():
        assert kernel.symbols and set(kernel.symbols) <= set(_loader.SYMBOLS), name
        assert set(kernel.devices) <= {"cpu", "cuda"} and kernel.outputs, name
        assert all(0 <= i < len(kernel.outputs) for i in kernel.variable), name


def test_an_unknown_fused_kernel_is_a_bug_not_a_fallback():
    with pytest.raises(KeyError):
        gn.fused("zipk_compress", np.zeros(4, np.float32))


def test_real_errors_propagate_through_the_fallback_helpers():
    with pytest.raises(IndexError, match="out of range"):
        gn.try_scatter_add(np.array([7]), np.array([1.0], np.float32), 3)
    with pytest.raises(TypeError, match="uint8"):
        gn.try_unpack(np.zeros(2, np.float32), 1, 8)


def test_unavailable_kernels_fall_back():
    with gn.disabled():
        assert gn.try_scatter_add(np.array([1]), np.array([1.0], np.float32), 3) is None
        assert gn.fused("qsgd_compress", np.zeros(4, np.float32)) is None
