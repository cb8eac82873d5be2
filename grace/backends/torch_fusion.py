"""A bucket's tensor ops fused by torch.compile, where each would launch a kernel of its own.

On a GPU without grace's CUDA library a segmented bucket's phases are chains of whole-buffer
tensor ops (dozens a bucket); torch.compile (TorchInductor) turns each chain into a few fused
kernels (Triton on a GPU), computing what the ops compute one by one: compiled with eager
numerics (no multiply and add contracted into one FMA, IEEE division, subnormals kept), which
inductor's C++ kernels on a CPU keep anyway.

A function's first call runs its ops one by one: what it makes once and keeps (a layout's
constants, in plain dicts) is then there for the compiled program to read as constants, with
no recompilation when the trace would have added it. Each function gets a code object of its
own: dynamo keeps its compiled entries per code object, at most ``recompile_limit`` (8) of
them, and every bucket's functions share one code. A function whose compilation fails runs
eagerly from then on (one warning). ``GRACE_FUSE=0`` turns fusing off.
"""
from __future__ import annotations

import itertools
import os
import types
import warnings

import torch

#: fuse CPU tensors' ops too (the accelerator path as a CPU runs it: bench_step, tests; inductor's
#: C++ kernels stand in for a GPU's Triton ones)
ON_CPU = False
_serial = itertools.count()
#: calls so far that ran a fused function's first call or compiled it (a benchmark warms up until
#: a step adds none)
cold_calls = 0
#: inductor's settings for results the eager ops would give (Triton contracts, divides
#: approximately and flushes subnormals by default)
EAGER_NUMERICS = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True,
                  "eager_numerics.disable_ftz": True}


def fuses(like) -> bool:
    """Whether ``fused`` compiles functions of tensors like ``like``."""
    return os.environ.get("GRACE_FUSE", "1") != "0" and (like.device.type != "cpu" or ON_CPU)


def fused(fn, name: str, like, dynamic: bool = False):
    """``fn``, a function of tensors without side effects, compiled from its second call on
    where ``fuses(like)``; else ``fn`` itself. ``dynamic``: its sizes vary by call (one program
    for every size, not one per size)."""
    if not fuses(like):
        return fn
    code = fn.__code__.replace(co_name=f"{name}_{next(_serial)}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    compiled = torch.compile(own, dynamic=dynamic, options=EAGER_NUMERICS)
    mode = ["first"]  # then "compiling" (the call that compiles), "compiled"; "eager" once compiling failed

    def call(*args):
        global cold_calls
        if mode[0] in ("compiling", "compiled"):
            cold_calls += mode[0] == "compiling"
            try:
                result = compiled(*args)
                mode[0] = "compiled"
                return result
            except Exception as error:  # (a failure of fn itself fails again below, eagerly)
                warnings.warn(f"grace: {name} runs its tensor ops one by one, torch.compile failed: "
                              f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)
                mode[0] = "eager"
        elif mode[0] == "first":
            mode[0], cold_calls = "compiling", cold_calls + 1
        return own(*args)

    return call
