"""The libraries are built and loaded; switching them off; threads, fork and DLPack."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import grace.native as gn
from grace.native._loader import LIB_DIR
from tests.native.conftest import BIG, draws, gradient, on, same_bytes, torch

REPO = Path(__file__).resolve().parents[2]


def _build_module():
    spec = importlib.util.spec_from_file_location("grace_csrc_build", REPO / "csrc" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(os.environ.get("GRACE_NATIVE", "1") == "0", reason="GRACE_NATIVE=0")
def test_cpu_library_is_built_and_loaded():
    if not (shutil.which("g++") or shutil.which("c++") or os.environ.get("CXX")):
        pytest.skip("no C++ compiler")
    assert gn.available("cpu"), gn.load_error("cpu")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="one CPU build off x86-64")
def test_the_best_cpu_build_for_this_cpu_is_loaded():
    """x86-64-v3 (AVX2) where the CPU runs it, from the current sources; x86-64-v2 otherwise or
    when GRACE_NATIVE_ISA says so."""
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    build = _build_module()
    portable = ctypes.CDLL(str(LIB_DIR / build.CPU_LIB))
    runs_v3 = bool(portable.grace_cpu_runs_x86_64_v3())
    wanted = os.environ.get("GRACE_NATIVE_ISA") or "x86-64-v3"
    assert gn.cpu_isa() == ("x86-64-v3" if runs_v3 and wanted == "x86-64-v3" else "x86-64-v2")
    for name, march in ((build.CPU_LIB, "x86-64-v2"), (build.CPU_AVX2_LIB, "x86-64-v3")):
        stamp = (LIB_DIR / f"{name}.stamp").read_text()
        assert stamp == build._stamp(build.cpu_command(LIB_DIR / name, march)[:-1]), f"{name} is older than csrc/"


def _suite_again(env: dict):
    """tests/native in a new process with ``env`` added to its environment, every test passing:
    the same oracle tests against another body of the kernels."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/native",
                          "-k", "not the_portable_build and not the_8_lane_loops"],
                         env={**os.environ, **env}, cwd=REPO, capture_output=True, text=True, timeout=900)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert out.returncode == 0 and " passed" in summary and "failed" not in summary, out.stdout[-4000:]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="one CPU build off x86-64")
@pytest.mark.skipif(bool(os.environ.get("GRACE_NATIVE_ISA")), reason="this is the run under GRACE_NATIVE_ISA")
def test_the_portable_build_passes_this_suite_too():
    """The x86-64-v2 library (older CPUs) against the oracle: tests/native again, in a process
    that loads it."""
    _suite_again({"GRACE_NATIVE_ISA": "x86-64-v2"})


def _switch_on(name: str, otherwise: bool) -> bool:
    """An environment switch as the library reads it: ``otherwise`` where unset, off where 0,
    false, no or off."""
    value = os.environ.get(name)
    return otherwise if value is None else value.strip().lower() not in ("0", "false", "no", "off")


def _cpu_has_avx512() -> bool:
    """AVX-512F and BW, which the 16-lane bodies use."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
        return " avx512f" in flags and " avx512bw" in flags
    except OSError:
        pytest.skip("no /proc/cpuinfo to ask")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="one CPU build off x86-64")
def test_avx512_bodies_follow_the_cpu_and_the_switch():
    lib = gn._loader.library("cpu")
    if lib is None or lib.isa != "x86-64-v3":
        pytest.skip("the AVX-512 bodies are in the x86-64-v3 build, not loaded here")
    assert lib.avx512 == (_switch_on("GRACE_NATIVE_AVX512", True) and _cpu_has_avx512())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64's switch")
def test_prefetching_follows_the_cpu_vendor_and_the_switch():
    """The passes prefetch ahead themselves except on an AMD CPU; GRACE_NATIVE_PREFETCH decides
    where set, in both builds, and the kernels give the same bytes either way."""
    try:
        amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo to ask")
    lib = gn._loader.library("cpu")
    if lib is None:
        pytest.skip("no CPU library built")
    assert lib.prefetch == _switch_on("GRACE_NATIVE_PREFETCH", not amd)
    probe = ("import sys, numpy as np, grace.native as gn, grace.native._loader as L\n"
             "rng = np.random.default_rng(3)\n"
             "gs = [rng.standard_normal(n).astype(np.float32) for n in (300000, 70000)]\n"
             "rs = [rng.standard_normal(g.size).astype(np.float32) * 0.1 for g in gs]\n"
             "values, idx, res = gn.topk_ef_step_many(gs, rs, [3000, 700])\n"
             "sys.stdout.write(repr((L.library('cpu').prefetch, [np.asarray(v).tobytes().hex()[:4000] for v in values],"
             " [np.asarray(r).sum(dtype=np.float64) for r in res])))\n")
    runs = {}
    for setting in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "GRACE_NATIVE_PREFETCH": setting})
        assert out.returncode == 0, out.stderr[-3000:]
        runs[setting] = out.stdout
    assert runs["0"].startswith("(False,") and runs["1"].startswith("(True,")
    assert runs["0"][len("(False,"):] == runs["1"][len("(True,"):]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="one CPU build off x86-64")
@pytest.mark.skipif(bool(os.environ.get("GRACE_NATIVE_ISA") or os.environ.get("GRACE_NATIVE_AVX512")),
                    reason="this is a run under another build")
def test_the_8_lane_loops_pass_this_suite_too():
    """Where kernels take their AVX-512 bodies, the 8-lane loops those replace (what a CPU
    without AVX-512 runs) against the oracle: tests/native again, GRACE_NATIVE_AVX512=0."""
    lib = gn._loader.library("cpu")
    if lib is None or not lib.avx512:
        pytest.skip("no AVX-512 bodies taken here: the suite ran the 8-lane loops already")
    _suite_again({"GRACE_NATIVE_AVX512": "0"})


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="one CPU build off x86-64")
def test_cpu_build_switches_the_kernels_in_this_process():
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    x, u = gradient(BIG, 2), draws(BIG)
    best = gn.cpu_isa()
    runs = {}
    for isa in ("x86-64-v2", best):
        with gn.cpu_build(isa):
            assert gn.cpu_isa() == isa
            called = []
            lib = gn.library("cpu")
            onebit = lib.onebit_compress
            lib.onebit_compress = lambda *a: called.append(isa) or onebit(*a)
            try:
                tx = torch.from_numpy(x)  # the cached kind of torch CPU tensors follows the switch too
                runs[isa] = (*gn.onebit_compress(tx), *gn.onebit_compress(x), *gn.efsignsgd_compress(x),
                             *gn.terngrad_compress(x, u), *gn.qsgd_compress(x, u, 7, 1000))
            finally:
                lib.onebit_compress = onebit
            assert called == [isa, isa]
        assert gn.cpu_isa() == best
    for a, b in zip(runs["x86-64-v2"], runs[best]):
        same_bytes(a, b)
    with pytest.raises(OSError, match="no CPU build for 'x86-64-v9'"):
        with gn.cpu_build("x86-64-v9"):
            pass


def test_an_unknown_isa_is_refused_by_name():
    code = "import grace.native as g; g.available('cpu')"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GRACE_NATIVE_ISA": "avx9"}, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "GRACE_NATIVE_ISA='avx9'" in out.stderr and "x86-64-v2" in out.stderr


def test_cuda_library_is_built_from_the_current_sources():
    """Where nvcc exists, setup.py built libgrace_cuda.so from these very sources (its stamp)."""
    build = _build_module()
    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the CUDA kernels are not built here")
    lib = LIB_DIR / build.CUDA_LIB
    assert lib.is_file(), "nvcc is there but libgrace_cuda.so was not built (python csrc/build.py --cuda on)"
    stamp = (LIB_DIR / f"{build.CUDA_LIB}.stamp").read_text()
    cmd = build.cuda_command(nvcc, lib)
    assert stamp == build._stamp(cmd[:-1]), "libgrace_cuda.so is older than csrc/: rebuild"


def test_grace_native_0_turns_it_off_and_the_fallback_runs():
    code = ("import numpy as np, torch, grace.native as g; from grace.core import bits; "
            "from grace.backends import get_backend; assert not g.available('cpu'); "
            "assert not g.supports(torch.zeros(3)); "
            "print(bits.pack(get_backend('torch'), torch.tensor([1, 0, 1], dtype=torch.uint8), 1).tolist())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GRACE_NATIVE": "0"}, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[5]"
    with gn.disabled():
        assert not gn.available("cpu")
        with pytest.raises(gn.NativeUnavailable):
            gn.signsgd_compress(np.zeros(3, np.float32))


def test_results_do_not_depend_on_the_number_of_threads():
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    x, u = gradient(BIG, 1), draws(BIG)
    runs = []
    for threads in (1, 2, 3, 0):
        gn.set_num_threads(threads)
        runs.append((*gn.onebit_compress(x), *gn.qsgd_compress(x, u, 127), *gn.topk_compress(x, 1000),
                     gn.scatter_add(np.arange(0, BIG, 3), x[::3].copy(), BIG)))
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            same_bytes(a, b)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_runs_the_kernels():
    """libgomp hangs in a forked child that enters a parallel region; the kernels then run on
    one thread (as torch's DataLoader workers do)."""
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    code = ("import os, numpy as np, grace.native as g\n"
            "x = np.random.default_rng(0).standard_normal(2**20).astype(np.float32)\n"
            "a = g.onebit_compress(x)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    b = g.onebit_compress(x)\n"
            "    os._exit(0 if a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes() else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "raise SystemExit(os.waitstatus_to_exitcode(status))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_dlpack_capsules_give_the_tensors_pointer(dev):
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torch.utils.dlpack import to_dlpack

    t = on(dev, gradient(1001))
    capsule = to_dlpack(t)
    ptr, n, dtype, dev_type, _ = gn.dlpack_info(capsule)
    assert (ptr, n, dtype, dev_type) == (t.data_ptr(), 1001, "float32", 1 if dev == "cpu" else 2)
    with pytest.raises(gn.NativeUnavailable):
        gn.dlpack_info(to_dlpack(on(dev, gradient(100)).reshape(10, 10).T))


def test_tensorflow_tensors_reach_the_same_kernels(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    if not gn.available("cpu"):
        pytest.skip("libgrace_cpu not built")
    x, u = gradient(1001, 3), draws(1001)
    for fn, args in ((gn.signsgd_compress, (x,)), (gn.onebit_compress, (x,)), (gn.qsgd_compress, (x, u, 15)),
                     (gn.natural_compress, (x, u)), (gn.topk_compress, (x, 10)), (gn.threshold_compress, (x, 1.0))):
        want = fn(*args)
        got = fn(*(tf.constant(a) if isinstance(a, np.ndarray) else a for a in args))
        for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            assert tf.is_tensor(b)
            same_bytes(a, b.numpy())
