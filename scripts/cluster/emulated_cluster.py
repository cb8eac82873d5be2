#!/usr/bin/env python3
"""An emulated cluster on one machine: N worker hosts as Linux network namespaces.

Topology (nothing is added to the root namespace; every name starts with the cluster's
prefix, gr<pid> or gr<pid>c<k>):

    <prefix>h0  eth0 10.213.X.1 ──tc──┐
    <prefix>h1  eth0 10.213.X.2 ──tc──┤  <prefix>sw: bridge br0   (a "switch" namespace)
    ...                               │
    <prefix>hd  eth0 10.213.X.254 ────┘  head: runs mpirun / horovodrun, unshaped control link

Each host link is a veth pair (eth0 in the host, p<i> on the switch) shaped on both ends'
egress, so it is rate-limited in both directions: tbf at the link rate, with netem delay of
latency/2 in front of it (one-way host-to-host latency = latency: two links of latency/2).
On a kernel without sch_netem, each host's outgoing packets go through a delay line instead
(delay_line.py on an NFQUEUE queue of the host's namespace, in front of tbf) that holds them
for the whole one-way latency: the same host-to-host latency, added at the sender.
The /24 is picked from 10.213.0.0/16 and refused if any address or route overlaps it, here or
in any other namespace. Host names resolve inside the cluster through /etc/netns/<ns>/hosts
(bind-mounted by `ip netns exec`; the global /etc/hosts is never touched), and processes
launched on a host get their own UTS namespace with the host name as hostname.

    emulated_cluster.py up --preset 100mbit -n 4          # prints the prefix; stays up
    emulated_cluster.py verify --prefix gr1234            # measure throughput and latency
    emulated_cluster.py run --prefix gr1234 -- python bench.py      # mpirun, 1 rank per host
    emulated_cluster.py run --preset 1gbit -n 2 --launcher horovodrun -- python train.py
    emulated_cluster.py down --prefix gr1234              # or --all: every leftover cluster
    emulated_cluster.py list

From Python:

    with EmulatedCluster(4, "100mbit", "2ms") as cluster:
        report = cluster.verify()                 # raises unless within 10% of 100 Mbit/s
        subprocess.run(cluster.mpirun_cmd(["python", "bench.py"]), check=True)

`run`, `verify` and the context manager clean up on exit, on exceptions and on SIGINT/SIGTERM.
Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's `ip netns` and `tc`.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CONFIG = REPO / "configs" / "cluster" / "links.yaml"
NS_RSH = HERE / "ns_rsh"
SSH_SHIM_DIR = HERE / "bin"        # holds `ssh` -> ns_rsh, for horovodrun
NETPROBE = HERE / "netprobe.py"
DELAY_LINE = HERE / "delay_line.py"
STATE_DIR = Path("/run/grace-cluster")
NETNS_ETC = Path("/etc/netns")
PREFIX_RE = re.compile(r"^gr\d+(?:c\d+)?$")
NS_RE = re.compile(r"^(gr\d+(?:c\d+)?)(sw|hd|h\d+)$")
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21

# Verification exit codes of the CLI
EXIT_OK, EXIT_FAILED, EXIT_PRIVILEGE, EXIT_UNVERIFIED = 0, 1, 2, 3

FALLBACK_CONFIG = {  # used when configs/cluster/links.yaml or PyYAML is missing
    "presets": {"10gbit": {"bandwidth": "10gbit", "latency": "0.1ms"},
                "1gbit": {"bandwidth": "1gbit", "latency": "0.5ms"},
                "100mbit": {"bandwidth": "100mbit", "latency": "2ms"}},
    "defaults": {"hosts": 2, "mtu": 1500, "queue": "20ms", "subnet_pool": "10.213.0.0/16",
                 "verify": {"seconds": 3.0, "warmup": 0.5, "tolerance": 0.10, "attempts": 3}},
}


class ClusterError(RuntimeError):
    """Setting up, using or tearing down the emulated cluster failed."""


class PrivilegeError(ClusterError):
    """The caller may not create network namespaces or shape links."""


class VerificationError(ClusterError):
    """Measured throughput (or latency) is not what the links were configured to."""

    def __init__(self, message, report=None):
        super().__init__(message)
        self.report = report


class UnverifiedError(VerificationError):
    """The configured rate is beyond what this machine can carry: the link is CPU-bound, not
    shaped, so its rate cannot be certified."""


# ----------------------------------------------------------------------------- units, config

_RATE_UNITS = {"bit": 1, "bps": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_rate(value) -> float:
    """'100mbit', '1gbit', '2.5gbit', 1e9 -> bits per second (tc's units: powers of 1000)."""
    if isinstance(value, (int, float)):
        rate = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _RATE_UNITS | {"": 1}:
            raise ValueError(f"bandwidth {value!r}: expected a number with bit, kbit, mbit or gbit")
        rate = float(m.group(1)) * (_RATE_UNITS.get(m.group(2).lower(), 1))
    if not rate > 0:
        raise ValueError(f"bandwidth {value!r} must be positive")
    return rate


def parse_time(value) -> float:
    """'0.5ms', '100us', '2ms', 0.001 -> seconds."""
    if isinstance(value, (int, float)):
        t = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _TIME_UNITS | {"": 1}:
            raise ValueError(f"time {value!r}: expected a number with s, ms or us")
        t = float(m.group(1)) * _TIME_UNITS.get(m.group(2).lower(), 1.0)
    if t < 0:
        raise ValueError(f"time {value!r} must not be negative")
    return t


def fmt_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.0f} bit/s"


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def load_config(path: Path | str | None = None) -> dict:
    path = Path(path) if path else CONFIG
    try:
        import yaml
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except (ImportError, FileNotFoundError):
        if path != CONFIG:
            raise
        cfg = FALLBACK_CONFIG
    defaults = {**FALLBACK_CONFIG["defaults"], **cfg.get("defaults", {})}
    defaults["verify"] = {**FALLBACK_CONFIG["defaults"]["verify"], **defaults.get("verify", {})}
    return {"presets": cfg.get("presets", {}), "defaults": defaults}


def preset(name: str, config: dict | None = None) -> dict:
    config = config or load_config()
    try:
        return dict(config["presets"][name])
    except KeyError:
        raise ValueError(f"unknown link preset {name!r}; known: {', '.join(config['presets'])}") from None


# ----------------------------------------------------------------------------- system helpers

def _run(cmd, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(map(str, cmd))}` failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _capabilities() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def check_privileges() -> None:
    """Raise PrivilegeError, saying what is missing, unless namespaces and tc can be used."""
    problems = []
    caps = _capabilities()
    if not caps >> CAP_NET_ADMIN & 1:
        problems.append("CAP_NET_ADMIN is missing (needed to create links and tc qdiscs)")
    if not caps >> CAP_SYS_ADMIN & 1:
        problems.append("CAP_SYS_ADMIN is missing (`ip netns add` mounts the namespace)")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` not found (install iproute2 / util-linux)")
    if not problems:
        proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        if proc.returncode != 0:
            problems.append(f"`ip netns` does not work here: {proc.stderr.strip()}")
    if problems:
        who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()} (not root)"
        raise PrivilegeError("the emulated cluster needs root with network-admin rights; running as "
                             f"{who}:\n  - " + "\n  - ".join(problems) +
                             "\nRun it as root (e.g. sudo) on a machine where `ip netns add` works.")


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 address (as its network) and route, in the root and in every named namespace."""
    nets = []
    where = [[]] + [["-n", ns] for ns in list_namespaces()]
    for ns_args in where:
        addr = _run(["ip", *ns_args, "-4", "-o", "addr", "show"], check=False).stdout
        for m in re.finditer(r"\binet (\S+)", addr):
            nets.append(ipaddress.ip_interface(m.group(1)).network)
            nets.append(ipaddress.ip_network(m.group(1).split("/")[0] + "/32"))
        routes = _run(["ip", *ns_args, "-4", "route", "show", "table", "all"], check=False).stdout
        for line in routes.splitlines():
            words = line.split()
            if not words:
                continue
            dst = words[1] if words[0] in {"local", "broadcast", "unicast", "multicast", "anycast",
                                           "unreachable", "blackhole", "prohibit", "throw", "nat"} else words[0]
            if dst == "default":
                continue
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


def _claimed_subnets() -> set[str]:
    claimed = set()
    for f in STATE_DIR.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            claimed.add(json.loads(f.read_text())["subnet"])
    return claimed


@contextlib.contextmanager
def _state_lock():
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def netem_available(ns: str) -> bool:
    """Whether this kernel has sch_netem (probed on the loopback of a namespace we own)."""
    ns_args = ["-n", ns]
    proc = _run(["tc", *ns_args, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem",
                 "delay", "1ms"], check=False)
    if proc.returncode == 0:
        _run(["tc", *ns_args, "qdisc", "del", "dev", "lo", "root"], check=False)
        return True
    return False


def iptables() -> str | None:
    """The iptables that takes an NFQUEUE rule (the nft one needs xt compatibility, the legacy one
    the legacy tables; kernels have either)."""
    return shutil.which("iptables") or shutil.which("iptables-legacy")


# ----------------------------------------------------------------------------- the cluster

@dataclass
class Host:
    index: int
    name: str      # namespace name == hostname inside the cluster
    ip: str
    port: str      # its veth end on the switch


class EmulatedCluster:
    """N hosts in network namespaces, each linked to a switch namespace by a shaped veth.

    ``bandwidth``: per-link rate, each direction (``'100mbit'``, ``'1gbit'`` or bit/s);
    ``latency``: one-way host-to-host latency (``'0.5ms'``; with netem each link adds half of it
    in each direction, a delay line adds all of it at the sender); ``preset``: a name from
    configs/cluster/links.yaml instead of the two.
    Latency is emulated by sch_netem, or where the kernel lacks it by a delay line per host
    (NFQUEUE and delay_line.py; needs iptables). ``allow_native_latency``: when neither works, go
    on with the links' native latency instead of refusing (the report says it is not emulated).
    ``keep``: leave the cluster up when the object is closed (the CLI's ``up``).
    """

    def __init__(self, n: int | None = None, bandwidth=None, latency=None, *, preset_name: str | None = None,
                 prefix: str | None = None, subnet: str | None = None, mtu: int | None = None,
                 queue=None, allow_native_latency: bool = False, keep: bool = False,
                 handle_signals: bool = True, config: dict | None = None, verbose: bool = False):
        self.config = config or load_config()
        d = self.config["defaults"]
        p = preset(preset_name, self.config) if preset_name else {}
        self.preset_name = preset_name
        self.n = int(n if n is not None else d["hosts"])
        if self.n < 1:
            raise ValueError("a cluster needs at least one host")
        if bandwidth is None and "bandwidth" not in p:
            raise ValueError("give a bandwidth or a preset")
        self.bandwidth = parse_rate(bandwidth if bandwidth is not None else p["bandwidth"])
        self.latency = parse_time(latency if latency is not None else p.get("latency", 0))
        self.mtu = int(mtu or p.get("mtu", d["mtu"]))
        self.queue = parse_time(queue if queue is not None else p.get("queue", d["queue"]))
        self.subnet_pool = ipaddress.ip_network(d["subnet_pool"])
        self.requested_subnet = subnet
        self.requested_prefix = prefix
        self.allow_native_latency = allow_native_latency
        self.keep = keep
        self.handle_signals = handle_signals
        self.verbose = verbose
        self.prefix: str | None = None
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: list[Host] = []
        self.head_ip: str | None = None
        self.latency_method = None     # 'netem', 'delay-line' or None (native latency)
        self.delay_hold = None         # what the delay lines hold each packet, once calibrated
        self._up = False
        self._old_handlers = {}
        self._created_netns_etc = False

    @property
    def latency_emulated(self) -> bool:
        return self.latency_method is not None

    # ---- names
    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}sw"

    @property
    def head_ns(self) -> str:
        return f"{self.prefix}hd"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_ns, self.head_ns] + [h.name for h in self.hosts]

    @property
    def host_names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def _log(self, msg):
        if self.verbose:
            print(f"[cluster {self.prefix}] {msg}", file=sys.stderr, flush=True)

    # ---- choosing names and addresses
    def _pick_prefix(self) -> str:
        existing = set(list_namespaces()) | {f.stem for f in STATE_DIR.glob("*.json")}
        taken = {m.group(1) for m in map(NS_RE.match, existing) if m} | existing
        if self.requested_prefix:
            if not PREFIX_RE.match(self.requested_prefix):
                raise ValueError(f"prefix {self.requested_prefix!r} must look like gr<digits>[c<digits>]")
            if self.requested_prefix in taken:
                raise ClusterError(f"a cluster named {self.requested_prefix} already exists")
            return self.requested_prefix
        base = f"gr{os.getpid()}"
        for k in range(1000):
            name = base if k == 0 else f"{base}c{k}"
            if name not in taken:
                return name
        raise ClusterError("no free cluster prefix")

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        in_use = _networks_in_use()
        claimed = _claimed_subnets()

        def free(net):
            return str(net) not in claimed and not any(net.overlaps(u) for u in in_use)

        if self.requested_subnet:
            net = ipaddress.ip_network(self.requested_subnet, strict=True)
            if net.num_addresses - 2 < self.n + 1:
                raise ValueError(f"subnet {net} is too small for {self.n} hosts and the head")
            if not free(net):
                clash = [str(u) for u in in_use if net.overlaps(u)] or ["another emulated cluster"]
                raise ClusterError(f"subnet {net} is in use ({', '.join(sorted(set(clash)))}); refusing to use it")
            return net
        if self.n + 1 > 253:
            raise ValueError("at most 252 hosts per cluster")
        subnets = list(self.subnet_pool.subnets(new_prefix=24))
        start = os.getpid() % len(subnets)
        for net in subnets[start:] + subnets[:start]:
            if free(net):
                return net
        raise ClusterError(f"no unused /24 left in {self.subnet_pool}")

    # ---- lifecycle
    def __enter__(self) -> "EmulatedCluster":
        self.up()
        return self

    def __exit__(self, *exc):
        if not self.keep:
            self.down()
        return False

    def _install_signal_handlers(self):
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            # turn the signal into an exception so `finally` / `__exit__` tear the cluster down
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(sig)
            if old in (signal.SIG_DFL, None):
                self._old_handlers[sig] = old
                signal.signal(sig, handler)
        # SIGINT already raises KeyboardInterrupt

    def _restore_signal_handlers(self):
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    def up(self) -> "EmulatedCluster":
        if self._up:
            return self
        check_privileges()
        if self.mtu < 576 or self.mtu > 65535:
            raise ValueError(f"mtu {self.mtu} out of range")
        self._install_signal_handlers()
        if not self.keep:
            atexit.register(self.down)
        try:
            with _state_lock():
                self.prefix = self._pick_prefix()
                self.subnet = self._pick_subnet()
                addrs = list(self.subnet.hosts())
                self.hosts = [Host(i, f"{self.prefix}h{i}", str(addrs[i]), f"p{i}") for i in range(self.n)]
                self.head_ip = str(addrs[-1])
                self._write_state("creating")          # claims the subnet and records the prefix
                self._create()
            self._up = True
            self._write_state("up")
            self._log(f"up: {self.n} hosts on {self.subnet}, {fmt_rate(self.bandwidth)}, "
                      f"latency {fmt_time(self.latency)}{'' if self.latency_emulated else ' (native)'}")
        except BaseException:
            self._teardown(self.prefix) if self.prefix else None
            self._restore_signal_handlers()
            raise
        return self

    def down(self) -> None:
        """Remove everything this cluster created (idempotent)."""
        if self.prefix is None:
            return
        if not self.keep:
            with contextlib.suppress(Exception):
                atexit.unregister(self.down)
        self._teardown(self.prefix)
        self._up = False
        self._restore_signal_handlers()

    close = down

    @staticmethod
    def _teardown(prefix: str) -> list[str]:
        return teardown(prefix)

    def _write_state(self, status: str):
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"prefix": self.prefix, "status": status, "pid": os.getpid(), "created": time.time(),
                 "n": self.n, "subnet": str(self.subnet), "bandwidth_bps": self.bandwidth,
                 "latency_s": self.latency, "latency_emulated": self.latency_emulated,
                 "latency_method": self.latency_method, "delay_hold_s": self.delay_hold,
                 "mtu": self.mtu, "queue_s": self.queue, "preset": self.preset_name, "kept": self.keep,
                 "switch": self.switch_ns, "head": {"name": self.head_ns, "ip": self.head_ip},
                 "hosts": [{"name": h.name, "ip": h.ip, "port": h.port} for h in self.hosts]}
        tmp = STATE_DIR / f".{self.prefix}.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(STATE_DIR / f"{self.prefix}.json")
        lines = [f"{h.ip} {h.name}" for h in self.hosts] + [f"{self.head_ip} {self.head_ns}"]
        (STATE_DIR / f"{self.prefix}.hosts").write_text("\n".join(lines) + "\n")

    @classmethod
    def attach(cls, prefix: str, **kw) -> "EmulatedCluster":
        """An object for a cluster that is already up (created by `up`); closing it keeps it up."""
        try:
            state = json.loads((STATE_DIR / f"{prefix}.json").read_text())
        except FileNotFoundError:
            raise ClusterError(f"no emulated cluster {prefix} (see `emulated_cluster.py list`)") from None
        if state.get("status") != "up":
            raise ClusterError(f"cluster {prefix} is {state.get('status')}, not up")
        obj = cls(state["n"], state["bandwidth_bps"], state["latency_s"], mtu=state["mtu"],
                  queue=state["queue_s"], keep=True, **kw)
        obj.prefix = prefix
        obj.preset_name = state.get("preset")
        obj.subnet = ipaddress.ip_network(state["subnet"])
        obj.hosts = [Host(i, h["name"], h["ip"], h["port"]) for i, h in enumerate(state["hosts"])]
        obj.head_ip = state["head"]["ip"]
        obj.latency_method = state.get("latency_method",  # a state file older than the delay lines
                                       "netem" if state["latency_emulated"] else None)
        obj.delay_hold = state.get("delay_hold_s")
        obj._up = True
        missing = [ns for ns in obj.namespaces if ns not in list_namespaces()]
        if missing:
            raise ClusterError(f"cluster {prefix} is broken: namespaces {missing} are gone; run `down --prefix {prefix}`")
        return obj

    def _ip(self, ns, *args):
        return _run(["ip", "-n", ns, *args])

    def _create(self):
        sw, hd = self.switch_ns, self.head_ns
        plen = self.subnet.prefixlen
        for ns in self.namespaces:
            _run(["ip", "netns", "add", ns])
            self._ip(ns, "link", "set", "lo", "up")
            self._sysctls(ns)
        if self.latency > 0:
            self.latency_method = "netem" if netem_available(sw) else "delay-line" if iptables() else None
        if self.latency > 0 and self.latency_method is None and not self.allow_native_latency:
            raise ClusterError(
                f"latency {fmt_time(self.latency)} cannot be emulated: this kernel has no sch_netem "
                "(CONFIG_NET_SCH_NETEM) and iptables, which the delay line needs, is not installed "
                "(apt-get install iptables). Use latency 0, or allow_native_latency=True "
                "(--allow-native-latency) to go on with the links' native latency (tens of us).")
        self._ip(sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        self._ip(sw, "link", "set", "br0", "mtu", str(self.mtu), "up")
        links = [(h.name, h.ip, h.port) for h in self.hosts] + [(hd, self.head_ip, "phd")]
        for ns, ip, port in links:
            # both ends are created directly in their namespaces: nothing appears in the root one
            _run(["ip", "link", "add", "eth0", "netns", ns, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", port, "netns", sw, "mtu", str(self.mtu)])
            self._ip(sw, "link", "set", port, "master", "br0")
            self._ip(sw, "link", "set", port, "up")
            self._ip(ns, "addr", "add", f"{ip}/{plen}", "dev", "eth0")
            self._ip(ns, "link", "set", "eth0", "up")
        for h in self.hosts:
            self._shape(h.name, "eth0")   # host -> switch
            self._shape(sw, h.port)       # switch -> host
        if self.latency_method == "delay-line":
            for h in self.hosts:
                self._add_delay_rule(h.name)
                self._start_delay_line(h.name, self.latency)
        self._write_hosts_files()
        self._wait_forwarding()
        if self.latency_method == "delay-line":
            self._calibrate_delay_lines()

    def _sysctls(self, ns):
        # per-namespace settings only: IPv4 only, and TCP buffers large enough for the
        # bandwidth-delay product of the fastest preset (autotuning stays on)
        big = max(64 << 20, int(4 * self.bandwidth / 8 * max(2 * self.latency, 1e-3)))
        settings = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1",
                    "net.ipv4.tcp_rmem": f"4096 131072 {big}", "net.ipv4.tcp_wmem": f"4096 16384 {big}"}
        args = [f"{k}={v}" for k, v in settings.items()]
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *args], check=False)

    def shaping_params(self) -> dict:
        rate_Bps = self.bandwidth / 8
        burst = max(int(rate_Bps * 1e-3), 64 * 1024, 2 * (self.mtu + 14))   # 1 ms of traffic, >= 64 KiB
        limit = max(int(rate_Bps * self.queue), 2 * burst, 64 * 1024)
        delay = self.latency / 2                                           # per link, per direction
        # netem holds every packet in flight on the link: at least the bandwidth-delay product
        netem_limit = max(1000, int(4 * rate_Bps * delay / (self.mtu + 14)) + 100)
        return {"rate_bit": int(round(self.bandwidth)), "burst_bytes": burst, "limit_bytes": limit,
                "delay_us": int(round(delay * 1e6)), "netem_limit_pkts": netem_limit}

    def _add_delay_rule(self, ns):
        """Send every packet leaving ns's eth0 to NFQUEUE 0 (before tbf)."""
        rule = ["-t", "mangle", "-A", "POSTROUTING", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", "0"]
        proc = _run(["ip", "netns", "exec", ns, iptables(), *rule], check=False)
        if proc.returncode != 0:
            raise ClusterError(f"latency {fmt_time(self.latency)}: no sch_netem, and the delay line's "
                               f"NFQUEUE rule was refused ({(proc.stderr or proc.stdout).strip()}); "
                               "use --allow-native-latency to go on without emulated latency")

    def _start_delay_line(self, ns, hold_s: float):
        """Run ns's delay line: each packet of NFQUEUE 0 held hold_s, then on to tbf."""
        # its own session: it outlives `up` and is killed with the namespace's other processes;
        # its errors go to a log next to the cluster's state (a pipe nobody reads could fill)
        log = STATE_DIR / f"{ns}.delay_line.log"
        with open(log, "w") as err:
            line = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(DELAY_LINE), "--queue", "0",
                                     "--delay", f"{hold_s * 1e6:.0f}us"], stdout=subprocess.PIPE,
                                    stderr=err, text=True, start_new_session=True)
        ready = line.stdout.readline().strip()
        if ready != "ready":
            line.kill()
            raise ClusterError(f"the delay line of {ns} did not start: {ready} {log.read_text().strip()}")
        line.stdout.close()

    def _delay_line_pids(self, ns) -> list:
        return [pid for pid in _ns_pids(ns) if "delay_line.py" in _cmdline(pid)]

    def _calibrate_delay_lines(self, probes: int = 30):
        """A delay line adds its own wake-up and netlink round trip (40-120 us here) to what it
        holds: measure the one-way latency once, idle, and hold each packet that much less."""
        if self.n < 2:
            return
        excess = self.measure_latency(0, 1, count=probes)["one_way_median"] - self.latency
        if excess <= 0:
            return
        self.delay_hold = max(0.0, self.latency - excess)
        for h in self.hosts:
            _stop(self._delay_line_pids(h.name))
            self._start_delay_line(h.name, self.delay_hold)

    def delay_lines_running(self) -> dict:
        """{host: whether its delay line runs} (empty unless latency is emulated by delay lines)."""
        if self.latency_method != "delay-line":
            return {}
        return {h.name: bool(self._delay_line_pids(h.name)) for h in self.hosts}

    def _shape(self, ns, dev):
        sp = self.shaping_params()
        tbf = ["tbf", "rate", f"{sp['rate_bit']}bit", "burst", str(sp["burst_bytes"]),
               "limit", str(sp["limit_bytes"])]
        _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        if self.latency_method == "netem" and sp["delay_us"] > 0:
            # netem delays, then hands packets to tbf (tc-netem(8): "netem delay ... parent 1:1 tbf")
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                  "delay", f"{sp['delay_us']}us", "limit", str(sp["netem_limit_pkts"])])
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
        else:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])

    def _unshape(self, ns, dev):
        _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    @contextlib.contextmanager
    def unshaped(self, *indices):
        """Temporarily remove the shaping of the given hosts' links (to measure the machine's ceiling)."""
        for i in indices:
            self._unshape(self.hosts[i].name, "eth0")
            self._unshape(self.switch_ns, self.hosts[i].port)
        try:
            yield
        finally:
            for i in indices:
                self._shape(self.hosts[i].name, "eth0")
                self._shape(self.switch_ns, self.hosts[i].port)

    def qdiscs(self) -> dict:
        """tc's view of every shaped link end: {'<ns>/<dev>': 'qdisc tbf ... qdisc netem ...'}."""
        out = {}
        for h in self.hosts:
            for ns, dev in ((h.name, "eth0"), (self.switch_ns, h.port)):
                out[f"{ns}/{dev}"] = " | ".join(_run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout.split("\n")).strip(" |")
        return out

    def link_bytes(self, host: int) -> dict:
        """Bytes that went through host's shaped link so far: {'up': host -> switch, 'down': switch -> host}
        (tbf's counters, Ethernet headers included)."""
        h = self.hosts[host]
        out = {}
        for key, ns, dev in (("up", h.name, "eth0"), ("down", self.switch_ns, h.port)):
            stats = json.loads(_run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev]).stdout)
            out[key] = max((q.get("bytes", 0) for q in stats if q.get("kind") == "tbf"), default=0)
        return out

    def _write_hosts_files(self):
        lines = ["127.0.0.1 localhost"] + [f"{h.ip} {h.name}" for h in self.hosts] + [f"{self.head_ip} {self.head_ns}"]
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir(parents=True, exist_ok=True)
            self._created_netns_etc = True
        for ns in [h.name for h in self.hosts] + [self.head_ns]:
            d = NETNS_ETC / ns
            d.mkdir(exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")

    def _wait_forwarding(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        ports = [h.port for h in self.hosts] + ["phd"]
        while True:
            out = _run(["bridge", "-n", self.switch_ns, "link", "show"], check=False).stdout
            states = {m.group(1): m.group(2) for m in re.finditer(r"\d+: (\S+?)@\S+: .*? state (\w+)", out)}
            if all(states.get(p) == "forwarding" for p in ports):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"bridge ports not forwarding after {timeout}s: {states}")
            time.sleep(0.05)

    # ---- running things
    def exec_prefix(self, host: int | str, hostname: bool = True) -> list[str]:
        """argv prefix that runs a command on host (index or name), or on 'head'."""
        if host == "head":
            ns = self.head_ns
        elif isinstance(host, int):
            ns = self.hosts[host].name
        else:
            ns = host
        if ns not in self.namespaces:
            raise ClusterError(f"{host!r} is not a host of cluster {self.prefix}")
        base = ["ip", "netns", "exec", ns]
        if hostname:
            base += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', ns]
        return base

    def popen(self, host, cmd, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.exec_prefix(host) + list(map(str, cmd)), **kw)

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env.update({"GRACE_CLUSTER_PREFIX": self.prefix, "GRACE_CLUSTER_SUBNET": str(self.subnet),
                    "GRACE_CLUSTER_HOSTS": ",".join(self.host_names),
                    "GRACE_CLUSTER_BANDWIDTH_BPS": str(int(self.bandwidth)),
                    "GRACE_CLUSTER_LATENCY_S": str(self.latency),
                    "GRACE_CLUSTER_LATENCY_EMULATED": "1" if self.latency_emulated else "0"})
        return env

    def _placement(self, np, ranks_per_host) -> tuple[int, str]:
        """-H list with exactly np slots, filled host by host (horovodrun would use every slot given)."""
        np = np or self.n * ranks_per_host
        if np < 1 or np > self.n * ranks_per_host:
            raise ValueError(f"{np} ranks do not fit {self.n} hosts x {ranks_per_host} ranks per host")
        slots, left = [], np
        for h in self.host_names:
            if left <= 0:
                break
            slots.append(f"{h}:{min(ranks_per_host, left)}")
            left -= ranks_per_host
        return np, ",".join(slots)

    def mpirun_cmd(self, cmd, np: int | None = None, ranks_per_host: int = 1, mpirun: str = "mpirun",
                   extra: list[str] | None = None) -> list[str]:
        """Full argv (run it as is: it enters the head namespace) for mpirun over the emulated links.

        Ranks are placed ``ranks_per_host`` per host in order; all MPI traffic (pml ob1, btl tcp)
        and the runtime's own (oob) are bound to the cluster subnet, so it crosses the shaped
        links. Ranks on the same host talk over that host's loopback (unshaped), as on a node.
        """
        np, hosts = self._placement(np, ranks_per_host)
        mpirun_path = shutil.which(mpirun) or mpirun
        args = [mpirun_path, "--allow-run-as-root", "-np", str(np), "-H", hosts,
                "--mca", "plm_rsh_agent", str(NS_RSH), "--mca", "plm_rsh_no_tree_spawn", "1",
                "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", str(self.subnet), "--mca", "oob_tcp_if_include", str(self.subnet),
                "--bind-to", "none"]
        args += list(extra or [])
        return self.exec_prefix("head") + args + list(map(str, cmd))

    def horovodrun_cmd(self, cmd, np: int | None = None, ranks_per_host: int = 1, gloo: bool = True,
                       extra: list[str] | None = None) -> list[str]:
        """argv for horovodrun (Gloo by default) over the emulated links; run it with ``env=cluster.env()``
        plus :meth:`horovodrun_env` (it finds ns_rsh as `ssh` on PATH)."""
        np, hosts = self._placement(np, ranks_per_host)
        horovodrun = shutil.which("horovodrun") or str(Path(sys.executable).parent / "horovodrun")
        args = [horovodrun, "-np", str(np), "-H", hosts, "--network-interface", "eth0"]
        args += ["--gloo"] if gloo else ["--mpi", "--mpi-args",
                                         f"--mca plm_rsh_agent {NS_RSH} --mca pml ob1 --mca btl tcp,self "
                                         f"--mca btl_tcp_if_include {self.subnet} --mca oob_tcp_if_include {self.subnet} --bind-to none"]
        args += list(extra or [])
        return self.exec_prefix("head") + args + list(map(str, cmd))

    def horovodrun_env(self, base: dict | None = None) -> dict:
        env = self.env(base)
        env["PATH"] = f"{SSH_SHIM_DIR}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["HOROVOD_GLOO_IFACE"] = "eth0"
        # Gloo gives up on a receive after 30 s; broadcasting a 68 MB model from one rank over an
        # emulated 100 Mbit link takes 15-20 s, more on a loaded machine
        env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "300")
        return env

    def torchrun_env(self, rank: int, world: int, ranks_per_host: int, base: dict | None = None) -> dict:
        """What torchrun gives each process (torch.distributed's env:// rendezvous, served by rank
        0 on host 0), with Gloo on the emulated link."""
        env = self.env(base)
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks_per_host),
                    "LOCAL_WORLD_SIZE": str(ranks_per_host), "MASTER_ADDR": self.hosts[0].ip,
                    "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "eth0"})
        return env

    def _run_torch(self, cmd, np: int | None, ranks_per_host: int, check: bool, env=None,
                   **kw) -> subprocess.CompletedProcess:
        """One process per rank in its host's namespace, as torchrun would start them; the first
        to fail stops the others (they would wait for it forever)."""
        np = self._placement(np, ranks_per_host)[0]
        self._log(f"run ({np} ranks, torch.distributed): " + " ".join(map(str, cmd)))
        procs = [self.popen(rank // ranks_per_host, cmd, env=self.torchrun_env(rank, np, ranks_per_host, env), **kw)
                 for rank in range(np)]
        try:
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        code = next((p.returncode for p in procs if p.returncode), 0)
        if check and code:
            raise subprocess.CalledProcessError(code, list(map(str, cmd)))
        return subprocess.CompletedProcess(list(map(str, cmd)), code)

    def run(self, cmd, launcher: str = "mpirun", np: int | None = None, ranks_per_host: int = 1,
            check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run cmd over the cluster. launcher: 'mpirun', 'horovodrun' (Gloo), 'torchrun' (one
        process per rank with torch.distributed's environment), 'head' (cmd runs in the head
        namespace with GRACE_CLUSTER_* set), or 'host:<i>' (cmd runs on host i)."""
        if launcher == "torchrun":
            return self._run_torch(cmd, np, ranks_per_host, check, **kw)
        if launcher == "mpirun":
            argv, env = self.mpirun_cmd(cmd, np, ranks_per_host), self.env(kw.pop("env", None))
        elif launcher == "horovodrun":
            argv, env = self.horovodrun_cmd(cmd, np, ranks_per_host), self.horovodrun_env(kw.pop("env", None))
        elif launcher == "head":
            argv, env = self.exec_prefix("head") + list(map(str, cmd)), self.env(kw.pop("env", None))
        elif launcher.startswith("host:"):
            argv, env = self.exec_prefix(int(launcher[5:])) + list(map(str, cmd)), self.env(kw.pop("env", None))
        else:
            raise ValueError(f"unknown launcher {launcher!r}")
        self._log("run: " + " ".join(argv))
        return subprocess.run(argv, env=env, check=check, **kw)

    # ---- verification
    def measure_throughput(self, src: int = 0, dst: int = 1, seconds: float = 3.0, warmup: float = 0.5,
                           port: int = 5201) -> dict:
        """TCP goodput from host src to host dst (netprobe.py at both ends)."""
        py = sys.executable
        recv = self.popen(dst, [py, NETPROBE, "recv", "--bind", self.hosts[dst].ip, "--port", port,
                                "--warmup", warmup, "--timeout", seconds + 30],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = recv.stdout.readline().strip()
            if ready != "ready":
                raise ClusterError(f"throughput receiver did not start: {ready} {recv.stderr.read()}")
            send = subprocess.run(self.exec_prefix(src) + [py, str(NETPROBE), "send", "--host", self.hosts[dst].ip,
                                                           "--port", str(port), "--seconds", str(seconds)],
                                  capture_output=True, text=True, timeout=seconds + 60)
            out, err = recv.communicate(timeout=seconds + 60)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        if send.returncode != 0 or recv.returncode != 0:
            raise ClusterError(f"throughput probe {src}->{dst} failed: {send.stderr.strip()} {err.strip()}")
        return json.loads(out.strip().splitlines()[-1])

    def measure_latency(self, src: int = 0, dst: int = 1, count: int = 50, port: int = 5202) -> dict:
        """TCP round trips of 64-byte messages from src to dst; one-way = median RTT / 2."""
        py = sys.executable
        echo = self.popen(dst, [py, NETPROBE, "echo", "--bind", self.hosts[dst].ip, "--port", port],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if echo.stdout.readline().strip() != "ready":
                raise ClusterError(f"echo server did not start: {echo.stderr.read()}")
            ping = subprocess.run(self.exec_prefix(src) + [py, str(NETPROBE), "ping", "--host", self.hosts[dst].ip,
                                                           "--port", str(port), "--count", str(count)],
                                  capture_output=True, text=True, timeout=120)
            echo.communicate(timeout=30)
        finally:
            if echo.poll() is None:
                echo.kill()
                echo.wait()
        if ping.returncode != 0:
            raise ClusterError(f"latency probe {src}->{dst} failed: {ping.stderr.strip()}")
        r = json.loads(ping.stdout.strip().splitlines()[-1])
        r["one_way_median"] = r["rtt_median"] / 2
        return r

    def verify(self, src: int = 0, dst: int | None = None, seconds: float | None = None,
               tolerance: float | None = None, attempts: int | None = None, warmup: float | None = None,
               both_directions: bool = True, ceiling: str = "auto", headroom: float = 2.0,
               strict: bool = True) -> dict:
        """Measure TCP goodput and latency between two hosts and compare with the configuration.

        Throughput passes when the best of ``attempts`` readings per direction is within
        ``tolerance`` (10%) of the configured rate: other jobs on a shared machine can only lower
        a reading, never raise it above what tbf lets through, so a reading above the band
        fails at once. When no reading reaches the band, the links are unshaped for a moment to
        measure what this machine can carry at all (the ceiling: the best of that reading and the
        shaped ones). Below ``headroom`` (2) x the configured rate / (1 - tolerance) the link is
        CPU-bound: status 'cpu-bound', unverified (two tbf stages per direction cost CPU too, and
        on a shared machine one reading of the ceiling can be off by 2x either way). With more
        headroom than that a low reading is a real failure: status 'failed'.
        ``ceiling='always'`` measures it anyway. With ``strict`` a failure raises
        VerificationError and an unverifiable rate UnverifiedError (the report is attached).
        Latency: with netem, the median one-way time (RTT/2) must lie within
        [0.9 L - 20 us, 1.1 L + 300 us] (the upper allowance is Python's own round-trip overhead).
        """
        if not self._up:
            raise ClusterError("the cluster is not up")
        if self.n < 2:
            raise ClusterError("verification needs two hosts")
        v = self.config["defaults"]["verify"]
        seconds = float(seconds if seconds is not None else v["seconds"])
        tolerance = float(tolerance if tolerance is not None else v["tolerance"])
        attempts = int(attempts if attempts is not None else v["attempts"])
        warmup = float(warmup if warmup is not None else v["warmup"])
        dst = 1 if dst is None else dst
        lo, hi = (1 - tolerance) * self.bandwidth, (1 + tolerance) * self.bandwidth
        directions = [(src, dst)] + ([(dst, src)] if both_directions else [])
        report = {"prefix": self.prefix, "configured_bps": self.bandwidth, "tolerance": tolerance,
                  "seconds": seconds, "directions": [], "ceiling_bps": None}
        status = "verified"
        for a, b in directions:
            readings = []
            for _ in range(attempts):
                r = self.measure_throughput(a, b, seconds, warmup)
                readings.append(r["goodput_bps"])
                if r["goodput_bps"] >= lo:      # in the band, or above it (which fails below)
                    break
            best = max(readings)
            d = {"src": self.hosts[a].name, "dst": self.hosts[b].name, "readings_bps": readings,
                 "measured_bps": best, "ratio": best / self.bandwidth}
            if best > hi:
                d["status"] = "failed"
                d["why"] = "faster than configured: the link is not shaped"
            elif best >= lo:
                d["status"] = "verified"
            else:
                d["status"] = "low"
            report["directions"].append(d)
        low = any(d["status"] == "low" for d in report["directions"])
        if low or ceiling == "always":
            with self.unshaped(src, dst):
                unshaped = self.measure_throughput(src, dst, seconds, warmup)["goodput_bps"]
            report["unshaped_bps"] = unshaped
            # a shaped reading is also a lower bound of what the machine carries (load varies)
            report["ceiling_bps"] = max([unshaped] + [x for d in report["directions"] for x in d["readings_bps"]])
        for d in report["directions"]:
            if d["status"] == "low":
                if report["ceiling_bps"] < self.bandwidth / (1 - tolerance):
                    d["status"] = "cpu-bound"
                    d["why"] = (f"this machine carries at most {fmt_rate(report['ceiling_bps'])} between two "
                                f"namespaces (measured with the shaping removed); the link is CPU-bound, "
                                f"not shaped")
                elif report["ceiling_bps"] < headroom * self.bandwidth / (1 - tolerance):
                    d["status"] = "cpu-bound"
                    d["why"] = (f"this machine carries {fmt_rate(report['ceiling_bps'])} unshaped, less than "
                                f"{headroom:g}x the rate: too little headroom for the shaper itself, so the "
                                f"link is CPU-bound")
                else:
                    d["status"] = "failed"
                    d["why"] = (f"below {100 * (1 - tolerance):.0f}% of the configured rate although the "
                                f"machine carries {fmt_rate(report['ceiling_bps'])} unshaped")
        states = {d["status"] for d in report["directions"]}
        status = "failed" if "failed" in states else "cpu-bound" if "cpu-bound" in states else "verified"
        report["status"] = status
        report["measured_bps"] = min(d["measured_bps"] for d in report["directions"])

        lat = self.measure_latency(src, dst)
        one_way = lat["one_way_median"]
        L = self.latency
        lat_report = {"configured_one_way_s": L, "measured_one_way_s": one_way, "rtt_median_s": lat["rtt_median"],
                      "rtt_min_s": lat["rtt_min"], "emulated": self.latency_emulated,
                      "method": self.latency_method, "delay_hold_s": self.delay_hold}
        if self.latency_emulated:
            ok = 0.9 * L - 20e-6 <= one_way <= 1.1 * L + 300e-6
            stopped = [h for h, up in self.delay_lines_running().items() if not up]
            lat_report["status"] = "verified" if ok and not stopped else "failed"
            if stopped:
                lat_report["why"] = f"the delay lines of {', '.join(stopped)} are not running"
        else:
            lat_report["status"] = "native" if L == 0 else "not-emulated"
        report["latency"] = lat_report
        report["certified"] = status == "verified" and lat_report["status"] in ("verified", "native")
        if strict:
            if status == "failed" or lat_report["status"] == "failed":
                raise VerificationError("link verification failed:\n" + format_report(report), report)
            if status == "cpu-bound":
                raise UnverifiedError("link rate cannot be verified (CPU-bound):\n" + format_report(report), report)
        return report


def format_report(r: dict) -> str:
    lines = [f"cluster {r['prefix']}: configured {fmt_rate(r['configured_bps'])} per link, "
             f"tolerance {100 * r['tolerance']:.0f}%, {r['seconds']:g} s per reading"]
    for d in r["directions"]:
        readings = ", ".join(fmt_rate(x) for x in d["readings_bps"])
        lines.append(f"  {d['src']} -> {d['dst']}: {fmt_rate(d['measured_bps'])} TCP goodput "
                     f"({100 * d['ratio']:.1f}% of configured; readings {readings}): {d['status'].upper()}"
                     + (f" - {d['why']}" if d.get("why") else ""))
    if r.get("ceiling_bps"):
        lines.append(f"  what this machine carries between two namespaces: {fmt_rate(r['ceiling_bps'])} "
                     f"(unshaped reading {fmt_rate(r['unshaped_bps'])})")
    lat = r.get("latency")
    if lat:
        lines.append(f"  latency one-way: configured {fmt_time(lat['configured_one_way_s'])}, measured "
                     f"{fmt_time(lat['measured_one_way_s'])} (TCP RTT median {fmt_time(lat['rtt_median_s'])}, "
                     f"min {fmt_time(lat['rtt_min_s'])}): {lat['status'].upper()}"
                     + (f" ({lat['method']}" + (f", each packet held {fmt_time(lat['delay_hold_s'])}"
                                                   if lat.get("delay_hold_s") is not None else "") + ")"
                        if lat.get("method") else "")
                     + (f" - {lat['why']}" if lat.get("why") else "")
                     + ("" if lat["emulated"] or lat["configured_one_way_s"] == 0 else
                        " - neither sch_netem nor the delay line; the links keep their native latency"))
    lines.append("  => " + ("CERTIFIED" if r.get("certified") else
                            "UNVERIFIED (CPU-bound: do not trust benchmark numbers at this rate)"
                            if r["status"] == "cpu-bound" else
                            "bandwidth verified, latency NOT emulated" if r["status"] == "verified" else "FAILED"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- cleanup by prefix

def _stop(pids: list[int], grace: float = 2.0):
    """SIGTERM, and SIGKILL for what is still there after ``grace`` seconds; returns once gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.05)
        if not pids:
            return


def _kill_ns_processes(ns: str, grace: float = 2.0):
    _stop(_ns_pids(ns), grace)


def teardown(prefix: str) -> list[str]:
    """Remove every namespace, /etc/netns entry and state file of cluster `prefix`. Returns what went."""
    if not PREFIX_RE.match(prefix):
        raise ValueError(f"refusing to tear down {prefix!r}: not an emulated-cluster prefix")
    removed = []
    mine = [ns for ns in list_namespaces() if (m := NS_RE.match(ns)) and m.group(1) == prefix]
    # processes still inside would keep a deleted namespace (and its links) alive
    for ns in mine:
        _kill_ns_processes(ns)
    for ns in mine:
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(f"netns {ns}")
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.iterdir():
            m = NS_RE.match(d.name)
            if m and m.group(1) == prefix:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(f"{d}")
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()          # only if empty (ours, or left empty)
    for suffix in (".json", ".hosts"):
        f = STATE_DIR / f"{prefix}{suffix}"
        if f.exists():
            f.unlink()
            removed.append(str(f))
    for f in STATE_DIR.glob(f"{prefix}h*.delay_line.log"):
        if NS_RE.match(f.name.split(".")[0]):
            f.unlink()
            removed.append(str(f))
    return removed


def _owner_pid(prefix: str) -> int | None:
    """The pid that created cluster `prefix` and still owns it; None for `up` clusters and unknown ones."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        state = json.loads((STATE_DIR / f"{prefix}.json").read_text())
        return None if state.get("kept") else int(state["pid"])
    return None


def leftovers() -> dict:
    """Every emulated-cluster object on this machine, by prefix."""
    found: dict[str, list[str]] = {}
    for ns in list_namespaces():
        if m := NS_RE.match(ns):
            found.setdefault(m.group(1), []).append(f"netns {ns}")
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.iterdir():
            if m := NS_RE.match(d.name):
                found.setdefault(m.group(1), []).append(str(d))
    for f in STATE_DIR.glob("gr*.*"):
        p = f.name.split(".")[0]
        if PREFIX_RE.match(p):
            found.setdefault(p, []).append(str(f))
    return found


# ----------------------------------------------------------------------------- CLI

def _add_link_args(p):
    p.add_argument("--preset", help="link preset from configs/cluster/links.yaml (10gbit, 1gbit, 100mbit, ...)")
    p.add_argument("--bandwidth", help="per-link rate, e.g. 100mbit, 1gbit (overrides the preset)")
    p.add_argument("--latency", help="one-way host-to-host latency, e.g. 0.5ms (overrides the preset)")
    p.add_argument("-n", "--hosts", type=int, default=None, help="number of hosts (default 2)")
    p.add_argument("--subnet", help="use this subnet (refused if any address or route is in it)")
    p.add_argument("--mtu", type=int)
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--allow-native-latency", action="store_true",
                   help="where latency cannot be emulated (no sch_netem, no iptables), keep the native latency instead of refusing")


def _add_verify_args(p):
    p.add_argument("--seconds", type=float, help="seconds per throughput reading (default 3)")
    p.add_argument("--tolerance", type=float, help="allowed deviation (default 0.10)")
    p.add_argument("--attempts", type=int, help="readings per direction, best counts (default 3)")
    p.add_argument("--ceiling", action="store_true", help="always measure the unshaped ceiling too")
    p.add_argument("--json", type=Path, help="write the verification report here")


def _cluster_from_args(args, keep=False) -> EmulatedCluster:
    if getattr(args, "prefix", None):
        return EmulatedCluster.attach(args.prefix, verbose=True)
    cfg = load_config(args.config)
    name = args.preset
    if name is None and args.bandwidth is None:
        name = "1gbit"
    return EmulatedCluster(args.hosts, args.bandwidth, args.latency, preset_name=name, subnet=args.subnet,
                           mtu=args.mtu, allow_native_latency=args.allow_native_latency, keep=keep,
                           config=cfg, verbose=True)


def _do_verify(cluster, args) -> tuple[int, dict]:
    report = cluster.verify(seconds=args.seconds, tolerance=args.tolerance, attempts=args.attempts,
                            ceiling="always" if args.ceiling else "auto", strict=False)
    print(format_report(report), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if report["status"] == "failed" or report["latency"]["status"] == "failed":
        return EXIT_FAILED, report
    if report["status"] == "cpu-bound":
        return EXIT_UNVERIFIED, report
    return EXIT_OK, report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create a cluster and leave it up (prints its prefix)")
    _add_link_args(p_up)
    p_up.add_argument("--verify", action="store_true", help="verify the links after creating them")
    _add_verify_args(p_up)
    p_down = sub.add_parser("down", help="remove a cluster (or every leftover one) by prefix")
    p_down.add_argument("--prefix", action="append", default=[])
    p_down.add_argument("--all", action="store_true",
                        help="every emulated cluster on this machine whose creating process has exited "
                             "(clusters from `up`, crashed runs); add --force for those in use too")
    p_down.add_argument("--force", action="store_true", help="with --all: also clusters whose creator still runs")
    sub.add_parser("list", help="list emulated clusters and leftovers")
    p_ver = sub.add_parser("verify", help="measure the links of a cluster (--prefix) or of a temporary one")
    p_ver.add_argument("--prefix", help="an existing cluster (from `up`)")
    _add_link_args(p_ver)
    _add_verify_args(p_ver)
    p_run = sub.add_parser("run", help="run a command over a cluster: run [options] -- CMD ...")
    p_run.add_argument("--prefix", help="an existing cluster (from `up`); otherwise a temporary one")
    _add_link_args(p_run)
    _add_verify_args(p_run)
    p_run.add_argument("--launcher", default="mpirun",
                       help="mpirun (default), horovodrun (Gloo), torchrun (torch.distributed env), head (CMD in the head namespace, "
                            "GRACE_CLUSTER_* set), host:<i>")
    p_run.add_argument("--np", type=int, help="ranks (default: hosts x --ranks-per-host)")
    p_run.add_argument("--ranks-per-host", type=int, default=1)
    p_run.add_argument("--no-verify", action="store_true", help="skip the link check (numbers not certified)")
    p_run.add_argument("--allow-unverified", action="store_true",
                       help="run even when the rate cannot be verified (CPU-bound); the run is marked so")
    p_run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    try:
        if args.command == "list":
            for prefix, what in sorted(leftovers().items()):
                state = STATE_DIR / f"{prefix}.json"
                desc = ""
                if state.exists():
                    s = json.loads(state.read_text())
                    desc = (f"{s['status']}, {s['n']} hosts, {s['subnet']}, {fmt_rate(s['bandwidth_bps'])}, "
                            f"latency {fmt_time(s['latency_s'])}{'' if s['latency_emulated'] else ' (native)'}, pid {s['pid']}")
                print(f"{prefix}: {desc or 'leftover'}\n    " + "\n    ".join(what))
            return EXIT_OK
        check_privileges()
        if args.command == "down":
            prefixes = list(args.prefix)
            if args.all:
                for prefix in leftovers():
                    owner = _owner_pid(prefix)
                    if owner and not args.force and owner != os.getpid() and Path(f"/proc/{owner}").exists():
                        print(f"{prefix}: skipped, its creator (pid {owner}) is still running (--force removes it)")
                        continue
                    prefixes.append(prefix)
            elif not prefixes:
                parser.error("down needs --prefix P or --all")
            for prefix in prefixes:
                removed = teardown(prefix)
                print(f"{prefix}: removed {len(removed)} object(s)" + "".join(f"\n    {r}" for r in removed))
            return EXIT_OK
        if args.command == "up":
            cluster = _cluster_from_args(args, keep=True).up()
            print(json.dumps({"prefix": cluster.prefix, "subnet": str(cluster.subnet),
                              "hosts": {h.name: h.ip for h in cluster.hosts},
                              "head": {cluster.head_ns: cluster.head_ip},
                              "bandwidth_bps": cluster.bandwidth, "latency_s": cluster.latency,
                              "latency_emulated": cluster.latency_emulated}, indent=1))
            if args.verify:
                return _do_verify(cluster, args)[0]
            return EXIT_OK
        if args.command == "verify":
            cluster = _cluster_from_args(args)
            with cluster:
                return _do_verify(cluster, args)[0]
        if args.command == "run":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("run needs a command after --")
            cluster = _cluster_from_args(args)
            with cluster:
                if args.no_verify:
                    print(f"[cluster {cluster.prefix}] links NOT verified (--no-verify)", file=sys.stderr)
                else:
                    code, report = _do_verify(cluster, args)
                    if code == EXIT_FAILED:
                        return code
                    if code == EXIT_UNVERIFIED and not args.allow_unverified:
                        print("refusing to run: the configured rate cannot be verified on this machine "
                              "(--allow-unverified runs anyway)", file=sys.stderr)
                        return code
                return cluster.run(cmd, launcher=args.launcher, np=args.np,
                                   ranks_per_host=args.ranks_per_host).returncode
    except PrivilegeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PRIVILEGE
    except KeyboardInterrupt:
        print("interrupted; the cluster was removed", file=sys.stderr)
        return 130
    except (ClusterError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
