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
import threading
from pathlib import Path

import psutil
import pytest

from tests.conftest import TIMEOUT, VENV_BIN, worker_env

WORKERS = {"torch": Path(__file__).parent / "workers" / "torch_elastic.py",
           "tensorflow": Path(__file__).parent / "workers" / "tensorflow_elastic.py"}
BENCHMARK = Path(__file__).parent / "workers" / "tensorflow_elastic_benchmark.py"


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
                                        ("torch", "randomk"), ("tensorflow", "none"), ("tensorflow", "randomk"),
                                        ("tensorflow", "topk_alltoall")],
                ids=lambda p: "-".join(p))
def run(request, tmp_path_factory):
    framework, method = request.param
    out = tmp_path_factory.mktemp(f"elastic-{framework}-{method}")
    first, second, third = local_names()
    hosts, discover = discovered_hosts(out, [first, second])
    cmd = [*elastic_launch(discover), sys.executable, str(WORKERS[framework]), "--out", str(out), "--hosts", str(hosts),
           "--grow-host", third, "--method", method]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=worker_env(), cwd=out)
    result = out / f"{method}.json"
    if not result.exists():
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}, no result:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return method, json.loads(result.read_text())


def discovered_hosts(out: Path, names):
    """A hosts file listing ``names`` (a slot each) and a host-discovery script that prints it."""
    hosts = out / "hosts"
    hosts.write_text("".join(f"{name}:1\n" for name in names))
    discover = out / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    return hosts, discover


def elastic_launch(discover: Path):
    return [str(VENV_BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(discover), "--elastic-timeout", "60"]


def test_the_world_shrinks_and_grows_back(run):
    _, result = run
    sizes = [entry["size"] for entry in result["log"]]
    assert sizes[:4] == [2] * 4 and 1 in sizes and sizes[-1] == 2, sizes
    assert [entry["step"] for entry in result["log"]] == list(range(len(sizes)))


def test_a_traced_step_is_traced_again_for_each_new_world(run):
    """TensorFlow: one tf.function, never rebuilt by the worker; every step runs a trace made for
    the world it runs in (grace has it traced again after each elastic reset), and only then."""
    _, result = run
    if "traced_for" not in result["log"][0]:
        pytest.skip("the PyTorch worker traces nothing")
    assert [entry["traced_for"] for entry in result["log"]] == [entry["size"] for entry in result["log"]]
    worlds = 1 + sum(1 for a, b in zip(result["log"], result["log"][1:]) if a["size"] != b["size"])
    assert result["log"][-1]["traces"] <= worlds + 1, result["log"]  # (a reset may also retrace in the same world)


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
    """Each step's result and the memories after it hold what came in (the ranks' gradients, the
    memories before it), the two-phase owners' memory through every hand-over."""
    _, result = run
    assert max(entry["mass"] for entry in result["log"]) < 1e-5, result["log"]


def test_step_counters_follow_rank_0(run):
    method, result = run  # (none keeps no step counter)
    assert set(result["steps"].values()) == (set() if method == "none" else {len(result["log"])})


@pytest.fixture(scope="module", params=["grace.topk(0.01)", "grace.qsgd(64, communicator='alltoall')"])
def benchmark(request, tmp_path_factory):
    """The benchmark-shaped worker; after its third iteration the discovery script stops listing
    the second host, as an operator taking a machine away would."""
    out = tmp_path_factory.mktemp("elastic-benchmark")
    first, second, _ = local_names()
    hosts, discover = discovered_hosts(out, [first, second])
    cmd = [*elastic_launch(discover), sys.executable, str(BENCHMARK), "--compression", request.param, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(),
                            cwd=out)
    timer = threading.Timer(TIMEOUT, proc.kill)
    timer.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "iteration 2 on 2 ranks" in line:
            hosts.write_text(f"{first}:1\n")
    proc.wait()
    timer.cancel()
    result = out / "result.json"
    if proc.returncode != 0 or not result.exists():
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{''.join(lines)[-6000:]}")
    return json.loads(result.read_text())


def test_a_benchmark_written_as_horovods_survives_a_host_taken_away(benchmark):
    """Horovod's TF2 elastic benchmark's shape, with a grace method and nothing else changed: the
    run ends, the world went from 2 ranks to 1, and every iteration ran a trace of its own world."""
    assert benchmark["sizes"][:3] == [2, 2, 2] and benchmark["sizes"][-1] == 1, benchmark
    assert benchmark["traced_for"] == benchmark["sizes"], benchmark
    assert 0 < benchmark["loss"] < 100


def test_the_exchange_ran_every_step_through_the_shrink(benchmark):
    """grace's step counter counts every committed batch (and the first, outside the loop): the
    traced-again step kept the exchange's state, and an interrupted batch left no count."""
    assert benchmark["steps"] == [benchmark["batches"] + 1], benchmark
