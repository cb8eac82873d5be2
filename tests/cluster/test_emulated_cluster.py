"""The emulated cluster (grace.bench.cluster, and its command line scripts/cluster/emulated_cluster.py):
namespaces, shaped links, launching.

Everything except the privilege check needs root and `ip netns`; without them these tests are
skipped (with the reason), which is not a pass. About 1.5 minutes on a 2-core machine.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import grace.bench.cluster as ec
from grace.bench.cluster import shaping, system

REPO = Path(__file__).resolve().parents[2]

SCRIPT = REPO / "scripts" / "cluster" / "emulated_cluster.py"
WORKERS = Path(__file__).parent / "workers"
PY = sys.executable


def _unavailable() -> str | None:
    try:
        ec.check_privileges()
    except ec.PrivilegeError as exc:
        return str(exc).splitlines()[0] + " " + " ".join(str(exc).splitlines()[1:])
    return None


REASON = _unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")


def _env() -> dict:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def _root_snapshot() -> dict:
    """The root namespace's network state and our files: must be the same before and after."""
    def out(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True).stdout
    # link lines carry counters-free state only (-o -br: name, state, address)
    return {"links": out("ip", "-br", "link"), "addrs": out("ip", "-o", "addr"),
            "routes": out("ip", "route", "show", "table", "all"), "qdiscs": out("tc", "qdisc", "show"),
            "etc_hosts": Path("/etc/hosts").read_text()}


def _mine(prefix: str) -> list[str]:
    return ec.leftovers().get(prefix, [])


def _result(output: str) -> dict:
    lines = [line for line in output.splitlines() if "RESULT " in line]
    assert lines, output[-4000:]
    # decode the object only (anything a launcher may append to the line is ignored)
    return json.JSONDecoder().raw_decode(lines[-1].split("RESULT ", 1)[1])[0]


# ----------------------------------------------------------------------------- no root needed

def test_privilege_check_is_clear(monkeypatch):
    monkeypatch.setattr(system, "_capabilities", lambda: 0)
    with pytest.raises(ec.PrivilegeError) as err:
        ec.check_privileges()
    message = str(err.value)
    assert "needs root" in message and "CAP_NET_ADMIN" in message and "CAP_SYS_ADMIN" in message


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop it")
def test_cli_refuses_without_privileges():
    # the CLI run as an unprivileged user: exit 2, a message saying what is missing, nothing created
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                           PY, str(SCRIPT), "up", "--preset", "100mbit", "--allow-native-latency"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == ec.EXIT_PRIVILEGE, proc.stdout + proc.stderr
    assert "needs root" in proc.stderr and "CAP_NET_ADMIN" in proc.stderr


def test_units_and_presets():
    assert ec.parse_rate("100mbit") == 1e8 and ec.parse_rate("1gbit") == 1e9 and ec.parse_rate("2.5gbit") == 2.5e9
    assert ec.parse_time("0.5ms") == pytest.approx(5e-4) and ec.parse_time("100us") == pytest.approx(1e-4)
    presets = ec.load_config()["presets"]
    assert {"10gbit", "1gbit", "100mbit"} <= set(presets)
    assert ec.parse_rate(presets["1gbit"]["bandwidth"]) == 1e9
    with pytest.raises(ValueError):
        ec.parse_rate("fast")
    with pytest.raises(ValueError):
        ec.preset("nope")


# ----------------------------------------------------------------------------- lifecycle

@needs_netns
def test_up_down_leaves_nothing_behind():
    before = _root_snapshot()
    with ec.EmulatedCluster(3, "100mbit", 0) as c:
        prefix = c.prefix
        assert set(c.namespaces) <= set(ec.list_namespaces())
        assert len(_mine(prefix)) >= 5
        # every host link is shaped at both ends (host egress and switch egress)
        qd = c.qdiscs()
        assert len(qd) == 6 and all("tbf" in v and "100Mbit" in v for v in qd.values()), qd
        # each host has its own address in the cluster's subnet, and resolves the others' names
        for h in c.hosts:
            r = c.run(["sh", "-c", "hostname; ip -4 -o addr show eth0; getent hosts " + c.hosts[0].name],
                      launcher=f"host:{h.index}", capture_output=True, text=True, check=True)
            assert h.name in r.stdout.split()[0] and f"{h.ip}/24" in r.stdout and c.hosts[0].ip in r.stdout
        # the root namespace got nothing
        assert _root_snapshot() == before
    assert _mine(prefix) == []
    assert not any(ns.startswith(prefix) for ns in ec.list_namespaces())
    assert _root_snapshot() == before


@needs_netns
def test_cli_up_list_down():
    before = _root_snapshot()
    proc = subprocess.run([PY, str(SCRIPT), "up", "--bandwidth", "100mbit", "--latency", "0", "-n", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    prefix = info["prefix"]
    try:
        assert len(info["hosts"]) == 2 and _mine(prefix)
        listed = subprocess.run([PY, str(SCRIPT), "list"], capture_output=True, text=True).stdout
        assert prefix in listed and "up, 2 hosts" in listed
        attached = ec.EmulatedCluster.attach(prefix)
        assert attached.host_names == list(info["hosts"])
    finally:
        down = subprocess.run([PY, str(SCRIPT), "down", "--prefix", prefix], capture_output=True, text=True)
    assert down.returncode == 0 and "removed" in down.stdout
    assert _mine(prefix) == [] and _root_snapshot() == before


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up(sig):
    # a `run` whose command is still running inside a namespace when the signal arrives. SIGINT
    # as a terminal's Ctrl-C delivers it: a shell's background jobs (a CI runner's, say) start
    # with SIGINT ignored, which Python then keeps, so the child gets the default back first
    proc = subprocess.Popen([PY, str(SCRIPT), "run", "--bandwidth", "100mbit", "--latency", "0", "--no-verify",
                             "--launcher", "host:0", "--", "sleep", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    prefix = f"gr{proc.pid}"
    deadline = time.monotonic() + 120  # generous: a loaded 2-core machine builds the cluster slowly
    while not any(p.startswith("sleep") or "sleep" in p for p in _pids_cmdlines(f"{prefix}h0")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert _mine(prefix) == []


def _pids_cmdlines(ns: str) -> list[str]:
    out = []
    for pid in system._ns_pids(ns) if ns in ec.list_namespaces() else []:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
        except OSError:
            pass
    return out


@needs_netns
def test_down_removes_leftovers_of_a_killed_run():
    proc = subprocess.Popen([PY, str(SCRIPT), "run", "--bandwidth", "100mbit", "--latency", "0", "--no-verify",
                             "--launcher", "host:1", "--", "sleep", "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefix = f"gr{proc.pid}"
    deadline = time.monotonic() + 30
    while not _pids_cmdlines(f"{prefix}h1"):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.kill()                          # no chance to clean up
    proc.wait()
    assert _mine(prefix), "a SIGKILLed run should leave its namespaces behind"
    down = subprocess.run([PY, str(SCRIPT), "down", "--prefix", prefix], capture_output=True, text=True)
    assert down.returncode == 0, down.stderr
    assert _mine(prefix) == []


@needs_netns
def test_subnet_in_use_is_refused():
    with ec.EmulatedCluster(2, "100mbit", 0) as a:
        with pytest.raises(ec.ClusterError, match="in use"):
            ec.EmulatedCluster(2, "100mbit", 0, subnet=str(a.subnet)).up()
    # a subnet of the root namespace (its own addresses or routes)
    routes = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    nets = [w for line in routes.splitlines() for w in line.split() if "/" in w and not w.startswith("127.")]
    if nets:
        import ipaddress
        net = ipaddress.ip_interface(nets[0]).network
        with pytest.raises(ec.ClusterError, match="in use"):
            ec.EmulatedCluster(2, "100mbit", 0, subnet=str(net)).up()


@needs_netns
def test_latency_is_emulated():
    """2 ms one way: netem where the kernel has it, else a delay line per host; verified by a
    TCP ping-pong, and the delay lines go with the cluster."""
    with ec.EmulatedCluster(2, "100mbit", "2ms") as c:
        assert c.latency_emulated and c.latency_method == ("netem" if _netem() else "delay-line")
        r = c.verify(seconds=1.5, attempts=2, both_directions=False, strict=False)
        print(ec.format_report(r))
        assert r["latency"]["status"] == "verified", ec.format_report(r)
        assert 1.8e-3 <= r["latency"]["measured_one_way_s"] <= 2.5e-3
        assert r["status"] == "verified"      # the delay line does not eat the bandwidth
        lines = c.delay_lines_running()
        assert all(lines.values()) and len(lines) == (0 if _netem() else 2)
        if not _netem():  # calibrated: the delay lines hold packets less than the latency
            assert c.delay_hold is not None and 1.5e-3 <= c.delay_hold < 2e-3
        pids = [pid for h in c.host_names for pid in system._ns_pids(h) if "delay_line.py" in system._cmdline(pid)]
        assert len(pids) == len(lines)
        prefix = c.prefix
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not _mine(prefix)


@needs_netns
def test_latency_that_cannot_be_emulated_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(shaping, "netem_available", lambda ns: False)
    monkeypatch.setattr(shaping, "iptables", lambda: None)
    with pytest.raises(ec.ClusterError, match="cannot be emulated.*iptables"):
        ec.EmulatedCluster(2, "100mbit", "1ms").up()
    assert not [p for p in ec.leftovers() if p.startswith(f"gr{os.getpid()}")]
    with ec.EmulatedCluster(2, "100mbit", "1ms", allow_native_latency=True) as c:
        assert not c.latency_emulated and c.latency_method is None
        r = c.verify(seconds=1, attempts=1, both_directions=False, strict=False)
        assert r["latency"]["status"] == "not-emulated" and not r["certified"]
        assert "native latency" in ec.format_report(r)
        assert all("netem" not in v for v in c.qdiscs().values())


def _netem() -> bool:
    with ec.EmulatedCluster(1, "100mbit", 0) as c:
        return ec.netem_available(c.switch_ns)


# ----------------------------------------------------------------------------- verification

@pytest.fixture(scope="module")
def cluster100():
    if REASON is not None:
        pytest.skip(f"emulated cluster unavailable: {REASON}")
    with ec.EmulatedCluster(2, "100mbit", 0) as c:
        yield c


def test_verify_100mbit(cluster100):
    r = cluster100.verify(seconds=2, ceiling="always", strict=True)
    print(ec.format_report(r))
    assert r["status"] == "verified" and r["certified"]
    for d in r["directions"]:
        # TCP goodput over 1500-byte frames is ~95.6% of the link rate; tbf never lets more through
        assert 0.9e8 <= d["measured_bps"] <= 1.0e8, d
    # the shaping is what limits: unshaped, the same pair of namespaces is much faster
    assert r["unshaped_bps"] > 1.5e8, r
    assert r["latency"]["measured_one_way_s"] < 2e-3


@needs_netns
def test_verify_1gbit():
    with ec.EmulatedCluster(2, "1gbit", 0) as c:
        r = c.verify(seconds=2, strict=False)
    print(ec.format_report(r))
    if r["status"] == "cpu-bound":
        # honest outcome on a machine that cannot carry 1 Gbit/s between namespaces: not certified
        assert r["ceiling_bps"] < 2 * 1e9 / 0.9 and not r["certified"]
        pytest.xfail("1 Gbit/s is CPU-bound on this machine right now: " + ec.format_report(r))
    assert r["status"] == "verified", ec.format_report(r)
    assert all(0.9e9 <= d["measured_bps"] <= 1.1e9 for d in r["directions"])


@needs_netns
def test_10gbit_is_not_certified_unless_measured():
    with ec.EmulatedCluster(2, "10gbit", 0) as c:
        r = c.verify(seconds=1.5, attempts=1, both_directions=False, strict=False)
        print(ec.format_report(r))
        if r["status"] == "verified":   # a machine fast enough to carry 10 Gbit/s between namespaces
            assert r["measured_bps"] >= 9e9 and r["certified"]
            return
        # below the band: never certified, and said to be CPU-bound when the machine has less
        # than 2x headroom over the rate without shaping
        assert r["measured_bps"] < 9e9 and not r["certified"]
        if r["ceiling_bps"] < 2 * 1e10 / 0.9:
            assert r["status"] == "cpu-bound", ec.format_report(r)
            assert "CPU-bound" in ec.format_report(r) and "UNVERIFIED" in ec.format_report(r)


class _FakeLinks(ec.EmulatedCluster):
    """verify()'s decisions on given readings (no namespaces: runs anywhere)."""

    def __init__(self, shaped, unshaped, rate="1gbit"):
        super().__init__(2, rate, 0)
        self.prefix, self._up = "gr0", True
        self.hosts = [ec.Host(i, f"gr0h{i}", f"10.0.0.{i + 1}", f"p{i}") for i in range(2)]
        self.shaped, self.unshaped_reading, self.is_unshaped = list(shaped), unshaped, False

    def measure_throughput(self, *a, **k):
        return {"goodput_bps": self.unshaped_reading if self.is_unshaped else self.shaped.pop(0)}

    def measure_latency(self, *a, **k):
        return {"one_way_median": 2e-5, "rtt_median": 4e-5, "rtt_min": 3e-5}

    def unshaped(self, *indices):
        outer = self

        class _Ctx:
            def __enter__(self):
                outer.is_unshaped = True

            def __exit__(self, *exc):
                outer.is_unshaped = False
        return _Ctx()


def test_verify_decisions():
    ok = _FakeLinks([0.95e9, 0.96e9], 5e9).verify(strict=True)
    assert ok["status"] == "verified" and ok["certified"] and ok["ceiling_bps"] is None
    # best of the readings counts: a reading lowered by other jobs is retried
    assert _FakeLinks([0.5e9, 0.95e9, 0.95e9], 5e9).verify(strict=True)["directions"][0]["readings_bps"] == [0.5e9, 0.95e9]
    with pytest.raises(ec.VerificationError) as err:      # faster than configured: not shaped
        _FakeLinks([1.5e9, 1.5e9], 5e9).verify()
    assert not isinstance(err.value, ec.UnverifiedError) and "not shaped" in str(err.value)
    with pytest.raises(ec.UnverifiedError) as err:        # the machine cannot carry the rate
        _FakeLinks([0.6e9] * 6, 0.7e9).verify()
    assert err.value.report["status"] == "cpu-bound" and "CPU-bound" in str(err.value)
    with pytest.raises(ec.UnverifiedError):               # too little headroom for the shaper
        _FakeLinks([0.8e9] * 6, 1.5e9).verify()
    with pytest.raises(ec.VerificationError) as err:      # plenty of headroom, still slow: a failure
        _FakeLinks([0.5e9] * 6, 10e9).verify()
    assert not isinstance(err.value, ec.UnverifiedError)
    r = _FakeLinks([0.6e9] * 6, 0.7e9).verify(strict=False)
    assert r["status"] == "cpu-bound" and not r["certified"] and "UNVERIFIED" in ec.format_report(r)


# ----------------------------------------------------------------------------- launching

@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
def test_mpi_allreduce_crosses_the_shaped_links(cluster100):
    pytest.importorskip("mpi4py")
    c, mb, reps = cluster100, 8.0, 3
    before = [c.link_bytes(i) for i in range(2)]
    p = c.run([PY, WORKERS / "mpi_allreduce.py", "--mb", mb, "--reps", reps], np=2, env=_env(),
              capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    shaped = _result(p.stdout)
    after = [c.link_bytes(i) for i in range(2)]
    assert [r["hostname"] for r in shaped["ranks"]] == [c.hosts[0].name, c.hosts[1].name]
    assert all(r["ok"] for r in shaped["ranks"])
    # each rank must send the other at least the whole vector once per allreduce: at 100 Mbit/s,
    # no repetition can be faster than size / bandwidth
    bound = shaped["bytes"] * 8 / c.bandwidth
    assert min(shaped["seconds"]) >= 0.95 * bound, (shaped, bound)
    assert min(shaped["seconds"]) <= 5 * bound + 1.0, (shaped, bound)
    # and the bytes went through both hosts' shaped links, in both directions
    for b, a in zip(before, after):
        assert a["up"] - b["up"] >= reps * shaped["bytes"] and a["down"] - b["down"] >= reps * shaped["bytes"], (before, after)
    # control: with the shaping removed the same allreduce is much faster
    with c.unshaped(0, 1):
        p = c.run([PY, WORKERS / "mpi_allreduce.py", "--mb", mb, "--reps", reps], np=2, env=_env(),
                  capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert min(_result(p.stdout)["seconds"]) < 0.5 * bound


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_horovod_torch_allreduce_in_namespaces(cluster100, launcher):
    pytest.importorskip("torch")
    pytest.importorskip("horovod.torch")
    c, mb = cluster100, 4.0
    before = [c.link_bytes(i) for i in range(2)]
    p = c.run([PY, WORKERS / "horovod_torch_allreduce.py", "--mb", mb, "--reps", 2], launcher=launcher, np=2,
              env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = _result(p.stdout)
    assert r["size"] == 2 and all(x["ok"] for x in r["ranks"])
    assert r["controller"] == ("mpi" if launcher == "mpirun" else "gloo")
    # one rank per emulated host: different hostnames, each alone on its node
    assert sorted(x["hostname"] for x in r["ranks"]) == sorted(c.host_names)
    assert all(x["local_size"] == 1 for x in r["ranks"])
    bound = r["bytes"] * 8 / c.bandwidth
    assert min(r["seconds"]) >= 0.95 * bound, (r, bound)
    after = [c.link_bytes(i) for i in range(2)]   # the tensors went through both shaped links
    assert all(a["up"] - b["up"] >= 2 * r["bytes"] and a["down"] - b["down"] >= 2 * r["bytes"]
               for a, b in zip(after, before)), (before, after)
