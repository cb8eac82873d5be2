"""mpi4py allreduce of --mb MB of float32 over the emulated cluster; rank 0 prints a JSON line.

Every rank reports its hostname and the address of its eth0 (set by the emulated cluster) so the
test can check the ranks really ran on different emulated hosts.
"""
import argparse
import json
import socket
import time

import numpy as np
from mpi4py import MPI

parser = argparse.ArgumentParser()
parser.add_argument("--mb", type=float, default=8.0)
parser.add_argument("--reps", type=int, default=3)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
n = int(args.mb * 1e6 / 4)
x = np.full(n, rank + 1, dtype=np.float32)
out = np.empty_like(x)
comm.Allreduce(np.ones(16, np.float32), np.empty(16, np.float32))   # connections are set up here
times = []
for _ in range(args.reps):
    comm.Barrier()
    t0 = time.perf_counter()
    comm.Allreduce(x, out, op=MPI.SUM)
    times.append(time.perf_counter() - t0)
expected = size * (size + 1) / 2
ok = bool(np.all(out == expected))
info = comm.gather({"rank": rank, "hostname": socket.gethostname(), "ok": ok}, root=0)
slowest = np.empty(len(times))
comm.Reduce(np.array(times), slowest, op=MPI.MAX, root=0)   # each repetition ends when the last rank has it
times = slowest
if rank == 0:
    print("RESULT " + json.dumps({"size": size, "bytes": 4 * n, "seconds": list(map(float, times)),
                                  "ranks": info}), flush=True)
