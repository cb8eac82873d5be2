"""State sent between ranks as bytes that can hold only data: no pickle.

What ranks hand each other (step counters, PowerSGD's Q, the keys that name an exchange) is
numbers, strings, arrays and containers of them. ``encode`` writes such a value as one uint8
array, a JSON description followed by the arrays' raw bytes; ``decode`` reads it back and can
build nothing but those types, whatever a peer sent.

    value := None | bool | int | float | str | numpy array | [value] | (value,) | {value: value}
"""
from __future__ import annotations

import json
from typing import Any, List

import numpy as np

from grace.core.tensors import backend_for
from grace.formats import numpy_dtype

#: the dtypes an array may have on the wire (bfloat16 through ml_dtypes)
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64")
_HEADER = 8  # bytes: the description's length, little-endian


def _dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise ValueError(f"grace: a peer sent an array of dtype {name!r}; only {', '.join(DTYPES)} are read")
    return numpy_dtype(name)


def on_host(value):
    """``value`` (nested dicts, lists and tuples of tensors and plain values) with NumPy arrays
    for the tensors."""
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(on_host(v) for v in value)
    if value is None or isinstance(value, (int, float, str, np.ndarray, np.generic)):
        return value
    return backend_for(value).to_numpy(value)


def _describe(value, arrays: List[np.ndarray]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return {"int": str(int(value))}  # (JSON numbers lose ints beyond 2**53 in some readers)
    if isinstance(value, (float, np.floating)):
        return {"float": repr(float(value))}
    if isinstance(value, np.ndarray):
        _dtype(value.dtype.name)
        arrays.append(np.ascontiguousarray(value))
        return {"array": len(arrays) - 1, "dtype": value.dtype.name, "shape": list(value.shape)}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [_describe(v, arrays) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_describe(k, arrays), _describe(v, arrays)] for k, v in value.items()]}
    raise TypeError(f"grace cannot send a {type(value).__name__} between ranks; convert it to a NumPy array first")


def encode(value) -> np.ndarray:
    """``value`` as one uint8 array (tensors must be NumPy arrays already)."""
    arrays: List[np.ndarray] = []
    text = json.dumps(_describe(value, arrays), separators=(",", ":")).encode()
    parts = [np.frombuffer(len(text).to_bytes(_HEADER, "little"), np.uint8), np.frombuffer(text, np.uint8)]
    parts += [a.reshape(-1).view(np.uint8) for a in arrays]
    return np.concatenate(parts)


def decode(data: np.ndarray):
    """The value ``encode`` wrote into ``data`` (a uint8 array)."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    length = int.from_bytes(data[:_HEADER].tobytes(), "little")
    if not 0 <= length <= data.size - _HEADER:
        raise ValueError("grace: a peer's state is cut short or damaged")
    description = json.loads(data[_HEADER:_HEADER + length].tobytes())
    offset = _HEADER + length
    arrays = []

    def array(node):
        nonlocal offset
        dtype, shape = _dtype(node["dtype"]), tuple(int(n) for n in node["shape"])
        nbytes = dtype.itemsize * int(np.prod(shape))
        if node["array"] != len(arrays) or offset + nbytes > data.size:
            raise ValueError("grace: a peer's state is cut short or damaged")
        arrays.append(data[offset:offset + nbytes].view(dtype).reshape(shape).copy())
        offset += nbytes
        return arrays[-1]

    def build(node):
        if node is None or isinstance(node, (bool, str)):
            return node
        kind = next(iter(node))
        if kind == "int":
            return int(node["int"])
        if kind == "float":
            return float(node["float"])
        if kind == "array":
            return array(node)
        if kind in ("list", "tuple"):
            items = [build(v) for v in node[kind]]
            return tuple(items) if kind == "tuple" else items
        if kind == "dict":
            return {build(k): build(v) for k, v in node["dict"]}
        raise ValueError(f"grace: a peer's state holds an unknown entry {kind!r}")

    return build(description)


def broadcast(communicator, value, root: int, like, name: str):
    """Rank ``root``'s ``value`` (tensors of any toolkit in it arrive as NumPy arrays; the other
    ranks pass anything, e.g. None), on every rank of ``communicator``: its encoding's length in
    one broadcast, its bytes in another, as tensors like ``like`` (the toolkit's)."""
    xp = backend_for(like)
    data = encode(on_host(value)) if communicator.rank == root else np.zeros(0, np.uint8)
    length = communicator.broadcast_async(xp.asarray(np.array([data.size], np.int64), like=like), root,
                                          f"{name}.length")()
    size = int(xp.to_numpy(length)[0])
    mine = xp.asarray(data, like=like) if communicator.rank == root else xp.zeros(size, "uint8", like=like)
    received = xp.to_numpy(communicator.broadcast_async(mine, root, name)())
    return value if communicator.rank == root else decode(received)
