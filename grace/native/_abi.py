# Generated from csrc/include/grace_native.h by `python csrc/abi.py`: do not edit (change the header, rerun it).
"""The C ABI of the native libraries for ctypes, as csrc/include/grace_native.h declares it.

name -> (restype, argtypes) of grace_cpu_<name> (CPU) and grace_cuda_<name> (CUDA; the argtypes
end with the caller's stream, a void*, for the functions in CUDA_STREAM), in the header's order.
"""
from ctypes import c_char_p, c_double, c_float, c_int, c_int64, c_uint32, c_void_p

_P = c_void_p  # any pointer
_S = c_char_p  # a returned const char*: a string
_I = c_int  # int
_L = c_int64  # int64_t
_U = c_uint32  # uint32_t
_F = c_float  # float
_D = c_double  # double

ABI = 27  # GRACE_NATIVE_ABI

# CPU (grace_cpu_*)
CPU = {
    "abi": (_I, []),
    "isa": (_S, []),
    "runs_x86_64_v3": (_I, []),
    "uses_avx512": (_I, []),
    "uses_prefetch": (_I, []),
    "set_num_threads": (None, [_I]),
    "get_num_threads": (_I, []),
    "set_cache_bytes": (None, [_L]),
    "get_cache_bytes": (_L, []),
    "pack": (_I, [_P, _L, _I, _P]),
    "unpack": (_I, [_P, _L, _I, _P]),
    "sign_pack": (None, [_P, _L, _I, _P]),
    "efsign_compress": (None, [_P, _L, _P, _P]),
    "onebit_compress": (None, [_P, _L, _P, _P]),
    "maxabs": (None, [_P, _L, _P]),
    "terngrad_compress": (None, [_P, _P, _L, _P, _P]),
    "qsgd_norms": (None, [_P, _L, _L, _P]),
    "qsgd_compress": (_I, [_P, _P, _L, _I, _L, _I, _P, _I, _P]),
    "natural_compress": (None, [_P, _P, _L, _P, _P]),
    "sign_decode": (None, [_P, _L, _P, _P]),
    "onebit_decode": (None, [_P, _L, _P, _P]),
    "terngrad_decode": (None, [_P, _L, _P, _P]),
    "qsgd_decode": (_I, [_P, _L, _I, _L, _I, _P, _P]),
    "natural_decode": (None, [_P, _P, _L, _P]),
    "bits_sum": (None, [_P, _L, _L, _P, _I, _P]),
    "bits_residual": (None, [_P, _P, _L, _P, _I, _P]),
    "bits_sum_segments": (None, [_L, _I, _P, _P, _I, _P, _I, _P, _I, _P]),
    "qsgd_sum_segments": (_I, [_L, _I, _P, _P, _P, _I, _L, _I, _I, _P, _I, _P]),
    "natural_sum_segments": (None, [_L, _I, _P, _P, _P, _I, _P, _I, _P]),
    "dgc_compensate": (None, [_P, _P, _P, _L, _F, _P, _P]),
    "dgc_select_segments": (_I, [_P, _P, _L, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _L, _L, _L]),
    "pairs_into_frame": (None, [_P, _P, _L, _P, _P, _L, _L]),
    "copy_pieces": (None, [_L, _P, _P, _P, _P]),
    "dgc_cut_segments": (_I, [_P, _L, _L, _P, _P, _P, _P, _P, _P, _P]),
    "dgc_select": (_L, [_P, _L, _L, _L, _L, _U, _U, _P]),
    "dgc_step_many": (_I, [_L, _P, _P, _P, _P, _P, _P, _F, _D, _D, _P, _P, _P, _P, _P, _P, _P, _P]),
    "uniform_segments": (None, [_L, _P, _P, _P, _P]),
    "random_indices_segments": (_I, [_L, _P, _P, _P, _P, _P]),
    "topk": (_L, [_P, _I, _L, _L, _I, _P, _I, _P]),
    "threshold": (_L, [_P, _I, _L, _D, _I, _P, _I, _P]),
    "nonzero": (_L, [_P, _L, _P, _I]),
    "topk_ef": (_L, [_P, _P, _L, _L, _F, _F, _I, _P, _P, _I, _P]),
    "threshold_ef": (_L, [_P, _P, _L, _F, _F, _F, _I, _P, _P, _I, _P]),
    "scatter_add": (_I, [_I, _P, _P, _P, _P, _I, _L, _P]),
    "topk_ef_many": (_I, [_L, _P, _P, _P, _P, _P, _F, _F, _I, _P, _P, _P, _P]),
    "bits_ef_many": (_I, [_L, _P, _P, _P, _P, _P, _P, _F, _F, _I, _I, _P, _P, _P, _P, _P]),
    "threshold_ef_many": (_I, [_L, _P, _P, _P, _P, _F, _F, _F, _I, _P, _P, _P, _P, _P]),
    "randomk_ef_many": (_I, [_L, _P, _P, _P, _P, _P, _P, _F, _F, _I, _P, _P, _P]),
    "randomk_ef_segments": (_I, [_P, _P, _L, _P, _P, _P, _P, _P, _P, _F, _F, _I, _P, _P, _P, _P, _I]),
    "scatter_add_segments": (_I, [_L, _I, _P, _P, _P, _P, _F, _P, _P]),
    "sparse_frames_mean": (_I, [_P, _I, _L, _P, _L, _L, _F, _L, _P, _P]),
    "sparse_variable_mean": (_I, [_P, _L, _P, _L, _I, _F, _L, _P]),
    "threshold_select_segments": (_I, [_P, _P, _L, _P, _L, _F, _F, _F, _I, _P, _P, _P, _P, _P, _I]),
    "threshold_write_segments": (_I, [_P, _P, _L, _P, _L, _P, _L, _L, _P]),
    "sparse_sum_mean": (_I, [_P, _P, _L, _F, _P, _L, _P]),
    "natural_compress_drawn": (None, [_P, _L, _U, _U, _P, _P]),
    "terngrad_compress_drawn": (None, [_P, _L, _U, _U, _P, _P]),
    "qsgd_compress_drawn": (_I, [_P, _L, _U, _U, _I, _L, _I, _P, _P]),
    "compress_many": (_I, [_I, _L, _P, _P, _P, _P, _P, _P, _I, _L, _I, _P]),
    "half_encode_many": (None, [_L, _P, _P, _F, _P]),
    "half_decode_many": (None, [_L, _P, _P, _F, _F, _P]),
    "divide_many": (None, [_L, _P, _P, _F, _P]),
    "flag_nonfinite_many": (None, [_L, _P, _P, _P]),
    "lowrank_project_many": (None, [_L, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "lowrank_back_many": (None, [_L, _P, _P, _P, _P, _P, _I, _P]),
    "lowrank_expand_many": (None, [_L, _P, _P, _P, _P, _P, _F, _P, _P, _P, _P]),
}

# CUDA (grace_cuda_*)
CUDA = {
    "abi": (_I, []),
    "device_count": (_I, []),
    "device_sync": (_I, []),
    "pack": (_I, [_P, _L, _I, _P, _P]),
    "unpack": (_I, [_P, _L, _I, _P, _P]),
    "sign_pack": (_I, [_P, _L, _I, _P, _P]),
    "efsign_compress": (_I, [_P, _L, _P, _P, _P]),
    "onebit_compress": (_I, [_P, _L, _P, _P, _P]),
    "maxabs": (_I, [_P, _L, _P, _P]),
    "terngrad_compress": (_I, [_P, _P, _L, _P, _P, _P]),
    "qsgd_norms": (_I, [_P, _L, _L, _P, _P]),
    "qsgd_compress": (_I, [_P, _P, _L, _I, _L, _I, _P, _I, _P, _P]),
    "natural_compress": (_I, [_P, _P, _L, _P, _P, _P]),
    "sign_decode": (_I, [_P, _L, _P, _P, _P]),
    "onebit_decode": (_I, [_P, _L, _P, _P, _P]),
    "bits_sum": (_I, [_P, _L, _L, _P, _I, _P, _P]),
    "terngrad_decode": (_I, [_P, _L, _P, _P, _P]),
    "qsgd_decode": (_I, [_P, _L, _I, _L, _I, _P, _P, _P]),
    "natural_decode": (_I, [_P, _P, _L, _P, _P]),
    "topk": (_L, [_P, _I, _L, _L, _I, _P, _I, _P, _P]),
    "topk_ef": (_L, [_P, _P, _L, _L, _F, _F, _I, _P, _P, _I, _P, _P]),
    "threshold": (_L, [_P, _I, _L, _D, _I, _P, _I, _P, _P]),
    "nonzero": (_L, [_P, _L, _P, _I, _P]),
    "threshold_ef": (_L, [_P, _P, _L, _F, _F, _F, _I, _P, _P, _I, _P, _P]),
    "uniform_segments": (_I, [_L, _P, _P, _P, _P, _P]),
    "hash_keys_segments": (_I, [_L, _P, _P, _P, _P, _P]),
    "terngrad_compress_segments": (_I, [_P, _L, _P, _P, _P, _P, _P, _P, _P]),
    "natural_compress_segments": (_I, [_P, _L, _P, _P, _P, _P, _P, _P, _P]),
    "qsgd_compress_segments": (_I, [_P, _L, _P, _P, _P, _P, _I, _L, _I, _P, _P, _P]),
    "efsign_compress_segments": (_I, [_P, _L, _P, _P, _P, _P, _P]),
    "onebit_compress_segments": (_I, [_P, _L, _P, _P, _P, _P, _P]),
    "efsign_ef_segments": (_I, [_P, _P, _L, _P, _P, _F, _F, _I, _P, _P, _P, _P, _I, _P]),
    "onebit_ef_segments": (_I, [_P, _P, _L, _P, _P, _F, _F, _I, _P, _P, _P, _P, _I, _P]),
    "topk_ef_segments": (_I, [_P, _P, _L, _P, _P, _P, _F, _F, _I, _P, _P, _P, _P, _I, _P, _P, _L, _L, _L, _P]),
    "randomk_ef_segments": (_I, [_P, _P, _L, _P, _P, _P, _P, _P, _P, _F, _F, _I, _P, _P, _P, _P, _I, _P]),
    "decode_segments": (_I, [_I, _L, _P, _P, _P, _I, _L, _I, _P, _P]),
    "mean_segments": (_I, [_I, _L, _P, _I, _P, _P, _I, _L, _I, _I, _P, _I, _P, _P, _P]),
    "scatter_add": (_I, [_I, _P, _P, _P, _P, _I, _L, _P, _P]),
    "sparse_frames_mean": (_I, [_P, _I, _L, _P, _L, _L, _F, _L, _P, _P, _P]),
    "sparse_variable_mean": (_I, [_P, _L, _P, _L, _I, _F, _L, _P, _P]),
    "threshold_select_segments": (_I, [_P, _P, _L, _P, _L, _F, _F, _F, _I, _P, _P, _P, _P, _P, _I, _P]),
    "threshold_write_segments": (_I, [_P, _P, _L, _P, _L, _P, _L, _L, _P, _P]),
    "dgc_compensate": (None, [_P, _P, _P, _L, _F, _P, _P, _P]),
    "dgc_select_segments": (_I, [_P, _P, _L, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _L, _L, _L, _P]),
    "dgc_cut_segments": (_I, [_P, _L, _L, _P, _P, _P, _P, _P, _P, _P, _P]),
    "sparse_sum_mean": (_I, [_P, _P, _L, _F, _P, _L, _P, _P]),
}

# the CUDA functions whose last argument is the caller's stream (void* stream)
CUDA_STREAM = frozenset({
    "pack", "unpack", "sign_pack", "efsign_compress", "onebit_compress", "maxabs", "terngrad_compress", "qsgd_norms",
    "qsgd_compress", "natural_compress", "sign_decode", "onebit_decode", "bits_sum", "terngrad_decode", "qsgd_decode",
    "natural_decode", "topk", "topk_ef", "threshold", "nonzero", "threshold_ef", "uniform_segments",
    "hash_keys_segments", "terngrad_compress_segments", "natural_compress_segments", "qsgd_compress_segments",
    "efsign_compress_segments", "onebit_compress_segments", "efsign_ef_segments", "onebit_ef_segments",
    "topk_ef_segments", "randomk_ef_segments", "decode_segments", "mean_segments", "scatter_add", "sparse_frames_mean",
    "sparse_variable_mean", "threshold_select_segments", "threshold_write_segments", "dgc_compensate",
    "dgc_select_segments", "dgc_cut_segments", "sparse_sum_mean",
})
