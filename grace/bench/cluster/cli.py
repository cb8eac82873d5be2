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
import json
import os
import sys
from pathlib import Path

from .cluster import EmulatedCluster
from .config import CONFIG, load_config
from .errors import ClusterError, PrivilegeError
from .system import STATE_DIR, _owner_pid, check_privileges, leftovers, teardown
from .units import fmt_rate, fmt_time
from .verify import format_report

# Verification exit codes of the CLI
EXIT_OK, EXIT_FAILED, EXIT_PRIVILEGE, EXIT_UNVERIFIED = 0, 1, 2, 3


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


def _add_run_parser(sub) -> None:
    p_run = sub.add_parser("run", help="run a command over a cluster: run [options] -- CMD ...")
    p_run.add_argument("--prefix", help="an existing cluster (from `up`); otherwise a temporary one")
    _add_link_args(p_run)
    _add_verify_args(p_run)
    p_run.add_argument("--launcher", default="mpirun",
                       help="mpirun (default), horovodrun (Gloo), torchrun (torch.distributed env), "
                            "head (CMD in the head namespace, GRACE_CLUSTER_* set), host:<i>")
    p_run.add_argument("--np", type=int, help="ranks (default: hosts x --ranks-per-host)")
    p_run.add_argument("--ranks-per-host", type=int, default=1)
    p_run.add_argument("--no-verify", action="store_true", help="skip the link check (numbers not certified)")
    p_run.add_argument("--allow-unverified", action="store_true",
                       help="run even when the rate cannot be verified (CPU-bound); the run is marked so")
    p_run.add_argument("cmd", nargs=argparse.REMAINDER)


def _parser() -> argparse.ArgumentParser:
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
    _add_run_parser(sub)
    return parser


def _list_command(args, parser) -> int:
    for prefix, what in sorted(leftovers().items()):
        state = STATE_DIR / f"{prefix}.json"
        desc = ""
        if state.exists():
            s = json.loads(state.read_text())
            desc = (f"{s['status']}, {s['n']} hosts, {s['subnet']}, {fmt_rate(s['bandwidth_bps'])}, "
                    f"latency {fmt_time(s['latency_s'])}{'' if s['latency_emulated'] else ' (native)'}, "
                    f"pid {s['pid']}")
        print(f"{prefix}: {desc or 'leftover'}\n    " + "\n    ".join(what))
    return EXIT_OK


def _leftovers_to_remove(force: bool) -> list:
    """Every leftover cluster, less those whose creator still runs (unless ``force``)."""
    prefixes = []
    for prefix in leftovers():
        owner = _owner_pid(prefix)
        if owner and not force and owner != os.getpid() and Path(f"/proc/{owner}").exists():
            print(f"{prefix}: skipped, its creator (pid {owner}) is still running (--force removes it)")
            continue
        prefixes.append(prefix)
    return prefixes


def _down_command(args, parser) -> int:
    prefixes = list(args.prefix)
    if args.all:
        prefixes += _leftovers_to_remove(args.force)
    elif not prefixes:
        parser.error("down needs --prefix P or --all")
    for prefix in prefixes:
        removed = teardown(prefix)
        print(f"{prefix}: removed {len(removed)} object(s)" + "".join(f"\n    {r}" for r in removed))
    return EXIT_OK


def _up_command(args, parser) -> int:
    cluster = _cluster_from_args(args, keep=True).up()
    print(json.dumps({"prefix": cluster.prefix, "subnet": str(cluster.subnet),
                      "hosts": {h.name: h.ip for h in cluster.hosts},
                      "head": {cluster.head_ns: cluster.head_ip},
                      "bandwidth_bps": cluster.bandwidth, "latency_s": cluster.latency,
                      "latency_emulated": cluster.latency_emulated}, indent=1))
    if args.verify:
        return _do_verify(cluster, args)[0]
    return EXIT_OK


def _verify_command(args, parser) -> int:
    cluster = _cluster_from_args(args)
    with cluster:
        return _do_verify(cluster, args)[0]


def _run_command(args, parser) -> int:
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


COMMANDS = {"down": _down_command, "up": _up_command, "verify": _verify_command, "run": _run_command}


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            return _list_command(args, parser)
        check_privileges()  # every command but list changes namespaces
        return COMMANDS[args.command](args, parser)
    except PrivilegeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_PRIVILEGE
    except KeyboardInterrupt:
        print("interrupted; the cluster was removed", file=sys.stderr)
        return 130
    except (ClusterError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
