"""grace.native's kernels inside a traced ``tf.function``: each call becomes a ``tf.py_function``
node that runs the kernel on the step's eager tensors.

The TensorFlow backend asks here (``graph_kernel``) when it is tracing; eager calls go to
grace.native directly. The node's output dtypes and variable-length outputs come from the
kernel table (``grace.native.KERNELS``); its static shapes from running the kernel once on zeros
while tracing.
"""
from __future__ import annotations

import tensorflow as tf

from grace import native
from grace.formats import index_dtype


def device_of(like) -> str:
    """The device string of ``like`` ('' where TensorFlow places it later)."""
    device = getattr(like, "device", None) if like is not None else None
    return device or ""


def on_gpu(like) -> bool:
    """Whether ops next to ``like`` run on a GPU (inside tf.function, with no device pinned:
    whether TensorFlow will place them on one)."""
    device = device_of(like)
    if device:
        return "GPU" in device.upper()
    if tf.executing_eagerly():
        return False  # eager tensors always know their device; no tensor: the host
    return bool(tf.config.list_logical_devices("GPU"))


def _static_shapes(kernel, args, count: int) -> list:
    """The kernel's output shapes for inputs of these static shapes, from running it once,
    eagerly, on zeros (every kernel returns flat arrays); [None] each where a shape is unknown."""
    tensors = [a for a in args if tf.is_tensor(a)]
    if not all(t.shape.is_fully_defined() for t in tensors):
        return [[None]] * count
    with tf.init_scope():  # out of the graph being traced
        out = kernel(*[tf.zeros(a.shape, a.dtype) if tf.is_tensor(a) else a for a in args])
    return [list(t.shape) for t in (out if isinstance(out, tuple) else (out,))]


def graph_kernel(name: str, like):
    """Kernel ``name`` as a function that adds a tf.py_function node to the graph being traced,
    or None where no built kernel serves ``like``'s device or its length is unknown (the
    method then traces its tensor-op formula)."""
    spec = native.KERNELS[name]
    if not tf.is_tensor(like):
        return None
    device = "cuda" if on_gpu(like) else "cpu"
    if device not in spec.devices or not native.available(device):
        return None
    numel = like.shape.num_elements()
    if "index" in spec.outputs and numel is None:  # the index type depends on the length
        return None
    tout = [tf.as_dtype(index_dtype(numel) if n == "index" else n) for n in spec.outputs]
    kernel = spec.function

    def call(*args):
        at = [i for i, a in enumerate(args) if tf.is_tensor(a)]

        def run(*tensors):  # eager tensors, when the step runs
            full = list(args)
            for i, t in zip(at, tensors):
                full[i] = t
            out = kernel(*full)
            return list(out) if isinstance(out, tuple) else [out]

        with tf.device(device_of(like)):
            out = tf.py_function(run, [args[i] for i in at], tout, name=name)
        for j, (t, shape) in enumerate(zip(out, _static_shapes(kernel, args, len(out)))):
            t.set_shape([None] if j in spec.variable else shape)
        return tuple(out) if len(out) > 1 else out[0]

    return call
