"""Arrays of every toolkit as (pointer, length, dtype) for the C ABI, and outputs of the same kind.

NumPy arrays and torch CPU tensors reach libgrace_cpu; torch CUDA tensors reach libgrace_cuda
with torch's current stream. TensorFlow eager tensors: on the CPU through NumPy; on a GPU
through DLPack (the device pointer of the same buffer; outputs are TensorFlow tensors
allocated on that GPU), so they run the same CUDA kernels as torch, synchronized with the
device around the call since TensorFlow's stream is not exposed.
"""
from __future__ import annotations

import ctypes
import functools
import sys

import numpy as np

from grace.native import _loader

DTYPE_CODES = {"float32": 0, "float64": 1}
INDEX_CODES = {"uint8": 0, "int16": 1, "int32": 2, "int64": 3}


@functools.lru_cache(maxsize=4096)
def c_array(ctype, length: int):
    """``ctype * length``, kept: ctypes holds its array types weakly, so one made per call is
    made again (13 us) after each garbage collection that frees it."""
    return ctype * length


class NativeUnavailable(RuntimeError):
    """No native library for this array (not built, not loadable, disabled, or unsupported)."""


class Buf:
    """A flat, contiguous array and what the kernels need of it."""

    __slots__ = ("obj", "ptr", "n", "dtype", "keep")

    def __init__(self, obj, ptr: int, n: int, dtype: str, keep=None):
        self.obj, self.ptr, self.n, self.dtype, self.keep = obj, ptr, n, dtype, keep


class TensorBuf(Buf):
    """A contiguous torch tensor's buffer, whose flat view (``obj``) is made only where it is
    asked for: a bucket call reads most of its buffers through their pointers alone, and a
    view costs more than the rest of a buffer (about 0.7 us)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor, ptr: int, n: int, dtype: str):
        self.tensor, self.ptr, self.n, self.dtype, self.keep = tensor, ptr, n, dtype, None

    @property
    def obj(self):
        return self.tensor if self.tensor.dim() == 1 else self.tensor.view(-1)


# --- DLPack -----------------------------------------------------------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_CODES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64", (1, 8): "uint8",
             (2, 16): "float16", (2, 32): "float32", (2, 64): "float64", (4, 16): "bfloat16", (6, 8): "bool"}
DL_CPU, DL_CUDA = 1, 2


def dlpack_info(capsule):
    """(pointer, numel, dtype name, device type, device id) of an unconsumed DLPack capsule
    of a contiguous tensor. The capsule must stay alive while the pointer is used."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get(capsule, b"dltensor")  # DLManagedTensor starts with its DLTensor
    t = _DLTensor.from_address(address)
    shape = [t.shape[i] for i in range(t.ndim)]
    numel = int(np.prod(shape)) if shape else 1
    if t.strides and numel > 1:
        expected = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and t.strides[i] != expected:
                raise NativeUnavailable("DLPack tensor is not contiguous")
            expected *= shape[i]
    dtype = _DL_CODES.get((t.dtype.code, t.dtype.bits))
    if dtype is None or t.dtype.lanes != 1:
        raise NativeUnavailable(f"DLPack dtype {(t.dtype.code, t.dtype.bits, t.dtype.lanes)} not supported")
    return (t.data or 0) + t.byte_offset, numel, dtype, t.device.device_type, t.device.device_id


# --- kinds ------------------------------------------------------------------------------------
class _Numpy:
    name = "numpy"
    stream = None

    def __init__(self):
        self.lib = _loader.library("cpu")

    @staticmethod
    def flat(x, dtype=None) -> Buf:
        a = np.ascontiguousarray(x).reshape(-1)
        if dtype is not None and a.dtype.name != dtype:
            a = a.astype(dtype)
        name = "bool" if a.dtype == np.bool_ else a.dtype.name
        return Buf(a, a.ctypes.data, a.size, name)

    @staticmethod
    def empty(n: int, dtype: str) -> Buf:
        a = np.empty(n, dtype=dtype)
        return Buf(a, a.ctypes.data, n, dtype)

    @staticmethod
    def typed(a, dtype: str):
        """The flat array ``a``'s memory read as ``dtype`` (its size a multiple of the item's)."""
        return a.view(dtype)

    @staticmethod
    def wrap(obj):
        return obj

    def sync(self):
        pass


_TORCH_NAMES: dict = {}  # torch dtype -> its name: asked for per tensor and step
_TORCH_CPU: list = []  # the kind of torch CPU tensors


def torch_dtype_name(dtype) -> str:
    """A torch dtype's name ("float32"), made once per dtype."""
    name = _TORCH_NAMES.get(dtype)
    return name if name is not None else _TORCH_NAMES.setdefault(dtype, str(dtype)[6:])


def _current_cuda_stream(torch, device) -> int:
    """The current CUDA stream's handle on ``device``: read per native call (a user may switch
    streams), so the raw query where torch has it (one C call; ``current_stream`` makes a
    Stream object, ~10 us a call on a busy host, and a bucket makes tens of calls)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


class _Torch:
    name = "torch"

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.stream = None
        if device.type == "cpu":
            self.lib = _loader.library("cpu")
        elif device.type == "cuda":
            self.lib = _loader.library("cuda")
            if self.lib is not None:
                if device.index is not None and device.index != torch.cuda.current_device():
                    raise NativeUnavailable("tensor is not on the current CUDA device")
                self.stream = _current_cuda_stream(torch, device)
        else:
            self.lib = None

    def flat(self, x, dtype=None) -> Buf:
        t = x if x.dim() == 1 else x.reshape(-1)  # a contiguous copy if x was not contiguous
        name = torch_dtype_name(t.dtype)
        if dtype is not None and name != dtype:
            t, name = t.to(getattr(self.torch, dtype)), dtype
        if not t.is_contiguous():
            t = t.contiguous()
        return Buf(t, t.data_ptr(), t.numel(), name)

    def empty(self, n: int, dtype: str) -> Buf:
        t = self.torch.empty(n, dtype=getattr(self.torch, dtype), device=self.device)
        return Buf(t, t.data_ptr(), n, dtype)

    def typed(self, t, dtype: str):
        """The flat tensor ``t``'s memory read as ``dtype`` (its size a multiple of the item's)."""
        return t.view(getattr(self.torch, dtype))

    @staticmethod
    def wrap(obj):
        return obj

    def sync(self):
        pass


class _TensorflowCPU(_Numpy):
    name = "tensorflow"

    def __init__(self, device: str):
        import tensorflow as tf

        super().__init__()
        self.tf, self.device = tf, device

    def flat(self, x, dtype=None) -> Buf:
        if hasattr(x, "numpy"):
            x = x.numpy()
        return _Numpy.flat(x, dtype)

    def wrap(self, obj):
        with self.tf.device(self.device):
            return self.tf.constant(obj)


class _TensorflowGPU:
    """TensorFlow GPU tensors through DLPack. TensorFlow does not expose its CUDA stream, so the
    kernels run on the legacy default stream between two device synchronizations."""

    name = "tensorflow"
    stream = 0

    def __init__(self, device: str):
        import tensorflow as tf

        self.tf, self.device = tf, device
        self.lib = _loader.library("cuda")
        if self.lib is not None:
            self.lib.device_sync()

    def flat(self, x, dtype=None) -> Buf:
        tf = self.tf
        x = tf.reshape(x, [-1])
        if dtype is not None and x.dtype.name != dtype:
            x = tf.cast(x, dtype)
        capsule = tf.experimental.dlpack.to_dlpack(x)
        ptr, n, name, dev_type, _ = dlpack_info(capsule)
        if dev_type != DL_CUDA:
            raise NativeUnavailable("TensorFlow tensor is not on a CUDA device")
        return Buf(x, ptr, n, name, keep=capsule)

    def empty(self, n: int, dtype: str) -> Buf:
        tf = self.tf
        with tf.device(self.device):
            t = tf.zeros([n], dtype=dtype)
        capsule = tf.experimental.dlpack.to_dlpack(t)
        ptr = dlpack_info(capsule)[0]
        return Buf(t, ptr, n, dtype, keep=capsule)

    @staticmethod
    def wrap(obj):
        return obj

    def sync(self):
        self.lib.device_sync()


def kind_of(x):
    """The kind (allocator, library, stream) for array ``x``; raises NativeUnavailable."""
    if not _loader.enabled():
        raise NativeUnavailable("native kernels are disabled (GRACE_NATIVE=0)")
    root = type(x).__module__.split(".")[0]
    if root == "torch":
        if x.requires_grad:
            raise NativeUnavailable("tensor requires grad")
        # one kind for CPU tensors, made again when cpu_build() switches the library; a CUDA
        # kind reads the current stream, so it is made per call
        if x.device.type == "cpu":
            if not _TORCH_CPU or _TORCH_CPU[0].lib is not _loader.library("cpu"):
                _TORCH_CPU[:] = [_Torch(x.device)]
            kind = _TORCH_CPU[0]
        else:
            kind = _Torch(x.device)
    elif root == "numpy" or isinstance(x, np.ndarray):
        kind = _Numpy()
    elif root == "tensorflow" or ("tensorflow" in sys.modules and sys.modules["tensorflow"].is_tensor(x)):
        if not hasattr(x, "numpy") or not sys.modules["tensorflow"].executing_eagerly():
            raise NativeUnavailable("symbolic TensorFlow tensor (inside tf.function): no buffer to hand over")
        device = getattr(x, "device", "") or ""
        kind = _TensorflowGPU(device) if ":GPU:" in device.upper() else _TensorflowCPU(device)
    else:
        raise NativeUnavailable(f"no native path for {type(x).__name__}")
    if kind.lib is None:
        lib = "cpu" if isinstance(kind, _Numpy) or getattr(getattr(kind, "device", None), "type", "") == "cpu" else "cuda"
        raise NativeUnavailable(_loader.load_error(lib) or f"no native library for {kind.name} on this device")
    return kind


def same_device(a, b) -> bool:
    """Whether kinds a and b hand the same library pointers it can use together."""
    if a.lib is not b.lib:
        return False
    if a.lib.kind == "cpu":
        return True
    return type(a) is type(b) and a.device == b.device


def call(kind, name: str, *args):
    """Call ``name`` in kind's library (adding the stream for CUDA); CUDA errors raise."""
    fn = getattr(kind.lib, name)
    if kind.lib.kind == "cuda":
        result = fn(*args, kind.stream)
        if result is not None and result < 0:
            raise RuntimeError(f"grace_cuda_{name} failed ({result})")
        return result
    return fn(*args)
