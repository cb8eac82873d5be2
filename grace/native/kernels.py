"""The kernel table: every grace.native function a backend calls, by name (``KERNELS``), and the one
way to reach it: ``kernel(name, like)`` (the function, where it runs on like's device, else None)
or ``run(name, like, *args)`` (its result, else None). None sends the caller to its tensor-op code;
any error other than NativeUnavailable is a real one and propagates."""
from __future__ import annotations

import inspect
import sys
import math
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Tuple, Union

from grace.native._arrays import NativeUnavailable, kind_of
from grace.native._rows import variable_rows
from grace.native.dgc import dgc_compensate_into, dgc_cut_segments, dgc_select, dgc_select_segments, dgc_step_many
from grace.native.draws import hash_keys_segments, random_indices_segments, uniform_segments
from grace.native.lowrank import lowrank_back_many, lowrank_expand_many, lowrank_project_many
from grace.native.means import (efsignsgd_mean_segments, natural_mean_segments, onebit_mean_segments,
                                qsgd_mean_segments, signsgd_mean_segments, sparse_frames_mean, sparse_sum_mean,
                                sparse_variable_mean, terngrad_mean_segments)
from grace.native.natural import (natural_compress, natural_compress_drawn, natural_compress_segments,
                                  natural_decompress, natural_decompress_segments, natural_decompress_sum,
                                  natural_decompress_sum_into)
from grace.native.packing import pack, unpack
from grace.native.qsgd import (norm, qsgd_compress, qsgd_compress_drawn, qsgd_compress_segments, qsgd_decompress,
                               qsgd_decompress_segments, qsgd_decompress_sum, qsgd_decompress_sum_into)
from grace.native.quantizers import (compress_many, divide_many_into, flag_nonfinite_many, fp16_compress_many_into,
                                    fp16_decompress_many_into)
from grace.native.signs import (efsignsgd_compress, efsignsgd_compress_segments, efsignsgd_decompress,
                                efsignsgd_decompress_segments, efsignsgd_decompress_sum, efsignsgd_decompress_sum_into,
                                efsignsgd_ef_step_many, efsignsgd_ef_step_segments, efsignsgd_residual_into,
                                onebit_compress, onebit_compress_segments, onebit_decompress,
                                onebit_decompress_segments, onebit_decompress_sum, onebit_decompress_sum_into,
                                onebit_ef_step_many, onebit_ef_step_segments, onebit_residual_into, signsgd_compress,
                                signsgd_decompress, signsgd_decompress_sum, signsgd_decompress_sum_into)
from grace.native.sparse import (nonzero, randomk_ef_step_many, randomk_ef_step_segments, scatter_add, scatter_add_many,
                                 scatter_add_segments_into, threshold_ef_step, threshold_select_segments,
                                 threshold_write_segments,
                                 threshold_ef_step_many, threshold_indices, topk_compress_segments, topk_ef_step,
                                 topk_ef_step_many, topk_ef_step_segments, topk_indices)
from grace.native.terngrad import (terngrad_compress, terngrad_compress_drawn, terngrad_compress_segments,
                                   terngrad_decompress, terngrad_decompress_pieces, terngrad_decompress_segments,
                                   terngrad_decompress_sum, terngrad_decompress_sum_into)

Symbols = Union[str, Tuple[str, ...]]
Launches = Callable[[Mapping], int]

SEGMENT_BATCH = 64  # segments per launch of a segment kernel (csrc/cuda/segments.cu's kSegBatch)


def fixed(count: int) -> Launches:
    """A CUDA call of ``count`` launches (kernels and memsets; at most, where the data can spare one)."""
    return lambda arguments: count


def per_batch(count: int, once: int = 0) -> Launches:
    """A segment kernel's launches: ``count`` per batch of SEGMENT_BATCH segments, ``once`` per call."""
    def counted(arguments):
        segments = len(arguments["numels"] if "numels" in arguments else arguments["counts"])
        return once + count * math.ceil(segments / SEGMENT_BATCH)
    return counted


# grace_cuda_topk: one memset of the histograms and tickets, three radix passes (each one's last block
# narrows the state), the counts (their last block scans them), the writes
TOPK_LAUNCHES = 1 + 3 + 1 + 1
# grace_cuda_threshold, grace_cuda_nonzero: one memset (the state, the ticket), the counts and scan, the writes
COMPACT_LAUNCHES = 1 + 1 + 1
# grace_cuda_topk_ef_segments, per batch: one memset of the three passes' histograms and tickets, the
# compensation with the first pass, two more passes (each segment's last block narrows its state), the
# counts (its last block scans them), the writes
SEGMENT_TOPK_LAUNCHES = 1 + 1 + 2 + 1 + 1


@dataclass(frozen=True)
class Kernel:
    """A native function and, per device, the C functions it calls there (grace_cpu_<symbol>,
    grace_cuda_<symbol>, as csrc/include/grace_native.h declares them; none: not on that device);
    its outputs' dtypes ("index": ``index_dtype`` of the input's length; a traced graph needs them
    before it runs) and the outputs whose length depends on the values."""

    function: Callable
    outputs: Tuple[str, ...]
    cpu: Tuple[str, ...] = ()
    cuda: Tuple[str, ...] = ()
    variable: Tuple[int, ...] = ()
    #: on a GPU: the kernels and memsets one call launches, from its bound arguments (at most),
    #: and the host waits it makes (a count of unknown size read back)
    launches: Launches = fixed(1)
    waits: int = 0

    def cuda_cost(self, *args, **kwargs) -> Tuple[int, int]:
        """(launches, host waits) of this call on a GPU."""
        arguments = inspect.signature(self.function).bind(*args, **kwargs).arguments
        return self.launches(arguments), self.waits

    @property
    def devices(self) -> Tuple[str, ...]:
        return tuple(device for device in ("cpu", "cuda") if self.symbols_on(device))

    @property
    def symbols(self) -> Tuple[str, ...]:
        return tuple(dict.fromkeys(self.cpu + self.cuda))

    def symbols_on(self, device: str) -> Tuple[str, ...]:
        return getattr(self, device)


def _tuple(symbols: Symbols) -> Tuple[str, ...]:
    return (symbols,) if isinstance(symbols, str) else tuple(symbols)


def both(function, symbols: Symbols, outputs, cuda: Symbols = None, **kw) -> Kernel:
    """A kernel on the CPU and on a GPU (``cuda``: where the GPU calls other C functions)."""
    return Kernel(function, _tuple(outputs), _tuple(symbols), _tuple(symbols if cuda is None else cuda), **kw)


def cpu(function, symbols: Symbols, outputs, **kw) -> Kernel:
    """A kernel of the CPU library only (a bucket in one call; lists in, lists out)."""
    return Kernel(function, _tuple(outputs), _tuple(symbols), **kw)


def gpu(function, symbols: Symbols, outputs, **kw) -> Kernel:
    """A kernel of the CUDA library only."""
    return Kernel(function, _tuple(outputs), cuda=_tuple(symbols), **kw)



KERNELS: Dict[str, Kernel] = {
    # building blocks (TorchBackend's ops, grace.core.draws)
    "pack": both(pack, "pack", "uint8"),
    "unpack": both(unpack, "unpack", "uint8"),
    "topk_indices": both(topk_indices, "topk", "int64", launches=fixed(TOPK_LAUNCHES)),
    "threshold_indices": both(threshold_indices, "threshold", "int64", variable=(0,), launches=fixed(COMPACT_LAUNCHES),
                              waits=1),
    "nonzero": both(nonzero, "nonzero", "int64", variable=(0,), launches=fixed(COMPACT_LAUNCHES), waits=1),
    "norm": cpu(norm, "qsgd_norms", "float32"),
    "scatter_add": both(scatter_add, "scatter_add", "float32", launches=fixed(2)),
    "scatter_add_many": both(scatter_add_many, "scatter_add", "float32",
                             launches=lambda arguments: 1 + len(arguments["payloads"])),
    "sparse_frames_mean": both(sparse_frames_mean, "sparse_frames_mean", ("float32", "float32")),
    "sparse_sum_mean": both(sparse_sum_mean, "sparse_sum_mean", "float32", launches=fixed(2)),
    "sparse_variable_mean": both(sparse_variable_mean, "sparse_variable_mean", "float32"),
    "threshold_select_segments": both(threshold_select_segments, "threshold_select_segments",
                                      ("float32", "uint8", "int64", "int64"), launches=fixed(2)),
    "threshold_write_segments": both(threshold_write_segments, "threshold_write_segments", "uint8",
                                     launches=fixed(1 + 2 + 1)),
    "uniform_segments": both(uniform_segments, "uniform_segments", "float32", launches=per_batch(1)),
    "hash_keys_segments": gpu(hash_keys_segments, "hash_keys_segments", "int64", launches=per_batch(1)),
    "random_indices_segments": cpu(random_indices_segments, "random_indices_segments", "int64"),
    # one tensor's compression or decompression in one pass
    "signsgd_compress": both(signsgd_compress, "sign_pack", "uint8"),
    "signsgd_decompress": both(signsgd_decompress, "sign_decode", "float32"),
    "efsignsgd_compress": both(efsignsgd_compress, "efsign_compress", ("uint8", "float32"), launches=fixed(2)),
    "efsignsgd_decompress": both(efsignsgd_decompress, "sign_decode", "float32"),
    "onebit_compress": both(onebit_compress, "onebit_compress", ("uint8", "float32"), launches=fixed(2)),
    "onebit_decompress": both(onebit_decompress, "onebit_decode", "float32"),
    "terngrad_compress": both(terngrad_compress, ("maxabs", "terngrad_compress"), ("uint8", "float32"),
                               launches=fixed(3)),
    "terngrad_decompress": both(terngrad_decompress, "terngrad_decode", "float32"),
    "terngrad_decompress_pieces": cpu(terngrad_decompress_pieces, "terngrad_decode_pieces", "float32"),
    "qsgd_compress": both(qsgd_compress, ("qsgd_norms", "qsgd_compress"), ("uint8", "float32"), launches=fixed(3)),
    "qsgd_decompress": both(qsgd_decompress, "qsgd_decode", "float32"),
    "natural_compress": both(natural_compress, "natural_compress", ("uint8", "uint8")),
    "natural_decompress": both(natural_decompress, "natural_decode", "float32"),
    # ... with the counter-based draws made inside (no tensor of draws)
    "terngrad_compress_drawn": cpu(terngrad_compress_drawn, "terngrad_compress_drawn", ("uint8", "float32")),
    "qsgd_compress_drawn": cpu(qsgd_compress_drawn, "qsgd_compress_drawn", ("uint8", "float32")),
    "natural_compress_drawn": cpu(natural_compress_drawn, "natural_compress_drawn", ("uint8", "uint8")),
    # every rank's payload of one tensor decoded and summed in one pass
    **{f"{method}_decompress_sum": both(function, "bits_sum", "float32")
       for method, function in (("signsgd", signsgd_decompress_sum), ("efsignsgd", efsignsgd_decompress_sum),
                                ("onebit", onebit_decompress_sum), ("terngrad", terngrad_decompress_sum))},
    "qsgd_decompress_sum": cpu(qsgd_decompress_sum, "qsgd_sum_segments", "float32"),
    "natural_decompress_sum": cpu(natural_decompress_sum, "natural_sum_segments", "float32"),
    # ... for every tensor of a bucket, into the caller's outputs
    **{f"{method}_decompress_sum_into": cpu(function, "bits_sum_segments", "float32")
       for method, function in (("signsgd", signsgd_decompress_sum_into), ("efsignsgd", efsignsgd_decompress_sum_into),
                                ("onebit", onebit_decompress_sum_into), ("terngrad", terngrad_decompress_sum_into))},
    "qsgd_decompress_sum_into": cpu(qsgd_decompress_sum_into, "qsgd_sum_segments", "float32"),
    "natural_decompress_sum_into": cpu(natural_decompress_sum_into, "natural_sum_segments", "float32"),
    "scatter_add_segments_into": cpu(scatter_add_segments_into, "scatter_add_segments", "float32"),
    # the ranks' variable-length frames read from their headers (pointers and counts for the sums)
    "variable_rows": cpu(variable_rows, "variable_rows", ("uint64", "int64")),
    # a bucket's segments: each through the per-tensor function on a CPU, one launch per phase on a GPU
    "efsignsgd_compress_segments": both(efsignsgd_compress_segments, "efsign_compress", ("uint8", "float32"),
                                        cuda="efsign_compress_segments", launches=per_batch(2)),
    "efsignsgd_decompress_segments": both(efsignsgd_decompress_segments, "sign_decode", "float32",
                                          cuda="decode_segments", launches=per_batch(1)),
    "onebit_compress_segments": both(onebit_compress_segments, "onebit_compress", ("uint8", "float32"),
                                     cuda="onebit_compress_segments", launches=per_batch(2)),
    "onebit_decompress_segments": both(onebit_decompress_segments, "onebit_decode", "float32",
                                       cuda="decode_segments", launches=per_batch(1)),
    "terngrad_compress_segments": both(terngrad_compress_segments, "terngrad_compress_drawn",
                                       ("uint8", "float32"), cuda="terngrad_compress_segments",
                                       launches=per_batch(2, once=1)),
    "terngrad_decompress_segments": both(terngrad_decompress_segments, "terngrad_decode", "float32",
                                         cuda="decode_segments", launches=per_batch(1)),
    "qsgd_compress_segments": both(qsgd_compress_segments, "qsgd_compress_drawn", ("uint8", "float32"),
                                   cuda="qsgd_compress_segments", launches=per_batch(3)),
    "qsgd_decompress_segments": both(qsgd_decompress_segments, "qsgd_decode", "float32", cuda="decode_segments",
                                     launches=per_batch(1)),
    "natural_compress_segments": both(natural_compress_segments, "natural_compress_drawn", ("uint8", "uint8"),
                                      cuda="natural_compress_segments", launches=per_batch(1)),
    "natural_decompress_segments": both(natural_decompress_segments, "natural_decode", "float32",
                                        cuda="decode_segments", launches=per_batch(1)),
    # ... every rank's fields of a bucket decoded, added and divided (the allgather's aggregate)
    **{f"{method}_mean_segments": both(function, symbol, "float32", cuda="mean_segments", launches=per_batch(1))
       for method, function, symbol in (
           ("signsgd", signsgd_mean_segments, "bits_sum_segments"),
           ("efsignsgd", efsignsgd_mean_segments, "bits_sum_segments"),
           ("onebit", onebit_mean_segments, "bits_sum_segments"),
           ("terngrad", terngrad_mean_segments, "bits_sum_segments"),
           ("qsgd", qsgd_mean_segments, "qsgd_sum_segments"),
           ("natural", natural_mean_segments, "natural_sum_segments"))},
    "topk_compress_segments": both(topk_compress_segments, "topk", ("float32", "int64"), cuda="topk_ef_segments",
                                   launches=per_batch(SEGMENT_TOPK_LAUNCHES)),
    "efsignsgd_ef_step_segments": both(efsignsgd_ef_step_segments, "bits_ef_many", ("uint8", "float32", "float32"),
                                       cuda="efsign_ef_segments", launches=per_batch(3)),
    "onebit_ef_step_segments": both(onebit_ef_step_segments, "bits_ef_many", ("uint8", "float32", "float32"),
                                    cuda="onebit_ef_segments", launches=per_batch(3)),
    "randomk_ef_step_segments": both(randomk_ef_step_segments, "randomk_ef_segments", ("float32", "int64", "float32"),
                                     launches=per_batch(SEGMENT_TOPK_LAUNCHES)),
    "topk_ef_step_segments": both(topk_ef_step_segments, "topk_ef_many", ("float32", "int64", "float32"),
                                  cuda="topk_ef_segments", launches=per_batch(SEGMENT_TOPK_LAUNCHES)),
    # error feedback fused with selection: one tensor, then a bucket in one call
    "topk_ef_step": both(topk_ef_step, "topk_ef", ("float32", "index", "float32"), launches=fixed(1 + TOPK_LAUNCHES)),
    "threshold_ef_step": both(threshold_ef_step, "threshold_ef", ("float32", "index", "float32"), variable=(0, 1),
                              launches=fixed(1 + COMPACT_LAUNCHES), waits=1),
    "topk_ef_step_many": cpu(topk_ef_step_many, "topk_ef_many", ("float32", "index", "float32")),
    "threshold_ef_step_many": cpu(threshold_ef_step_many, ("threshold_ef_many", "copy_pieces", "variable_frame"),
                                  ("float32", "index", "float32"), variable=(0, 1)),  # (and into a frame)
    "randomk_ef_step_many": cpu(randomk_ef_step_many, "randomk_ef_many", ("float32", "float32")),
    "efsignsgd_ef_step_many": cpu(efsignsgd_ef_step_many, "bits_ef_many", ("uint8", "float32", "float32")),
    "onebit_ef_step_many": cpu(onebit_ef_step_many, "bits_ef_many", ("uint8", "float32", "float32")),
    "efsignsgd_residual_into": cpu(efsignsgd_residual_into, "bits_residual", "float32"),
    "onebit_residual_into": cpu(onebit_residual_into, "bits_residual", "float32"),
    "dgc_compensate_into": both(dgc_compensate_into, "dgc_compensate", ("float32", "float32")),
    "dgc_cut_segments": both(dgc_cut_segments, "dgc_cut_segments", "float32", launches=per_batch(1)),
    "dgc_select_segments": both(dgc_select_segments, "dgc_select_segments", ("float32", "int64"),
                                launches=per_batch(SEGMENT_TOPK_LAUNCHES)),
    "dgc_select": cpu(dgc_select, "dgc_select", "int64", variable=(0,)),
    "dgc_step_many": cpu(dgc_step_many, ("dgc_step_many", "copy_pieces", "variable_frame"), ("float32", "index"),
                         variable=(0, 1)),
    # a bucket's payloads, half-precision casts and PowerSGD's products in one call each
    "compress_many": cpu(compress_many, "compress_many", ("uint8", "float32")),
    "fp16_compress_many_into": cpu(fp16_compress_many_into, "half_encode_many", "float16"),
    "fp16_decompress_many_into": cpu(fp16_decompress_many_into, "half_decode_many", "float32"),
    "divide_many_into": cpu(divide_many_into, "divide_many", "float32"),
    "flag_nonfinite_many": cpu(flag_nonfinite_many, "flag_nonfinite_many", "float32"),
    "lowrank_project_many": cpu(lowrank_project_many, "lowrank_project_many", "float32"),
    "lowrank_back_many": cpu(lowrank_back_many, "lowrank_back_many", "float32"),
    "lowrank_expand_many": cpu(lowrank_expand_many, "lowrank_expand_many", "float32"),
}


def _compiling() -> bool:
    """Whether torch.compile is tracing the caller (then the tensor ops run, to be compiled)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def kernel(name: str, like):
    """The function of kernel ``name`` where it runs natively on the device of ``like``, else None."""
    entry = KERNELS[name]  # (an unknown name is a bug, not a reason to fall back)
    if _compiling():  # (torch.compile's trace: its tensors have no memory to hand to C)
        return None
    try:
        device = kind_of(like).lib.kind
    except NativeUnavailable:
        return None
    return entry.function if entry.symbols_on(device) else None


def run(name: str, like, *args, **kwargs):
    """Kernel ``name`` called with ``args`` where it serves them on like's device; None where it does
    not (not built, another device, a dtype or layout it does not take: NativeUnavailable)."""
    function = kernel(name, like)
    if function is None:
        return None
    try:
        return function(*args, **kwargs)
    except NativeUnavailable:
        return None
