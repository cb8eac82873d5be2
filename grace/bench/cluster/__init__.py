"""The emulated cluster: N worker hosts on one Linux machine, each a network namespace whose
link to a switch namespace is rate-limited (tc tbf) and delayed (sch_netem, or a delay line per
host where the kernel lacks it), with launchers that run MPI / Horovod / torch.distributed
ranks on them. Needs root. The design and the numbers are in scripts/cluster/README.md; the
command line is ``scripts/cluster/emulated_cluster.py`` (cli.py).

    from grace.bench.cluster import EmulatedCluster
    with EmulatedCluster(4, "100mbit", "2ms") as cluster:     # or preset_name="1gbit"
        report = cluster.verify()          # raises VerificationError / UnverifiedError
        cluster.run([sys.executable, "train.py"], launcher="horovodrun")

By job:

* ``units``, ``config``: rates and times ('100mbit', '0.5ms'); presets and defaults from
  configs/cluster/links.yaml.
* ``system``: privileges, commands, namespaces and their processes, the state directory
  (/run/grace-cluster) and its lock, ``teardown`` and ``leftovers`` by prefix.
* ``topology``: names, subnet, namespaces, the switch bridge, veth links, hosts files.
* ``shaping``: tbf and netem on the links; the delay lines (``delay_line``, their program).
* ``launch``: mpirun / horovodrun / torchrun over the links (``shims/ns_rsh``: the ssh stand-in).
* ``verify``: throughput and latency measurements (``netprobe``, their program), the verdict,
  ``format_report``.
* ``cluster``: ``EmulatedCluster``, made of the above, and its life (up, down, state, signals).
* ``cli``: the command line (``main``).
"""
from .cli import EXIT_FAILED, EXIT_OK, EXIT_PRIVILEGE, EXIT_UNVERIFIED, main
from .cluster import EmulatedCluster
from .config import load_config, preset
from .errors import ClusterError, PrivilegeError, UnverifiedError, VerificationError
from .shaping import netem_available
from .system import check_privileges, leftovers, list_namespaces, teardown
from .topology import Host
from .units import parse_rate, parse_time
from .verify import format_report

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_PRIVILEGE", "EXIT_UNVERIFIED", "ClusterError", "EmulatedCluster", "Host",
           "PrivilegeError", "UnverifiedError", "VerificationError", "check_privileges", "format_report",
           "leftovers", "list_namespaces", "load_config", "main", "netem_available", "parse_rate", "parse_time",
           "preset", "teardown"]
