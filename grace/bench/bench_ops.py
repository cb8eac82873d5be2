"""Native kernels (csrc/, grace.native) against the tensor-op fallback, per method and size.

    python scripts/bench_ops.py [--sizes 16 20 24] [--repeats 7] [--device cpu|cuda] [--json out.json]
                                [--only METHOD ...] [--builds x86-64-v3 x86-64-v2]

For each method and size (float32 elements, standard normal), compress + decompress:
  fallback   the method's compressor on the torch backend with native dispatch off (GRACE_NATIVE=0)
  ops        the same compressor with native dispatch on (TorchBackend/bits ops: packing,
             selection, scatter-add), i.e. what the compressors get today
  native     the fused kernels of grace.native (one pass per function)
  speedup    fallback / native
  GB/s       bytes the native functions must move (inputs read once, outputs written once; a
             gradient read twice where the method needs a whole-tensor scalar before its first
             code: TernGrad's max |x|, QSGD's norm with one bucket) / time
  of copy    that bandwidth as a fraction of a plain tensor copy of the n floats (read + write),
             measured in the same run
Random draws are made once beforehand and handed to both paths (the kernels take them as
input), so neither time includes the random number generator. Times are medians of
``--repeats`` runs (fewer if a fallback takes seconds); torch's default threads. The header
names the CPU kernels' build (x86-64-v3 where the CPU runs AVX2); ``--builds x86-64-v3
x86-64-v2`` times the native kernels of both builds in the same run, one row each.
'topk select' compares the native selection with torch.topk on the same |x| (k = 1%).
"""
from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path


import numpy as np
import torch

import grace
import grace.native as gn
from grace.backends import get_backend
from grace.bench.common import help_parser
from grace.core import bits
from grace.core.compressor import TensorInfo, index_dtype

TX = get_backend("torch")
INFO = TensorInfo("bench", 0, 1)


def keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS, so that every new output faults its pages in
    again (tens of microseconds per MiB on a VM, and noisy). Keep them in the heap instead, for
    both paths alike: steady state, as in a training loop."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: no mmap for blocks below 1 GiB
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB free at the heap top
    except OSError:
        pass


def timer(device: str, repeats: int, budget_s: float = 2.0):
    def measure(fn) -> float:
        t0 = time.perf_counter()
        fn()  # warm-up (a second one unless that took long)
        if time.perf_counter() - t0 < 0.2:
            fn()
        times = []
        start_all = time.perf_counter()
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            if len(times) >= 3 and time.perf_counter() - start_all > budget_s:
                break
        return statistics.median(times)

    return measure


def compressor_roundtrip(compressor, x, u=None):
    """compress + decompress with the torch backend; ``u``: the draws uniform() returns."""
    def run():
        if u is not None:
            TX.uniform = lambda n, seed, like=None: u[:n]
        try:
            payload, ctx = compressor.compress(TX, x, INFO)
            return compressor.decompress(TX, payload, ctx)
        finally:
            if u is not None:
                del TX.uniform
    return run


def fallback(fn):
    def run():
        with gn.disabled():
            return fn()
    return run


def _pack_cases(n: int, gen, device: str) -> dict:
    """Bit packing and unpacking of random codes, 1 to 4 bits wide."""
    out = {}
    for width in (1, 2, 3, 4):
        codes = torch.randint(0, 1 << width, (n,), generator=gen, dtype=torch.uint8).to(device)
        packed_bytes = math.ceil(n * width / 8)

        def pure(codes=codes, width=width):
            return bits.unpack(TX, bits.pack(TX, codes, width), width, n)

        def native(codes=codes, width=width):
            return gn.unpack(gn.pack(codes, width), width, n)

        out[f"pack {width}-bit"] = (fallback(pure), None, native, 2 * n + 2 * packed_bytes)
    return out


def _quantizer_cases(n: int, x, u, gen, device: str) -> dict:
    """The dense quantizers: fp16, the sign methods, TernGrad, QSGD and natural compression."""
    out = {}
    f4 = 4 * n
    c = grace.fp16().compressor
    out["fp16 (vs plain torch)"] = (lambda: (x / INFO.world_size).half().float() * INFO.world_size, None,
                                    compressor_roundtrip(c, x), f4 + 2 * n + 2 * n + f4)

    sign_bytes = f4 + n // 8 + n // 8 + f4

    c = grace.signsgd().compressor
    out["signsgd"] = (fallback(compressor_roundtrip(c, x)), compressor_roundtrip(c, x),
                      lambda: gn.signsgd_decompress(gn.signsgd_compress(x), n), sign_bytes)
    c = grace.efsignsgd(0.1).compressor
    out["efsignsgd"] = (fallback(compressor_roundtrip(c, x)), compressor_roundtrip(c, x),
                        lambda: gn.efsignsgd_decompress(*gn.efsignsgd_compress(x), n), sign_bytes)
    c = grace.onebit().compressor
    out["onebit"] = (fallback(compressor_roundtrip(c, x)), compressor_roundtrip(c, x),
                     lambda: gn.onebit_decompress(*gn.onebit_compress(x), n), sign_bytes)
    c = grace.terngrad().compressor
    out["terngrad"] = (fallback(compressor_roundtrip(c, x, u)), compressor_roundtrip(c, x, u),
                       lambda: gn.terngrad_decompress(*gn.terngrad_compress(x, u), n),
                       3 * f4 + 2 * math.ceil(n / 4) + f4)  # x twice: max |x|, then the codes
    for levels, bucket in ((127, 0), (7, 0), (127, 512), (15, 512)):
        c = grace.qsgd(levels, bucket_size=bucket).compressor
        w = bits.code_width(2 * (levels + 1))
        b = bucket or n
        uq = u if n % b == 0 else torch.rand(-(-n // b) * b, generator=gen).to(device)
        out[f"qsgd s={levels}" + (f" b={bucket}" if bucket else "")] = (
            fallback(compressor_roundtrip(c, x, uq)), compressor_roundtrip(c, x, uq),
            lambda levels=levels, bucket=bucket, uq=uq: gn.qsgd_decompress(
                *gn.qsgd_compress(x, uq, levels, bucket), n, levels, bucket),
            (2 if bucket else 3) * f4 + 2 * math.ceil(n * w / 8) + f4)  # one bucket: the norm first
    c = grace.natural().compressor
    out["natural"] = (fallback(compressor_roundtrip(c, x, u)), compressor_roundtrip(c, x, u),
                      lambda: gn.natural_decompress(*gn.natural_compress(x, u), n),
                      2 * f4 + 2 * (n // 8 + n) + f4)
    return out


def _sparse_cases(n: int, x, gen, device: str) -> dict:
    """Top-k and threshold sparsification (k = 1%), with and without residual, and sparse aggregation."""
    f4 = 4 * n
    k = max(1, math.ceil(0.01 * n))
    isz = np.dtype(index_dtype(n)).itemsize
    sparse_bytes = f4 + k * (4 + isz) + k * (4 + isz) + f4
    out = {}
    c = grace.topk(0.01).compressor
    out["topk 1%"] = (fallback(compressor_roundtrip(c, x)), compressor_roundtrip(c, x),
                      lambda: gn.scatter_add(*reversed(gn.topk_compress(x, k)), n), sparse_bytes)
    ax = x.abs()
    out["topk select (vs torch.topk)"] = (lambda: torch.topk(ax, k, sorted=False).indices, None,
                                          lambda: gn.topk_indices(ax, k), f4 + 8 * k)
    thr = 2.5758  # about 1% of a standard normal
    c = grace.threshold(thr).compressor
    out["threshold ~1%"] = (fallback(compressor_roundtrip(c, x)), compressor_roundtrip(c, x),
                            lambda: gn.scatter_add(*reversed(gn.threshold_compress(x, thr)), n), sparse_bytes)
    out.update(_residual_cases(n, x, gen, device, k, thr))
    out.update(_aggregate_case(n, gen, device, k))
    return out


def _residual_cases(n: int, x, gen, device: str, k: int, thr: float) -> dict:
    """Compensate, compress, decompress and memory update in one step, against the fused native step."""
    f4, isz = 4 * n, np.dtype(index_dtype(n)).itemsize
    out = {}
    e = 0.1 * torch.randn(n, generator=gen).to(device)
    for label, make, native_step in (
            ("topk 1% + residual", lambda: grace.topk(0.01), lambda: gn.topk_ef_step(x, e, k)),
            ("threshold + residual", lambda: grace.threshold(thr), lambda: gn.threshold_ef_step(x, e, thr))):
        compression = make()

        def pipeline(compression=compression):
            memory, comp = compression.memory, compression.compressor
            p = memory.compensate(TX, x, e)
            payload, ctx = comp.compress(TX, p, INFO)
            y = comp.decompress(TX, payload, ctx)
            return y, memory.update(TX, p, y, e)

        def native(native_step=native_step):
            values, idx, new_e = native_step()
            return gn.scatter_add(idx, values, n), new_e

        out[label] = (fallback(pipeline), pipeline, native, 2 * f4 + f4 + 2 * k * (4 + isz) + f4)
    return out


def _aggregate_case(n: int, gen, device: str, k: int) -> dict:
    """Summing 8 ranks' top-k payloads."""
    f4, isz = 4 * n, np.dtype(index_dtype(n)).itemsize
    ranks = 8
    payloads = []
    for r in range(ranks):
        xr = torch.randn(n, generator=gen).to(device)
        payloads.append(gn.topk_compress(xr, k))
    c = grace.topk(0.01).compressor

    def aggregate():
        return c.aggregate(TX, payloads, grace.core.compressor.Shape((n,), "float32"))

    return {"aggregate 8 ranks topk": (fallback(aggregate), aggregate, lambda: gn.scatter_add_many(payloads, n),
                                       ranks * k * (4 + isz) + f4)}


def cases(n: int, device: str):
    """name -> (fallback fn, ops fn or None, native fn, bytes the native fn moves)."""
    gen = torch.Generator().manual_seed(n)  # one generator, drawn from in a fixed order
    x = torch.randn(n, generator=gen).to(device)
    u = torch.rand(n, generator=gen).to(device)
    out = _pack_cases(n, gen, device)
    out.update(_quantizer_cases(n, x, u, gen, device))
    out.update(_sparse_cases(n, x, gen, device))
    return x, out


def _parse_args(argv):
    parser = help_parser(__doc__)
    parser.add_argument("--sizes", nargs="+", default=["16", "20", "24"],
                        help="element counts, or powers of two as exponents (<= 40)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each op")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ops run")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--only", nargs="*", help="methods whose name starts with one of these")
    parser.add_argument("--builds", nargs="+", metavar="ISA",
                        help="CPU: time the native kernels of each of these builds in this run, "
                             "interleaved (e.g. x86-64-v3 x86-64-v2)")
    parser.add_argument("--malloc-default", action="store_true",
                        help="leave glibc's malloc as it is (every large output faults its pages in)")
    return parser.parse_args(argv)


def _device_name(device: str) -> str:
    """The GPU's name, or the CPU with its thread counts and kernel build, for the header."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform
    lib = gn._loader.library("cpu")
    return f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, " \
           f"native threads {lib.get_num_threads()}, kernels {gn.cpu_isa()}{' + AVX-512' if lib.avx512 else ''}"


def _native_builds(args) -> list:
    """The CPU builds to time (--builds, those that load); [None]: the one loaded."""
    if not (args.builds and args.device == "cpu"):
        return [None]
    builds = []
    for isa in args.builds:
        try:
            with gn.cpu_build(isa):
                builds.append(isa)
        except OSError as exc:
            print(f"# build {isa} left out: {exc}")
    return builds or [None]


def _time_size(n: int, args, measure, builds: list, rows: list) -> None:
    """One size: a plain copy for reference, then every case (one row per build); rows printed and appended."""
    x, table = cases(n, args.device)
    y = torch.empty_like(x)
    t_copy = measure(lambda: y.copy_(x))
    copy_bw = 8 * n / t_copy
    print(f"{'(copy of n floats)':<28} {'2^%d' % round(math.log2(n)) if n & (n - 1) == 0 else n:>9} "
          f"{'':>12} {'':>10} {t_copy * 1e3:>10.3f} {'':>8} {copy_bw / 1e9:>7.1f} {1.0:>8.2f}")
    rows.append({"method": "copy", "n": n, "native_s": t_copy, "gbps": copy_bw / 1e9, "of_copy": 1.0})
    for name, (fb, ops, nat, nbytes) in table.items():
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        t_fb = measure(fb)
        t_ops = measure(ops) if ops is not None else None
        size = "2^%d" % round(math.log2(n)) if n & (n - 1) == 0 else str(n)
        ops_s = f"{t_ops * 1e3:>10.3f}" if t_ops is not None else f"{'-':>10}"
        for isa in builds:
            with gn.cpu_build(isa) if isa else contextlib.nullcontext():
                t_nat = measure(nat)
            bw = nbytes / t_nat
            label = f"{name} [{isa}]" if isa else name
            rows.append({"method": name, "n": n, "fallback_s": t_fb, "ops_s": t_ops, "native_s": t_nat,
                         "speedup": t_fb / t_nat, "gbps": bw / 1e9, "of_copy": bw / copy_bw,
                         "device": args.device, "build": isa or gn.cpu_isa()})
            print(f"{label:<28} {size:>9} {t_fb * 1e3:>12.3f} {ops_s} {t_nat * 1e3:>10.3f} "
                  f"{t_fb / t_nat:>7.1f}x {bw / 1e9:>7.1f} {bw / copy_bw:>8.2f}", flush=True)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if not args.malloc_default:
        keep_freed_memory()
    sizes = [2 ** int(s) if int(s) <= 40 else int(s) for s in args.sizes]
    if not gn.available(args.device):
        print(f"native library for {args.device} not available: {gn.load_error(args.device)}", file=sys.stderr)
        return 1
    name = _device_name(args.device)
    print(f"# device: {args.device} ({name}); torch {torch.__version__}; repeats {args.repeats} (median)")
    measure = timer(args.device, args.repeats)
    builds = _native_builds(args)
    rows = []
    header = f"{'method':<28} {'n':>9} {'fallback ms':>12} {'ops ms':>10} {'native ms':>10} {'speedup':>8} " \
             f"{'GB/s':>7} {'of copy':>8}"
    print(header)
    print("-" * len(header))
    for n in sizes:
        _time_size(n, args, measure, builds, rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
