"""The overflow flag a segment step writes where it reads the gradient anyway: in the dtype that
carries it (a frame's byte, an allreduce's float), 1 where the gradient holds an inf or a NaN."""
from __future__ import annotations

import ctypes

from grace.formats import ITEMSIZE
from grace.native._arrays import NativeUnavailable
from grace.native._common import _same_kind


def _flag_of(kind, nonfinite):
    """A segment step's ``nonfinite`` as C arguments (pointer, width; or None, 0): one float32 (an
    allreduce's) or uint8 (a frame's) that receives the overflow flag, 1 where g holds an inf or a NaN."""
    b = _same_kind(kind, nonfinite) if nonfinite is not None else None
    if b is None:
        return None, 0
    if b.n != 1 or b.dtype not in ("float32", "uint8"):
        raise NativeUnavailable("the overflow flag is one float32 or uint8 element")
    return b.ptr, ITEMSIZE[b.dtype]


class _HostFlag:
    """A CPU bucket step's ``nonfinite``: the float32 its C function sets (``arg``, None where no
    flag is asked), then written in the flag's own dtype (``put``)."""

    def __init__(self, kind, nonfinite):
        self.address, self.width = _flag_of(kind, nonfinite)
        self.told = ctypes.c_float(0.0)
        self.arg = ctypes.byref(self.told) if self.address else None

    def put(self) -> None:
        if self.address:
            value = ctypes.c_uint8(self.told.value != 0) if self.width == 1 else ctypes.c_float(self.told.value != 0)
            ctypes.memmove(self.address, ctypes.byref(value), self.width)
