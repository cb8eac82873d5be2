"""grace: gradient compression for distributed deep learning on Horovod."""
from setuptools import find_packages, setup

setup(
    name="grace",
    version="0.1.0",
    description="Gradient compression (GRACE pipeline) for PyTorch and TensorFlow on stock Horovod",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["grace", "grace.*"]),
    install_requires=["numpy>=1.22"],
    # Horovod 0.28.1 is not listed: its sdist needs our build fixes (scripts/setup_env.sh).
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16", "tf-keras", "ml_dtypes"],
        "mpi": ["mpi4py>=3.1"],
        "test": ["pytest", "pytest-timeout", "scikit-learn", "mpi4py>=3.1"],
        "bench": ["scikit-learn", "tqdm", "PyYAML", "matplotlib"],
    },
)
