"""Horovod elastic training with grace (real processes, PyTorch and TensorFlow): the world
shrinks from 2 ranks to 1 when a process dies, and grows back to 2 when a host is added. grace
reads rank and size where they change, compares configurations again in each new world (the
joining rank has taken rank 0's step counters through Horovod's state sync), and every step's
averaged gradient is the mean of the current ranks' gradients."""
from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import TIMEOUT, VENV_BIN, worker_env

WORKERS = {"torch": Path(__file__).parent / "workers" / "torch_elastic.py",
           "tensorflow": Path(__file__).parent / "workers" / "tensorflow_elastic.py"}


def local_names():
    """Three names of this machine that Horovod starts processes on without ssh (it compares
    their address with the local interfaces'): a host each, as far as elastic Horovod knows."""
    addresses = {a.address for nic in psutil.net_if_addrs().values() for a in nic if a.family == socket.AF_INET}
    names = ["localhost", "127.0.0.1", socket.gethostname(), *sorted(addresses)]
    usable = []
    for name in names:
        try:
            if socket.gethostbyname(name) in addresses and name not in usable:
                usable.append(name)
        except OSError:
            continue
    if len(usable) < 3:
        pytest.fail(f"this machine has fewer than three local host names: {usable}")
    return usable[:3]


@pytest.fixture(scope="module", params=[("torch", "none"), ("torch", "topk"), ("torch", "topk_alltoall"),
                                        ("torch", "randomk"), ("tensorflow", "none"), ("tensorflow", "randomk")],
                ids=lambda p: "-".join(p))
def run(request, tmp_path_factory):
    framework, method = request.param
    out = tmp_path_factory.mktemp(f"elastic-{framework}-{method}")
    first, second, third = local_names()
    hosts = out / "hosts"
    hosts.write_text(f"{first}:1\n{second}:1\n")
    discover = out / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    cmd = [str(VENV_BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(discover), "--elastic-timeout", "60",
           sys.executable, str(WORKERS[framework]), "--out", str(out), "--hosts", str(hosts), "--grow-host", third,
           "--method", method]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=worker_env(), cwd=out)
    result = out / f"{method}.json"
    if not result.exists():
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}, no result:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return method, json.loads(result.read_text())


def test_the_world_shrinks_and_grows_back(run):
    _, result = run
    sizes = [entry["size"] for entry in result["log"]]
    assert sizes[:4] == [2] * 4 and 1 in sizes and sizes[-1] == 2, sizes
    assert [entry["step"] for entry in result["log"]] == list(range(len(sizes)))


def test_every_rank_holds_the_same_model_at_every_size(run):
    _, result = run
    assert max(entry["spread"] for entry in result["log"]) == 0.0


def test_the_averaged_gradient_is_the_mean_of_the_current_ranks(run):
    method, result = run
    errors = [entry["error"] for entry in result["log"]]
    if method == "none":  # exact; with one rank left, its own gradient (not half of it)
        assert max(errors) < 1e-6, result["log"]
    else:  # compressed: never far off, and not silently uncompressed
        assert 0 < max(errors) < 10, result["log"]


def test_no_gradient_mass_is_lost_at_any_size(run):
    """PyTorch: each step's result and the memories after it hold what came in (the ranks'
    gradients, the memories before it), the two-phase owners' memory through every hand-over."""
    method, result = run
    masses = [entry["mass"] for entry in result["log"] if "mass" in entry]
    if "mass" in result["log"][0]:
        assert max(masses) < 1e-5, result["log"]
    else:
        pytest.skip("the TensorFlow worker does not read its memories back")


def test_step_counters_follow_rank_0(run):
    method, result = run  # (none keeps no step counter)
    assert set(result["steps"].values()) == (set() if method == "none" else {len(result["log"])})
