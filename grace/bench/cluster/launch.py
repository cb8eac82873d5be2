"""Running things on the cluster: a command on one host or the head, and ranks over the
emulated links with mpirun, horovodrun (Gloo or MPI) or torch.distributed's environment.

mpirun and horovodrun reach the hosts through shims/ns_rsh (an ssh stand-in that enters a
host's namespace); horovodrun finds it as `ssh` in shims/bin."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from grace.bench.horovodrun import HOROVODRUN

from .errors import ClusterError

SHIMS = Path(__file__).resolve().parent / "shims"
NS_RSH = SHIMS / "ns_rsh"
SSH_SHIM_DIR = SHIMS / "bin"        # holds `ssh` -> ns_rsh, for horovodrun


class LaunchMixin:
    """EmulatedCluster's launchers. Uses the cluster's n, prefix, subnet, hosts, head_ns,
    namespaces, bandwidth, latency and latency_emulated."""

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
        args = [*HOROVODRUN, "-np", str(np), "-H", hosts, "--network-interface", "eth0"]
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
