"""grace: gradient compression for distributed deep learning on Horovod.

The native kernels (csrc/) are plain shared libraries with a C ABI, built by csrc/build.py
during the build: libgrace_cpu.so always (a C++17 compiler with OpenMP), libgrace_cuda.so when
nvcc is found (a note otherwise). ``pip install -e .`` puts them in grace/native/_lib/ of the
source tree; ``python setup.py build_ext --inplace`` or ``python csrc/build.py`` rebuild them
there. A library that fails to build only warns: grace then runs its tensor-op code.
"""
import importlib.util
import os

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext as _build_ext
from setuptools.command.build_py import build_py as _build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))


def _native():
    """csrc/build.py, loaded by path (importing grace here would need its dependencies)."""
    spec = importlib.util.spec_from_file_location("grace_csrc_build", os.path.join(HERE, "csrc", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_native(target: str) -> None:
    cuda = "off" if os.environ.get("GRACE_NATIVE_BUILD_CUDA", "1") == "0" else "auto"
    _native().build_all(target, cuda=cuda, strict=os.environ.get("GRACE_NATIVE_STRICT") == "1")


def _in_tree() -> str:
    return os.path.join(HERE, "grace", "native", "_lib")


class build_py(_build_py):
    """Also builds the native libraries: into the source tree for editable installs, else
    next to the built package."""

    def run(self):
        super().run()
        editable = getattr(self, "editable_mode", False)
        _build_native(_in_tree() if editable else os.path.join(self.build_lib, "grace", "native", "_lib"))


class build_ext(_build_ext):
    """``python setup.py build_ext --inplace`` (or an editable install): the native libraries."""

    def run(self):
        inplace = self.inplace or getattr(self, "editable_mode", False)
        _build_native(_in_tree() if inplace else os.path.join(self.build_lib, "grace", "native", "_lib"))
        super().run()


class BinaryDistribution(Distribution):
    """The wheel holds compiled libraries: platform-specific."""

    def has_ext_modules(self):
        return True


setup(
    name="grace",
    version="0.1.0",
    description="Gradient compression (GRACE pipeline) for PyTorch and TensorFlow on stock Horovod",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["grace", "grace.*"]),
    # the emulated cluster's ssh stand-in (bin/ssh: a link to ns_rsh, for horovodrun), kept executable
    package_data={"grace.native": ["_lib/*.so"], "grace.bench.cluster": ["shims/ns_rsh", "shims/bin/ssh"]},
    cmdclass={"build_py": build_py, "build_ext": build_ext},
    distclass=BinaryDistribution,
    install_requires=["numpy>=1.22"],
    # Horovod 0.28.1 is not listed: its sdist needs our build fixes (scripts/setup_env.sh).
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16", "tf-keras", "ml_dtypes"],
        "mpi": ["mpi4py>=3.1"],
        "test": ["pytest", "pytest-timeout", "scikit-learn", "mpi4py>=3.1", "sphinx>=9.0", "myst-parser>=5.0"],
        "docs": ["sphinx>=9.0", "myst-parser>=5.0"],
        "bench": ["scikit-learn", "tqdm", "PyYAML", "matplotlib"],
    },
)
