"""The native kernel table and the fallback rule: a backend falls back to its tensor-op code
only where no kernel serves the inputs (NativeUnavailable), never on a real error."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import grace.native as gn
from grace.native import _loader


def test_every_fused_kernel_names_c_functions_the_libraries_export():
    for name, kernel in gn.KERNELS.items():
        assert kernel.symbols and set(kernel.symbols) <= set(_loader.SYMBOLS), name
        assert set(kernel.devices) <= {"cpu", "cuda"} and kernel.outputs, name
        assert all(0 <= i < len(kernel.outputs) for i in kernel.variable), name


def test_an_unknown_fused_kernel_is_a_bug_not_a_fallback():
    with pytest.raises(KeyError):
        gn.kernel("zipk_compress", np.zeros(4, np.float32))


def test_real_errors_propagate_through_the_fallback_helpers():
    with pytest.raises(IndexError, match="out of range"):
        gn.run("scatter_add", np.zeros(1, np.float32), np.array([7]), np.array([1.0], np.float32), 3)
    with pytest.raises(TypeError, match="uint8"):
        gn.run("unpack", np.zeros(2, np.uint8), np.zeros(2, np.float32), 1, 8)


def test_unavailable_kernels_fall_back():
    with gn.disabled():
        assert gn.run("scatter_add", np.zeros(1, np.float32), np.array([1]), np.array([1.0], np.float32), 3) is None
        assert gn.kernel("qsgd_compress", np.zeros(4, np.float32)) is None


def test_on_the_cpu_a_kernel_calls_only_the_c_functions_its_table_entry_lists(monkeypatch):
    """Every catalogue method's exchange on the CPU (per tensor and bucketed, torch tensors): every
    C function is reached through the kernel table, and is one its entry names for the CPU."""
    import sys

    import grace
    from grace.core.communicator import ReplicaCommunicator
    from grace.core.exchange import Exchange
    from tests.native.conftest import gradient, torch
    from tests.unit.conftest import METHODS

    active, seen, strays = [], {}, []

    def entered(name, function):
        def run(*args, **kwargs):
            active.append(name)
            try:
                return function(*args, **kwargs)
            finally:
                active.pop()
        return run

    for name, entry in list(gn.KERNELS.items()):
        monkeypatch.setitem(gn.KERNELS, name, dataclasses.replace(entry, function=entered(name, entry.function)))
    for module in [m for n, m in sys.modules.items() if n.startswith("grace.native.") and hasattr(m, "call")]:
        real = module.call

        def spy(kind, symbol, *args, _real=real):
            if active:
                seen.setdefault(active[0], set()).add(symbol)
            else:
                strays.append(symbol)
            return _real(kind, symbol, *args)
        monkeypatch.setattr(module, "call", spy)
    grads = {"w": torch.from_numpy(gradient(64 * 33, seed=1).reshape(64, 33)), "b": torch.from_numpy(gradient(77, 2))}
    for method in METHODS:
        for bucket_mb in (0, 25):
            compression = METHODS[method]()
            compression.bucket_mb = float(bucket_mb or compression.bucket_mb * (compression.scope == "bucket"))
            exchange = Exchange(compression, ReplicaCommunicator(3))
            for _ in range(2):
                exchange.exchange({k: v.clone() for k, v in grads.items()})
    assert grace  # (imported for the methods' registration)
    for name, symbols in seen.items():
        assert symbols <= set(gn.KERNELS[name].cpu), f"{name} called {symbols - set(gn.KERNELS[name].cpu)} on the CPU"
    assert len(seen) >= 30, sorted(seen)
    assert not strays, f"C functions called outside the kernel table: {sorted(set(strays))}"


def test_a_segment_kernels_cuda_launches_grow_by_batches_of_segments():
    """What bench_step's accelerator path counts for a native call: its CUDA launches, per batch
    of SEGMENT_BATCH segments for the segment kernels, per call for the others."""
    x = np.zeros(130, np.float32)
    topk = gn.KERNELS["topk_ef_step_segments"]
    for segments, batches in ((1, 1), (64, 1), (65, 2), (130, 3)):
        numels = [130 // segments] * segments
        starts = list(range(0, 130 // segments * segments, 130 // segments))
        assert topk.cuda_cost(x, x, starts, numels, [1] * segments) == (6 * batches, 0)
        assert gn.KERNELS["topk_compress_segments"].cuda_cost(x, starts, numels, [1] * segments) == (6 * batches, 0)
        assert gn.KERNELS["randomk_ef_step_segments"].cuda_cost(x, x, starts, numels, [1] * segments,
                                                                 [(1, 2)] * segments) == (6 * batches, 0)
    assert gn.KERNELS["uniform_segments"].cuda_cost([5] * 65, [(1, 2)] * 65, x) == (2, 0)
    assert gn.KERNELS["terngrad_compress_segments"].cuda_cost(x, [0], [130], [(1, 2)]) == (1 + 2, 0)
    assert gn.KERNELS["terngrad_mean_segments"].cuda_cost(x, x, [5] * 65, 4, (False, (4,)), None) == (2, 0)
    assert gn.KERNELS["nonzero"].cuda_cost(x) == (3, 1)  # its count read back
    assert gn.KERNELS["scatter_add_many"].cuda_cost([(x, x)] * 3, 130) == (1 + 3, 0)
    assert gn.KERNELS["signsgd_decompress"].cuda_cost(x, 130) == (1, 0)


CUDA_CALLS = {  # a call of each kernel the segmented plans make on a GPU: (name, arguments of a 1-d n, u, c)
    "topk_ef_step_segments": lambda n, u, c: (n, u, [0, 1000], [1000, 2000], [10, 20]),
    "topk_compress_segments": lambda n, u, c: (n, [0, 1000], [1000, 2000], [10, 20]),
    "randomk_ef_step_segments": lambda n, u, c: (n, u, [0, 1000], [1000, 2000], [10, 20], [(1, 2), (3, 4)],
                                                 [100.0, 100.0]),
    "efsignsgd_compress_segments": lambda n, u, c: (n, [0, 1000], [1000, 2000]),
    "onebit_compress_segments": lambda n, u, c: (n, [0, 1000], [1000, 2000]),
    "efsignsgd_ef_step_segments": lambda n, u, c: (n, u, [0, 1000], [1000, 2000], 1.0, 0.1),
    "onebit_ef_step_segments": lambda n, u, c: (n, u, [0, 1000], [1000, 2000], 0.9, 1.0),
    "terngrad_compress_segments": lambda n, u, c: (n, [0, 1000], [1000, 2000], [(1, 2), (3, 4)]),
    "qsgd_compress_segments": lambda n, u, c: (n, [0, 1000], [1000, 2000], [(1, 2), (3, 4)], 127, 8192),
    "natural_compress_segments": lambda n, u, c: (n, [0, 1000], [1000, 2000], [(1, 2), (3, 4)]),
    # every rank's fields (3 ranks) of two segments of 1000 and 2000 elements: 2-bit codes and a scale each
    "terngrad_mean_segments": lambda n, u, c: ((c[:3 * 750] % 256).byte(), u[:6], [1000, 2000], 3, (False, (3,)),
                                               c[:1] - 1),
    "signsgd_mean_segments": lambda n, u, c: ((c[:3 * 375] % 256).byte(), [1000, 2000], 3, (True, ()), None),
    "uniform_segments": lambda n, u, c: ([1000, 2000], [(1, 2), (3, 4)], u),
    "hash_keys_segments": lambda n, u, c: ([1000, 2000], [(1, 2), (3, 4)], c),
    "dgc_compensate_into": lambda n, u, c: (u, n, n, 0.9, u.clone(), n.clone()),
    "dgc_cut_segments": lambda n, u, c: (n, [0, 1000], [1000, 2000], [10, 2000], [1, 20], [(1, 2), (3, 4)]),
    "dgc_select_segments": lambda n, u, c: (n.clone(), u.clone(), [0, 1000], [1000, 2000], [10, 20],
                                            u[:2].contiguous()),
    "threshold_select_segments": lambda n, u, c: (n, u, c.new_tensor([0, 1000]), 1.0, 1.0, 1.0, None, u[:1] * 0),
    # the selection of two segments of 1000 and 2000 elements, 3 elements each taken: a frame of 64 bytes
    "threshold_write_segments": lambda n, u, c: (u.clone(), ((c % 1000 < 3) & (c < 2000)).byte(), c.new_tensor(
        [0, 24, 0, 3, 0, 2, 12, 30, 3, 3, 1000, 2]), 64, 36, (c[:1] * 0).byte()),
    "signsgd_compress": lambda n, u, c: (n,),
    "topk_indices": lambda n, u, c: (n, 30),
    "nonzero": lambda n, u, c: (n > 0,),
    "scatter_add_many": lambda n, u, c: ([(n[:10], c[:10]), (n[10:20], c[10:20])], 3000),
    # random-k's summed values of 100 distinct indices, a summed flag of 0
    "sparse_sum_mean": lambda n, u, c: (n[:100], c[:100] * 7, 3.0, u[:1] * 0, 3000),
    # 3 ranks' variable-length frames of 100 bytes (zeros): two segments of 1000 and 2000 elements,
    # sending 2 and 1 pairs (int16 indices); one cooperative launch
    "sparse_variable_mean": lambda n, u, c: ((c[:300] * 0).byte(), c.new_tensor(
        [[100 * r, 100 * r + 12, 0, 2, 0, 2, 100 * r + 8, 100 * r + 16, 2, 1, 1000, 2] for r in range(3)]).reshape(-1),
        3, 3.0, 3000),
    # 3 ranks' frames of 64 bytes (zeros: values 0.0 at index 0), two pairs each: one cooperative launch
    "sparse_frames_mean": lambda n, u, c: ((c[:192] * 0).byte(), 3, 64,
                                           c.new_tensor([[0, 4], [8, 12], [4, 4], [0, 100]]), 60, 3.0, 3000),
}


def _cuda_call_arguments(name: str, device: str):
    from tests.native.conftest import torch

    n = torch.randn(3000, device=device)
    u = torch.rand(3000, device=device)
    c = torch.arange(3000, device=device, dtype=torch.int64)
    return CUDA_CALLS[name](n, u, c)


@pytest.mark.parametrize("name", sorted(set(CUDA_CALLS) - {"hash_keys_segments"}))
def test_the_cuda_launch_checks_call_their_kernels_rightly(name):
    """The calls below, made here on the CPU library (which takes the same arguments): they run."""
    assert gn.KERNELS[name].function(*_cuda_call_arguments(name, "cpu")) is not None


@pytest.mark.parametrize("name", sorted(CUDA_CALLS))
def test_a_cuda_calls_launches_are_its_table_entrys(name):
    """On a GPU: the kernels and memsets a native call launches, from torch's profiler (copies
    back to the host left out: those are its waits), are what its table entry says (what
    bench_step's accelerator path counts)."""
    from tests.native.conftest import _cuda_ok, torch

    if not _cuda_ok():
        pytest.skip("no CUDA device or libgrace_cuda not built")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    args = _cuda_call_arguments(name, "cuda")
    entry = gn.KERNELS[name]
    entry.function(*args)  # (warm: the memory pool)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        entry.function(*args)
        torch.cuda.synchronize()
    launched = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith("Memcpy"))
    assert launched == entry.cuda_cost(*args)[0], name
