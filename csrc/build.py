"""Build grace's native kernels as plain shared libraries with a C ABI (no toolkit needed).

    libgrace_cpu.so       csrc/cpu/*.cpp   C++17, -O3, portable -march (x86-64-v2), OpenMP
    libgrace_cpu_avx2.so  the same for x86-64-v3 (AVX2; x86-64 only), loaded where the CPU runs it
    libgrace_cuda.so      csrc/cuda/*.cu   nvcc, sm_80 + sm_90 + compute_90 PTX; only when nvcc is found

Each folder holds a source file per kernel family and the internal headers they share (csrc/cpu/*.h,
csrc/cuda/*.cuh; common.h and common.cuh describe them). The CUDA files are compiled without
relocatable device code: device functions several files use are defined in those headers.

setup.py calls ``build_all`` from its build_py / build_ext steps (``pip install -e .`` puts the
libraries in grace/native/_lib/ of the source tree). It is also a script:

    python csrc/build.py [--out DIR] [--cuda auto|on|off] [--force] [--check-cuda]

``--cuda on`` fails when nvcc is missing or the CUDA sources do not compile; ``auto`` (the
default) prints a note and goes on without the CUDA library; ``--check-cuda`` only compiles the
CUDA sources (CI machines with nvcc but no GPU). A library is rebuilt only when its sources,
flags or compiler changed (a stamp file next to it). Environment: CXX, NVCC or CUDA_HOME,
GRACE_CUDA_ARCHS (e.g. "80;90"), GRACE_NATIVE_BUILD_CUDA=0 (as --cuda off).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent
DEFAULT_OUT = CSRC.parent / "grace" / "native" / "_lib"
CPU_LIB = "libgrace_cpu.so"
CPU_AVX2_LIB = "libgrace_cpu_avx2.so"
CUDA_LIB = "libgrace_cuda.so"


def _log(msg: str) -> None:
    print(f"[grace native] {msg}", file=sys.stderr, flush=True)


def cpu_command(out: Path, march: str = "x86-64-v2") -> list:
    """The compile command; ``march`` applies on x86-64 (x86-64-v2: SSE4.2, any x86 server of
    the last decade; x86-64-v3: AVX2)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"
    flags = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fvisibility=hidden",
             # every float operation rounds as in the NumPy reference: no contraction to FMA,
             # no fast-math; errno-free sqrt/floor only
             "-ffp-contract=off", "-fno-math-errno", "-Wall",
             # one program across the family files: their shared kernels inline as in one file,
             # and only the grace_cpu_* API is exported
             "-flto=auto"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags += [f"-march={march}", "-mtune=generic"]
    sources = sorted(str(p) for p in (CSRC / "cpu").glob("*.cpp"))
    return [cxx, *flags, f"-I{CSRC / 'include'}", *sources, "-o", str(out)]


def find_nvcc():
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc:
        return nvcc
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def cuda_archs() -> list:
    archs = [a.strip() for a in os.environ.get("GRACE_CUDA_ARCHS", "80;90").replace(",", ";").split(";") if a.strip()]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return flags + [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]  # PTX for newer GPUs


def cuda_command(nvcc: str, out: Path) -> list:
    flags = ["-O3", "-std=c++17", "-shared", "-Xcompiler=-fPIC,-fvisibility=hidden", "--threads=0",
             "-fmad=false",  # as -ffp-contract=off on the host: codes must not depend on FMA
             "-cudart=static", "-lineinfo"]
    sources = sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))
    return [nvcc, *flags, *cuda_archs(), f"-I{CSRC / 'include'}", *sources, "-o", str(out)]


def _stamp(cmd: list) -> str:
    """Hash of the command (flags, compiler) and of the sources it compiles and includes."""
    h = hashlib.sha256(" ".join(cmd).encode())
    dirs = {CSRC / "include"} | {Path(a).parent for a in cmd if a.endswith((".cpp", ".cu"))}
    for folder in sorted(dirs):
        for path in sorted(folder.glob("*")):
            if path.suffix in (".cpp", ".cu", ".h", ".cuh", ".hpp"):
                h.update(path.name.encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _compile(name: str, cmd: list, out_dir: Path, force: bool) -> Path:
    """Run ``cmd`` (whose last argument is the output) into out_dir/name; atomic replace."""
    target = out_dir / name
    stamp_file = out_dir / f"{name}.stamp"
    stamp = _stamp(cmd[:-1])
    if not force and target.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
    os.close(fd)
    cmd = [*cmd[:-1], tmp]
    _log(f"building {name}: {' '.join(cmd)}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {name} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # a process that has the old library loaded keeps it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stamp_file.write_text(stamp)
    return target


def build_cpu(out_dir: Path = DEFAULT_OUT, force: bool = False) -> Path:
    """libgrace_cpu.so and, on x86-64, libgrace_cpu_avx2.so (a failure of the latter only
    warns: the portable library runs everywhere)."""
    out_dir = Path(out_dir)
    target = _compile(CPU_LIB, cpu_command(out_dir / CPU_LIB), out_dir, force)
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            _compile(CPU_AVX2_LIB, cpu_command(out_dir / CPU_AVX2_LIB, "x86-64-v3"), out_dir, force)
        except RuntimeError as exc:
            _log(f"warning: {exc}\n[grace native] continuing with the x86-64-v2 library only")
    return target


def build_cuda(out_dir: Path = DEFAULT_OUT, force: bool = False, mode: str = "auto"):
    """libgrace_cuda.so, or None when nvcc is missing (mode 'auto') or mode is 'off'."""
    if mode == "off" or (mode == "auto" and os.environ.get("GRACE_NATIVE_BUILD_CUDA", "1") == "0"):
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        if mode == "on":
            raise RuntimeError("nvcc not found (PATH, NVCC, CUDA_HOME): cannot build libgrace_cuda.so")
        _log("note: nvcc not found; the CUDA kernels are not built (CPU kernels and the "
             "tensor-op fallback still work)")
        return None
    try:
        return _compile(CUDA_LIB, cuda_command(nvcc, out_dir / CUDA_LIB), Path(out_dir), force)
    except RuntimeError as exc:
        if mode == "on":
            raise
        _log(f"warning: {exc}\n[grace native] continuing without libgrace_cuda.so")
        return None


def build_all(out_dir=DEFAULT_OUT, force: bool = False, cuda: str = "auto", strict: bool = False) -> dict:
    """Both libraries into ``out_dir``. A failed CPU build raises when ``strict``, else warns
    (grace then runs on its tensor-op fallback)."""
    out_dir = Path(out_dir)
    built = {}
    try:
        built["cpu"] = build_cpu(out_dir, force)
    except (RuntimeError, OSError) as exc:
        if strict:
            raise
        _log(f"warning: {exc}\n[grace native] continuing without libgrace_cpu.so")
    built["cuda"] = build_cuda(out_dir, force, cuda)
    return built


def check_cuda_compiles() -> None:
    """Compile the CUDA sources to a throw-away library (raises if they do not compile)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    with tempfile.TemporaryDirectory() as tmp:
        _compile(CUDA_LIB, cuda_command(nvcc, Path(tmp) / CUDA_LIB), Path(tmp), True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: grace/native/_lib)")
    parser.add_argument("--cuda", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--check-cuda", action="store_true", help="only check that the CUDA sources compile")
    args = parser.parse_args(argv)
    try:
        if args.check_cuda:
            check_cuda_compiles()
            _log("CUDA sources compile")
            return 0
        built = build_all(args.out, args.force, args.cuda, strict=True)
    except RuntimeError as exc:
        print(f"[grace native] ERROR: {exc}", file=sys.stderr)
        return 1
    for kind, path in built.items():
        _log(f"{kind}: {path if path else 'not built'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
