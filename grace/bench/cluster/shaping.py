"""Shaping the host links: tbf at the link rate on both ends' egress, and latency, by sch_netem
in front of tbf or, on a kernel without it, by a delay line per host (delay_line.py on an
NFQUEUE queue of the host's namespace, started, calibrated and watched from here)."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import ClusterError
from .system import STATE_DIR, _cmdline, _ns_pids, _run, _stop
from .units import fmt_time

DELAY_LINE = Path(__file__).resolve().parent / "delay_line.py"


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


class ShapingMixin:
    """EmulatedCluster's link shaping and latency emulation. Uses the cluster's bandwidth, latency,
    mtu, queue, hosts, switch_ns and allow_native_latency; sets latency_method and delay_hold."""

    # ---- choosing how latency is emulated
    def _choose_latency_method(self):
        """netem where the kernel has it, else delay lines where iptables is installed, else none
        (refused unless allow_native_latency)."""
        if self.latency > 0:
            self.latency_method = "netem" if netem_available(self.switch_ns) else "delay-line" if iptables() else None
        if self.latency > 0 and self.latency_method is None and not self.allow_native_latency:
            raise ClusterError(
                f"latency {fmt_time(self.latency)} cannot be emulated: this kernel has no sch_netem "
                "(CONFIG_NET_SCH_NETEM) and iptables, which the delay line needs, is not installed "
                "(apt-get install iptables). Use latency 0, or allow_native_latency=True "
                "(--allow-native-latency) to go on with the links' native latency (tens of us).")

    # ---- tbf and netem
    def shaping_params(self) -> dict:
        rate_Bps = self.bandwidth / 8
        burst = max(int(rate_Bps * 1e-3), 64 * 1024, 2 * (self.mtu + 14))   # 1 ms of traffic, >= 64 KiB
        limit = max(int(rate_Bps * self.queue), 2 * burst, 64 * 1024)
        delay = self.latency / 2                                           # per link, per direction
        # netem holds every packet in flight on the link: at least the bandwidth-delay product
        netem_limit = max(1000, int(4 * rate_Bps * delay / (self.mtu + 14)) + 100)
        return {"rate_bit": int(round(self.bandwidth)), "burst_bytes": burst, "limit_bytes": limit,
                "delay_us": int(round(delay * 1e6)), "netem_limit_pkts": netem_limit}

    def _link_ends(self, host) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of a host's link: its eth0 (host -> switch) and its
        port on the switch (switch -> host)."""
        return [(host.name, "eth0"), (self.switch_ns, host.port)]

    def _shape_links(self):
        for h in self.hosts:
            for ns, dev in self._link_ends(h):
                self._shape(ns, dev)

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
            for ns, dev in self._link_ends(self.hosts[i]):
                self._unshape(ns, dev)
        try:
            yield
        finally:
            for i in indices:
                for ns, dev in self._link_ends(self.hosts[i]):
                    self._shape(ns, dev)

    def qdiscs(self) -> dict:
        """tc's view of every shaped link end: {'<ns>/<dev>': 'qdisc tbf ... qdisc netem ...'}."""
        out = {}
        for h in self.hosts:
            for ns, dev in self._link_ends(h):
                out[f"{ns}/{dev}"] = " | ".join(_run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout.split("\n")).strip(" |")
        return out

    def link_bytes(self, host: int) -> dict:
        """Bytes that went through host's shaped link so far: {'up': host -> switch, 'down': switch -> host}
        (tbf's counters, Ethernet headers included)."""
        out = {}
        for key, (ns, dev) in zip(("up", "down"), self._link_ends(self.hosts[host])):
            stats = json.loads(_run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev]).stdout)
            out[key] = max((q.get("bytes", 0) for q in stats if q.get("kind") == "tbf"), default=0)
        return out

    # ---- delay lines (no sch_netem)
    def _start_delay_lines(self):
        """Where latency is emulated by delay lines: each host's NFQUEUE rule and delay line."""
        if self.latency_method == "delay-line":
            for h in self.hosts:
                self._add_delay_rule(h.name)
                self._start_delay_line(h.name, self.latency)

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
        holds: measure the one-way latency once, idle, and hold each packet that much less. The
        fastest round trip tells that overhead; a median taken while other jobs load the machine
        would take their noise for it and hold packets too short once the machine is quiet."""
        if self.n < 2:
            return
        excess = self.measure_latency(0, 1, count=probes)["rtt_min"] / 2 - self.latency
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
