"""EmulatedCluster: one object per cluster, composed of the jobs in topology.py, shaping.py,
launch.py and verify.py; here are its settings, its life (up, down, state file, signals,
attaching to a cluster that is up) and the order in which a cluster is built."""
from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import os
import signal
import sys
import threading
import time

from .config import load_config, preset
from .errors import ClusterError
from .launch import LaunchMixin
from .shaping import ShapingMixin
from .system import STATE_DIR, _state_lock, check_privileges, list_namespaces, teardown
from .topology import Host, TopologyMixin
from .units import fmt_rate, fmt_time, parse_rate, parse_time
from .verify import VerifyMixin


class EmulatedCluster(TopologyMixin, ShapingMixin, LaunchMixin, VerifyMixin):
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

    def _log(self, msg):
        if self.verbose:
            print(f"[cluster {self.prefix}] {msg}", file=sys.stderr, flush=True)

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
                self._assign_addresses()
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

    def _create(self):
        self._add_namespaces()
        self._choose_latency_method()
        self._add_links()
        self._shape_links()
        self._start_delay_lines()
        self._write_hosts_files()
        self._wait_forwarding()
        if self.latency_method == "delay-line":
            self._calibrate_delay_lines()

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
