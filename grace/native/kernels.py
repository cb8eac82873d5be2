"""The kernel table: what a backend may ask for (FUSED, fused), and the building blocks
TorchBackend uses where they apply (the try_* functions: None where no kernel serves)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from grace.native._arrays import NativeUnavailable, kind_of
from grace.native.dgc import dgc_compensate_into, dgc_step_many
from grace.native.lowrank import lowrank_back_many, lowrank_expand_many, lowrank_project_many
from grace.native.natural import (natural_compress, natural_compress_drawn, natural_compress_segments,
                                  natural_decompress, natural_decompress_segments, natural_decompress_sum,
                                  natural_decompress_sum_into)
from grace.native.packing import pack, unpack
from grace.native.qsgd import (norm, qsgd_compress, qsgd_compress_drawn, qsgd_compress_segments, qsgd_decompress,
                               qsgd_decompress_segments, qsgd_decompress_sum, qsgd_decompress_sum_into)
from grace.native.quantizers import compress_many, fp16_compress_many_into, fp16_decompress_many_into
from grace.native.signs import (efsignsgd_compress, efsignsgd_compress_segments, efsignsgd_decompress,
                                efsignsgd_decompress_segments, efsignsgd_decompress_sum, efsignsgd_decompress_sum_into,
                                efsignsgd_ef_step_many, efsignsgd_residual_into, onebit_compress,
                                onebit_compress_segments, onebit_decompress, onebit_decompress_segments,
                                onebit_decompress_sum, onebit_decompress_sum_into, onebit_ef_step_many,
                                onebit_residual_into, signsgd_compress, signsgd_decompress, signsgd_decompress_sum,
                                signsgd_decompress_sum_into)
from grace.native.sparse import (nonzero, randomk_ef_step_many, scatter_add, scatter_add_many,
                                 scatter_add_segments_into, threshold_ef_step, threshold_ef_step_many,
                                 threshold_indices, topk_compress_segments, topk_ef_step, topk_ef_step_many,
                                 topk_ef_step_segments, topk_indices)
from grace.native.terngrad import (terngrad_compress, terngrad_compress_drawn, terngrad_compress_segments,
                                   terngrad_decompress, terngrad_decompress_segments, terngrad_decompress_sum,
                                   terngrad_decompress_sum_into)


# --- the kernel table: what a backend may ask for, and what each function returns -----------------
@dataclass(frozen=True)
class Kernel:
    """A native function a backend dispatches to: the C functions it calls (grace_cpu_<symbol>,
    grace_cuda_<symbol>; their argument types: ``_loader.SYMBOLS``), its outputs' dtypes
    ("index": ``index_dtype`` of the input's length; a graph needs them before it runs), the
    outputs whose length depends on the values, and the devices that have it."""

    function: Callable
    symbols: Tuple[str, ...]
    outputs: Tuple[str, ...]
    variable: Tuple[int, ...] = ()
    devices: Tuple[str, ...] = ("cpu", "cuda")


# The one-pass functions a compressor asks for by name (``xp.fused(name, like)``).
FUSED: Dict[str, Kernel] = {
    "signsgd_compress": Kernel(signsgd_compress, ("sign_pack",), ("uint8",)),
    "signsgd_decompress": Kernel(signsgd_decompress, ("sign_decode",), ("float32",)),
    "efsignsgd_compress": Kernel(efsignsgd_compress, ("efsign_compress",), ("uint8", "float32")),
    "efsignsgd_decompress": Kernel(efsignsgd_decompress, ("sign_decode",), ("float32",)),
    "onebit_compress": Kernel(onebit_compress, ("onebit_compress",), ("uint8", "float32")),
    "onebit_decompress": Kernel(onebit_decompress, ("onebit_decode",), ("float32",)),
    "signsgd_decompress_sum": Kernel(signsgd_decompress_sum, ("bits_sum",), ("float32",)),
    "efsignsgd_decompress_sum": Kernel(efsignsgd_decompress_sum, ("bits_sum",), ("float32",)),
    "onebit_decompress_sum": Kernel(onebit_decompress_sum, ("bits_sum",), ("float32",)),
    "terngrad_decompress_sum": Kernel(terngrad_decompress_sum, ("bits_sum",), ("float32",)),
    "qsgd_decompress_sum": Kernel(qsgd_decompress_sum, ("qsgd_sum_segments",), ("float32",), devices=("cpu",)),
    "natural_decompress_sum": Kernel(natural_decompress_sum, ("natural_sum_segments",), ("float32",),
                                     devices=("cpu",)),
    "qsgd_decompress_sum_into": Kernel(qsgd_decompress_sum_into, ("qsgd_sum_segments",), ("float32",),
                                       devices=("cpu",)),
    "natural_decompress_sum_into": Kernel(natural_decompress_sum_into, ("natural_sum_segments",), ("float32",),
                                          devices=("cpu",)),
    # (on a GPU one launch per kernel for all segments: the *_segments and decode_segments symbols)
    "efsignsgd_compress_segments": Kernel(efsignsgd_compress_segments, ("efsign_compress", "efsign_compress_segments"),
                                          ("uint8", "float32")),
    "efsignsgd_decompress_segments": Kernel(efsignsgd_decompress_segments, ("sign_decode", "decode_segments"),
                                            ("float32",)),
    "onebit_compress_segments": Kernel(onebit_compress_segments, ("onebit_compress", "onebit_compress_segments"),
                                       ("uint8", "float32")),
    "onebit_decompress_segments": Kernel(onebit_decompress_segments, ("onebit_decode", "decode_segments"),
                                         ("float32",)),
    "topk_compress_segments": Kernel(topk_compress_segments, ("topk",), ("float32", "int64")),
    "topk_ef_step_segments": Kernel(topk_ef_step_segments, ("topk_ef", "topk_ef_segments"),
                                    ("float32", "int64", "float32")),
    "terngrad_compress_segments": Kernel(terngrad_compress_segments,
                                         ("maxabs", "terngrad_compress", "terngrad_compress_segments"),
                                         ("uint8", "float32")),
    "terngrad_decompress_segments": Kernel(terngrad_decompress_segments, ("terngrad_decode", "decode_segments"),
                                           ("float32",)),
    "qsgd_compress_segments": Kernel(qsgd_compress_segments, ("qsgd_compress", "qsgd_compress_segments"),
                                     ("uint8", "float32")),
    "qsgd_decompress_segments": Kernel(qsgd_decompress_segments, ("qsgd_decode", "decode_segments"), ("float32",)),
    "natural_compress_segments": Kernel(natural_compress_segments, ("natural_compress", "natural_compress_segments"),
                                        ("uint8", "uint8")),
    "natural_decompress_segments": Kernel(natural_decompress_segments, ("natural_decode", "decode_segments"),
                                          ("float32",)),
    "terngrad_compress": Kernel(terngrad_compress, ("maxabs", "terngrad_compress"), ("uint8", "float32")),
    "terngrad_decompress": Kernel(terngrad_decompress, ("terngrad_decode",), ("float32",)),
    "qsgd_compress": Kernel(qsgd_compress, ("qsgd_norms", "qsgd_compress"), ("uint8", "float32")),
    "qsgd_decompress": Kernel(qsgd_decompress, ("qsgd_decode",), ("float32",)),
    "natural_compress": Kernel(natural_compress, ("natural_compress",), ("uint8", "uint8")),
    "natural_compress_drawn": Kernel(natural_compress_drawn, ("natural_compress_drawn",), ("uint8", "uint8"),
                                     devices=("cpu",)),
    "terngrad_compress_drawn": Kernel(terngrad_compress_drawn, ("terngrad_compress_drawn",), ("uint8", "float32"),
                                      devices=("cpu",)),
    "qsgd_compress_drawn": Kernel(qsgd_compress_drawn, ("qsgd_compress_drawn",), ("uint8", "float32"),
                                  devices=("cpu",)),
    "natural_decompress": Kernel(natural_decompress, ("natural_decode",), ("float32",)),
    "topk_ef_step": Kernel(topk_ef_step, ("topk_ef",), ("float32", "index", "float32")),
    "threshold_ef_step": Kernel(threshold_ef_step, ("threshold_ef",), ("float32", "index", "float32"),
                                variable=(0, 1)),
    # a bucket in one call (lists in, lists out; eager CPU tensors only)
    "topk_ef_step_many": Kernel(topk_ef_step_many, ("topk_ef_many",), ("float32", "index", "float32"),
                                devices=("cpu",)),
    "threshold_ef_step_many": Kernel(threshold_ef_step_many, ("threshold_ef_many",), ("float32", "index", "float32"),
                                     devices=("cpu",), variable=(0, 1)),
    "randomk_ef_step_many": Kernel(randomk_ef_step_many, ("randomk_ef_many",), ("float32", "float32"),
                                   devices=("cpu",)),
    "scatter_add_segments_into": Kernel(scatter_add_segments_into, ("scatter_add_segments",), ("float32",),
                                        devices=("cpu",)),
    "dgc_compensate_into": Kernel(dgc_compensate_into, ("dgc_compensate",), ("float32", "float32"),
                                  devices=("cpu",)),
    "lowrank_project_many": Kernel(lowrank_project_many, ("lowrank_project_many",), ("float32",), devices=("cpu",)),
    "lowrank_back_many": Kernel(lowrank_back_many, ("lowrank_back_many",), ("float32",), devices=("cpu",)),
    "lowrank_expand_many": Kernel(lowrank_expand_many, ("lowrank_expand_many",), ("float32",), devices=("cpu",)),
    "compress_many": Kernel(compress_many, ("compress_many",), ("uint8", "float32"), devices=("cpu",)),
    "dgc_step_many": Kernel(dgc_step_many, ("dgc_step_many",), ("float32", "index"), devices=("cpu",), variable=(0, 1)),
    "fp16_compress_many_into": Kernel(fp16_compress_many_into, ("half_encode_many",), ("float16",), devices=("cpu",)),
    "fp16_decompress_many_into": Kernel(fp16_decompress_many_into, ("half_decode_many",), ("float32",),
                                        devices=("cpu",)),
    "efsignsgd_ef_step_many": Kernel(efsignsgd_ef_step_many, ("bits_ef_many",), ("uint8", "float32", "float32"),
                                     devices=("cpu",)),
    "onebit_ef_step_many": Kernel(onebit_ef_step_many, ("bits_ef_many",), ("uint8", "float32", "float32"),
                                  devices=("cpu",)),
    "efsignsgd_residual_into": Kernel(efsignsgd_residual_into, ("bits_residual",), ("float32",), devices=("cpu",)),
    "onebit_residual_into": Kernel(onebit_residual_into, ("bits_residual",), ("float32",), devices=("cpu",)),
    **{f"{method}_decompress_sum_into": Kernel(function, ("bits_sum_segments",), ("float32",), devices=("cpu",))
       for method, function in (("signsgd", signsgd_decompress_sum_into), ("efsignsgd", efsignsgd_decompress_sum_into),
                                ("onebit", onebit_decompress_sum_into), ("terngrad", terngrad_decompress_sum_into))},
}


def fused(name: str, like):
    """The fused function ``name`` (e.g. 'qsgd_compress') when it runs natively on the device
    of ``like``, else None: the compressor then runs its tensor-op formula."""
    kernel = FUSED[name]  # (an unknown name is a bug, not a reason to fall back)
    try:
        kind = kind_of(like)
    except NativeUnavailable:
        return None
    return kernel.function if kind.lib.kind in kernel.devices else None


# --- the building blocks TorchBackend uses where they apply (top-k, nonzero, scatter-add, packing) ---
def _unless_unavailable(fn, *args, **kwargs):
    """fn(...), or None where no native kernel serves these inputs (no library, another device,
    a dtype it does not take: NativeUnavailable); the caller then runs its tensor-op code.
    Any other error is a real one and propagates."""
    try:
        return fn(*args, **kwargs)
    except NativeUnavailable:
        return None


def try_pack(codes, bits: int):
    return _unless_unavailable(pack, codes, bits)


def try_unpack(packed, bits: int, numel: int):
    return _unless_unavailable(unpack, packed, bits, numel)


def try_topk_indices(x, k: int):
    return _unless_unavailable(topk_indices, x, k)


def try_nonzero(mask):
    return _unless_unavailable(nonzero, mask)


def try_threshold_indices(x, threshold: float):
    return _unless_unavailable(threshold_indices, x, threshold)


def try_norm(x):
    return _unless_unavailable(norm, x)


def try_scatter_add(indices, values, numel: int):
    return _unless_unavailable(scatter_add, indices, values, numel)


def try_scatter_add_many(payloads, numel: int):
    return _unless_unavailable(scatter_add_many, payloads, numel)
