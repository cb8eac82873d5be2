"""Native kernels (csrc/): bit packing, fused quantize+pack, selection, error feedback, scatter-add.

Every function takes NumPy arrays, torch tensors (CPU; CUDA when libgrace_cuda is built) or
TensorFlow eager tensors (CPU through NumPy, GPU through DLPack), of any shape (read flat), and
returns arrays of the same kind on the same device; CUDA tensors never leave the GPU. The
results equal the pure tensor-op code's byte for byte (tests/native): codes, packed bytes,
indices, values and, on the CPU, the float32 scalars too (NumPy's pairwise summation is
reproduced); on a GPU, sums (norms, means, L1 scale) are deterministic but in another order.

Random methods take their uniform draws ``u`` (float32, one per element, as ``xp.uniform``
gives them) as an input: generating them is not part of the kernel.

When a library is missing, or ``GRACE_NATIVE=0``, or ``with disabled():``, the functions raise
``NativeUnavailable``; ``supports(x)`` says beforehand. Other code reaches a function one way:
by its name in ``KERNELS`` (its C functions per device, its outputs), through ``kernel(name, like)``
or ``run(name, like, *args)``, which give None where no kernel serves and the caller takes its
tensor-op path; any other error propagates.

The wrappers sit by family, a module each (its docstring lists its functions with their
arguments); every public name is exported here, as are the few others that other code reads
from here (the last imports below). Which module holds which:

    status.py       available, supports, set_num_threads, set_cache_bytes
    packing.py      pack, unpack
    sparse.py       topk_indices, threshold_indices, nonzero, topk_ / threshold_compress, scatter_add(_many),
                    topk_ / threshold_ef_step, topk_compress_segments, topk_ef_step_segments,
                    topk_ / threshold_ / randomk_ef_step_many, randomk_ef_step_segments, scatter_add_segments_into,
                    threshold_select_segments, threshold_write_segments
    signs.py        signsgd_, efsignsgd_, onebit_: compress, decompress, decompress_sum(_into);
                    efsignsgd_, onebit_: compress_segments, decompress_segments, ef_step_many, ef_step_segments,
                    residual_into
    terngrad.py     terngrad_: compress(_drawn), decompress(_pieces), (de)compress_segments, decompress_sum(_into)
    qsgd.py         qsgd_: the same; norm
    natural.py      natural_: the same
    quantizers.py   compress_many (a bucket's payloads), fp16_compress_many_into, fp16_decompress_many_into,
                    divide_many_into, flag_nonfinite_many
    means.py        signsgd_, efsignsgd_, onebit_, terngrad_, qsgd_, natural_mean_segments (a bucket's aggregate);
                    sparse_frames_mean, sparse_variable_mean, sparse_sum_mean (sparse pairs' aggregate)
    lowrank.py      PowerSGD's products: lowrank_project, lowrank_back, lowrank_expand and their _many forms
    dgc.py          dgc_compensate_into, dgc_cut_segments, dgc_select, dgc_select_segments, dgc_step_many
    draws.py        uniform_segments, hash_keys_segments, random_indices_segments
    kernels.py      KERNELS (the kernel table), Kernel, kernel, run
    _common.py      the helpers the families share (buffers, C arrays, in-place outputs, segments)
    _rows.py        FrameRows (every rank's pieces of the frames, which the decoded sums take),
                    payload_ranks, variable_rows (variable-length frames' read from their headers)
    _frames.py      FrameRoom (where a variable-length bucket call writes its frame itself)
    _flags.py       the overflow flag a segment step writes (a frame's byte or an allreduce's float)
    _arrays.py      any toolkit's array as (pointer, length, dtype, stream); outputs of the same kind
    _loader.py      the libraries, their C functions' argument types, the switch (disabled, set_enabled)
"""
from __future__ import annotations

from grace.native._arrays import NativeUnavailable, dlpack_info
from grace.native._frames import FrameRoom
from grace.native._rows import FrameRows, payload_ranks, variable_rows
from grace.native._loader import cpu_build, cpu_isa, disabled, enabled, load_error, set_enabled
from grace.native.dgc import dgc_compensate_into, dgc_cut_segments, dgc_select, dgc_select_segments, dgc_step_many
from grace.native.draws import hash_keys_segments, random_indices_segments, uniform_segments
from grace.native.kernels import KERNELS, Kernel, kernel, run
from grace.native.lowrank import (lowrank_back, lowrank_back_many, lowrank_expand, lowrank_expand_many,
                                  lowrank_project, lowrank_project_many)
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
                                 scatter_add_segments_into, threshold_compress, threshold_select_segments,
                                 threshold_write_segments,
                                 threshold_ef_step, threshold_ef_step_many, threshold_indices, topk_compress,
                                 topk_compress_segments, topk_ef_step, topk_ef_step_many, topk_ef_step_segments,
                                 topk_indices)
from grace.native.status import available, set_cache_bytes, set_num_threads, supports
from grace.native.terngrad import (terngrad_compress, terngrad_compress_drawn, terngrad_compress_segments,
                                   terngrad_decompress, terngrad_decompress_pieces, terngrad_decompress_segments,
                                   terngrad_decompress_sum, terngrad_decompress_sum_into)

# besides __all__, the names other code reads from here: library (benchmarks, tests), _same_kind (tests),
# _placed (grace.core.memory)
from grace.native._common import _placed, _same_kind  # noqa: F401
from grace.native._loader import library  # noqa: F401

__all__ = [
    "FrameRoom", "FrameRows", "KERNELS", "Kernel", "NativeUnavailable", "available", "compress_many", "cpu_build",
    "cpu_isa", "dgc_compensate_into", "dgc_cut_segments", "dgc_select", "dgc_select_segments", "dgc_step_many",
    "disabled", "divide_many_into", "flag_nonfinite_many",
    "dlpack_info", "efsignsgd_compress",
    "efsignsgd_compress_segments", "efsignsgd_decompress", "efsignsgd_decompress_segments", "efsignsgd_decompress_sum",
    "efsignsgd_decompress_sum_into", "efsignsgd_ef_step_many", "efsignsgd_ef_step_segments", "efsignsgd_mean_segments",
    "efsignsgd_residual_into", "enabled", "fp16_compress_many_into", "fp16_decompress_many_into",
    "hash_keys_segments", "kernel", "load_error", "lowrank_back", "lowrank_back_many", "lowrank_expand",
    "lowrank_expand_many", "lowrank_project", "lowrank_project_many", "natural_compress", "natural_compress_drawn",
    "natural_compress_segments", "natural_decompress", "natural_decompress_segments", "natural_decompress_sum",
    "natural_decompress_sum_into", "natural_mean_segments", "nonzero", "norm", "onebit_compress",
    "onebit_compress_segments", "onebit_decompress", "onebit_decompress_segments", "onebit_decompress_sum",
    "onebit_decompress_sum_into", "onebit_ef_step_many", "onebit_ef_step_segments", "onebit_mean_segments",
    "onebit_residual_into", "pack", "payload_ranks", "qsgd_compress", "qsgd_compress_drawn", "qsgd_compress_segments",
    "qsgd_decompress", "qsgd_decompress_segments", "qsgd_decompress_sum", "qsgd_decompress_sum_into",
    "qsgd_mean_segments", "random_indices_segments", "randomk_ef_step_many", "randomk_ef_step_segments", "run",
    "scatter_add", "scatter_add_many", "scatter_add_segments_into", "set_cache_bytes", "set_enabled", "set_num_threads",
    "signsgd_compress", "signsgd_decompress", "signsgd_decompress_sum", "signsgd_decompress_sum_into",
    "signsgd_mean_segments", "sparse_frames_mean", "sparse_sum_mean", "sparse_variable_mean", "supports",
    "terngrad_compress", "terngrad_compress_drawn", "terngrad_compress_segments", "terngrad_decompress",
    "terngrad_decompress_pieces", "terngrad_decompress_segments", "terngrad_decompress_sum",
    "terngrad_decompress_sum_into", "terngrad_mean_segments",
    "threshold_compress", "threshold_ef_step", "threshold_ef_step_many", "threshold_indices",
    "threshold_select_segments", "threshold_write_segments", "topk_compress", "topk_compress_segments",
    "topk_ef_step", "topk_ef_step_many", "topk_ef_step_segments", "topk_indices", "uniform_segments", "unpack",
    "variable_rows"
]
