"""Sizes and dtypes of the wire formats, shared by the core and the native kernels.

Plain arithmetic on counts: this module imports neither ``grace.core`` nor ``grace.native``,
so both can use it without importing each other.
"""
from __future__ import annotations

import functools
import math

import numpy as np

#: bytes per element of each dtype a payload may have
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
            "float32": 4, "int64": 8, "float64": 8}


def index_dtype(numel: int) -> str:
    """The smallest integer type that holds every index of a tensor of ``numel`` elements."""
    if numel <= 2**8:
        return "uint8"
    if numel <= 2**15:
        return "int16"
    if numel <= 2**31:
        return "int32"
    return "int64"


def code_width(levels: int) -> int:
    """The number of bits that holds ``levels`` distinct codes."""
    bits = max(1, math.ceil(math.log2(levels)))
    if bits > 8:
        raise ValueError(f"{levels} levels do not fit in one byte")
    return bits


def qsgd_bucket(numel: int, bucket_size: int) -> int:
    """QSGD's bucket in a tensor of ``numel`` elements: ``bucket_size``, or the whole tensor (0, or
    one past its end: the same norm and draws, no padding to a bucket that is mostly zeros)."""
    return min(int(bucket_size), max(numel, 1)) if bucket_size else max(numel, 1)


def packed_size(numel: int, bits: int) -> int:
    """Bytes that hold ``numel`` codes of ``bits`` bits each."""
    return (numel * bits + 7) // 8


@functools.lru_cache(maxsize=None)
def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name; NumPy has no bfloat16, ml_dtypes (a TensorFlow and JAX
    dependency) does."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
