"""The C ABI is written once, in csrc/include/grace_native.h: grace/native/_abi.py (the ctypes
types the loader binds) is generated from it by csrc/abi.py, and the kernel table names only
functions the header declares for the devices it lists."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import grace.native as gn
from grace.native import _abi, _loader

REPO = Path(__file__).resolve().parents[2]


def _abi_module():
    spec = importlib.util.spec_from_file_location("grace_csrc_abi", REPO / "csrc" / "abi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


abi = _abi_module()


@pytest.fixture(autouse=True)
def _needs_the_cpu_library():
    """(conftest's fixture of this name skips without libgrace_cpu: these read only the header)"""


def test_the_committed_bindings_are_generated_from_the_header_as_it_is():
    committed = (REPO / "grace" / "native" / "_abi.py").read_text()
    assert committed == abi.generate(), "grace/native/_abi.py is out of date: run python csrc/abi.py"
    assert abi.main(["--check"]) == 0


def test_every_kernel_names_functions_the_header_declares_for_each_of_its_devices():
    """A Kernel lists, per device, the C functions its wrapper calls there (a bucket's segments:
    the per-tensor function segment by segment on the CPU, one *_segments launch on CUDA): each
    is declared for that device, and a kernel's devices are those with functions."""
    _, tables = abi.parse(abi.HEADER.read_text())
    for name, kernel in gn.KERNELS.items():
        assert kernel.devices, f"KERNELS[{name!r}] names no C function"
        for device in ("cpu", "cuda"):
            missing = [s for s in kernel.symbols_on(device) if s not in tables[device]]
            assert not missing, f"KERNELS[{name!r}]: {missing} not declared as grace_{device}_* in the header"
            assert (device in kernel.devices) == bool(kernel.symbols_on(device)), name


def test_the_loader_binds_the_generated_types():
    assert _loader.ABI == _abi.ABI
    assert _loader.CPU_ONLY == set(_abi.CPU) - set(_abi.CUDA) and "dgc_step_many" in _loader.CPU_ONLY
    assert _loader.CUDA_ONLY == set(_abi.CUDA) - set(_abi.CPU) and "topk_ef_segments" in _loader.CUDA_ONLY
    assert _loader.SYMBOLS["topk"] == _abi.CPU["topk"] and _abi.CUDA["topk"][1] == [*_abi.CPU["topk"][1], _abi._P]
    res, args = _abi.CUDA["decode_segments"]
    assert _loader.SYMBOLS["decode_segments"] == (res, args[:-1])
    lib = _loader.library("cpu")
    if lib is not None:
        assert lib.pack.argtypes == _abi.CPU["pack"][1] and isinstance(lib.isa, str)


HEADER = """/* a header */
#define GRACE_NATIVE_ABI 7
int grace_cpu_abi(void);
const char* grace_cpu_isa(void); // a comment
void grace_cpu_f(const float* const* x, /* n */ int64_t n,
                 uint32_t s, double d);
int64_t grace_cuda_f(const float* const* x, int64_t n, uint32_t s, double d, void* stream);
"""


def test_the_generator_reads_prototypes_over_lines_and_comments():
    version, tables = abi.parse(HEADER)
    assert version == 7 and list(tables["cpu"]) == ["abi", "isa", "f"] and list(tables["cuda"]) == ["f"]
    assert tables["cpu"]["isa"] == ("_S", [])
    assert tables["cpu"]["f"] == ("None", [("_P", "x"), ("_L", "n"), ("_U", "s"), ("_D", "d")])
    namespace = {}
    exec(abi.render(version, tables), namespace)
    assert namespace["CUDA_STREAM"] == {"f"} and namespace["CUDA"]["f"][1][-1] is namespace["c_void_p"]


@pytest.mark.parametrize("bad, message", [
    ("size_t grace_cpu_g(void);", "size_t"),
    ("int grace_cpu_g(int);", "parameter"),
    ("int grace_cpu_g(int a) { return a; }", "not understood"),
    ("int grace_cpu_abi(void);", "twice"),
])
def test_the_generator_refuses_what_it_does_not_read(bad, message):
    with pytest.raises(abi.HeaderError, match=message):
        abi.parse(HEADER + bad)


def test_check_fails_on_a_stale_module(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "_abi.py"
    stale.write_text(abi.generate().replace("ABI = ", "ABI = 1"))
    monkeypatch.setattr(abi, "OUTPUT", stale)
    assert abi.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
