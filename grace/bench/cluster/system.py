"""The machine's side: privileges, commands, namespaces and their processes, the state
directory and its lock, and removing a cluster (or finding what one left) by its prefix."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .errors import ClusterError, PrivilegeError

STATE_DIR = Path("/run/grace-cluster")
NETNS_ETC = Path("/etc/netns")
PREFIX_RE = re.compile(r"^gr\d+(?:c\d+)?$")
NS_RE = re.compile(r"^(gr\d+(?:c\d+)?)(sw|hd|h\d+)$")
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21


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


@contextlib.contextmanager
def _state_lock():
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
