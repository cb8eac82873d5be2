"""The cluster's network: namespace and address choice, the namespaces, the switch (a bridge in
its own namespace), a veth link per host, addresses and hosts files. Nothing goes into the root
namespace: both ends of every link are created inside their namespaces."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import time
from dataclasses import dataclass

from .errors import ClusterError
from .system import NETNS_ETC, NS_RE, PREFIX_RE, STATE_DIR, _run, list_namespaces


@dataclass
class Host:
    index: int
    name: str      # namespace name == hostname inside the cluster
    ip: str
    port: str      # its veth end on the switch


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


class TopologyMixin:
    """EmulatedCluster's network: names, addresses, namespaces and links (not their shaping).
    Uses the cluster's n, mtu, bandwidth, latency, prefix, subnet, hosts and head_ip."""

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

    def _assign_addresses(self) -> None:
        addrs = list(self.subnet.hosts())
        self.hosts = [Host(i, f"{self.prefix}h{i}", str(addrs[i]), f"p{i}") for i in range(self.n)]
        self.head_ip = str(addrs[-1])

    # ---- creating them
    def _ip(self, ns, *args):
        return _run(["ip", "-n", ns, *args])

    def _add_namespaces(self):
        for ns in self.namespaces:
            _run(["ip", "netns", "add", ns])
            self._ip(ns, "link", "set", "lo", "up")
            self._sysctls(ns)

    def _sysctls(self, ns):
        # per-namespace settings only: IPv4 only, and TCP buffers large enough for the
        # bandwidth-delay product of the fastest preset (autotuning stays on)
        big = max(64 << 20, int(4 * self.bandwidth / 8 * max(2 * self.latency, 1e-3)))
        settings = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1",
                    "net.ipv4.tcp_rmem": f"4096 131072 {big}", "net.ipv4.tcp_wmem": f"4096 16384 {big}"}
        args = [f"{k}={v}" for k, v in settings.items()]
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *args], check=False)

    def _add_links(self):
        """The switch (bridge br0) and a veth per host and for the head, addressed and up."""
        sw, hd = self.switch_ns, self.head_ns
        plen = self.subnet.prefixlen
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
